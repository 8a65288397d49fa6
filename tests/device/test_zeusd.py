"""GPU settings through Zeus's daemon zeusd: the setters speak its HTTP API, journal the route, restore through it.

zeusd cannot be built here: every test talks to `zeusd_double.py`, a test double written from zeusd's
published API document, run as a process of its own (as the root daemon would be) that applies the changes
to the simulated node's shared state, where the client's NVML reads see them. The client process carries the
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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import TOY_STEPS_COUNTER
from zeusd_double import issue_token

from zeus_callbacks.core.device import setters, zeusd
from zeus_callbacks.core.device.errors import GPUError, GPUNoPermissionError, InvalidInputError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.journal import read_journal, write_atomic
from zeus_callbacks.core.device.state_guard import guard, journal_dir

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
DOUBLE = HERE / "zeusd_double.py"
SCRIPT = HERE / "fault_training.py"
KEY = "test-signing-key-0123456789abcdef"
ZEUSD_ENV = (zeusd.SOCK_ENV, zeusd.HOST_PORT_ENV, zeusd.TOKEN_ENV, setters.SETTERS_ENV)


class Daemon:
    """A running test double: `env` points a client at it; `requests()` lists what it was asked."""

    def __init__(self, proc: subprocess.Popen, env: dict[str, str], log: Path) -> None:
        self.proc, self.env, self.log = proc, env, log

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def writes(self) -> list[str]:
        return [r for r in self.requests() if r.startswith("POST")]


@pytest.fixture(autouse=True)
def _no_zeusd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ZEUSD_ENV:
        monkeypatch.delenv(name, raising=False)
    setters.forget()


@pytest.fixture
def start_zeusd(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """`start_zeusd(transport="unix"|"tcp", *options)`: the double on this test's simulated node."""
    started: list[subprocess.Popen] = []

    def start(transport: str = "unix", *options: str) -> Daemon:
        log = tmp_path / f"zeusd-{len(started)}.log"
        where = (
            ["--socket", str(tmp_path / f"zeusd-{len(started)}.sock")]
            if transport == "unix"
            else ["--tcp", "127.0.0.1:0"]
        )
        env = {k: v for k, v in os.environ.items() if k != "ZEUS_CALLBACKS_SIM_FAULTS"}  # the daemon is root
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        proc = subprocess.Popen(
            [sys.executable, str(DOUBLE), *where, "--log", str(log), *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append(proc)
        line = proc.stdout.readline().split()
        assert line[:1] == ["READY"], (line, proc.stderr.read() if proc.poll() is not None else "")
        name = zeusd.SOCK_ENV if transport == "unix" else zeusd.HOST_PORT_ENV
        return Daemon(proc, {name: line[1]}, log)

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def _client(monkeypatch: pytest.MonkeyPatch, daemon: Daemon | None = None, **env: str) -> None:
    for k, v in {**(daemon.env if daemon else {}), **env}.items():
        monkeypatch.setenv(k, v)


# -- choosing the route ----------------------------------------------------------------------------
def test_route_follows_the_environment_as_zeus_does(monkeypatch):
    assert setters.route().name == "nvml"
    monkeypatch.setenv(zeusd.HOST_PORT_ENV, "node1:4938")
    assert setters.route().name == "zeusd" and str(setters.route().endpoint) == "tcp:node1:4938"
    monkeypatch.setenv(zeusd.SOCK_ENV, "/run/zeusd/zeusd.sock")  # the socket is tried first
    assert str(setters.route().endpoint) == "unix:/run/zeusd/zeusd.sock"
    monkeypatch.setenv(setters.SETTERS_ENV, "nvml")
    assert setters.route().name == "nvml"
    monkeypatch.setenv(setters.SETTERS_ENV, "zeusd")
    assert setters.route().name == "zeusd"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({setters.SETTERS_ENV: "daemon"}, "ZEUS_CALLBACKS_SETTERS='daemon' is not one of auto, nvml, zeusd"),
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


def test_the_daemons_index_is_found_by_pci_address(sim_gpus, start_zeusd, monkeypatch):
    """On a mixed node NVML's order is not CUDA's: `cuda:0` (the A10G) is zeusd's GPU 1."""
    system = sim_gpus("a10g,t4", faults="no_cap_sys_admin")
    for options in ((), ("--no-pci-address",)):  # older daemons give no address: NVML index and name
        setters.forget()
        daemon = start_zeusd("unix", *options)
        _client(monkeypatch, daemon)
        gpus = get_gpus()
        gpus[0].set_power_limit_mw(120_000)
        assert system.cuda_gpus()[0].power_limit_mw == 120_000 and system.gpus[0].power_limit_mw == 70_000
        assert '"gpu_ids": "1"' in daemon.writes()[0]
        assert guard().restore()


def test_restore_falls_back_to_nvml_where_this_process_may(sim_gpus, start_zeusd, monkeypatch):
    system = sim_gpus("a40")  # this process holds the (simulated) capability
    daemon = start_zeusd()
    _client(monkeypatch, daemon)
    get_gpus()[0].set_power_limit_mw(200_000)
    daemon.proc.terminate()  # the daemon is gone by the end
    daemon.proc.wait(timeout=10)
    assert guard().restore()
    assert system.gpus[0].power_limit_mw == 300_000


def test_a_journal_from_before_routes_is_still_repaired(sim_gpus):
    """Entries without a route were NVML changes: they are read and undone as such."""
    system = sim_gpus("a40")
    gpus = get_gpus(repair=False)
    system.gpus[0].set_power_limit_mw(150_000)
    dead = subprocess.Popen(["true"])
    dead.wait()
    directory = journal_dir()
    directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    entry = {"uuid": gpus[0].uuid, "name": gpus[0].name, "knob": "power_limit", "original": 300_000}
    write_atomic(directory / f"{dead.pid}-0.json", {"pid": dead.pid, "start": "0", "entries": [entry]})
    [restored] = guard().repair_dead_runs(gpus)
    assert (restored.route, restored.zeusd) == ("nvml", None)
    assert system.gpus[0].power_limit_mw == 300_000


# -- refusals: one clear line, nothing journaled -------------------------------------------------------
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
            "HTTP 403 (GPU 0: NVML error: NoPermission); zeusd itself may not",
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


def test_a_daemon_error_is_reported_with_its_message(sim_gpus, start_zeusd, monkeypatch):
    sim_gpus("a40", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", "--faults", "not_supported=clocks")
    _client(monkeypatch, daemon)
    with pytest.raises(GPUError, match=r"HTTP 400 \(GPU 0: NVML error: NotSupported\).*not supported"):
        get_gpus()[0].lock_sm_clocks(900, 900)


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
    assert code == 1 and r["setters"]["route"] == "nvml" and r["setters"]["zeusd"] is None
    assert "zeusd" in r["permission"]["reason"]  # the way out is named
    daemon = start_zeusd()
    code, r = _doctor(daemon.env)
    assert code == 0 and r["permission"]["may_change"]
    assert r["setters"]["route"] == "zeusd" and r["setters"]["why"] == "ZEUSD_SOCK_PATH is set"
    assert r["setters"]["zeusd"]["reachable"] and r["setters"]["zeusd"]["gpu_control"]
    assert r["setters"]["zeusd"]["gpu_ids"] == {"0": 0}
    code, r = _doctor({zeusd.SOCK_ENV: str(tmp_path / "nobody.sock")})
    assert code == 1 and not r["setters"]["zeusd"]["reachable"]
    assert any("cannot be reached" in p for p in r["problems"])
    assert daemon.writes() == []  # doctor changes nothing


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
@pytest.mark.parametrize(("framework", "transport"), [("plain", "unix"), ("hf", "tcp"), ("pipeline", "unix")])
def test_training_without_cap_sys_admin_changes_the_gpu_through_zeusd(
    sim_gpus, start_zeusd, sim_state_dir, tmp_path, framework, transport
):
    system = sim_gpus("a40", **({"energy_refresh_ms": 10} if framework != "pipeline" else {}))
    daemon = start_zeusd(transport)
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
