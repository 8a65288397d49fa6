"""A full disk, `ulimit -f`, a read-only file system (issue 38): a save fails with one warning, training goes on,
the GPU is restored, the last complete file is kept and no temporary file is left; eight processes saving and
loading one profile never fail nor see half a file.

The failures are real ones where this host allows: ENOSPC from a 64 KiB tmpfs filled to the brim, EROFS from a
read-only tmpfs (both mounted in a private mount namespace, `unshare --mount`, so nothing outlives the test;
root only), EFBIG from RLIMIT_FSIZE with SIGXFSZ ignored (any user). Without root, the read-only case is a
directory of mode 500 (EACCES) and the full disk is skipped.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from zeus_callbacks.core import files

HERE = Path(__file__).parent
SCRIPT = HERE / "full_disk_training.py"
_FILL = 'head -c 1048576 /dev/zero > "$1/fill" 2>/dev/null; '
_MOUNTS = {
    "enospc": 'mount -t tmpfs -o size=64k tmpfs "$1" && ' + _FILL,
    "erofs": 'mount -t tmpfs -o ro,size=64k tmpfs "$1" && ',
}


def _run_on(directory: Path, failure: str, argv: list[str], env: dict[str, str] | None = None):
    """Run `argv` with `directory` made to fail as `failure` says (see the module's docstring)."""
    env = {**os.environ, **(env or {})}
    if failure in _MOUNTS and os.geteuid() == 0 and shutil.which("unshare"):
        shell = _MOUNTS[failure] + 'shift; exec "$@"'
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            shell,
            "sh",
            str(directory),
            *argv,
        ]
    elif failure == "erofs":
        directory.chmod(0o500)  # as an unprivileged user: writes refused (EACCES) as on a read-only mount
    elif failure == "enospc":
        pytest.skip("a full file system needs root (mount -t tmpfs) and unshare")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    if "mount:" in done.stderr and "RESULT" not in done.stdout:
        pytest.skip(f"mount refused here: {done.stderr.strip()[:200]}")
    return done


def _result(done: subprocess.CompletedProcess) -> dict:
    found = re.search(r"^RESULT (.*)$", done.stdout, re.M)
    assert done.returncode == 0 and found, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(found.group(1))


@pytest.mark.system
@pytest.mark.parametrize("failure", ["enospc", "efbig", "erofs"])
def test_profile_and_report_that_cannot_be_written_never_stop_training(failure: str, tmp_path: Path) -> None:
    """Rule: a failed save of the power-limit profile, the run record, the report or a write of the monitor's
    log is one warning each, a lost ledger line one warning with the line (a checkpoint's and the end's), and
    the run trains on and restores the GPU. Fails on a0ffbee: `save_profile` raised OSError out of
    `on_step_end` (ENOSPC, EFBIG: exit 1 with a traceback), and the run record warned at every write."""
    out = tmp_path / "out"
    out.mkdir()
    done = _run_on(out, failure, [sys.executable, str(SCRIPT), str(out), "outputs", failure])
    result = _result(done)
    assert result["steps"] == 60 and result["phase"] == "done"
    assert len(result["seen_mw"]) > 1, "the limit changed while profiling"
    assert result["after_mw"] == result["before_mw"] == 300_000, "restored at the end"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for what in ("power-limit profile", "run record"):
        assert done.stderr.count(f"Cannot write the {what}") == 1, done.stderr[-3000:]
    assert done.stderr.count("Cannot write the report") == 1, done.stderr[-3000:]
    if failure != "erofs":
        assert done.stderr.count("Cannot write the ZeusMonitor log") == 1, done.stderr[-3000:]
    lost = [line for line in done.stderr.splitlines() if "Energy ledger" in line]
    assert len(lost) == 2 and all("this line is lost" in line.lower() for line in lost), lost
    if failure != "enospc":  # the tmpfs went with its namespace; elsewhere nothing half-written is left
        assert [p.name for p in out.rglob("*") if p.name.endswith(".tmp")] == []
        assert not (out / "ledger.jsonl").exists() or (out / "ledger.jsonl").stat().st_size == 0


@pytest.mark.system
@pytest.mark.parametrize("failure", ["enospc", "efbig", "erofs"])
def test_a_journal_that_cannot_be_written_leaves_the_gpu_alone_and_trains_on(
    failure: str, tmp_path: Path
) -> None:
    """Rule: no change is made that no journal records: the GPU stays as it was, with a warning, and the run
    trains on."""
    out = tmp_path / "out"
    out.mkdir()
    done = _run_on(out, failure, [sys.executable, str(SCRIPT), str(out), "journal", failure])
    result = _result(done)
    assert result["steps"] == 60 and result["seen_mw"] == [300_000] and result["after_mw"] == 300_000
    assert "Cannot write the GPU-state journal" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.system
