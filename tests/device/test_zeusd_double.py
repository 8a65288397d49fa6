# ruff: noqa: F811 - the fixture imported from zeusd_daemon is named by each test
"""The zeusd double answers as zeusd's source does (each case is a rule of `zeusd_double.py`)."""

from __future__ import annotations

import json
import time

import pytest
from zeusd_daemon import GENERATIONS, Daemon, start_zeusd  # noqa: F401 - the fixture
from zeusd_double import issue_token

from zeus_callbacks.core.device import zeusd

pytestmark = pytest.mark.system  # other processes or the real clock (tests/tiers.py)

KEY = "test-signing-key-0123456789abcdef"


def _ask(daemon: Daemon, method: str, target: str, token: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body text) of one raw request."""
    conn = zeusd.ZeusdEndpoint(socket_path=daemon.env[zeusd.SOCK_ENV]).connection(10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request(method, target, headers={"Content-Length": "0", **headers} if method == "POST" else headers)
    response = conn.getresponse()
    kind = response.getheader("Content-Type") or ""
    body = response.read(4096 if "event-stream" not in kind else 64).decode()
    conn.close()
    return response.status, kind.split(";")[0], body


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("gpu_ids=0&block=true", "missing field `power_limit_mw`"),
        ("gpu_ids=0&power_limit_mw=150000&block=true&force=1", "unknown field `force`, expected one of"),
        ("gpu_ids=0&power_limit_mw=150000&block=true&block=true", "duplicate field `block`"),
        ("gpu_ids=0&power_limit_mw=150W&block=true", "invalid digit found in string"),
        ("gpu_ids=0&power_limit_mw=150000&block=yes", "provided string was not `true` or `false`"),
    ],
)
def test_a_malformed_query_is_actix_plain_text(sim_gpus, start_zeusd, query, says):
    system = sim_gpus("a40")
    daemon = start_zeusd()
    status, kind, body = _ask(daemon, "POST", f"/gpu/set_power_limit?{query}")
    assert (
        (status, kind) == (400, "text/plain") and body == f"Query deserialize error: {says}" or says in body
    )
    assert body.startswith("Query deserialize error: ") and system.gpus[0].power_limit_mw == 300_000


@pytest.mark.parametrize("generation", GENERATIONS)
def test_an_unknown_gpu_in_a_write_runs_nothing(sim_gpus, start_zeusd, generation):
    system = sim_gpus("a40")
    daemon = start_zeusd(generation=generation)
    status, kind, body = _ask(
        daemon, "POST", "/gpu/set_power_limit?gpu_ids=0,5&power_limit_mw=150000&block=true"
    )
    assert (status, kind, body) == (400, "text/plain", "GPU index 5 does not exist.")
    assert system.gpus[0].power_limit_mw == 300_000


def test_gpu_ids_are_parsed_as_each_generation_parses_them(sim_gpus, start_zeusd):
    system = sim_gpus("a40")
    target = "/gpu/set_power_limit?gpu_ids=0,x&power_limit_mw=150000&block=true"
    status, _, body = _ask(start_zeusd(generation="0.5"), "POST", target)
    assert (status, json.loads(body)) == (400, {"error": "Invalid GPU index: x"})
    assert _ask(start_zeusd(generation="0.4"), "POST", target)[0] == 200  # 0.4 drops what does not parse
    assert system.gpus[0].power_limit_mw == 150_000


def test_discovery_per_generation(sim_gpus, start_zeusd):
    sim_gpus("a40")
    found = {g: json.loads(_ask(start_zeusd(generation=g), "GET", "/discover")[2]) for g in GENERATIONS}
    assert found["0.4"]["gpu_ids"] == [0] and "gpus" not in found["0.4"]
    assert found["0.5"]["gpus"] == [{"id": 0, "name": "NVIDIA A40"}]
    assert found["master"]["gpus"][0]["pci_address"] == "0000:17:00.0"


def test_tokens_have_a_60_s_leeway_and_typed_claims(sim_gpus, start_zeusd):
    sim_gpus("a40")
    daemon = start_zeusd("unix", "--signing-key", KEY)
    now = int(time.time())
    assert (
        _ask(daemon, "GET", "/auth/whoami", issue_token(KEY.encode(), "bob", ["gpu-read"], exp=now - 30))[0]
        == 200
    )
    status, _, body = _ask(
        daemon, "GET", "/auth/whoami", issue_token(KEY.encode(), "bob", ["gpu-read"], exp=now - 90)
    )
    assert (status, json.loads(body)) == (401, {"error": "Token has expired."})
    status, _, body = _ask(daemon, "GET", "/auth/whoami", issue_token(KEY.encode(), "bob", ["root"]))
    assert status == 401 and "unknown variant `root`" in json.loads(body)["error"]
    status, _, body = _ask(
        daemon, "GET", "/auth/whoami", issue_token(KEY.encode(), "bob", ["gpu-read"], aud="x")
    )
    assert (status, json.loads(body)) == (401, {"error": "Invalid token: InvalidAudience"})


def test_block_false_answers_before_the_command_runs(sim_gpus, start_zeusd):
    system = sim_gpus("a40")
    daemon = start_zeusd("unix", "--hold-writes", "1")
    assert _ask(daemon, "POST", "/gpu/set_power_limit?gpu_ids=0&power_limit_mw=150000&block=false")[0] == 200
    assert system.gpus[0].power_limit_mw == 300_000  # queued, not run
    daemon.proc.terminate()
    daemon.proc.wait(timeout=30)
    assert system.gpus[0].power_limit_mw == 150_000  # run although nobody waited


def test_stream_power_and_cpu_routes_exist(sim_gpus, start_zeusd):
    sim_gpus("a40")
    daemon = start_zeusd()
    status, kind, body = _ask(daemon, "GET", "/gpu/stream_power")
    assert (status, kind) == (200, "text/event-stream")
    assert _ask(daemon, "GET", "/cpu/get_power")[:2] == (200, "application/json")
    assert _ask(daemon, "GET", "/gpu/get_power_limit")[0] == 200
    assert _ask(start_zeusd(generation="0.4"), "GET", "/gpu/get_power_limit")[0] == 404  # from 0.5
