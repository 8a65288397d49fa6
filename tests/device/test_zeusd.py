# ruff: noqa: F811 - the fixture imported from zeusd_daemon is named by each test
"""GPU settings through Zeus's daemon zeusd: the setters speak its HTTP API, journal the route, restore through it.

zeusd cannot be built here: every test talks to `zeusd_double.py`, a test double rebuilt from zeusd's Rust
source per released API generation (0.4, 0.5, master), run as a process of its own (as the root daemon
would be) that applies the changes to the simulated node's shared state, where the client's NVML reads see
them. The client process carries the
`no_cap_sys_admin` fault: NVML refuses it every change, so whatever changes, zeusd changed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import TOY_STEPS_COUNTER
from zeusd_daemon import GENERATIONS, ROOT, Daemon, no_zeusd_from_the_shell, start_zeusd  # noqa: F401 - the fixtures
from zeusd_double import issue_token

from zeus_callbacks.core.device import setters, zeusd
from zeus_callbacks.core.device.errors import (
    GPUError,
    GPULostError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    InvalidInputError,
)
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.journal import read_journal, write_atomic
from zeus_callbacks.core.device.state_guard import guard, journal_dir, leftover_entries

HERE = Path(__file__).parent
SCRIPT = HERE / "fault_training.py"
KEY = "test-signing-key-0123456789abcdef"


def _client(monkeypatch: pytest.MonkeyPatch, daemon: Daemon | None = None, **env: str) -> None:
    for k, v in {**(daemon.env if daemon else {}), **env}.items():
        monkeypatch.setenv(k, v)


# -- choosing the route ----------------------------------------------------------------------------
def test_route_follows_the_environment_as_zeus_does(monkeypatch):
    assert setters.route().name == "direct"
    monkeypatch.setenv(zeusd.HOST_PORT_ENV, "node1:4938")
    assert setters.route().name == "zeusd" and str(setters.route().endpoint) == "tcp:node1:4938"
    monkeypatch.setenv(zeusd.SOCK_ENV, "/run/zeusd/zeusd.sock")  # the socket is tried first
    assert str(setters.route().endpoint) == "unix:/run/zeusd/zeusd.sock"
    monkeypatch.setenv(setters.SETTERS_ENV, "direct")
    assert setters.route().name == "direct"
    monkeypatch.setenv(setters.SETTERS_ENV, "nvml")  # direct's name before AMD: environments still say it
    assert (
        setters.route().name == "direct" and setters.describe_choice()["why"] == "ZEUS_CALLBACKS_SETTERS=nvml"
    )
    monkeypatch.setenv(setters.SETTERS_ENV, "zeusd")
    assert setters.route().name == "zeusd"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {setters.SETTERS_ENV: "daemon"},
            "ZEUS_CALLBACKS_SETTERS='daemon' is not one of auto, direct, zeusd",
        ),
        ({setters.SETTERS_ENV: "zeusd"}, "neither ZEUSD_SOCK_PATH nor ZEUSD_HOST_PORT"),
        ({zeusd.HOST_PORT_ENV: "node1"}, "ZEUSD_HOST_PORT='node1' is not host:port"),
        ({zeusd.SOCK_ENV: ""}, "ZEUSD_SOCK_PATH is set but empty"),
    ],
)
def test_unusable_settings_say_which_variable(monkeypatch, env, says):
    _client(monkeypatch, **env)
    with pytest.raises(InvalidInputError, match=re.escape(says)):
        setters.route()


def test_endpoint_is_recorded_and_read_back():
    for text in ("unix:/run/zeusd/zeusd.sock", "tcp:node1:4938", "tcp:[::1]:4938"):
        assert str(zeusd.ZeusdEndpoint.parse(text)) == text
    with pytest.raises(ValueError):
        zeusd.ZeusdEndpoint.parse("http://node1")


# -- changes and restores through the daemon ---------------------------------------------------------
@pytest.mark.system
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_changes_go_through_zeusd_and_are_undone_through_it(sim_gpus, start_zeusd, monkeypatch, transport):
    system = sim_gpus("a40", faults="no_cap_sys_admin")  # NVML refuses this process every change
    daemon = start_zeusd(transport)
    _client(monkeypatch, daemon)
    gpu = get_gpus()[0]
    assert gpu.may_change_settings()  # zeusd changes them: no CAP_SYS_ADMIN needed
    gpu.set_power_limit_mw(150_000)
    gpu.lock_sm_clocks(900, 900)
    assert gpu.power_limit_mw() == 150_000  # read through NVML, as every read is
    assert system.gpus[0].locked_sm_clocks_mhz == (900, 900)
    [journal] = [read_journal(p) for p in journal_dir().glob("*.json")]
    endpoint = f"{'unix' if transport == 'unix' else 'tcp'}:{next(iter(daemon.env.values()))}"
    assert {(e["knob"], e["route"], e["zeusd"]) for e in journal["entries"]} == {
        ("power_limit", "zeusd", endpoint),
        ("sm_clocks", "zeusd", endpoint),
    }
    assert guard().restore()
    assert system.gpus[0].power_limit_mw == 300_000 and system.gpus[0].locked_sm_clocks_mhz is None
    # The documented API: POST, every parameter in the query string, the NVML index, block=true, mW and MHz.
    assert daemon.writes() == [
        'POST /gpu/set_power_limit {"block": "true", "gpu_ids": "0", "power_limit_mw": "150000"}',
        'POST /gpu/set_gpu_locked_clocks {"block": "true", "gpu_ids": "0", "max_clock_mhz": "900", "min_clock_mhz": "900"}',
        'POST /gpu/reset_gpu_locked_clocks {"block": "true", "gpu_ids": "0"}',
        'POST /gpu/set_power_limit {"block": "true", "gpu_ids": "0", "power_limit_mw": "300000"}',
    ]


@pytest.mark.system
def test_the_daemons_index_is_found_by_pci_address(sim_gpus, start_zeusd, monkeypatch):
    """On a mixed node NVML's order is not CUDA's: `cuda:0` (the A10G) is zeusd's GPU 1."""
    system = sim_gpus("a10g,t4", faults="no_cap_sys_admin")
    for generation in GENERATIONS:  # before master no address: NVML index, the whole node seen alike
        setters.forget()
        daemon = start_zeusd("unix", generation=generation)
        _client(monkeypatch, daemon)
        gpus = get_gpus()
        gpus[0].set_power_limit_mw(120_000)
        assert system.cuda_gpus()[0].power_limit_mw == 120_000 and system.gpus[0].power_limit_mw == 70_000
        assert '"gpu_ids": "1"' in daemon.writes()[0]
        assert guard().restore()


