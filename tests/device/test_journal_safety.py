"""The GPU-state journal on a shared node: where it lives, what is trusted, concurrent repair, one owner per
GPU, forked workers. Each scenario runs several real processes on a simulated node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zeus_callbacks import cli
from zeus_callbacks.core.device import gpus as devices
from zeus_callbacks.core.device.journal import default_journal_dir
from zeus_callbacks.core.device.state_guard import guard, journal_dir

ROOT = Path(__file__).parents[2]
NOBODY = 65534


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _start(code: str, **env: str) -> subprocess.Popen:
    """Start `python -c code` and wait for its `ready` line."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(**env),
    )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        out, err = proc.communicate(timeout=20)
        raise AssertionError(f"child did not get ready: {line!r} {out!r} {err!r}")
    return proc


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


SET_AND_WAIT = """
import sys, time
from zeus_callbacks.core.device.gpus import get_gpus
get_gpus()[0].set_power_limit_mw({mw})
print("ready", flush=True)
time.sleep(60)
"""

MEASURE = """
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
m = ZeusMonitor(gpu_indices=[0])
m.begin_window("w"); print("energy", m.end_window("w").total_energy)
"""


def _journals(directory: Path | None = None) -> list[Path]:
    d = directory or journal_dir()
    return sorted(d.glob("*.json")) if d and d.is_dir() else []


def _dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


# -- place ------------------------------------------------------------------------------------------------
def test_default_journal_dir_lives_as_long_as_the_gpu_settings(monkeypatch, tmp_path):
    """Fails if the default journal directory is one that may not outlast the GPU settings (root: /run;
    others: the XDG state directory; never $TMPDIR)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "job-private-tmp"))  # a container's or a Slurm job's /tmp
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_journal_dir() == Path("/run/zeus_callbacks/journal")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_journal_dir() == tmp_path / "state" / "zeus_callbacks" / "journal"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_journal_dir() == Path.home() / ".local" / "state" / "zeus_callbacks" / "journal"


@pytest.mark.slow
def test_two_journal_dirs_and_sigkill_warn_and_restore_to_default(sim_gpus, tmp_path, monkeypatch):
    """Fails if a limit off its default that no journal explains goes unreported, or `restore --to-default`
    does not reset it."""
    system = sim_gpus("a40")
    # A run whose journal lived in one place (say, a job's private /tmp) is killed hard...
    # (Its restore watchdog went with it, as in a container torn down.)
    first = _start(
        SET_AND_WAIT.format(mw=150_000),
        ZEUS_CALLBACKS_JOURNAL_DIR=str(tmp_path / "a"),
        ZEUS_CALLBACKS_WATCHDOG="0",
    )
    first.kill()
    first.communicate(timeout=20)
    assert system.gpus[0].power_limit_mw == 150_000
    # ...and the next run, with its journal elsewhere, finds the leftover limit: it says so, loudly.
    second = _run(
        "from zeus_callbacks.core.device.gpus import get_gpus\nget_gpus()[0].set_power_limit_mw(200_000)",
        ZEUS_CALLBACKS_JOURNAL_DIR=str(tmp_path / "b"),
    )
    assert second.returncode == 0, second.stderr
    assert "power limit is 150 W, not its default 300 W" in second.stderr
    assert "zeus-callbacks restore --to-default" in second.stderr
    assert system.gpus[0].power_limit_mw == 150_000  # left as that run found it
    monkeypatch.setenv("ZEUS_CALLBACKS_JOURNAL_DIR", str(tmp_path / "b"))
    devices.reset()
    assert cli.main(["restore", "--to-default"]) == 0
    assert system.gpus[0].power_limit_mw == 300_000


@pytest.mark.slow
def test_restore_to_default_leaves_a_live_owners_gpu_alone(sim_gpus, capsys):
    """Fails if `restore --to-default` resets a GPU whose owner is alive."""
    system = sim_gpus("a40")
    owner = _start(SET_AND_WAIT.format(mw=150_000))
    try:
        assert cli.main(["restore", "--to-default"]) == 0
        assert f"owned by live process {owner.pid}" in capsys.readouterr().out
        assert system.gpus[0].power_limit_mw == 150_000
    finally:
        owner.terminate()
        owner.communicate(timeout=20)
    assert system.gpus[0].power_limit_mw == 300_000


# -- trust ------------------------------------------------------------------------------------------------
def _plant(directory: Path, entries: list[dict], how: str) -> None:
    """A journal of a dead process that would set the GPU to 100 W, planted the way `how` says."""
    target = directory
    if how == "symlinked_dir":
        target = directory.parent / "elsewhere"
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.symlink_to(target)
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = target / f"{_dead_pid()}-1.json"
    path.write_text(json.dumps({"pid": _dead_pid(), "start": "1", "entries": entries}))
    path.chmod(0o600)
    if how == "world_writable_dir":
        target.chmod(0o777)
    elif how == "world_writable_file":
        path.chmod(0o666)
    elif how == "foreign_dir":
        os.chown(target, NOBODY, NOBODY)
    elif how == "foreign_file":
        os.chown(path, NOBODY, NOBODY)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [
        "world_writable_dir",
        "world_writable_file",
        "symlinked_dir",
        pytest.param(
            "foreign_dir", marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
        ),
        pytest.param(
            "foreign_file", marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
        ),
        "out_of_range",
        "unknown_setting",
    ],
)
def test_a_planted_journal_never_changes_the_gpu(sim_gpus, how):
    """Fails if a journal another user could have written (or reached through a symbolic link), or an entry
    that is not a valid setting, is applied or skipped without a warning."""
    system = sim_gpus("a40")
    uuid = system.gpus[0].uuid
    entry = {"uuid": uuid, "name": "NVIDIA A40", "knob": "power_limit", "original": 100_000}
    if how == "out_of_range":
        entry["original"] = 50_000  # below the A40's 100 W minimum
    elif how == "unknown_setting":
        entry = {**entry, "knob": "fan_speed"}
    _plant(journal_dir(), [entry], how)
    # A root process that merely measures energy discovers the GPUs (which repairs dead runs' journals).
    child = _run(MEASURE)
    assert child.returncode == 0, child.stderr
    assert "energy" in child.stdout
    assert system.gpus[0].power_limit_mw == 300_000
    assert "Ignoring" in child.stderr or "Dropping" in child.stderr, child.stderr


def test_a_malformed_or_foreign_journal_file_is_skipped_with_one_warning(sim_gpus, caplog):
    """Fails if a file that is not a journal stops a repair, or is warned about at each repair of one
    process (the watchdog repairs at its start and again at the end) rather than once."""
    sim_gpus("a40")
    d = journal_dir()
    d.mkdir(parents=True, mode=0o700)
    (d / "broken.json").write_text('{"pid": 12')
    (d / "foreign.json").write_text('{"name": "another tool"}')
    gpus = devices.get_gpus()
    guard().repair_dead_runs(gpus)  # a second repair in this process, as the watchdog's at the end
    devices.get_gpus()[0].set_power_limit_mw(200_000)  # looks for journals that explain the limit too
    devices.reset()
    devices.get_gpus()
    for name in ("broken.json", "foreign.json"):
        assert sum(name in r.getMessage() for r in caplog.records) == 2  # once per process (two here)


# -- concurrency ------------------------------------------------------------------------------------------
SLOW_REPAIR = """
import time
from zeus_callbacks.sim import fake_nvml
real = fake_nvml.nvmlDeviceSetPowerManagementLimit
def slow(handle, mw):  # a slow driver call widens the window between reading and rewriting a journal
    time.sleep(0.5)
    real(handle, mw)
