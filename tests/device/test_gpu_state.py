"""The GPU is left as it was found: journal before change, restore on exit/exception/signals, repair."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from zeus_callbacks import cli, sim
from zeus_callbacks.core.device import gpus as devices
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.state_guard import guard, journal_dir
from zeus_callbacks.sim import fake_nvml

# A child that changes GPU 0's power limit to 150 W through the package, then does what `tail` says.
_CHILD = """
import os, signal, sys, time
from zeus_callbacks.core.device.gpus import get_gpus
gpu = get_gpus()[0]
{setup}
gpu.set_power_limit_mw(150_000)
assert gpu.power_limit_mw() == 150_000
print("ready", flush=True)
{tail}
"""


def _child_code(tail: str = "", setup: str = "") -> str:
    return _CHILD.format(setup=textwrap.dedent(setup), tail=textwrap.dedent(tail))


def _start(code: str, **env: str) -> subprocess.Popen:
    """Start a child and wait until it has changed the power limit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"child did not get ready: {line!r} {out!r} {err!r}")
    return proc


def _journals() -> list[dict]:
    d = journal_dir()
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d and d.is_dir() else []


def test_journal_is_written_before_the_change(sim_gpus, monkeypatch):
    sim_gpus("a40")
    gpu = get_gpus()[0]
    real_set = fake_nvml.nvmlDeviceSetPowerManagementLimit
    seen = []

    def set_and_check(handle, limit):
        seen.append(_journals())  # what is on disk at the moment the GPU changes
        real_set(handle, limit)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceSetPowerManagementLimit", set_and_check)
    gpu.set_power_limit_mw(200_000)
    gpu.set_power_limit_mw(175_000)  # the second change keeps the first original
    [journal] = seen[0]
    assert journal["pid"] == os.getpid()
    assert journal["entries"] == [
        {
            "uuid": gpu.uuid,
            "name": "NVIDIA A40",
            "knob": "power_limit",
            "original": 300_000,
            "route": "direct",  # how the change was made, so how it is undone (zeusd: and its endpoint)
            "zeusd": None,
        }
    ]
    assert seen[1] == seen[0]
    gpu.lock_sm_clocks(210, 1200)
    assert [e["knob"] for e in _journals()[0]["entries"]] == ["power_limit", "sm_clocks"]
    monkeypatch.undo()
    assert guard().restore()
    assert gpu.power_limit_mw() == 300_000
    assert sim.simulated_gpu(gpu).locked_sm_clocks_mhz is None
    assert _journals() == []


@pytest.mark.system
def test_restore_at_normal_exit(sim_gpus, run_python):
    system = sim_gpus("a40")
    child = run_python(
        _child_code(
            "from zeus_callbacks import sim\ngpu.lock_sm_clocks(210, 1000)\n"
            "print(sim.simulated_gpu(gpu).locked_sm_clocks_mhz)"
        )
    )
    assert child.returncode == 0, child.stderr
    assert "(210, 1000)" in child.stdout
    assert system.gpus[0].power_limit_mw == 300_000
    assert system.gpus[0].locked_sm_clocks_mhz is None
    assert _journals() == []


@pytest.mark.system
def test_restore_on_uncaught_exception(sim_gpus, run_python):
    system = sim_gpus("a40")
    child = run_python(_child_code("raise RuntimeError('boom in training')"))
    assert child.returncode == 1 and "boom in training" in child.stderr
    assert system.gpus[0].power_limit_mw == 300_000
    assert _journals() == []


@pytest.mark.system
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_restore_on_signal_chains_the_users_handler(sim_gpus, signum):
    system = sim_gpus("a40")
    # The user's handler is installed first; it must still run, after the GPU is restored.
    setup = f"""
    def handler(signum, frame):
        print("user handler; limit", get_gpus()[0].power_limit_mw(), flush=True)
        sys.exit(7)
    signal.signal({int(signum)}, handler)
    """
    proc = _start(_child_code("time.sleep(30)", setup=setup))
    assert system.gpus[0].power_limit_mw == 150_000
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 7, err
    assert "user handler; limit 300000" in out  # restored before the user's handler ran
    assert system.gpus[0].power_limit_mw == 300_000
    assert _journals() == []