@pytest.mark.system
def test_restore_falls_back_to_the_direct_route_where_this_process_may(sim_gpus, start_zeusd, monkeypatch):
    system = sim_gpus("a40")  # this process holds the (simulated) capability
    daemon = start_zeusd()
    _client(monkeypatch, daemon)
    get_gpus()[0].set_power_limit_mw(200_000)
    daemon.proc.terminate()  # the daemon is gone by the end
    daemon.proc.wait(timeout=10)
    assert guard().restore()
    assert system.gpus[0].power_limit_mw == 300_000


@pytest.mark.system
@pytest.mark.parametrize("route", [None, "nvml"])
def test_a_journal_from_before_routes_is_still_repaired(sim_gpus, route):
    """Entries without a route were NVML changes, and `nvml` is the in-process route's name before AMD: both are
    read and undone in this process (`direct`)."""
    system = sim_gpus("a40")
    gpus = get_gpus(repair=False)
    system.gpus[0].set_power_limit_mw(150_000)
    dead = subprocess.Popen(["true"])
    dead.wait()
    directory = journal_dir()
    directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    entry = {"uuid": gpus[0].uuid, "name": gpus[0].name, "knob": "power_limit", "original": 300_000}
    if route is not None:
        entry.update(route=route, zeusd=None)
    write_atomic(directory / f"{dead.pid}-0.json", {"pid": dead.pid, "start": "0", "entries": [entry]})
    [restored] = guard().repair_dead_runs(gpus)
    assert (restored.route, restored.zeusd) == (route or "direct", None)
    assert system.gpus[0].power_limit_mw == 300_000


