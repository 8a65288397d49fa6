"""One owner per GPU across users (issue 38, item 3): jobs of two users, each with their own journal directory,
on one GPU through NVML or through one zeusd, see one another through the node's lock directory
(`core/device/global_lock.py`).

The system tests run each job as a real second and third user of the node: a child that starts as root,
imports everything and opens the simulated GPU, then drops to the user with `setuid` (the simulator's state
files admit no other user, and this interpreter lives under /root, mode 700). They need root (to make the
accounts with `useradd` and to drop to them) and skip, saying so, elsewhere. The administrator's limit is
237 W on an A40 whose default is 300 W: the limit the GPU must be left at.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import TOY_STEPS_COUNTER
from shared_machine_helpers import other_user
from zeusd_daemon import DOUBLE, ROOT

from zeus_callbacks import cli
from zeus_callbacks.core.device import global_lock, zeusd
from zeus_callbacks.core.device.global_lock import LOCK_DIR_ENV
from zeus_callbacks.core.device.journal import boot_id
from zeus_callbacks.core.device.process_identity import start_time

THIRD_USER = "zc-xuser-test"
ADMIN_MW = 237_000  # what the administrator set: neither the default (300 W) nor any job's limit
UUID = "GPU-00000000-1111-2222-3333-444444444444"


# -- the lock directory, one process (deterministic) ------------------------------------------------------
@pytest.fixture(autouse=True)
def _nothing_held_after() -> Iterator[None]:
    """A test that failed while holding a claim must not make the next one's claim a no-op."""
    yield
    global_lock._held.clear()


@pytest.fixture
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "lock"
    path.mkdir()
    path.chmod(0o1777)  # as an administrator makes it
    monkeypatch.setenv(LOCK_DIR_ENV, str(path))
    return path


