"""Bad inputs of the features added since issue 14's table: zeusd's variables and answers, the engine adapters,
the monitoring options (ZeusMonitor's other arguments, ReplayZeusMonitor's logs, ProfileDataLoader and the
epoch logs).

Same rule as `test_bad_inputs.py`: one clear error that names the input and says what to do; from the CLI one
line `zeus-callbacks <cmd>: ...`, exit code 2, no traceback; nothing wrong accepted; valid edges keep working.
zeusd's answers come from `FakeZeusd` (below: canned bytes on a Unix socket, for answers no zeusd gives) and
from `zeusd_double.py` (a test double rebuilt from zeusd's source, for a real daemon of the wrong generation).
"""

from __future__ import annotations

import json
import math
import os
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import assert_clear, assert_one_clear_line, run_cli

from zeus_callbacks.core.device import setters, zeusd
from zeus_callbacks.core.device.errors import GPUError, InvalidInputError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor.dataloader import ProfileDataLoader
from zeus_callbacks.core.monitor.epoch_log import EpochLog
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.replay import ReplayZeusMonitor

HERE = Path(__file__).parent
ZEUSD_ENV = (zeusd.SOCK_ENV, zeusd.HOST_PORT_ENV, zeusd.TOKEN_ENV, zeusd.TIMEOUT_ENV, setters.SETTERS_ENV)


@pytest.fixture(autouse=True)
def _no_zeusd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*ZEUSD_ENV, "ZEUS_CALLBACKS_WATCHDOG", "ZEUS_LOG_PREFIX", "ZEUS_MONITOR_SLEEP_MS"):
        monkeypatch.delenv(name, raising=False)
    setters.forget()
    yield
    setters.forget()
    ProfileDataLoader.close_logs()


# -- zeusd's variables (every command that may change a GPU reads them) -------------------------------------
NO_SOCKET = {zeusd.SOCK_ENV: "/nonexistent/zeusd.sock"}
ZEUSD_ENV_CASES = [
    ({setters.SETTERS_ENV: "daemon"}, ["ZEUS_CALLBACKS_SETTERS='daemon'", "auto, direct, zeusd"]),
    ({setters.SETTERS_ENV: "zeusd"}, ["ZEUS_CALLBACKS_SETTERS=zeusd", "ZEUSD_SOCK_PATH=/run/zeusd"]),
    ({zeusd.HOST_PORT_ENV: "node1"}, ["ZEUSD_HOST_PORT='node1'", "node1:4938"]),
    ({zeusd.HOST_PORT_ENV: "node1:0"}, ["ZEUSD_HOST_PORT='node1:0'", "node1:4938"]),
    ({zeusd.HOST_PORT_ENV: ":4938"}, ["ZEUSD_HOST_PORT=':4938'"]),
    ({zeusd.HOST_PORT_ENV: "node1:99999"}, ["ZEUSD_HOST_PORT='node1:99999'"]),
    ({zeusd.HOST_PORT_ENV: "node1:http"}, ["ZEUSD_HOST_PORT='node1:http'"]),
    ({zeusd.SOCK_ENV: ""}, ["ZEUSD_SOCK_PATH is set but empty"]),
    ({**NO_SOCKET, zeusd.TIMEOUT_ENV: "x"}, ["ZEUS_CALLBACKS_ZEUSD_TIMEOUT_S='x'", "e.g. 10"]),
    ({**NO_SOCKET, zeusd.TIMEOUT_ENV: "0"}, ["ZEUS_CALLBACKS_ZEUSD_TIMEOUT_S='0'"]),
    ({**NO_SOCKET, zeusd.TIMEOUT_ENV: "-1"}, ["ZEUS_CALLBACKS_ZEUSD_TIMEOUT_S='-1'"]),
    ({**NO_SOCKET, zeusd.TIMEOUT_ENV: "nan"}, ["ZEUS_CALLBACKS_ZEUSD_TIMEOUT_S='nan'"]),
    ({**NO_SOCKET, zeusd.TIMEOUT_ENV: "inf"}, ["ZEUS_CALLBACKS_ZEUSD_TIMEOUT_S='inf'"]),
    ({**NO_SOCKET, zeusd.TOKEN_ENV: "abc\ndef"}, ["ZEUSD_TOKEN", "the token alone"]),
    ({**NO_SOCKET, zeusd.TOKEN_ENV: "abc def"}, ["ZEUSD_TOKEN", "the token alone"]),
    ({**NO_SOCKET, zeusd.TOKEN_ENV: "t\u20ac"}, ["ZEUSD_TOKEN", "the token alone"]),
]


