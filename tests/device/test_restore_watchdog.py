"""The restore watchdog puts the GPU back within 1 s of a hard death, with no later process running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

CHILD = """
import os, sys, time
{setup}
from zeus_callbacks.core.device.gpus import get_gpus
get_gpus()[{gpu}].set_power_limit_mw(150_000)
print("ready", flush=True)
{tail}
"""


def _start(gpu: int = 0, setup: str = "", tail: str = "time.sleep(60)", **env: str) -> subprocess.Popen:
    code = CHILD.format(gpu=gpu, setup=textwrap.dedent(setup), tail=textwrap.dedent(tail))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path, **env},
    )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"child did not get ready: {line!r} {proc.communicate()}")
    return proc


def _back_within(gpu, seconds: float) -> float:
    start = time.monotonic()
    while gpu.power_limit_mw != 300_000:
        if time.monotonic() - start > seconds:
            raise AssertionError(f"GPU still at {gpu.power_limit_mw / 1000:g} W {seconds} s after the death")
        time.sleep(0.01)
    return time.monotonic() - start


def _watchdogs_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"zeus_callbacks.core.device.watchdog" in cmd and str(pid).encode() in cmd:
            out.append(int(d.name))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP])
def test_gpu_back_within_1s_of_a_hard_death(sim_gpus, signum):
    system = sim_gpus("a40")
    proc = _start()
    time.sleep(1.5)  # let the watchdog finish starting (it starts along with the first change)
    assert system.gpus[0].power_limit_mw == 150_000
    proc.send_signal(signum)
    proc.wait(timeout=10)
    assert proc.returncode == -signum
    _back_within(system.gpus[0], 1.0)
    time.sleep(0.5)
    assert _watchdogs_of(proc.pid) == []  # it does not outlive its purpose


@pytest.mark.slow
def test_the_watchdog_leaves_a_live_owner_alone_and_ends_with_the_restore(sim_gpus):
    system = sim_gpus("a40")
    proc = _start(
        tail="time.sleep(2)\nprint(get_gpus()[0].power_limit_mw(), flush=True)\nfrom zeus_callbacks.core.device.state_guard import guard\nguard().restore()\nprint('restored', flush=True)\ntime.sleep(60)"
    )
    assert proc.stdout.readline().strip() == "150000"  # not touched while its owner lives
    assert proc.stdout.readline().strip() == "restored"
    time.sleep(1.5)
    assert _watchdogs_of(proc.pid) == []  # gone once the settings are back, though the process lives
    proc.kill()
    proc.communicate(timeout=10)
    assert system.gpus[0].power_limit_mw == 300_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_while_blocked_in_a_collective_then_sigkill(sim_gpus):
    system = sim_gpus("2*a40")
    port = _free_port()
    setup = f"""
    import datetime, os, torch, torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    """
    # Rank 1 freezes; rank 0 blocks in a collective, where Python cannot run a signal handler.
    frozen = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(setup) + "\nimport time; time.sleep(120)"],
        env={**os.environ, "RANK": "1", "PYTHONPATH": str(ROOT)},
    )
    try:
        blocked = _start(setup=setup, tail="dist.all_reduce(torch.ones(1))", RANK="0")
        time.sleep(1.5)
        blocked.send_signal(signal.SIGTERM)  # the scheduler's SIGTERM: no handler can run now
        time.sleep(2)
        assert blocked.poll() is None and system.gpus[0].power_limit_mw == 150_000
        blocked.kill()  # ...and its SIGKILL after the grace period
        blocked.wait(timeout=10)
        _back_within(system.gpus[0], 1.0)
    finally:
        frozen.kill()
        frozen.wait(timeout=10)