fake_nvml.nvmlDeviceSetPowerManagementLimit = slow
time.sleep(max(0.0, {start} - time.time()))
from zeus_callbacks.core.device.gpus import get_gpus
get_gpus()
"""


@pytest.mark.slow
def test_concurrent_repair_loses_no_update(sim_gpus):
    """Fails if two repairers may rewrite one journal at once (no directory lock): an update is lost and a
    stale entry left."""
    system = sim_gpus("2*a40")
    for g in system.gpus:
        g.set_power_limit_mw(250_000)  # an administrator's setting, before the run
    dead = _start(
        """
        from zeus_callbacks.core.device.gpus import get_gpus
        for g in get_gpus():
            g.set_power_limit_mw(150_000)
        print("ready", flush=True)
        import time; time.sleep(60)
        """,
        ZEUS_CALLBACKS_WATCHDOG="0",  # the journal is left for the next job (as when the watchdog died too)
    )
    dead.kill()
    dead.communicate(timeout=20)
    # Two ranks of the next job repair the dead run's journal at the same moment, each for its own GPU.
    start = time.time() + 3
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SLOW_REPAIR.format(start=start))],
            env=_env(CUDA_VISIBLE_DEVICES=str(i)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for r in ranks:
        _, err = r.communicate(timeout=60)
        assert r.returncode == 0, err
    assert [g.power_limit_mw for g in system.gpus] == [250_000, 250_000]
    assert _journals() == []  # no stale entry left behind...
    # ...that could later revert a live rank's limit.
    live = _start(SET_AND_WAIT.format(mw=150_000), CUDA_VISIBLE_DEVICES="0")
    try:
        assert _run("from zeus_callbacks.core.device.gpus import get_gpus; get_gpus()").returncode == 0
        assert system.gpus[0].power_limit_mw == 150_000
    finally:
        live.terminate()
        live.communicate(timeout=20)
    assert system.gpus[0].power_limit_mw == 250_000


# -- one owner per GPU ------------------------------------------------------------------------------------
SECOND_OWNER = """
import sys
from zeus_callbacks.core.device.errors import GPUBusyError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
try:
    get_gpus()[0].set_power_limit_mw(200_000)
except GPUBusyError as e:
    print("refused:", e, flush=True)
