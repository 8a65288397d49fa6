"""A node shared with other users (issue 38): no file is written through a link another user planted, a file
that chooses a power limit or a clock is not taken from another user, and a FIFO never stalls a reader.

Each write route of the package (`shared_machine_helpers.WRITE_ROUTES`) is run with symbolic links to a
victim file planted where writers of commit a0ffbee put their temporary file (`<file>.tmp`,
`.<file>.<pid>.tmp`) and at the file itself; the victim must be left as it was. Tests that need a second
account (root only) make one with `useradd` and skip, saying so, elsewhere.
"""

from __future__ import annotations

import json
import os
import pwd
import threading
from pathlib import Path

import pytest
from shared_machine_helpers import WRITE_ROUTES, give_to, other_user, zeus_profile

from zeus_callbacks import sim

VICTIM_TEXT = "root's file: must never change\n"


@pytest.fixture(scope="session")
def user() -> pwd.struct_passwd:
    """Another, unprivileged, user of this node (made before any test's tier check: `useradd` is a
    process)."""
    return other_user()


def _plant_links(directory: Path, name: str, victim: Path) -> list[Path]:
    """Links to `victim` at every name a writer of commit a0ffbee used for `name`, and at `name` itself."""
    names = [name, f"{name}.tmp", f".{name}.{os.getpid()}.tmp"]
    stem, dot, suffix = name.rpartition(".")
    if dot:
        names.append(f"{stem}.{suffix}.tmp")
    links = []
    for n in dict.fromkeys(names):
        (directory / n).symlink_to(victim)
        links.append(directory / n)
    return links


@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "named_temporary"])
@pytest.mark.parametrize("route", sorted(WRITE_ROUTES))
def test_no_write_route_writes_through_a_planted_link(
    route: str, unnamed: bool, tmp_path: Path, monkeypatch
) -> None:
    """Rule: every writer makes its temporary file under an unpredictable name with O_EXCL|O_NOFOLLOW and
    renames it over the target (a link at the target is replaced, not followed). Fails on a0ffbee: the
    profile, record and report wrote `<file>.tmp` through the link; the Zeus² files and the plot wrote
    through a link at the file; the journal's fixed name made the write fail (ELOOP). Checked with an
    unnamed temporary file (O_TMPFILE) and with the named one of file systems without it."""
    if not unnamed:
        monkeypatch.setattr("zeus_callbacks.core.files._TMPFILE", False)
    name, write = WRITE_ROUTES[route]
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)  # as /tmp: anyone may plant a name there
    links = _plant_links(shared, name, victim)

    write(shared / name)

    assert victim.read_bytes() == VICTIM_TEXT.encode()
    target = shared / name
    assert target.is_file() and not target.is_symlink() and target.stat().st_size > 0
    assert all(p.is_symlink() for p in links[1:]), "the planted links are left alone"
    left = [p.name for p in shared.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    assert left == []


def test_private_files_are_private_and_reports_readable(tmp_path: Path) -> None:
    """Rule: files written during training are 0600 (a profile, a record, a journal), in directories made
    0700; what is made to be shared (the HTML report, a Zeus² profile) is 0644 less the umask, in
    directories made as mkdir makes them."""
    modes = {}
    for route in ("power_limit_profile", "report_html", "zeus2_profile", "journal"):
        name, write = WRITE_ROUTES[route]
        write(tmp_path / route / "new" / name)
        modes[route] = (
            (tmp_path / route / "new" / name).stat().st_mode & 0o777,
            (tmp_path / route).stat().st_mode & 0o777,
        )
    umask = os.umask(0)
    os.umask(umask)
    shared = 0o644 & ~umask
    assert modes == {
        "power_limit_profile": (0o600, 0o700),
        "report_html": (shared, 0o700),  # its run's records, written first, are private
        "zeus2_profile": (shared, 0o777 & ~umask),
        "journal": (0o600, 0o700),
    }


@pytest.mark.parametrize("route", ["power_limit_profile", "run_record", "journal", "pipeline_profile"])
def test_a_directory_reached_through_another_users_link_is_refused(
    route: str, tmp_path: Path, user, caplog
) -> None:
    """Rule: directories are walked without following a link another user owns (root follows it
    otherwise, whatever `protected_symlinks` says: this one is in a group-writable, not sticky, directory).
    Fails on a0ffbee: root made the directories and wrote the file where the link led."""
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o2775)  # a group's project directory
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    link = project / "runs"
    link.symlink_to(private)
    give_to(link, user)
    name, write = WRITE_ROUTES[route]

    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        try:
            write(link / "job1" / name)
            said = caplog.text  # the run recorder says it and trains on
        except OSError as e:
            said = str(e)
    assert f"symbolic link owned by {user.pw_name}" in said
    assert list(private.iterdir()) == []