@pytest.mark.system
def test_restore_on_sigterm_with_default_handler_still_dies_of_the_signal(sim_gpus):
    system = sim_gpus("a40")
    proc = _start(_child_code("time.sleep(30)"))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGTERM
    assert system.gpus[0].power_limit_mw == 300_000


@pytest.mark.system
def test_restore_on_sigint_with_default_handler_raises_keyboard_interrupt(sim_gpus):
    system = sim_gpus("a40")
    proc = _start(_child_code("time.sleep(30)"))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert "KeyboardInterrupt" in err
    assert system.gpus[0].power_limit_mw == 300_000


def _killed_child(system) -> dict:
    """An admin set 250 W; a run then set 150 W and was killed with SIGKILL (no restore watchdog, which
    would put the limit back at once: see test_restore_watchdog.py). Returns its journal."""
    system.gpus[0].set_power_limit_mw(250_000)  # outside this package: not journaled
    proc = _start(_child_code("time.sleep(30)"), ZEUS_CALLBACKS_WATCHDOG="0")
    proc.kill()
    proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGKILL
    assert system.gpus[0].power_limit_mw == 150_000  # nothing could run: the change stays
    [journal] = _journals()
    assert journal["pid"] == proc.pid
    assert journal["entries"][0]["original"] == 250_000
    return journal


@pytest.mark.system
def test_sigkill_leaves_the_change_and_the_next_discovery_repairs_it(sim_gpus, caplog):
    system = sim_gpus("a40")
    journal = _killed_child(system)
    devices.reset()
    get_gpus()  # discovery in the next process
    assert system.gpus[0].power_limit_mw == 250_000  # the value before the run, not the default 300 W
    assert _journals() == []
    assert f"Process {journal['pid']} ended without restoring power_limit" in caplog.text


@pytest.mark.system
def test_sigkill_repaired_by_another_process(sim_gpus, run_python):
    system = sim_gpus("a40")
    _killed_child(system)
    child = run_python(
        "from zeus_callbacks.core.device.gpus import get_gpus; print(get_gpus()[0].power_limit_mw())"
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "250000"
    assert system.gpus[0].power_limit_mw == 250_000


@pytest.mark.system
def test_zeus_callbacks_restore_repairs(sim_gpus, capsys):
    system = sim_gpus("a40")
    _killed_child(system)
    assert cli.main(["restore"]) == 0
    out = capsys.readouterr().out
    assert "power_limit" in out and "250" in out
    assert system.gpus[0].power_limit_mw == 250_000
    assert _journals() == []
    assert cli.main(["restore"]) == 0
    assert "Nothing to restore" in capsys.readouterr().out


@pytest.mark.system
def test_live_runs_are_left_alone_unless_asked(sim_gpus):
    system = sim_gpus("a40")
    proc = _start(_child_code("time.sleep(30)"))
    try:
        get_gpus()
        assert system.gpus[0].power_limit_mw == 150_000  # a live run keeps its setting
        restored = guard().repair_dead_runs(get_gpus(), include_live=True)
        assert [(e.knob, e.original) for e in restored] == [("power_limit", 300_000)]
        assert system.gpus[0].power_limit_mw == 300_000
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    assert system.gpus[0].power_limit_mw == 300_000


@pytest.mark.system
def test_journal_of_a_lost_gpu_is_kept(sim_gpus, run_python, monkeypatch):
    system = sim_gpus("a40")
    _killed_child(system)
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_FAULTS", "lost_after=6")  # discovery itself takes 6 calls
    child = run_python("from zeus_callbacks.core.device.gpus import get_gpus; get_gpus()")
    assert child.returncode == 0, child.stderr
    assert "Could not restore power_limit" in child.stderr
    assert system.gpus[0].power_limit_mw == 150_000
    assert len(_journals()) == 1  # kept for a later `zeus-callbacks restore`