def test_simulated_state_on_a_full_disk_is_a_clear_error_not_sigbus(tmp_path: Path) -> None:
    """Rule: the simulated GPU's state file gets its blocks (posix_fallocate) before it is mapped. Fails on
    a0ffbee: the first store into the mapped page of a file the full tmpfs could not back killed the
    process with SIGBUS, and nothing said why."""
    if os.geteuid() != 0:
        pytest.skip("a full file system needs root (mount -t tmpfs)")
    state = tmp_path / "state"
    state.mkdir()
    argv = [sys.executable, "-m", "zeus_callbacks.cli", "devices"]
    env = {"ZEUS_CALLBACKS_SIMULATE": "a40", "ZEUS_CALLBACKS_SIM_STATE_DIR": str(state)}
    done = _run_on(state, "enospc", argv, env)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "No space left on device" in done.stderr and "ZEUS_CALLBACKS_SIM_STATE_DIR" in done.stderr


def test_a_failed_write_keeps_the_last_complete_file_and_leaves_no_temporary(tmp_path, monkeypatch) -> None:
    """Rule: whatever step fails (a write, the fsync, the close), the last complete file is kept and the
    temporary is removed."""
    path = tmp_path / "plo.json"
    files.write_atomic(path, b"complete")
    for step in ("write", "fsync", "close"):
        real, failed = getattr(os, step), []

        def fail(fd, *args, real=real, failed=failed):
            if failed or not stat.S_ISREG(os.fstat(fd).st_mode):  # the temporary file's first call only
                return real(fd, *args)
            failed.append(fd)
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))  # NFS says so at write, fsync or close

        with monkeypatch.context() as m:
            m.setattr(files.os, step, fail)
            with pytest.raises(OSError) as caught:
                files.write_atomic(path, b"newer, never whole")
        assert failed and caught.value.filename == str(path)
        assert path.read_bytes() == b"complete" and sorted(tmp_path.iterdir()) == [path], step


def test_a_log_whose_write_fails_says_so_once_and_never_raises(tmp_path, caplog) -> None:
    """Rule: a log written as training goes (the monitor's, EpochLog's) ends at its first failed write with
    one warning; later writes, flushes and the close raise nothing. /dev/full answers every write with
    ENOSPC (null(4))."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    log = files.LogFile(os.open("/dev/full", os.O_WRONLY), tmp_path / "monitor.csv", "ZeusMonitor log")
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        for i in range(3):
            log.write(f"{i},step\n")
            log.flush()
        log.close()
    said = [r.getMessage() for r in caplog.records if "ZeusMonitor log" in r.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0] and "the log ends" in said[0]


def _save_and_load(args: tuple[str, int, int]) -> tuple[int, int]:
    """`rounds` saves and loads of one profile by one process; (failed saves, bad loads)."""
    from zeus_callbacks.core.power_limit.estimates import PowerLimitStats
    from zeus_callbacks.core.power_limit.profile_file import ProfileContext, load_profile, save_profile

    path, worker, rounds = Path(args[0]), args[1], args[2]
    context = ProfileContext("NVIDIA A40", (100, 300), 25, 1, True)
    failed = bad = 0
    for i in range(rounds):
        steps = 1 + (worker * rounds + i) % 97
        stats = {300: PowerLimitStats(300, steps, 0.1 * steps, 30.0 * steps, 0.01 * steps, 900.0 * steps)}
        try:
            save_profile(path, context, stats, complete=False)
        except OSError:
            failed += 1
        try:
            loaded = load_profile(path, context)
            bad += loaded.stats[300].steps not in range(1, 98)
        except (OSError, ValueError):
            bad += 1
    return failed, bad


@pytest.mark.system
def test_eight_processes_save_and_load_one_profile(tmp_path: Path) -> None:
    """Rule: writers never share a temporary file and readers see a whole file. Fails on a0ffbee: its
    writers shared `<file>.tmp`, so saves failed (one renamed another's file away) and loads saw half a
    file."""
    path = str(tmp_path / "plo.json")
    with multiprocessing.get_context("spawn").Pool(8) as pool:
        outcomes = pool.map(_save_and_load, [(path, w, 1000) for w in range(8)])
    assert outcomes == [(0, 0)] * 8
    assert [p.name for p in tmp_path.iterdir()] == ["plo.json"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EROFS], ids=["enospc", "efbig", "erofs"])
def test_a_pipeline_profile_that_cannot_be_written_is_a_warning_and_keeps_the_last(
    code: int, tmp_path: Path, monkeypatch, caplog
) -> None:
    """Rule: the Perseus profile, written while training (when the plan is made), fails as the others do:
    a warning naming the file and why, nothing raised into training, the last complete file kept and no
    temporary left."""
    from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
    from zeus_callbacks.core.pipeline_frequency.profiling import save_profile

    path = tmp_path / "perseus.csv"
    rows = [ProfileRow(0, "forward", 1410, 0.1, 20.0), ProfileRow(0, "backward", 1410, 0.2, 40.0)]
    save_profile(path, rows, {})
    before = path.read_bytes()

    def fail(fd: int, data: bytes) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(files, "_write_all", fail)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        save_profile(path, rows[:1], {"edge_delays": [(0, "forward", 0, "backward", 0.001)]})
    assert os.strerror(code) in caplog.text and str(path) in caplog.text
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