def test_without_the_directory_the_lock_is_off_and_doctor_says_how_to_turn_it_on(
    sim_gpus, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: no lock directory is today's per-user behaviour (nothing written, nobody refused), and doctor
    says the cross-user lock is off and the one command that turns it on. Fails on a0ffbee: no finding."""
    sim_gpus("a40")
    missing = tmp_path / "no-such-dir"
    monkeypatch.setenv(LOCK_DIR_ENV, str(missing))
    assert global_lock.claim(UUID, "GPU 0") is None and global_lock.owner(UUID) is None
    assert not missing.exists()
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cross_user_lock"]["on"] is False
    [said] = [w for w in report["warnings"] if "cross-user GPU owner lock is off" in w]
    assert (
        f"{missing} does not exist" in said and f"sudo install -d -m 1777 -o root -g root {missing}" in said
    )
    assert cli.main(["doctor"]) == 0
    assert f"cross-user owner lock: off ({missing} does not exist)" in capsys.readouterr().out


def test_doctor_says_the_lock_is_on(sim_gpus, capsys, lock_dir: Path) -> None:
    """Rule: a lock directory made as documented turns the lock on, and doctor says where."""
    sim_gpus("a40")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"cross-user owner lock: on at {lock_dir}" in out and "lock is off" not in out


def test_a_claim_writes_a_readable_record_made_o_excl_and_the_release_removes_it(lock_dir: Path) -> None:
    """Rule: the owner's record names its user, pid, start time, host and boot, readable by every user (644,
    whatever the umask), and goes with the release. Fails on a0ffbee: nothing is written."""
    old = os.umask(0o077)
    try:
        assert global_lock.claim(UUID, "GPU 0", journal=lock_dir.parent / "j" / "1-2.json") is None
    finally:
        os.umask(old)
    [record] = lock_dir.iterdir()
    assert record.name == f"owner-{UUID}.{os.geteuid()}.json" and (record.stat().st_mode & 0o777) == 0o644
    data = json.loads(record.read_text())
    assert (data["pid"], data["host"]) == (os.getpid(), socket.gethostname())
    assert data["start"] and data["boot"] and data["journal"].endswith("1-2.json")
    assert global_lock.claim(UUID, "GPU 0") is None  # held already: nothing changes
    assert global_lock.owner(UUID) is None  # this process is not "another owner"
    global_lock.release(UUID)
    assert list(lock_dir.iterdir()) == []


def _record(lock_dir: Path, pid: int, start: str | None, uid: int | None = None) -> Path:
    uid = os.geteuid() if uid is None else uid
    path = lock_dir / f"owner-{UUID}.{uid}.json"
    data = {"pid": pid, "start": start, "host": socket.gethostname(), "boot": boot_id()}
    data["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    path.write_text(json.dumps(data))
    return path


def test_a_dead_owners_record_is_recovered_with_a_warning(lock_dir: Path, caplog) -> None:
    """Rule: a record whose process is gone (pid 2**22 + 1 is above Linux's pid_max) is stale: taken over,
    said once. Fails if a stale record refused the GPU for ever."""
    _record(lock_dir, 2**22 + 1, "1")
    with caplog.at_level(logging.WARNING):
        assert global_lock.claim(UUID, "GPU 0") is None
    assert f"GPU 0: process {2**22 + 1} of" in caplog.text and "ended without giving up" in caplog.text
    assert json.loads((lock_dir / f"owner-{UUID}.{os.geteuid()}.json").read_text())["pid"] == os.getpid()
    global_lock.release(UUID)


def test_a_record_of_a_reused_pid_is_stale(lock_dir: Path) -> None:
    """Rule: pid and start time, as the journal: this process's parent runs, but did not start at tick 1."""
    _record(lock_dir, os.getppid(), "1")
    assert global_lock.owner(UUID) is None


def test_a_record_is_believed_only_for_a_process_of_its_files_owner(lock_dir: Path) -> None:
    """Rule: a record another user wrote naming a live process that is not theirs (here root's: this
    process's parent, with its true start time) is forged or stale, and refuses nobody."""
    user = other_user()
    parent = os.getppid()
    path = _record(lock_dir, parent, start_time(parent), uid=user.pw_uid)
    os.chown(path, user.pw_uid, user.pw_gid)
    assert global_lock.owner(UUID) is None


def test_a_live_owner_is_named(lock_dir: Path) -> None:
    """Rule: another live process's record refuses the claim, naming the owner's pid, user, host, start."""
    parent = os.getppid()
    _record(lock_dir, parent, start_time(parent))
    found = global_lock.claim(UUID, "GPU 0")
    assert found is not None and found.pid == parent and found.host == socket.gethostname()
    assert str(found).startswith(f"process {parent} of ") and ", started 20" in str(found)


def test_a_dead_owner_whose_watchdog_runs_is_waited_for(
    lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: while a dead owner's restore watchdog (here: this process's parent, live) puts the GPU back, a
    claim waits and is then refused, so that no job records the dead owner's limit as what it found; the
    record is no live owner for a repair (`owner()`: None), which the watchdog's own repair needs."""
    monkeypatch.setattr(global_lock, "_RESTORE_WAIT_S", 0.2)
    path = _record(lock_dir, 2**22 + 1, "1")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "restorer": [os.getppid(), start_time(os.getppid())]}))
    found = global_lock.claim(UUID, "GPU 0")
    assert found is not None and found.restoring and "restore watchdog is putting the GPU back" in str(found)
    assert global_lock.owner(UUID) is None
    assert path.exists()


def test_a_dead_owners_record_goes_once_its_journal_no_longer_holds_the_gpu(lock_dir: Path, tmp_path) -> None:
    """Rule: the repair of a dead process's journal (its watchdog, its user's next job, `zeus-callbacks
    restore`) removes its record once the journal no longer holds the GPU, and not before."""
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    path = _record(lock_dir, 2**22 + 1, "1")
    held = journal / "4194305-1.json"
    entry = {"uuid": UUID, "name": "NVIDIA A40", "knob": "power_limit", "original": ADMIN_MW}
    held.write_text(json.dumps({"pid": 2**22 + 1, "start": "1", "entries": [entry]}))
    held.chmod(0o600)
    path.write_text(json.dumps({**json.loads(path.read_text()), "journal": str(held)}))
    assert global_lock.release_dead(journal, [UUID]) == [] and path.exists()
    held.unlink()  # repaired
    assert global_lock.release_dead(journal, [UUID]) == [UUID] and not path.exists()