def test_the_energy_ledger_behind_another_users_link_is_refused(tmp_path: Path, user, caplog) -> None:
    """Rule: the ledger (appended to, not replaced) is opened in a directory walked as every file's is.
    Fails on a0ffbee: root appended to a ledger it created where another user's link led."""
    from zeus_callbacks.core.accounting.identity import JobIdentity
    from zeus_callbacks.core.accounting.ledger import LedgerEntry, append

    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    link = tmp_path / "ledgers"
    link.symlink_to(private)
    give_to(link, user)
    entry = LedgerEntry(JobIdentity("local", "1", "root", "node1"), "end", ("GPU-1",), 1.0, 1.0)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        assert not append(link / "energy.jsonl", entry)
    assert f"symbolic link owned by {user.pw_name}" in caplog.text and list(private.iterdir()) == []


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_link_or_fifo_another_user_planted_at_the_ledger_is_not_written_and_training_goes_on(
    planted: str, tmp_path: Path, user, caplog
) -> None:
    """Rule: the ledger (appended in place, not replaced) is opened O_NOFOLLOW|O_NONBLOCK: what another
    user put at its name in a shared directory is never written through nor waited on; each line is lost
    with a warning naming who put it there, and the reporter's checkpoint and end raise nothing into
    training. Fails on the parent: with the FIFO, the first checkpoint raised InvalidInputError out of the
    training loop (as it did with the link wherever open(2) answers ELOOP); the link's warning did not say
    whose it was (here the kernel answers O_CREAT on another user's link in a sticky directory with EACCES)."""
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor
    from zeus_callbacks.core.monitor.reporting import EnergyReporter

    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)  # a site's ledger directory all users append in, as /tmp
    ledger = shared / "energy.jsonl"
    if planted == "symlink":
        ledger.symlink_to(victim)
    else:
        os.mkfifo(ledger)
    give_to(ledger, user)
    system = sim.simulate("a40", virtual_clock=True)
    reporter = EnergyReporter(ZeusMonitor(), ledger_path=ledger)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        reporter.start()
        system.run_step(0.1)
        reporter.checkpoint(step=1)
        system.run_step(0.1)
        reporter.stop()
    said = [r.getMessage() for r in caplog.records if "Energy ledger" in r.getMessage()]
    assert len(said) == 2 and all(f"put there by {user.pw_name}" in x for x in said), said
    assert victim.read_text() == VICTIM_TEXT and (ledger.is_symlink() or ledger.is_fifo())


def test_journal_and_simulated_state_dirs_behind_another_users_link_are_refused(tmp_path: Path, user) -> None:
    """Rule: the journal directory and the simulated GPUs' state directory are not reached through a link
    another user owns at any component. Fails on a0ffbee: the journal's checks resolved the parents
    (realpath) and judged only where the link led, a root-owned directory."""
    from zeus_callbacks.core.device.errors import InvalidInputError
    from zeus_callbacks.core.device.journal import ensure_trusted_dir, trusted_dir
    from zeus_callbacks.sim.gpu_state import GPUState

    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    (private / "journal").mkdir(mode=0o700)
    link = tmp_path / "state"
    link.symlink_to(private)
    give_to(link, user)

    with pytest.raises(OSError, match=f"symbolic link owned by {user.pw_name}"):
        ensure_trusted_dir(link / "journal")
    assert not trusted_dir(link / "journal", warn=False)
    with pytest.raises(InvalidInputError, match="ZEUS_CALLBACKS_SIM_STATE_DIR"):
        GPUState(link / "sim" / "gpu0", {})
    assert sorted(p.name for p in private.iterdir()) == ["journal"]


def test_a_link_of_ones_own_is_followed(tmp_path: Path) -> None:
    """Rule: only others' links are refused: a link of this user's (or root's) to a directory is followed,
    for writing and reading alike."""
    from zeus_callbacks.core.files import read_regular

    (tmp_path / "real").mkdir()
    (tmp_path / "here").symlink_to(tmp_path / "real")
    name, write = WRITE_ROUTES["power_limit_profile"]
    write(tmp_path / "here" / "deep" / name)
    assert (tmp_path / "real" / "deep" / name).is_file()
    (tmp_path / "alias.json").symlink_to(tmp_path / "here" / "deep" / name)
    assert json.loads(read_regular(tmp_path / "alias.json", chooses="the power limit"))["complete"] is False


def test_root_refuses_another_users_power_limit_profile(tmp_path: Path, user) -> None:
    """Rule: a profile chooses a power limit, so one another user owns is refused, saying whose it is and
    what to do. Fails on a0ffbee: root's job took the planted Zeus profile and set 100 W."""
    from zeus_callbacks.core.device.errors import InvalidInputError
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor
    from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer

    profile = tmp_path / "plo.json"
    zeus_profile(profile)
    give_to(profile, user)
    system = sim.simulate("a40", virtual_clock=True)
    with pytest.raises(InvalidInputError) as caught:  # the profile is read when the optimizer is made
        opt = GlobalPowerLimitOptimizer(ZeusMonitor(), profile_path=profile, warmup_steps=1, profile_steps=2)
        for _ in range(5):
            opt.on_step_begin()
            system.run_step(0.1)
            opt.on_step_end()
    said = str(caught.value)
    assert f"owned by {user.pw_name} (uid {user.pw_uid})" in said and "copy it to a file of your own" in said
    assert system.gpus[0].power_limit_mw == 300_000


