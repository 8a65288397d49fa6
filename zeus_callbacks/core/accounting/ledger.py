"""The per-job energy ledger: one JSON line per rank and run at each checkpoint and at the end, appended to a
file that many ranks, jobs and hosts share (a shared file system is the normal case), and its sums.

An append never tears or interleaves a line: the writer holds an exclusive POSIX record lock on the file
(`fcntl.lockf`, which NFS honours through its lock manager, unlike `O_APPEND` alone, which NFS does not make
atomic across clients), writes the line at the end in one go, and cuts the file back to where it was if the
write fails half-way (a full disk). A failed append is logged and reported, never raised: accounting must not
stop training.

A line carries a rank's figures since its run began, so a later line of the same run supersedes an earlier
one: `totals` sums one line of every (job, run, rank, host), its final line (`end` or `failed`) where it has
one, else its newest checkpoint line (a run that died hard after a checkpoint, or is still running). A
finished run is never counted twice, and a killed one is counted up to its last checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import stat
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from zeus_callbacks.core import files
from zeus_callbacks.core.accounting.identity import JobIdentity
from zeus_callbacks.core.device.errors import InvalidInputError

__all__ = ["LedgerEntry", "append", "read", "totals", "JobTotal", "RUN_ID", "LEDGER_ENV", "GROUPINGS"]

logger = logging.getLogger(__name__)

LEDGER_ENV = "ZEUS_CALLBACKS_LEDGER"
"""The ledger file every job of a site appends to, unless an argument names another."""
RUN_ID = uuid.uuid4().hex[:12]
"""This process's run: a resumed or requeued job is a new run of the same job id."""
_VERSION = 2  # 2: `step` (a checkpoint's training step); version-1 lines are read as lines without one
_READ_VERSIONS = (1, 2)
_EVENTS = ("checkpoint", "end", "failed")
GROUPINGS = ("job", "user", "partition")