@pytest.mark.parametrize("how", ["world_writable_without_sticky", "link_to_a_directory"])
def test_an_unsafe_directory_is_not_used_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, how: str
) -> None:
    """Rule: a directory where any user could remove another's record (no sticky bit) is not a lock: it is
    said, with the fix, and nothing is written there."""
    real = tmp_path / "lock"
    real.mkdir()
    real.chmod(0o777)
    path = real
    if how == "link_to_a_directory":
        user = other_user()
        path = tmp_path / "link"
        path.symlink_to(real)
        os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
        real.chmod(0o1777)
    monkeypatch.setenv(LOCK_DIR_ENV, str(path))
    with caplog.at_level(logging.WARNING):
        assert global_lock.claim(UUID, "GPU 0") is None
    assert "cross-user GPU owner lock is off" in caplog.text and "install -d -m 1777" in caplog.text
    assert list(real.iterdir()) == []
    assert global_lock.status().on is False


def test_a_planted_link_is_not_a_record_nor_written_through(lock_dir: Path, tmp_path: Path) -> None:
    """Rule: records are opened O_NOFOLLOW and created O_EXCL: a link planted at this user's record name is
    replaced, never followed (the victim is left as it was)."""
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    (lock_dir / f"owner-{UUID}.{os.geteuid()}.json").symlink_to(victim)
    assert global_lock.owner(UUID) is None
    assert global_lock.claim(UUID, "GPU 0") is None
    assert victim.read_text() == "root's file\n"
    assert not (lock_dir / f"owner-{UUID}.{os.geteuid()}.json").is_symlink()
    global_lock.release(UUID)


# -- two users, one GPU (system: real users, real processes) ------------------------------------------------
CHILD = r"""
import os, sys
uid, gid, action, watts = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
import http.client, json, logging, urllib.parse  # the zeusd client's modules, loaded while /root is readable
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from zeus_callbacks.core.device import errors, state_guard, zeusd
from zeus_callbacks.core.device.gpus import get_gpus
gpus = get_gpus(repair=False)  # opens the simulated GPU as root: its state files admit no other user
gpus[0].power_limit_mw()
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
if action == "restore":
    restored = state_guard.guard().repair_dead_runs(gpus)
    print("restored", json.dumps([e.original for e in restored]), flush=True)
    sys.exit(0)
try:
    gpus[0].set_power_limit_mw(watts * 1000)
    print("changed", flush=True)
except errors.GPUBusyError as e:
    print("refused:", e, flush=True)
sys.stdin.readline()  # until the test says so; then the normal end restores what was changed
"""


@dataclass
class Node:
    """One simulated A40 shared by users through `route`, a lock directory, and each user's journal dir."""

    base: Path
    env: dict[str, str]
    gpu: object  # the simulated GPU (its state is the node's)
    jobs: list[subprocess.Popen] = field(default_factory=list)

    def journal(self, user: pwd.struct_passwd) -> Path:
        path = self.base / f"journal-{user.pw_name}"
        if not path.exists():
            path.mkdir(mode=0o700)
            os.chown(path, user.pw_uid, user.pw_gid)
        return path

    def start(self, user: pwd.struct_passwd, watts: int, action: str = "own", **env: str) -> subprocess.Popen:
        """A job of `user` that sets `watts` on GPU 0 (or, `action="restore"`, repairs the user's journals)."""
        job = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(user.pw_uid), str(user.pw_gid), action, str(watts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self.base,
            env={**self.env, "ZEUS_CALLBACKS_JOURNAL_DIR": str(self.journal(user)), **env},
        )
        self.jobs.append(job)
        return job

    def records(self) -> list[str]:
        return sorted(p.name for p in (self.base / "lock").iterdir())