def test_clock_and_plan_profiles_of_another_user_are_refused(tmp_path: Path, user) -> None:
    """Rule: the Perseus profile (it chooses clocks) and the Zeus² profile (batch size and power limit) of
    another user are refused like the power-limit profile. Fails on a0ffbee: both were read."""
    from zeus_callbacks.core.heterogeneous.profile_file import load_profile
    from zeus_callbacks.core.pipeline_frequency.profile_file import read_profile

    WRITE_ROUTES["pipeline_profile"][1](tmp_path / "perseus.csv")
    (tmp_path / "a10.json").write_text(
        json.dumps(
            {
                "32": [{"power_limit": 150, "energy": 1.0, "time": 0.1}],
                "64": [{"power_limit": 150, "energy": 2.0, "time": 0.2}],
            }
        )
    )
    for name in ("perseus.csv", "a10.json"):
        give_to(tmp_path / name, user)
    with pytest.raises(ValueError, match=f"owned by {user.pw_name}"):
        read_profile(tmp_path / "perseus.csv")
    with pytest.raises(ValueError, match=f"owned by {user.pw_name}"):
        load_profile(tmp_path / "a10.json")


def test_a_profile_anyone_may_write_is_refused(tmp_path: Path) -> None:
    """Rule: a file that chooses a power limit and that any user may write is refused (`chmod o-w`)."""
    from zeus_callbacks.core.power_limit.profile_file import ProfileContext, load_profile

    profile = tmp_path / "plo.json"
    zeus_profile(profile)
    profile.chmod(0o666)
    with pytest.raises(ValueError, match="chmod o-w"):
        load_profile(profile, ProfileContext("NVIDIA A40", (100, 300), 100, 1, True))


def _finishes(fn, timeout_s: float = 10.0) -> BaseException | None:
    """Run `fn` in a daemon thread; the exception it raised (None if none). Fails if it is still running."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"still waiting after {timeout_s} s (a FIFO opened for reading blocks until a writer)"
    return outcome[0]


def test_a_fifo_or_device_as_a_profile_or_record_is_refused_at_once(tmp_path: Path) -> None:
    """Rule: readers open O_NONBLOCK and take regular files only. Fails on a0ffbee: `load_profile` and
    `read_record` on a FIFO waited forever for a writer."""
    from zeus_callbacks.core.device.errors import InvalidInputError
    from zeus_callbacks.core.power_limit.profile_file import ProfileContext, load_profile
    from zeus_callbacks.core.report.records import read_record

    fifo = tmp_path / "plo.json"
    os.mkfifo(fifo)
    device = tmp_path / "zero.json"
    device.symlink_to("/dev/zero")  # read whole, it never ends
    context = ProfileContext("NVIDIA A40", (100, 300), 100, 1, True)
    for path, what in ((fifo, "a FIFO"), (device, "a device")):
        error = _finishes(lambda path=path: load_profile(path, context))
        assert isinstance(error, ValueError) and what in str(error), error
        error = _finishes(lambda path=path: read_record(path))
        assert isinstance(error, InvalidInputError) and what in str(error), error


def test_report_of_a_run_dir_whose_record_is_a_fifo_says_so(tmp_path: Path, capsys) -> None:
    """Rule: `zeus-callbacks report RUN_DIR` never waits on a record that is a FIFO: one line, exit 2."""
    from zeus_callbacks.cli import main

    os.mkfifo(tmp_path / "record.rank0.json")
    code: list[int] = []
    assert _finishes(lambda: code.append(main(["report", str(tmp_path)]))) is None
    assert code == [2] and "a FIFO" in capsys.readouterr().err


@pytest.mark.parametrize("steps", [10**20, 1e20], ids=["int", "float"])
def test_a_profile_claiming_more_steps_than_any_job_measures_is_refused(steps: float, tmp_path: Path) -> None:
    """Rule: a limit's count of steps is at most `MAX_STEPS` (a billion). Fails on a0ffbee: `steps` 10**20
    was taken, and its per-step figures, looking exact, changed the choice."""
    from zeus_callbacks.core.power_limit.estimates import PowerLimitStats
    from zeus_callbacks.core.power_limit.profile_file import ProfileContext, load_profile, save_profile

    context = ProfileContext("NVIDIA A40", (100, 300), 100, 1, True)
    path = tmp_path / "plo.json"
    save_profile(path, context, {300: PowerLimitStats(300, 4, 0.4, 120.0, 0.04, 3600.0)}, complete=False)
    data = json.loads(path.read_text())
    data["measurements"][0]["steps"] = steps
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="is not a count of measured steps"):
        load_profile(path, context)
