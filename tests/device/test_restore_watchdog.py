"""The restore watchdog puts the GPU back after a hard death, with no later process running.

How soon is `benchmarks/restore_latency.py`'s figure (17 ms median on an idle 2-core VM), not an assert: these
tests wait up to `_RESTORE_DEADLINE_S` for the outcome, since a loaded host wakes the watchdog late (issue 37:
no test asserts a duration)."""

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
    path = os.pathsep.join([str(ROOT), env.pop("PYTHONPATH", os.environ.get("PYTHONPATH", ""))])
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


# Interpreter start-up slowed for the watchdog alone (as a loaded node or a slow `nvmlInit` does).
_SLOW_WATCHDOG = """
import time
if b"zeus_callbacks.core.device.watchdog" in open("/proc/self/cmdline", "rb").read():
    time.sleep(1.5)
"""


@pytest.mark.slow
def test_gpu_back_after_a_death_right_after_the_first_change(sim_gpus, tmp_path):
    system = sim_gpus("a40")
    (tmp_path / "sitecustomize.py").write_text(_SLOW_WATCHDOG)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    # It dies the moment its first change returns: that change waited until the watchdog was ready.
    proc = _start(tail="os.kill(os.getpid(), 9)", PYTHONPATH=path)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    _back(system.gpus[0])


# An outcome's deadline, not a timing: no other process runs that could put the GPU back.
_RESTORE_DEADLINE_S = 30.0


def _back(gpu) -> None:
    start = time.monotonic()
    while gpu.power_limit_mw != 300_000:
        if time.monotonic() - start > _RESTORE_DEADLINE_S:
            raise AssertionError(
                f"GPU still at {gpu.power_limit_mw / 1000:g} W {_RESTORE_DEADLINE_S:g} s after the death"
            )
        time.sleep(0.01)


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
def test_gpu_back_after_a_hard_death(sim_gpus, signum):
    system = sim_gpus("a40")
    proc = _start()
    assert system.gpus[0].power_limit_mw == 150_000
    proc.send_signal(signum)  # at once: the first change waited until its watchdog was ready
    proc.wait(timeout=10)
    assert proc.returncode == -signum
    _back(system.gpus[0])
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
def test_sigterm_while_blocked_in_a_collective_restores_at_once(sim_gpus):
    """Issue 24: the rank's Python handler cannot run while it waits in a collective; the watchdog learns of
    the SIGTERM through the wakeup fd and restores, the rank still blocked."""
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
        assert system.gpus[0].power_limit_mw == 150_000
        blocked.send_signal(signal.SIGTERM)  # the scheduler's SIGTERM: no Python handler can run now
        _back(system.gpus[0])
        assert blocked.poll() is None  # still blocked in the collective: the watchdog restored it
        assert system.gpus[1].power_limit_mw == 300_000  # the other rank's GPU was never touched
        blocked.kill()  # ...and its SIGKILL after the grace period
        blocked.wait(timeout=10)
        time.sleep(0.5)
        assert system.gpus[0].power_limit_mw == 300_000
        assert _watchdogs_of(blocked.pid) == []
    finally:
        frozen.kill()
        frozen.wait(timeout=10)


# What the kernel's OOM killer does to a process: SIGKILL, chosen for its memory, while it allocates. This is an
# emulation, not an out-of-memory condition: the child raises its own OOM score (the kernel would pick it
# first), caps its address space (it can never endanger the machine: past the cap it gets MemoryError, frees
# and allocates again) and allocates in a loop; the test sends the SIGKILL from outside once it has grown.
_ALLOCATING = """
import resource
with open("/proc/self/oom_score_adj", "w") as f:
    f.write("1000")
with open("/proc/self/statm") as f:
    size = int(f.read().split()[0]) * resource.getpagesize()
cap = size + (256 << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
print("allocating", flush=True)
held = []
while True:
    try:
        held.append(b"x" * (8 << 20))  # touched pages: resident memory, as a real leak would have
    except MemoryError:
        held.clear()
"""