@dataclass(frozen=True)
class LedgerEntry:
    """One rank's figures since its run began.

    Attributes:
        job: The job as its scheduler names it.
        event: `checkpoint` (figures so far, written when the trainer saves a checkpoint), `end`, or `failed`
            (the run ended with an exception). An `end` or `failed` line supersedes the run's checkpoint
            lines.
        gpus: The rank's GPUs by UUID.
        energy_j: GPU energy (J).
        time_s: Time since the run began (s).
        energy_bound_j: How far the true energy may lie from `energy_j` (J), None when not known.
        co2eq_g: Emissions (gCO2eq), None when no carbon intensity is given.
        cost: Cost in the price's currency, None when no price is given.
        power_limit_w: The power limit the optimizer chose (W), None without one.
        simulated: The GPUs were simulated: the figures are a simulation.
        step: The training step of a checkpoint line (the trainer's global step), None where not given.
        run: The run (one process start) these figures belong to.
        written_at: When the line was written (Unix time, s).
    """

    job: JobIdentity
    event: str
    gpus: tuple[str, ...]
    energy_j: float
    time_s: float
    energy_bound_j: float | None = None
    co2eq_g: float | None = None
    cost: float | None = None
    power_limit_w: float | None = None
    simulated: bool = False
    step: int | None = None
    run: str = RUN_ID
    written_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.event not in _EVENTS:
            raise ValueError(f"LedgerEntry: event must be one of {_EVENTS}, got {self.event!r}.")
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int)):
            raise ValueError(f"LedgerEntry: step must be a whole number or None, got {self.step!r}.")
        for name in ("energy_j", "time_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LedgerEntry: {name} must be a finite number >= 0, got {value!r}.")

    def to_line(self) -> bytes:
        """The entry as one JSON line (UTF-8, ending in a newline)."""
        record = asdict(self)
        record["gpus"] = list(self.gpus)
        record["version"] = _VERSION
        return (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_line(cls, line: str) -> LedgerEntry:
        """Parse a line written by `to_line`.

        Raises:
            ValueError: not such a line (torn, of a newer version, or not a ledger line at all).
        """
        record = json.loads(line)
        if not isinstance(record, dict) or record.pop("version", None) not in _READ_VERSIONS:
            raise ValueError(f"not a ledger line of version {' or '.join(map(str, _READ_VERSIONS))}")
        job = record.pop("job")
        known = {f.name for f in fields(JobIdentity)}
        if not isinstance(job, dict) or set(job) - known:
            raise ValueError("the job field is not a job identity")
        record["gpus"] = tuple(record.get("gpus", ()))
        return cls(job=JobIdentity(**job), **record)


def append(path: str | os.PathLike[str], entry: LedgerEntry) -> bool:
    """Append `entry` to the ledger at `path` (created private to its owner if new); True once it is there.

    A failure (a full disk, a file system that refuses locks, no permission, a symlink or FIFO another user
    put at `path`) is logged at WARNING with what to do and returns False: the line is not in the ledger,
    and nothing half of it is.

    Raises:
        InvalidInputError: `path` is this user's (or root's) folder, FIFO or symlink: it cannot be a ledger.
    """
    line = entry.to_line()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:  # its directories walked without another user's links (`files.open_directory`), as every file's
        dir_fd = files.open_directory(Path(path).parent)
        try:
            fd = os.open(Path(path).name, flags, 0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        found = None if isinstance(e, files.UnsafePathError) else _lstat(path)
        if found is not None and not stat.S_ISREG(found.st_mode):  # a link, folder or FIFO at the name
            return _refuse(path, found, line)
        logger.warning("Energy ledger %s: cannot open it (%s); this line is lost: %s", path, e, line.decode())
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _refuse(path, st, line)
        return _locked_append(fd, path, line)
    finally:
        os.close(fd)


def _locked_append(fd: int, path: str | os.PathLike[str], line: bytes) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
    except OSError as e:
        logger.warning("Energy ledger %s: cannot lock it (%s); this line is lost: %s", path, e, line.decode())
        return False
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(line):
                written += os.write(fd, line[written:])
            return True
        except OSError as e:
            with contextlib.suppress(OSError):  # a failed cut is said below with the line; never raised
                os.ftruncate(fd, end)  # no half line left behind
            logger.warning(
                "Energy ledger %s: the append failed (%s); free space or point %s elsewhere. This line is "
                "lost: %s",
                path,
                e,
                LEDGER_ENV,
                line.decode(),
            )
            return False
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


def _lstat(path: str | os.PathLike[str]) -> os.stat_result | None:
    with contextlib.suppress(OSError):
        return os.stat(path, follow_symlinks=False)
    return None


def _refuse(path: str | os.PathLike[str], found: os.stat_result, line: bytes) -> bool:
    """Not a regular file at the ledger's name (`found`): this user's (or root's) is a mistake in the path,
    raised; one another user put there (a directory others may write) is said with the lost line, and
    training goes on (False): it is never written through nor waited on."""
    what = "a symbolic link" if stat.S_ISLNK(found.st_mode) else "a folder, a FIFO or a device"
    if found.st_uid in (os.geteuid(), 0):
        raise _not_a_ledger(path, f"is {what}")
    logger.warning(
        "Energy ledger %s is %s put there by %s: it is never written through. Point %s at a file of your "
        "own. This line is lost: %s",
        path,
        what,
        files.user_name(found.st_uid),
        LEDGER_ENV,
        line.decode(),
    )
    return False


def _not_a_ledger(path: str | os.PathLike[str], why: str) -> InvalidInputError:
    return InvalidInputError(
        f"Energy ledger {str(path)!r} {why}: name a regular file (it is created if missing), e.g. "
        f"{LEDGER_ENV}=$HOME/energy-ledger.jsonl."
    )


@dataclass
class LedgerContents:
    """What `read` found: the entries, and how many lines were not ledger lines."""

    entries: list[LedgerEntry]
    skipped: int = 0


def read(paths: Iterable[str | os.PathLike[str]]) -> LedgerContents:
    """Every entry of the ledgers at `paths`; a line that is not a ledger line is counted, not fatal.

    Raises:
        InvalidInputError: a path is missing, a folder or not a regular file.
    """
    out = LedgerContents([])
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise InvalidInputError(f"Energy ledger {str(p)!r} is not a file: name the file jobs append to.")
        for line in _lines(p):
            try:
                out.entries.append(LedgerEntry.from_line(line))
            except (ValueError, TypeError, KeyError):
                out.skipped += 1
    return out


def _lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                yield line


@dataclass(frozen=True)
class JobTotal:
    """A group's sums (a job, a user or a partition): energy with its bound, GPU time, the processes and ranks.

    `runs` counts process runs (each rank's process is one; a requeued or resumed job's ranks start new ones),
    `ranks` the line counted of each (`totals`), `checkpointed` those of them that are checkpoint lines (no
    final line: the run died after a checkpoint, or is still running). `energy_bound_j` is None when any line
    lacks its bound; `gpu_hours` is each rank's time times its GPUs.
    """

    key: str
    jobs: int
    runs: int
    ranks: int
    gpus: int
    energy_j: float
    energy_bound_j: float | None
    gpu_hours: float
    co2eq_g: float | None
    cost: float | None
    simulated: bool
    failed: bool
    checkpointed: int = 0


def totals(entries: Iterable[LedgerEntry], by: str = "job") -> list[JobTotal]:
    """Sum one line of every (job, run, rank, host) per `by` (one of `GROUPINGS`), largest energy first: its
    final line (`end`, `failed`) where it has one, else its newest checkpoint line (`_supersedes`)."""
    if by not in GROUPINGS:
        raise ValueError(f"totals: by must be one of {GROUPINGS}, got {by!r}.")
    newest: dict[tuple, LedgerEntry] = {}
    for e in entries:
        key = (e.job.scheduler, e.job.job_id, e.run, e.job.rank, e.job.host)
        if key not in newest or _supersedes(e, newest[key]):
            newest[key] = e
    groups: dict[str, list[LedgerEntry]] = {}
    for e in newest.values():
        name = {"job": e.job.job_id, "user": e.job.user, "partition": e.job.partition or "-"}[by]
        groups.setdefault(name, []).append(e)
    result = [_total(name, group) for name, group in groups.items()]
    return sorted(result, key=lambda t: (-t.energy_j, t.key))


def _supersedes(line: LedgerEntry, other: LedgerEntry) -> bool:
    """Whether `line` stands for its run's rank instead of `other`: a final line over a checkpoint line
    whatever their times say (a clock stepped back between them), else the later line, else the later step."""
    final, other_final = line.event != "checkpoint", other.event != "checkpoint"
    if final != other_final:
        return final
    return (line.written_at, line.step or 0) >= (other.written_at, other.step or 0)


def _total(key: str, group: list[LedgerEntry]) -> JobTotal:
    bounds = [e.energy_bound_j for e in group]
    return JobTotal(
        key=key,
        jobs=len({(e.job.scheduler, e.job.job_id) for e in group}),
        runs=len({e.run for e in group}),
        ranks=len(group),
        gpus=len({uuid for e in group for uuid in e.gpus}),
        energy_j=sum(e.energy_j for e in group),
        # Summed, not added in quadrature: a board's gain error is the same sign in every window it measures.
        energy_bound_j=None if any(b is None for b in bounds) else sum(b for b in bounds if b is not None),
        gpu_hours=sum(e.time_s * len(e.gpus) for e in group) / 3600,
        co2eq_g=_sum_known([e.co2eq_g for e in group]),
        cost=_sum_known([e.cost for e in group]),
        simulated=any(e.simulated for e in group),
        failed=any(e.event == "failed" for e in group),
        checkpointed=sum(e.event == "checkpoint" for e in group),
    )


def _sum_known(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