# -- refusals: one clear line, nothing journaled -------------------------------------------------------
@pytest.mark.system
@pytest.mark.parametrize(
    ("options", "token", "says"),
    [
        (("--signing-key", KEY), None, "requires a token; set ZEUSD_TOKEN"),
        (("--signing-key", KEY), "not-a-token", "HTTP 401 (Invalid token"),
        (("--signing-key", KEY), issue_token(b"another key", "eve", ["gpu-control"]), "HTTP 401"),
        (
            ("--signing-key", KEY),
            issue_token(KEY.encode(), "bob", ["gpu-control"], exp=1),
            "Token has expired",
        ),
        (
            ("--signing-key", KEY),
            issue_token(KEY.encode(), "bob", ["gpu-read"]),
            "HTTP 403 (Token for user 'bob'",
        ),
        (("--enable", "gpu-read"), None, "does not enable GPU control"),
        (
            ("--faults", "no_cap_sys_admin"),
            None,
            "HTTP 403 (GPU 0: NVML error: the current user does not have permission to perform this "
            "operation); zeusd itself may not",
        ),
    ],
)
def test_a_refusal_says_what_failed_and_what_to_do(sim_gpus, start_zeusd, monkeypatch, options, token, says):
    system = sim_gpus("a40", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", *options)
    _client(monkeypatch, daemon, **({zeusd.TOKEN_ENV: token} if token else {}))
    gpu = get_gpus()[0]
    with pytest.raises(GPUNoPermissionError, match=re.escape(says)) as err:
        gpu.set_power_limit_mw(150_000)
    message = str(err.value)
    assert "\n" not in message and "Measuring still works." in message
    assert f"zeusd at unix:{daemon.env[zeusd.SOCK_ENV]}" in message
    assert system.gpus[0].power_limit_mw == 300_000 and guard().entries == []


@pytest.mark.system
def test_a_good_token_with_the_gpu_control_scope_is_accepted(sim_gpus, start_zeusd, monkeypatch):
    system = sim_gpus("a40", faults="no_cap_sys_admin")
    daemon = start_zeusd("tcp", "--signing-key", KEY)
    _client(monkeypatch, daemon, **{zeusd.TOKEN_ENV: issue_token(KEY.encode(), "alice", ["gpu-control"])})
    get_gpus()[0].set_power_limit_mw(175_000)
    assert system.gpus[0].power_limit_mw == 175_000
    assert guard().restore() and system.gpus[0].power_limit_mw == 300_000


def test_an_unreachable_daemon_says_so(sim_gpus, monkeypatch, tmp_path):
    sim_gpus("a40", faults="no_cap_sys_admin")
    _client(monkeypatch, **{zeusd.SOCK_ENV: str(tmp_path / "nobody.sock")})
    with pytest.raises(GPUNoPermissionError, match="cannot reach zeusd at unix:.*nobody.sock .*start zeusd"):
        get_gpus()[0].set_power_limit_mw(150_000)
    assert guard().entries == []


@pytest.mark.system
@pytest.mark.parametrize("generation", GENERATIONS)
def test_an_unsupported_clock_lock_leaves_no_journal_entry(sim_gpus, start_zeusd, monkeypatch, generation):
    """zeusd's real answer is nvml-wrapper's text, with 400 from 0.5 and 500 at 0.4 (`error.rs`)."""
    sim_gpus("a40", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", "--faults", "not_supported=clocks", generation=generation)
    _client(monkeypatch, daemon)
    status = 500 if generation == "0.4" else 400
    says = f"HTTP {status} (GPU 0: NVML error: the requested operation is not available on the target device)"
    with pytest.raises(GPUNotSupportedError, match=re.escape(says)):
        get_gpus()[0].lock_sm_clocks(900, 900)
    assert guard().entries == [] and list(journal_dir().glob("*.json")) == []
    assert leftover_entries() == []  # nothing for `restore` to report or `doctor` to warn about


@pytest.mark.system
@pytest.mark.parametrize("generation", GENERATIONS)
def test_a_lost_gpu_is_a_gpu_lost_error(sim_gpus, start_zeusd, monkeypatch, generation):
    sim_gpus("a40", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", "--faults", "lost_after=0", generation=generation)
    _client(monkeypatch, daemon)
    says = "HTTP 500 (GPU 0: NVML error: device fell off the bus or has otherwise become inacessible)"
    with pytest.raises(GPULostError, match=re.escape(says)):
        get_gpus()[0].set_power_limit_mw(150_000)


@pytest.mark.system
@pytest.mark.parametrize("generation", GENERATIONS)
def test_a_change_answered_after_the_timeout_is_undone_by_the_restore(
    sim_gpus, start_zeusd, monkeypatch, generation
):
    """zeusd runs a queued command even after its caller left (`devices/gpu/mod.rs`): a timeout is no refusal."""
    system = sim_gpus("a40", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", "--hold-writes", "1", generation=generation)  # queued behind a slow one
    _client(monkeypatch, daemon, **{zeusd.TIMEOUT_ENV: "0.5"})
    gpu = get_gpus()[0]
    with pytest.raises(zeusd.ZeusdNoAnswerError, match="may still be applied: it stays journaled"):
        gpu.set_power_limit_mw(150_000)
    [entry] = guard().entries
    assert entry.unconfirmed and [e["unconfirmed"] for e in _journal()["entries"]] == [True]
    assert system.gpus[0].power_limit_mw == 300_000  # not yet: it waits in zeusd's queue
    assert guard().restore()  # sends 300 W although the GPU still reads 300 W
    _stop(daemon)  # whatever was still queued has run
    assert system.gpus[0].power_limit_mw == 300_000
    assert [w.split()[1] for w in daemon.writes()] == ["/gpu/set_power_limit"] * 2
    assert list(journal_dir().glob("*.json")) == []


def _journal() -> dict:
    [path] = journal_dir().glob("*.json")
    return read_journal(path)


def _stop(daemon: Daemon) -> None:
    daemon.proc.terminate()
    daemon.proc.wait(timeout=30)


@pytest.mark.system
@pytest.mark.parametrize(
    ("generation", "env", "says"),
    [
        ("0.5", {"CUDA_VISIBLE_DEVICES": "1"}, "CUDA_VISIBLE_DEVICES='1' gives this job part of the node"),
        ("0.4", {"CUDA_VISIBLE_DEVICES": "1"}, "CUDA_VISIBLE_DEVICES='1' gives this job part of the node"),
    ],
)
def test_without_pci_addresses_a_part_of_the_node_is_refused(
    sim_gpus, start_zeusd, monkeypatch, generation, env, says
):
    system = sim_gpus("a40,a40", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", generation=generation)
    _client(monkeypatch, daemon, **env)
    with pytest.raises(GPUError, match=re.escape(says)) as err:
        get_gpus()[0].set_power_limit_mw(150_000)
    assert "upgrade zeusd" in str(err.value) and "\n" not in str(err.value)
    assert daemon.writes() == [] and all(g.power_limit_mw == 300_000 for g in system.gpus)


@pytest.mark.system
def test_a_job_that_sees_fewer_gpus_is_matched_by_pci_address_or_refused(sim_gpus, start_zeusd, monkeypatch):
    """A container given GPU 1 only: its NVML index 0 is zeusd's GPU 1."""
    system = sim_gpus("a40,a40", faults="no_cap_sys_admin;hidden@0")  # this job's NVML sees one GPU
    for generation in GENERATIONS:
        setters.forget()
        daemon = start_zeusd("unix", generation=generation)
        _client(monkeypatch, daemon)
        gpu = get_gpus()[0]
        if generation == "master":
            gpu.set_power_limit_mw(150_000)
            assert system.gpus[1].power_limit_mw == 150_000 and system.gpus[0].power_limit_mw == 300_000
            assert guard().restore()
        else:
            with pytest.raises(GPUError, match=r"this job sees \d GPU.* where zeusd serves 2.*upgrade zeusd"):
                gpu.set_power_limit_mw(150_000)
            assert daemon.writes() == []


@pytest.mark.system
@pytest.mark.parametrize("generation", GENERATIONS)
def test_doctor_says_the_generation_and_the_mapping(sim_gpus, start_zeusd, generation):
    sim_gpus("a10g,t4", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", generation=generation)
    endpoint = zeusd.ZeusdEndpoint(socket_path=daemon.env[zeusd.SOCK_ENV])
    report = zeusd.status(endpoint, None, list(get_gpus()))
    assert report["reachable"] and report["generation"] == generation and report["problem"] is None
    assert report["gpu_ids"] == {0: 1, 1: 0}  # CUDA's fastest-first order is not NVML's bus order
    how = "PCI address 0000:27:00.0" if generation == "master" else "NVML index 1 (the same 2 GPU(s)"
    assert report["mapping"][0].startswith(how)


# -- doctor -------------------------------------------------------------------------------------------
def _doctor(env: dict[str, str]) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "doctor", "--json"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_doctor_reports_the_route_and_the_daemon(sim_gpus, start_zeusd, tmp_path):
    sim_gpus("a40", faults="no_cap_sys_admin")
    code, r = _doctor({})
    assert code == 1 and r["setters"]["route"] == "direct" and r["setters"]["zeusd"] is None
    assert "zeusd" in r["permission"]["reason"]  # the way out is named
    daemon = start_zeusd()
    code, r = _doctor(daemon.env)
    assert code == 0 and r["permission"]["may_change"]
    assert r["setters"]["route"] == "zeusd" and r["setters"]["why"] == "ZEUSD_SOCK_PATH is set"
    assert r["setters"]["zeusd"]["reachable"] and r["setters"]["zeusd"]["gpu_control"]
    assert r["setters"]["zeusd"]["gpu_ids"] == {"0": 0} and r["setters"]["zeusd"]["generation"] == "master"
    code, r = _doctor({zeusd.SOCK_ENV: str(tmp_path / "nobody.sock")})
    assert code == 1 and not r["setters"]["zeusd"]["reachable"]
    assert any("cannot be reached" in p for p in r["problems"])
    assert daemon.writes() == []  # doctor changes nothing


@pytest.mark.slow
@pytest.mark.parametrize("generation", GENERATIONS)
def test_doctor_prints_the_api_generation_and_the_gpu_mapping(sim_gpus, start_zeusd, generation):
    """zeusd 0.4 is reachable, though its /discover has no `gpus` list."""
    sim_gpus("a10g,t4", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", generation=generation)
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "doctor"],
        env={**os.environ, **daemon.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    api = {"0.4": "zeusd 0.4 (GPU indices only)", "0.5": "zeusd 0.5 (GPU names", "master": "zeusd after 0.5"}
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("zeusd:")]
    assert "reachable, API " + api[generation] in line, proc.stdout
    by = "PCI address 0000:27:00.0" if generation == "master" else "NVML index 1"
    assert f"  GPU 0 -> zeusd GPU 1 (by {by}" in proc.stdout
    assert proc.returncode == 0, proc.stdout


# -- training through zeusd ---------------------------------------------------------------------------
def _train(framework: str, sim_state_dir: Path, tmp_path: Path, env: dict[str, str]) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), framework],
        env={
            **os.environ,
            "ZEUS_CALLBACKS_SIM_FAULTS": "no_cap_sys_admin",
            "ZEUS_CALLBACKS_SIM_STATE_DIR": str(sim_state_dir),
            "OUT_DIR": str(tmp_path / "out"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **TOY_STEPS_COUNTER,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :]), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("framework", "transport", "generation"),
    [
        ("plain", "unix", "0.4"),
        ("plain", "unix", "0.5"),
        ("plain", "unix", "master"),
        ("hf", "tcp", "master"),
        ("pipeline", "unix", "0.4"),
    ],
)
def test_training_without_cap_sys_admin_changes_the_gpu_through_zeusd(
    sim_gpus, start_zeusd, sim_state_dir, tmp_path, framework, transport, generation
):
    system = sim_gpus("a40", **({"energy_refresh_ms": 10} if framework != "pipeline" else {}))
    daemon = start_zeusd(transport, generation=generation)
    result, _ = _train(framework, sim_state_dir, tmp_path, daemon.env)
    assert result["steps"] == 40
    if framework == "pipeline":
        assert "locked" in result["seen"]  # SM clocks locked per instruction, by zeusd
        assert any("/gpu/set_gpu_locked_clocks" in w for w in daemon.writes())
        assert "/gpu/reset_gpu_locked_clocks" in daemon.writes()[-1]  # unlocked at the end
    else:
        assert len(result["seen"]) > 1  # the optimizer profiled limits: zeusd changed them
        assert all("/gpu/set_power_limit" in w for w in daemon.writes())
    assert system.gpus[0].power_limit_mw == 300_000 and system.gpus[0].locked_sm_clocks_mhz is None
    assert list(journal_dir().glob("*.json")) == []


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["bad_token", "unreachable"])
def test_a_refused_or_missing_daemon_stands_the_optimizer_down(
    sim_gpus, start_zeusd, sim_state_dir, tmp_path, fault
):
    system = sim_gpus("a40", energy_refresh_ms=10)
    if fault == "bad_token":
        daemon = start_zeusd("unix", "--signing-key", KEY)
        env = {**daemon.env, zeusd.TOKEN_ENV: issue_token(b"wrong key", "mallory", ["gpu-control"])}
        says = "HTTP 401 (Invalid token"
    else:
        env = {zeusd.SOCK_ENV: str(tmp_path / "nobody.sock")}
        says = "cannot reach zeusd at unix:"
    result, stderr = _train("plain", sim_state_dir, tmp_path, env)
    assert result["steps"] == 40 and result["seen"] == ["300W"]  # trained on, GPU untouched
    [line] = [x for x in stderr.splitlines() if "GlobalPowerLimitOptimizer:" in x and says in x]
    assert "Restoring the GPU and training on without it" in line
    assert system.gpus[0].power_limit_mw == 300_000


# -- hard deaths --------------------------------------------------------------------------------------
CHILD = """
from zeus_callbacks.core.device.gpus import get_gpus
get_gpus()[0].set_power_limit_mw(150_000)
print("ready", flush=True)
import time; time.sleep(120)
"""


def _changed_then_killed(env: dict[str, str]) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ZEUS_CALLBACKS_SIM_FAULTS": "no_cap_sys_admin", **env},
    )
    assert proc.stdout.readline().strip() == "ready", proc.communicate()
    time.sleep(1.0)  # let the restore watchdog start (it starts with the first change)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    return proc.pid


def _wait_for(condition: Callable[[], bool], seconds: float = 60) -> None:
    """Wait for `condition` (a deadline that only stops a hung test: no speed is asserted)."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)


@pytest.mark.slow
def test_the_watchdog_restores_through_zeusd_after_a_sigkill(sim_gpus, start_zeusd):
    system = sim_gpus("a40")
    daemon = start_zeusd()
    _changed_then_killed(daemon.env)
    _wait_for(lambda: system.gpus[0].power_limit_mw == 300_000)
    assert daemon.writes()[-1].endswith('"power_limit_mw": "300000"}')  # put back by zeusd
    _wait_for(lambda: list(journal_dir().glob("*.json")) == [])


@pytest.mark.slow
def test_restore_puts_back_through_zeusd_what_a_killed_run_left(sim_gpus, start_zeusd):
    system = sim_gpus("a40")
    daemon = start_zeusd()
    _changed_then_killed({**daemon.env, "ZEUS_CALLBACKS_WATCHDOG": "0"})
    assert system.gpus[0].power_limit_mw == 150_000  # left behind
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "restore", "--json"],
        # A later shell that may not change GPUs itself, and has no ZEUSD_* set: the journal says where.
        env={**os.environ, "ZEUS_CALLBACKS_SIM_FAULTS": "no_cap_sys_admin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    [restored] = json.loads(proc.stdout)["restored"]
    assert (restored["knob"], restored["route"]) == ("power_limit", "zeusd")
    assert restored["zeusd"] == f"unix:{daemon.env[zeusd.SOCK_ENV]}"
    assert system.gpus[0].power_limit_mw == 300_000
    assert daemon.writes()[-1].endswith('"power_limit_mw": "300000"}')


LATE_CHILD = """
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.zeusd import ZeusdNoAnswerError
try:
    get_gpus()[0].set_power_limit_mw(150_000)
except ZeusdNoAnswerError:
    print("ready", flush=True)
import time; time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["restore", "watchdog"])
def test_a_late_answer_of_a_killed_run_is_undone(sim_gpus, start_zeusd, how):
    """The change of a run killed while zeusd still held it is put back by `zeus-callbacks restore` and by
    the watchdog, though the GPU reads unchanged when they look."""
    system = sim_gpus("a40")
    daemon = start_zeusd("unix", "--hold-writes", "1", generation="0.5")
    env = {
        **daemon.env,
        zeusd.TIMEOUT_ENV: "0.5",
        **({"ZEUS_CALLBACKS_WATCHDOG": "0"} if how == "restore" else {}),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", LATE_CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ZEUS_CALLBACKS_SIM_FAULTS": "no_cap_sys_admin", **env},
    )
    assert proc.stdout.readline().strip() == "ready", proc.communicate()
    time.sleep(1.0)  # let the restore watchdog start (it starts with the first change)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    if how == "restore":
        assert system.gpus[0].power_limit_mw == 300_000  # still queued in zeusd
        done = subprocess.run(
            [sys.executable, "-m", "zeus_callbacks.cli", "restore", "--json"],
            env={**os.environ, "ZEUS_CALLBACKS_SIM_FAULTS": "no_cap_sys_admin"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    _wait_for(lambda: len(daemon.writes()) == 2)  # the restore was sent
    _wait_for(lambda: list(journal_dir().glob("*.json")) == [])
    _stop(daemon)
    assert system.gpus[0].power_limit_mw == 300_000  # the held 150 W ran first, then the restore
    assert daemon.writes()[-1].endswith('"power_limit_mw": "300000"}')