def _dead(pid: int) -> bool:
    """Whether `pid` has ended: gone, or a zombie waiting for its (new) parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow
def test_gpu_back_after_an_oom_killer_style_sigkill(sim_gpus):
    """An emulated OOM kill (see `_ALLOCATING`): SIGKILL from outside while the child allocates memory."""
    system = sim_gpus("a40")
    proc = _start(tail=_ALLOCATING)
    assert proc.stdout.readline().strip() == "allocating"
    start_mb = _resident_mb(proc.pid)
    deadline = time.monotonic() + 30
    while _resident_mb(proc.pid) < start_mb + 64:  # growing, as the OOM killer's victim is
        assert time.monotonic() < deadline, "the child's memory did not grow"
        time.sleep(0.01)
    assert system.gpus[0].power_limit_mw == 150_000
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    _back(system.gpus[0])
    time.sleep(0.5)
    assert _watchdogs_of(proc.pid) == []


# A script that `zeus-callbacks profile` runs: its training step hangs once the GPU is below its maximum limit,
# so the CLI's --timeout kills it (SIGKILL) with the GPU changed.
_HANGING_PROFILE_SCRIPT = """
import os, time
from pathlib import Path
from zeus_callbacks import profile_power_limits
from zeus_callbacks.core.device.gpus import get_gpus

def step():
    if get_gpus()[0].power_limit_mw() < 300_000:
        Path({pid_file!r}).write_text(str(os.getpid()))
        time.sleep(120)

profile_power_limits(step)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher", [[], ["bash", "-c", '"$0" "$1"; exit $?']], ids=["direct", "under-a-shell"]
)
def test_gpu_back_after_profile_timeout(sim_gpus, tmp_path, launcher):
    """`zeus-callbacks profile --timeout` SIGKILLs a run of the script past its time and returns: the GPU is
    back after that return (the kill came just before it), with the script gone and no later process
    of this package running; also when the script runs under a launcher (here a shell that does not exec
    it), whose children the kill reaches too."""
    system = sim_gpus("a40")
    pid_file = tmp_path / "script.pid"
    script = tmp_path / "hang.py"
    script.write_text(_HANGING_PROFILE_SCRIPT.format(pid_file=str(pid_file)))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    cli = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "profile", "--gpu-name", "a40", "--batch-sizes", "8,16"]
        + ["--power-limits", "150", "--warmup-steps", "0", "--timeout", "15", "--keep-sim-workload"]
        + ["--output", str(tmp_path / "a40.json"), "--", *launcher, sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": path, "ZEUS_CALLBACKS_SIMULATE": "a40"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        _back(system.gpus[0])
    except AssertionError as e:
        raise AssertionError(f"{e}\n{cli.stderr}") from None
    assert cli.returncode == 1, cli.stderr
    assert "batch size 8 ran past --timeout 15.0s" in cli.stderr
    assert "Traceback" not in cli.stderr
    script_pid = int(pid_file.read_text())  # it reached the hanging step with the GPU at 150 W
    assert _dead(script_pid)
    time.sleep(0.5)
    assert _watchdogs_of(script_pid) == []
    assert not (tmp_path / "a40.json").exists()


@pytest.mark.slow
def test_ctrl_c_of_profile_reaches_the_script(sim_gpus, tmp_path):
    """The script runs in a process group of its own (for the timeout's kill): a Ctrl-C of the CLI is passed
    on to it, it restores the GPU itself, and the CLI ends with one line and 130."""
    system = sim_gpus("a40")
    pid_file = tmp_path / "script.pid"
    script = tmp_path / "hang.py"
    script.write_text(_HANGING_PROFILE_SCRIPT.format(pid_file=str(pid_file)))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    cli = subprocess.Popen(
        [sys.executable, "-m", "zeus_callbacks.cli", "profile", "--gpu-name", "a40", "--batch-sizes", "8,16"]
        + ["--power-limits", "150", "--warmup-steps", "0", "--keep-sim-workload"]
        + ["--output", str(tmp_path / "a40.json"), "--", sys.executable, str(script)],
        env={
            **os.environ,
            "PYTHONPATH": path,
            "ZEUS_CALLBACKS_SIMULATE": "a40",
            "ZEUS_CALLBACKS_WATCHDOG": "0",
        },
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert time.monotonic() < deadline and cli.poll() is None, "the script did not reach its hanging step"
        time.sleep(0.05)
    assert system.gpus[0].power_limit_mw == 150_000
    cli.send_signal(signal.SIGINT)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 130, err
    assert err.splitlines()[-1] == "zeus-callbacks profile: interrupted at batch size 8"
    assert system.gpus[0].power_limit_mw == 300_000  # the script's own SIGINT handling (no watchdog here)
    assert _dead(int(pid_file.read_text()))