m = ZeusMonitor(gpu_indices=[0])
m.begin_window("w")
print("ready", flush=True)
sys.stdin.readline()  # until the test says so
import time; time.sleep(0.3)  # the window spans a few refreshes of the 100 ms energy counter
print("energy", m.end_window("w").total_energy, flush=True)
"""


@pytest.mark.slow
def test_a_second_live_process_may_measure_but_not_change_the_gpu(sim_gpus):
    """Fails if a second live process may change a GPU another one owns."""
    system = sim_gpus("a40")
    first = _start(SET_AND_WAIT.format(mw=150_000))
    second = subprocess.Popen(
        [sys.executable, "-c", SECOND_OWNER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    refused = second.stdout.readline()
    assert refused.startswith("refused:") and f"owned by process {first.pid}" in refused, refused
    assert second.stdout.readline().strip() == "ready"
    assert system.gpus[0].power_limit_mw == 150_000
    first.terminate()  # the owner ends first: it restores the GPU as it found it
    first.communicate(timeout=20)
    out, err = second.communicate("go\n", timeout=20)
    assert second.returncode == 0, err
    assert float(out.split()[-1]) > 0  # measuring still worked
    assert system.gpus[0].power_limit_mw == 300_000  # and the second process did not put 150 W back


# -- forks ------------------------------------------------------------------------------------------------
FORKING_PARENT = """
import os, time, torch
from zeus_callbacks.core.device.gpus import get_gpus
get_gpus()[0].set_power_limit_mw(150_000)

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        print("worker", os.getpid(), flush=True)
        time.sleep(60)
        return i

print("ready", flush=True)
try:
    for _ in torch.utils.data.DataLoader(Slow(), num_workers=1, multiprocessing_context="fork"):
        pass
except Exception as e:
    print("loader stopped:", type(e).__name__, flush=True)
print("parent alive", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_forked_worker_that_gets_sigint_leaves_the_parents_gpu_and_journal(sim_gpus):
    """Fails if a forked child restores its parent's GPU; it takes both of the child's guards to break (the
    termination handler's pid check and `GPUStateGuard.restore`'s)."""
    system = sim_gpus("a40")
    parent = _start(FORKING_PARENT)
    try:
        line = parent.stdout.readline()
        assert line.startswith("worker"), line
        worker = int(line.split()[1])
        [journal] = _journals()
        os.kill(worker, signal.SIGINT)
        for line in iter(parent.stdout.readline, ""):
            if line.startswith("parent alive"):
                break
        assert system.gpus[0].power_limit_mw == 150_000  # the worker did not restore the parent's GPU
        assert _journals() == [journal]  # nor delete its journal
    finally:
        parent.send_signal(signal.SIGTERM)
        parent.communicate(timeout=30)
    assert system.gpus[0].power_limit_mw == 300_000  # the parent itself restores it
    assert _journals() == []


# -- the simulator's state directory (issue 24) ------------------------------------------------------------
def _default_state_file(tmp_path: Path, spec: str) -> Path:
    """Where `simulate(spec)` keeps GPU 0's state with `ZEUS_CALLBACKS_SIM_STATE_DIR` unset and TMPDIR here."""
    import hashlib

    digest = hashlib.sha1(spec.encode()).hexdigest()[:12]
    return tmp_path / f"zeus_callbacks-sim-{os.getuid()}" / digest / "gpu0.state"


@pytest.mark.parametrize("how", ["symlinked_file", "world_writable_dir", "foreign_dir"])
def test_the_default_sim_state_dir_follows_no_planted_symlink_nor_foreign_dir(tmp_path, monkeypatch, how):
    """A `gpu0.state` planted as a symbolic link to someone's file made the simulator overwrite that file's
    first bytes; the journal's trust rules now apply to the state directory too. Fails if the state file is
    opened through a symbolic link or in a directory other users may write."""
    import tempfile

    from zeus_callbacks import sim
    from zeus_callbacks.core.device.errors import InvalidInputError

    if how == "foreign_dir" and os.geteuid() != 0:
        pytest.skip("needs root to chown")
    monkeypatch.delenv("ZEUS_CALLBACKS_SIM_STATE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # $TMPDIR, as `tempfile.gettempdir` reads it
    state = _default_state_file(tmp_path, "a40")
    state.parent.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious " * 100)
    if how == "symlinked_file":
        state.symlink_to(victim)
    elif how == "world_writable_dir":
        state.parent.chmod(0o777)
    else:
        os.chown(state.parent.parent, NOBODY, NOBODY)
    with pytest.raises(InvalidInputError, match="ZEUS_CALLBACKS_SIM_STATE_DIR") as raised:
        sim.simulate("a40", export_env=False)
    reason = {
        "symlinked_file": "symbolic link",
        "world_writable_dir": "writable by other",
        "foreign_dir": "other",
    }
    assert reason[how] in str(raised.value) or "uid" in str(raised.value), raised.value
    assert victim.read_bytes() == b"precious " * 100
    assert not state.exists() or state.is_symlink()  # nothing written in its place either