def _user(name: str) -> pwd.struct_passwd:
    """An unprivileged account of this node (made once with `useradd`)."""
    return other_user(name)


@pytest.fixture
def users() -> tuple[pwd.struct_passwd, pwd.struct_passwd]:
    """Two unprivileged users of this node, neither of them root."""
    return other_user(), _user(THIRD_USER)


@pytest.fixture(params=["nvml", "zeusd"])
def node(request, sim_gpus, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """The node: every path under a directory all users may traverse (pytest's own is root's, mode 700)."""
    base = Path(tempfile.mkdtemp(prefix="zc-cross-user-", dir="/tmp"))
    base.chmod(0o755)
    (base / "lock").mkdir()
    (base / "lock").chmod(0o1777)  # as documented: `install -d -m 1777 -o root -g root`
    system = sim_gpus("a40", state_dir=str(base / "sim"))
    system.gpus[0].set_power_limit_mw(ADMIN_MW)  # the administrator's limit
    monkeypatch.setenv(LOCK_DIR_ENV, str(base / "lock"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "ZEUS_CALLBACKS_WATCHDOG": "0",  # a dropped user's watchdog could not open the simulator's state
    }
    daemon = None
    if request.param == "zeusd":
        sock = base / "zeusd.sock"
        daemon = subprocess.Popen(
            [sys.executable, str(DOUBLE), "--socket", str(sock), "--log", str(base / "zeusd.log")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in env.items() if k != "ZEUS_CALLBACKS_SIM_FAULTS"},  # the daemon is root
        )
        line = daemon.stdout.readline().split()
        assert line[:1] == ["READY"], line
        sock.chmod(0o666)  # zeusd's `--socket-permissions 666` (zeusd/src/config.rs): every user may connect
        # The jobs may not change the GPU themselves: whatever changes, zeusd changed.
        env.update({zeusd.SOCK_ENV: str(sock), "ZEUS_CALLBACKS_SIM_FAULTS": "no_cap_sys_admin"})
    node = Node(base, env, system.gpus[0])
    try:
        yield node
    finally:
        for job in node.jobs:  # a failed test's jobs must not outlive it (their restore would write here)
            if job.poll() is None:
                job.kill()
            job.communicate(timeout=30)
        if daemon is not None:
            daemon.terminate()
            daemon.communicate(timeout=10)
        shutil.rmtree(base, ignore_errors=True)


def _said(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    assert line, proc.communicate(timeout=30)
    return line


def _end(proc: subprocess.Popen) -> str:
    """Let a job end normally; its stderr."""
    _, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, err
    return err


def _owner_words(proc: subprocess.Popen, user: pwd.struct_passwd) -> str:
    return f"owned by process {proc.pid} of {user.pw_name} (uid {user.pw_uid}) on {socket.gethostname()}"


@pytest.mark.system
@pytest.mark.slow
def test_the_second_user_is_refused_and_the_owner_ending_first_leaves_the_administrators_limit(
    node: Node, users: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """Rule: a job of another user, with its own journal directory, is refused the GPU a job owns, naming
    the owner (user, pid, host, start time); when the owner ends first, the GPU is at the administrator's
    limit, whatever the second job does. Fails on a0ffbee: the second job changed the GPU (150 W), recorded
    the owner's 200 W as what it found, and left the GPU at 200 W after the owner put 237 W back."""
    alice, bob = users
    first = node.start(alice, 200)
    assert _said(first) == "changed"
    second = node.start(bob, 150)
    refused = _said(second)
    assert refused.startswith("refused:") and _owner_words(first, alice) in refused, refused
    assert ", started 20" in refused
    assert node.gpu.power_limit_mw == 200_000
    assert node.records() == [f"owner-{node.gpu.uuid}.{alice.pw_uid}.json"]
    _end(first)  # the owner ends first
    assert node.gpu.power_limit_mw == ADMIN_MW and node.records() == []
    _end(second)
    assert node.gpu.power_limit_mw == ADMIN_MW


@pytest.mark.system
@pytest.mark.slow
def test_a_dead_owners_lock_is_recovered_and_its_user_puts_the_administrators_limit_back(
    node: Node, users: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """Rule: a job killed hard (no watchdog) leaves its record, which another user's job recovers (pid and
    start time say its process is gone), saying whose it was and what it left; that job then owns the GPU
    for every user (a later job of the dead owner's user is refused, naming it); once it has ended, the dead
    job's user repairs its journal, which puts the administrator's limit back and removes the record. Fails
    on a0ffbee: nothing was recovered (no warning), and the later job changed the GPU under the owner."""
    alice, bob = users
    dead = node.start(alice, 200)
    assert _said(dead) == "changed"
    dead.send_signal(signal.SIGKILL)
    dead.communicate(timeout=30)
    stale = f"owner-{node.gpu.uuid}.{alice.pw_uid}.json"
    assert node.records() == [stale] and node.gpu.power_limit_mw == 200_000

    taker = node.start(bob, 150)
    assert _said(taker) == "changed"
    assert node.gpu.power_limit_mw == 150_000
    later = node.start(alice, 250)
    refused = _said(later)
    assert refused.startswith("refused:") and _owner_words(taker, bob) in refused, refused
    _end(later)
    said = _end(taker)
    assert f"process {dead.pid} of {alice.pw_name} (uid {alice.pw_uid})" in said
    assert "ended without giving up its cross-user owner lock" in said
    assert node.gpu.power_limit_mw == 200_000  # what the dead job left, as the warning said
    assert node.records() == [stale]  # the sticky directory lets only its owner (or root) remove it

    repair = node.start(alice, 0, action="restore")
    assert _said(repair) == f"restored [{ADMIN_MW}]"
    _end(repair)
    assert node.gpu.power_limit_mw == ADMIN_MW and node.records() == []


TRAINING = r"""
import os, runpy, sys
import torch  # noqa: F401 - loaded while /root is readable, as everything the run needs
import zeus_callbacks.core.power_limit.optimizer  # noqa: F401
from zeus_callbacks.core.device.gpus import get_gpus
get_gpus(repair=False)[0].power_limit_mw()  # the simulated GPU, opened as root
os.setgroups([])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[1]))
sys.argv = [os.environ["SCRIPT"], "plain"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.system
@pytest.mark.slow
def test_the_second_users_optimizer_stands_down_without_profiling_the_owners_gpu(
    node: Node, users: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """Rule: the issue's run: a power-limit optimizer of another user, on the GPU a job owns, says who owns
    it and trains on without profiling; the GPU ends at the administrator's limit. Fails on a0ffbee: it
    profiled the owner's GPU (limits other than the owner's 200 W were seen)."""
    alice, bob = users
    owner = node.start(alice, 200)
    assert _said(owner) == "changed"
    env = {**node.env, "ZEUS_CALLBACKS_JOURNAL_DIR": str(node.journal(bob)), **TOY_STEPS_COUNTER}
    # The script is read after the drop to bob: a copy in the node's directory (mode 755), since the
    # checkout may sit where only root can read (a clone in `mktemp -d`, mode 700).
    script = shutil.copy(Path(__file__).parent / "fault_training.py", node.base / "fault_training.py")
    run = subprocess.run(
        [sys.executable, "-c", TRAINING, str(bob.pw_uid), str(bob.pw_gid)],
        env={**env, "SCRIPT": str(script), "OUT_DIR": str(node.base)},
        capture_output=True,
        text=True,
        cwd=node.base,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result["steps"] == 40 and result["seen"] == ["200W"]  # trained on, never profiled
    [said] = [x for x in run.stderr.splitlines() if "GlobalPowerLimitOptimizer:" in x]
    assert _owner_words(owner, alice) in said and "training on without it" in said
    _end(owner)
    assert node.gpu.power_limit_mw == ADMIN_MW and node.records() == []