def _ids(cases: list) -> list[str]:
    return [" ".join(f"{k}={v!r}" for k, v in c[0].items()) for c in cases]


@pytest.mark.parametrize(("env", "words"), ZEUSD_ENV_CASES, ids=_ids(ZEUSD_ENV_CASES))
@pytest.mark.parametrize("command", [["devices"], ["doctor"]])
def test_zeusd_environment(env, words, command, sim_gpus, monkeypatch, capsys):
    sim_gpus("a40")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rc, _, err = run_cli(capsys, command)
    assert_one_clear_line(rc, err, command[0], *words)


@pytest.mark.parametrize(("env", "words"), ZEUSD_ENV_CASES, ids=_ids(ZEUSD_ENV_CASES))
def test_zeusd_environment_at_the_first_change(env, words, sim_gpus, monkeypatch):
    """The API says the same before anything is sent (the GPU is not changed)."""
    system = sim_gpus("a40")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError) as info:
        get_gpus()[0].set_power_limit_mw(150_000)
    assert_clear(info.value, *words)
    assert system.gpus[0].power_limit_mw == 300_000


@pytest.mark.system
def test_zeusd_environment_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "doctor"],
        env={**os.environ, "ZEUS_CALLBACKS_SIMULATE": "a40", **NO_SOCKET, zeusd.TOKEN_ENV: "abc\ndef"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_clear_line(proc.returncode, proc.stderr, "doctor", "ZEUSD_TOKEN")


@pytest.mark.parametrize(
    ("value", "words"),
    [("maybe", ["ZEUS_CALLBACKS_WATCHDOG='maybe'", "0"]), ("off ", ["ZEUS_CALLBACKS_WATCHDOG='off '"])],
)
def test_watchdog_switch(value, words, sim_gpus, monkeypatch):
    system = sim_gpus("a40")
    monkeypatch.setenv("ZEUS_CALLBACKS_WATCHDOG", value)
    with pytest.raises(InvalidInputError) as info:
        get_gpus()[0].set_power_limit_mw(150_000)
    assert_clear(info.value, *words)
    assert system.gpus[0].power_limit_mw == 300_000


def test_valid_zeusd_environment_edges(monkeypatch):
    """A token with the newline `$(cat token.txt)`-less reading leaves, a timeout of 0.5 s, IPv6 hosts."""
    monkeypatch.setenv(zeusd.HOST_PORT_ENV, "[::1]:4938")
    monkeypatch.setenv(zeusd.TOKEN_ENV, "eyJhbGciOiJIUzI1NiJ9.e30.abc_-\n")
    monkeypatch.setenv(zeusd.TIMEOUT_ENV, "0.5")
    chosen = setters.route()
    assert chosen.name == "zeusd" and chosen.has_token and zeusd.timeout_s() == 0.5


# -- zeusd's answers: malformed discovery, garbage bodies, a server that is not zeusd ---------------------
def _http(status: int, body: object, kind: str = "application/json") -> bytes:
    raw = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    head = f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\nContent-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    return head.encode() + raw


class FakeZeusd:
    """A Unix-socket server that answers each request path with canned bytes (`answers[path]`, else
    `answers["*"]`; no entry: the connection is closed unanswered)."""

    def __init__(self, path: Path, answers: dict[str, bytes]) -> None:
        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline().decode("latin-1")
                while self.rfile.readline().strip():  # the headers
                    pass
                route = line.split(" ")[1].split("?")[0] if line.count(" ") >= 2 else ""
                raw = answers.get(route, answers.get("*"))
                if raw is not None:
                    self.wfile.write(raw)

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.server = Server(str(path), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


GOOD_DISCOVERY = {
    "gpus": [{"id": 0, "name": "NVIDIA A40", "pci_address": "0000:17:00.0"}],
    "cpus": [],
    "enabled_api_groups": ["gpu-control", "gpu-read"],
    "auth_required": False,
}
DISCOVER_OK = {"/discover": _http(200, GOOD_DISCOVERY)}
NOT_ZEUSD = "check that ZEUSD_SOCK_PATH / ZEUSD_HOST_PORT points at zeusd"
ANSWER_CASES = [
    ("discover-html", {"/discover": _http(200, "<html>hi</html>", "text/html")}, ["/discover", NOT_ZEUSD]),
    ("discover-empty-object", {"/discover": _http(200, {})}, ["/discover", NOT_ZEUSD]),
    ("discover-truncated-json", {"/discover": _http(200, '{"gpus": [')}, ["/discover", NOT_ZEUSD]),
    (
        "discover-string-id",
        {"/discover": _http(200, {**GOOD_DISCOVERY, "gpus": [{"id": "0"}]})},
        ["/discover", NOT_ZEUSD],
    ),
    (
        "discover-0.4-string-ids",
        {"/discover": _http(200, {"gpu_ids": ["a"], "enabled_api_groups": [], "auth_required": False})},
        ["/discover", NOT_ZEUSD],
    ),
    (
        "discover-auth-not-bool",
        {"/discover": _http(200, {**GOOD_DISCOVERY, "auth_required": "no"})},
        ["/discover", NOT_ZEUSD],
    ),
    (
        "discover-bad-pci-address",
        {"/discover": _http(200, {**GOOD_DISCOVERY, "gpus": [{"id": 0, "pci_address": "zz"}]})},
        ["serves no GPU at PCI address", "point ZEUSD_SOCK_PATH"],
    ),
    (
        "discover-no-gpu-control",
        {"/discover": _http(200, {**GOOD_DISCOVERY, "enabled_api_groups": ["gpu-read"]})},
        ["does not enable GPU control", "--enable gpu-control"],
    ),
    ("discover-404", {"/discover": _http(404, "Not Found", "text/plain")}, ["HTTP 404", "upgrade zeusd"]),
    ("discover-500-html", {"/discover": _http(500, "<html>x</html>", "text/html")}, ["HTTP 500", "its log"]),
    ("not-http", {"*": b"\x00\xffgarbage\r\n\r\n"}, ["not an HTTP answer", NOT_ZEUSD]),
    ("closes-unanswered", {}, ["closed the connection", NOT_ZEUSD]),
    (
        "write-400-empty",
        {**DISCOVER_OK, "/gpu/set_power_limit": _http(400, "", "text/plain")},
        ["HTTP 400", "disagree on its API"],
    ),
    (
        "write-418-html",
        {**DISCOVER_OK, "/gpu/set_power_limit": _http(418, "<html>teapot</html>", "text/html")},
        ["HTTP 418", "its log"],
    ),
    (
        "write-500-truncated-json",
        {**DISCOVER_OK, "/gpu/set_power_limit": _http(500, '{"err')},
        ["HTTP 500", "its log"],
    ),
    (
        "write-not-http",
        {**DISCOVER_OK, "/gpu/set_power_limit": b"HTTP/9 what\r\n\r\n"},
        ["not an HTTP answer", "may still be applied"],
    ),
]


@pytest.mark.system
@pytest.mark.parametrize(
    ("answers", "words"), [c[1:] for c in ANSWER_CASES], ids=[c[0] for c in ANSWER_CASES]
)
def test_zeusd_answers(answers, words, sim_gpus, monkeypatch, tmp_path, capsys):
    """Every odd answer is one GPUError line naming the daemon and what to do; `doctor` says it, no traceback."""
    sim_gpus("a40", faults="no_cap_sys_admin")  # NVML refuses this process every change: zeusd must do it
    server = FakeZeusd(tmp_path / "z.sock", answers)
    try:
        monkeypatch.setenv(zeusd.SOCK_ENV, str(tmp_path / "z.sock"))
        monkeypatch.setenv(zeusd.TIMEOUT_ENV, "5")
        with pytest.raises(GPUError) as info:
            get_gpus()[0].set_power_limit_mw(150_000)
        assert_clear(ValueError(str(info.value)), f"zeusd at unix:{tmp_path / 'z.sock'}", *words)
        assert all(c.isprintable() for c in str(info.value)), repr(str(info.value))
        setters.forget()
        rc, out, err = run_cli(capsys, ["doctor"])
        assert "Traceback" not in out + err and rc in (0, 1), out + err
    finally:
        server.stop()


@pytest.mark.system
@pytest.mark.parametrize("generation", ["0.4", "0.5"])
def test_zeusd_of_a_generation_without_pci_addresses_for_part_of_a_node(generation, sim_gpus, tmp_path):
    """The real-source double: a zeusd that cannot say which GPU is which, for a job given one of two."""
    sim_gpus("a10g,t4", faults="no_cap_sys_admin")
    sock = tmp_path / "zeusd.sock"
    env = {k: v for k, v in os.environ.items() if k != "ZEUS_CALLBACKS_SIM_FAULTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "device" / "zeusd_double.py"), "--socket", str(sock)]
        + ["--generation", generation, "--log", str(tmp_path / "log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().startswith("READY")
        code = (
            "from zeus_callbacks.core.device.gpus import get_gpus\n"
            "from zeus_callbacks.core.device.errors import GPUError\n"
            "try:\n    get_gpus()[0].set_power_limit_mw(60_000)\n"
            "except GPUError as e:\n    print('REFUSED', e)\n"
        )
        child = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, zeusd.SOCK_ENV: str(sock), "CUDA_VISIBLE_DEVICES": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.stdout.startswith("REFUSED"), child.stdout + child.stderr
        for w in ("gives no PCI addresses", "CUDA_VISIBLE_DEVICES='1'", "upgrade zeusd"):
            assert w in child.stdout, child.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


# -- the engine adapters ---------------------------------------------------------------------------------
def _pfo():
    from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

    return PipelineFrequencyOptimizer(rank=0, pp_rank=0, pp_degree=1, world_size=1, wait_steps=0)


def _plo():
    from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer

    return GlobalPowerLimitOptimizer(ZeusMonitor([0]))


def _engine():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return PipelineEngine.__new__(PipelineEngine)  # passes the type check; no process group needed


MEGATRON_CASES = [
    (
        "optimizer-str",
        lambda: (("x",), {}),
        ["instrument_megatron(optimizer='x')", "PipelineFrequencyOptimizer"],
    ),
    ("optimizer-None", lambda: ((None,), {}), ["instrument_megatron(optimizer=None)"]),
    (
        "power-limit-optimizer",
        lambda: ((_plo(),), {}),
        ["GlobalPowerLimitOptimizer", "PipelineFrequencyOptimizer"],
    ),
    ("mark-steps-str", lambda: ((_pfo(),), {"mark_steps": "no"}), ["mark_steps='no'", "True or False"]),
]
DEEPSPEED_CASES = [
    ("optimizer-str", lambda: ((_engine(), "x"), {}), ["instrument_deepspeed(", "optimizer='x'"]),
    ("power-limit-optimizer", lambda: ((_engine(), _plo()), {}), ["GlobalPowerLimitOptimizer"]),
    ("mark-steps-int", lambda: ((_engine(), _pfo()), {"mark_steps": 1}), ["mark_steps=1", "True or False"]),
    ("swapped", lambda: ((_pfo(), _engine()), {}), ["not a DeepSpeed PipelineEngine"]),
]


@pytest.mark.parametrize(
    ("make", "words"), [c[1:] for c in MEGATRON_CASES], ids=[c[0] for c in MEGATRON_CASES]
)
def test_instrument_megatron_arguments(make, words, sim_gpus):
    pytest.importorskip("megatron.core")
    from zeus_callbacks import megatron

    sim_gpus("a40")
    args, kw = make()
    with pytest.raises((TypeError, ValueError)) as info:
        megatron.instrument_megatron(*args, **kw).remove()
    assert_clear(info.value, *words)
    assert megatron._active is None  # nothing was installed


@pytest.mark.parametrize(
    ("make", "words"), [c[1:] for c in DEEPSPEED_CASES], ids=[c[0] for c in DEEPSPEED_CASES]
)
def test_instrument_deepspeed_arguments(make, words, sim_gpus):
    pytest.importorskip("deepspeed")
    from zeus_callbacks.deepspeed import instrument_deepspeed

    sim_gpus("a40")
    args, kw = make()
    with pytest.raises((TypeError, ValueError)) as info:
        instrument_deepspeed(*args, **kw).remove()
    assert_clear(info.value, *words)
    assert "_INSTRUCTION_MAP" not in vars(args[0])  # nothing was installed


ORDER_CASES = [
    ("megatron", (0, 4), {}, ["num_stages=0", ">= 1"]),
    ("megatron", (-1, 4), {}, ["num_stages=-1"]),
    ("megatron", ("2", 4), {}, ["num_stages='2'"]),
    ("megatron", (2, 0), {}, ["num_microbatches=0"]),
    ("megatron", (2, 4, 0), {}, ["num_chunks=0"]),
    ("megatron", (2, 4, 2, 0), {}, ["microbatch_group_size=0"]),
    ("deepspeed", (0, 4), {}, ["num_stages=0"]),
    ("deepspeed", (2, 0), {}, ["num_microbatches=0"]),
    ("deepspeed", (2, -1), {}, ["num_microbatches=-1"]),
    ("deepspeed", ("2", 4), {}, ["num_stages='2'"]),
]


@pytest.mark.parametrize(("engine", "args", "kw", "words"), ORDER_CASES)
def test_schedule_order_arguments(engine, args, kw, words):
    pytest.importorskip("megatron.core" if engine == "megatron" else "deepspeed")
    module = __import__(f"zeus_callbacks.{engine}", fromlist=["x"])
    function = getattr(module, f"{engine}_schedule_order")
    with pytest.raises(InvalidInputError) as info:
        function(*args, **kw)
    assert_clear(info.value, f"{engine}_schedule_order(", *words)


def test_valid_engine_edges(sim_gpus):
    """One stage and one microbatch is a schedule; mark_steps=False is a choice."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("deepspeed")
    from zeus_callbacks.deepspeed import deepspeed_schedule_order, instrument_deepspeed
    from zeus_callbacks.megatron import instrument_megatron, megatron_schedule_order

    sim_gpus("a40")
    assert [len(r) for r in megatron_schedule_order(1, 1)] == [2]
    assert [len(r) for r in deepspeed_schedule_order(1, 1)] == [2]
    instrument_megatron(_pfo(), mark_steps=False).remove()
    instrument_deepspeed(_engine(), _pfo(), mark_steps=False).remove()


# -- ZeusMonitor's other arguments --------------------------------------------------------------------------
MONITOR_CASES = [
    ({"cpu_indices": "0"}, ["cpu_indices='0'", "list of CPU package indices"]),
    ({"cpu_indices": 0}, ["cpu_indices=0", "list of CPU package indices"]),
    ({"cpu_indices": ["a"]}, ["'a' is not a CPU package index"]),
    ({"cpu_indices": [-1]}, ["-1 is not a CPU package index"]),
    ({"cpu_indices": [True]}, ["True is not a CPU package index"]),
    ({"approx_instant_energy": "no"}, ["approx_instant_energy='no'", "True or False"]),
    ({"sync_execution_with": "jax"}, ["sync_execution_with='jax'", "'torch'"]),
    ({"log_file": 3}, ["log_file=3", "path"]),
    ({"log_file": "."}, ["log_file=", "is a directory"]),
    ({"log_file": "FILE/log.csv"}, ["log_file=", "cannot be created"]),
]


@pytest.mark.parametrize(("kw", "words"), MONITOR_CASES)
def test_monitor_other_arguments(kw, words, sim_gpus, tmp_path):
    sim_gpus("a40")
    (tmp_path / "FILE").write_text("a file")
    kw = {k: str(tmp_path / v) if k == "log_file" and isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(ValueError) as info:
        ZeusMonitor(**kw)
    assert_clear(info.value, "ZeusMonitor(", *words)


@pytest.mark.parametrize(("key", "words"), [(3, ["3", "window name"]), (None, ["None", "window name"])])
def test_monitor_window_names(key, words, sim_gpus):
    sim_gpus("a40")
    monitor = ZeusMonitor()
    with pytest.raises(ValueError) as info:
        monitor.begin_window(key)
    assert_clear(info.value, *words)
    assert monitor.open_windows == []


def test_monitor_valid_other_edges(sim_gpus, tmp_path):
    sim_gpus("a40")
    m = ZeusMonitor(cpu_indices=[], approx_instant_energy=True, log_file=tmp_path / "new" / "log.csv")
    assert m.cpu_indices == [] and (tmp_path / "new" / "log.csv").exists()
    assert ZeusMonitor(cpu_indices=(0,)).gpu_indices == [0]  # a package RAPL lacks is said, not refused


# -- ReplayZeusMonitor's logs ----------------------------------------------------------------------------
HEADER = "start_time,window_name,elapsed_time,gpu0_energy\n"
ZEUS_ROW = "0,__GlobalPowerLimitOptimizer_300,{t},{e}\n"
REPLAY_CASES = [
    ("missing", None, {}, ["missing.csv", "does not exist"]),
    ("directory", "DIR", {}, ["is a directory"]),
    ("binary", b"\x89PNG\r\n\x00\xff\xfe", {}, ["not a text file"]),
    (
        "bad-column",
        "start_time,window_name,elapsed_time,gpuX_energy\n0,a,1,2\n",
        {},
        ["gpuX_energy", "gpu<i>_energy"],
    ),
    ("no-gpu-column-name", "start_time,window_name,elapsed_time,energy\n0,a,1,2\n", {}, ["'energy'"]),
    (
        "gpu-indices-count",
        HEADER + "0,a,1,2\n",
        {"gpu_indices": [0, 1]},
        ["gpu_indices=[0, 1]", "1 GPU column(s)"],
    ),
    ("gpu-indices-str", HEADER + "0,a,1,2\n", {"gpu_indices": "0"}, ["gpu_indices='0'"]),
    ("steps-per-row-str", HEADER + "0,a,1,2\n", {"steps_per_row": "40"}, ["steps_per_row='40'"]),
    ("zeus-row-nan-time", HEADER + ZEUS_ROW.format(t="nan", e=5), {}, ["line 2", "elapsed_time is 'nan'"]),
    ("zeus-row-negative-energy", HEADER + ZEUS_ROW.format(t=1, e=-5), {}, ["line 2", "gpu0_energy is '-5'"]),
    ("zeus-row-short", HEADER + "0,__GlobalPowerLimitOptimizer_300,1\n", {}, ["line 2", "fields"]),
    ("row-nan-time", HEADER + "0,a,nan,1\n", {}, ["line 2", "elapsed_time is 'nan'"]),
    ("row-inf-energy", HEADER + "0,a,1,inf\n", {}, ["line 2", "gpu0_energy is 'inf'"]),
    ("row-negative-energy", HEADER + "0,a,1,-3\n", {}, ["line 2", "gpu0_energy is '-3'"]),
    ("row-text", HEADER + "0,a,1,x\n", {}, ["line 2", "gpu0_energy is 'x'"]),
]


@pytest.mark.parametrize(
    ("content", "kw", "words"), [c[1:] for c in REPLAY_CASES], ids=[c[0] for c in REPLAY_CASES]
)
def test_replay_logs(content, kw, words, tmp_path, sim_gpus):
    """Every unusable log is refused when the monitor is built, naming the file (and line)."""
    sim_gpus("a40")
    path = tmp_path / "missing.csv"
    if content == "DIR":
        path = tmp_path
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as info:
        ReplayZeusMonitor(log_file=path, ignore_sync_execution=True, **kw)
    assert_clear(info.value, "ReplayZeusMonitor(", *words)


def test_replay_valid_edges(tmp_path, sim_gpus):
    """A lost GPU's empty cell, a zero-energy window and a CPU-only log replay as recorded."""
    sim_gpus("a40")
    path = tmp_path / "log.csv"
    path.write_text("start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy\n0,a,1.5,0,\n")
    monitor = ReplayZeusMonitor(log_file=path, ignore_sync_execution=True)
    monitor.begin_window("a")
    m = monitor.end_window("a")
    assert (m.time, m.gpu_energy) == (1.5, {0: 0.0})


# -- ProfileDataLoader, EpochLog and their variables --------------------------------------------------------
DATA = list(range(100))
LOADER_CASES = [
    ({"split": "test"}, ["split='test'", "'train' or 'eval'"]),
    ({"subset_proportion": 0}, ["subset_proportion=0", "(0, 1]"]),
    ({"subset_proportion": math.nan}, ["subset_proportion=nan"]),
    ({"subset_proportion": "0.5"}, ["subset_proportion='0.5'", "(0, 1]"]),
    ({"subset_proportion": 0.01}, ["holds no more than one batch"]),
    ({"batch_size": "4", "subset_proportion": 0.5}, ["batch_size='4'", "whole number"]),
    ({"batch_size": 0}, ["batch_size=0"]),
    ({"batch_size": 2.5}, ["batch_size=2.5"]),
    ({"monitor": "x"}, ["monitor='x'", "ZeusMonitor"]),
    ({"log_prefix": None}, ["log_prefix", "ZEUS_LOG_PREFIX"]),
    ({"log_prefix": "FILE/run"}, ["FILE", "cannot be created"]),
]


@pytest.mark.parametrize(("kw", "words"), LOADER_CASES)
def test_profile_data_loader_arguments(kw, words, sim_gpus, tmp_path):
    sim_gpus("a40")
    (tmp_path / "FILE").write_text("a file")
    kw = {"batch_size": 4, "split": "train", "log_prefix": tmp_path / "logs" / "run", **kw}
    if isinstance(kw["log_prefix"], str):
        kw["log_prefix"] = tmp_path / kw["log_prefix"]
    with pytest.raises(ValueError) as info:
        loader = ProfileDataLoader(DATA, **kw)
        for _ in loader:  # a file that cannot be created is found at the first epoch at the latest
            pass
    assert_clear(info.value, *words)


@pytest.mark.parametrize(
    ("env", "kw", "words"),
    [
        ({"ZEUS_MONITOR_SLEEP_MS": "abc"}, {}, ["ZEUS_MONITOR_SLEEP_MS='abc'", "milliseconds"]),
        ({"ZEUS_MONITOR_SLEEP_MS": "1.5"}, {}, ["ZEUS_MONITOR_SLEEP_MS='1.5'"]),
        ({"ZEUS_MONITOR_SLEEP_MS": "-5"}, {}, ["ZEUS_MONITOR_SLEEP_MS='-5'", "0 for no power log"]),
        ({}, {"sleep_ms": -1}, ["sleep_ms=-1"]),
        ({}, {"sleep_ms": "x"}, ["sleep_ms='x'"]),
        ({}, {"monitor": "x"}, ["monitor='x'", "ZeusMonitor"]),
    ],
)
def test_epoch_log_arguments(env, kw, words, sim_gpus, monkeypatch, tmp_path):
    sim_gpus("a40")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        EpochLog(log_prefix=tmp_path / "run", **kw)
    assert_clear(info.value, "EpochLog(" if kw else "", *words)


def test_loader_valid_edges(sim_gpus, tmp_path, monkeypatch):
    """ZEUS_MONITOR_SLEEP_MS=0 (no power log), a whole-number float batch size, eval with a full dataset."""
    sim_gpus("a40", virtual_clock=True)
    monkeypatch.setenv("ZEUS_MONITOR_SLEEP_MS", "0")
    loader = ProfileDataLoader(DATA, batch_size=10, split="eval", log_prefix=tmp_path / "run")
    assert sum(1 for _ in loader) == 10
    assert not (tmp_path / "run+gpu0.power.csv").exists()
    assert [r.split for r in loader.records] == ["eval"]


# -- the monitoring options: PowerMonitor, TemperatureMonitor, serve_metrics, carbon, `report` --------------
def _param_ids(cases: list) -> list[str]:
    return [c.values[0] if hasattr(c, "marks") else c[0] for c in cases]  # a pytest.param is a tuple too


MONITORING_CASES = [
    ("power-gpu-indices-int", "PowerMonitor", {"gpu_indices": 0}, ["gpu_indices=0", "list of GPU indices"]),
    ("power-gpu-absent", "PowerMonitor", {"gpu_indices": [5]}, ["gpu_indices=[5]", "visible GPU"]),
    ("power-period-0", "PowerMonitor", {"update_period": 0}, ["update_period=0", "greater than 0"]),
    ("power-period-nan", "PowerMonitor", {"update_period": math.nan}, ["update_period=nan"]),
    ("power-period-str", "PowerMonitor", {"update_period": "0.1"}, ["update_period='0.1'"]),
    (
        "power-max-samples-0",
        "PowerMonitor",
        {"max_samples_per_gpu": 0},
        ["max_samples_per_gpu=0", "at least 2"],
    ),
    ("power-domain-unknown", "PowerMonitor", {"power_domains": ["x"]}, ["'x' is not a power domain"]),
    ("power-domains-str", "PowerMonitor", {"power_domains": "device_instant"}, ["list of power domains"]),
    ("temp-gpu-indices-int", "TemperatureMonitor", {"gpu_indices": 0}, ["gpu_indices=0"]),
    ("temp-period-inf", "TemperatureMonitor", {"update_period": math.inf}, ["update_period=inf"]),
    ("temp-max-samples-neg", "TemperatureMonitor", {"max_samples_per_gpu": -1}, ["max_samples_per_gpu=-1"]),
]


@pytest.mark.parametrize(
    ("cls", "kw", "words"), [c[1:] for c in MONITORING_CASES], ids=[c[0] for c in MONITORING_CASES]
)
def test_power_and_temperature_monitor_arguments(cls, kw, words, sim_gpus):
    from zeus_callbacks.core.monitor import power, temperature

    sim_gpus("a40")
    make = power.PowerMonitor if cls == "PowerMonitor" else temperature.TemperatureMonitor
    with pytest.raises(ValueError) as info:
        make(background=False, **kw).stop()
    assert_clear(info.value, f"{cls}(", *words)


SERVE_CASES = [
    ("port-negative", {"port": -1}, ["serve_metrics(port=-1)", "[0, 65535]"]),
    ("port-too-big", {"port": 70000}, ["port=70000"]),
    ("port-str", {"port": "x"}, ["port='x'"]),
    ("port-float", {"port": 9464.5}, ["port=9464.5"]),
    ("addr-unknown", {"port": 0, "addr": "not a host!"}, ["not a host!", "Choose"]),
    ("optimizer-str", {"port": 0, "optimizers": ["x"]}, ["optimizers=", "GlobalPowerLimitOptimizer"]),
    pytest.param(
        "monitor-str",
        {"port": 0, "monitor": "x"},
        ["serve_metrics(monitor='x')", "ZeusMonitor"],
    ),
    pytest.param(
        "job-empty",
        {"port": 0, "job": ""},
        ["serve_metrics(job='')"],
    ),
]


@pytest.mark.parametrize(
    ("name", "kw", "words"),
    SERVE_CASES,
    ids=_param_ids(SERVE_CASES),
)
def test_serve_metrics_arguments(name, kw, words, sim_gpus):
    pytest.importorskip("prometheus_client")
    from zeus_callbacks.core.observability.endpoint import serve_metrics

    sim_gpus("a40")
    with pytest.raises(ValueError) as info:
        serve_metrics(**kw).stop()
    assert_clear(info.value, *words)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("abc", ["ZEUS_CALLBACKS_PROMETHEUS_PORT='abc'", "e.g. 9464"]),
        ("1.5", ["ZEUS_CALLBACKS_PROMETHEUS_PORT='1.5'"]),
        pytest.param(
            "-1",
            ["ZEUS_CALLBACKS_PROMETHEUS_PORT='-1'"],
        ),
        pytest.param(
            "70000",
            ["ZEUS_CALLBACKS_PROMETHEUS_PORT='70000'"],
        ),
    ],
)
def test_prometheus_port_variable(value, words, sim_gpus, monkeypatch):
    pytest.importorskip("prometheus_client")
    from zeus_callbacks.core.observability.endpoint import serve_metrics_from_env

    sim_gpus("a40")
    monkeypatch.setenv("ZEUS_CALLBACKS_PROMETHEUS_PORT", value)
    with pytest.raises(ValueError) as info:
        server = serve_metrics_from_env()
        if server is not None:
            server.stop()
    assert_clear(info.value, *words)


CARBON_CASES = [
    ("fixed-negative", lambda c: c.FixedCarbonIntensity(-1), ["FixedCarbonIntensity(-1)", ">= 0"]),
    ("fixed-nan", lambda c: c.FixedCarbonIntensity(math.nan), ["FixedCarbonIntensity(nan)"]),
    ("fixed-str", lambda c: c.FixedCarbonIntensity("400"), ["FixedCarbonIntensity('400')"]),
    ("monitor-provider-str", lambda c: c.CarbonEmissionMonitor("x"), ["carbon_intensity_provider='x'"]),
    (
        "region-unknown",
        lambda c: c.RegionCarbonIntensity("Atlantis"),
        ["RegionCarbonIntensity('Atlantis')", "Known"],
    ),
    ("maps-location-str", lambda c: c.ElectricityMapsClient(location="x", api_key="k"), ["location='x'"]),
    (
        "maps-factor",
        lambda c: c.ElectricityMapsClient(zone="DE", emission_factor_type="x", api_key="k"),
        ["'lifecycle'"],
    ),
    ("maps-nothing", lambda c: c.ElectricityMapsClient(), ["location=(latitude, longitude)", "zone="]),
    pytest.param(
        "maps-latitude-200",
        lambda c: c.ElectricityMapsClient(location=(200, 0), api_key="k"),
        ["location=(200, 0)", "latitude"],
    ),
    pytest.param(
        "maps-timeout-0",
        lambda c: c.ElectricityMapsClient(zone="DE", timeout_s=0, api_key="k"),
        ["timeout_s=0"],
    ),
]


@pytest.mark.parametrize(
    ("name", "make", "words"),
    CARBON_CASES,
    ids=_param_ids(CARBON_CASES),
)
def test_carbon_arguments(name, make, words, sim_gpus):
    from zeus_callbacks.core.monitor import carbon

    sim_gpus("a40")
    with pytest.raises(ValueError) as info:
        make(carbon)
    assert_clear(info.value, *words)


def _run_dir(tmp_path: Path, kind: str) -> Path:
    run_dir = tmp_path / "run"
    if kind == "missing":
        return run_dir
    if kind == "file":
        run_dir.write_text("not a folder")
        return run_dir
    run_dir.mkdir()
    content = {"corrupt": "{not json", "foreign": '{"a": 1}', "binary": "\x00\xff"}.get(kind)
    if content is not None:
        (run_dir / "record.rank0.json").write_text(content, encoding="latin-1")
    return run_dir


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("file", ["not a folder"]),
        ("empty", ["no run record", "report_path="]),
        ("corrupt", ["record.rank0.json", "not valid JSON"]),
        ("foreign", ["record.rank0.json", "not a zeus_callbacks run record"]),
        ("binary", ["record.rank0.json"]),
    ],
)
def test_report_run_dir(kind, words, tmp_path, capsys):
    rc, _, err = run_cli(capsys, ["report", str(_run_dir(tmp_path, kind)), "-o", str(tmp_path / "r.html")])
    assert_one_clear_line(rc, err, "report", *words)
    assert not (tmp_path / "r.html").exists()


def test_carbon_monitor_takes_one_gpu_index_as_zeus_monitor_does(sim_gpus):
    """`gpu_indices=0` is GPU 0, as `ZeusMonitor` reads it (Zeus's DDP example passes one int)."""
    from zeus_callbacks.core.monitor import carbon

    sim_gpus("2*a40")
    assert carbon.CarbonEmissionMonitor(400.0, gpu_indices=0).zeus_monitor.gpu_indices == [0]
