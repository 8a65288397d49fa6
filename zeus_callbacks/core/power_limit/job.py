"""What a power-limit optimizer learns of its job at set-up (`Job`: the grid every rank profiles, the job's
GPUs, whether it may change their limits), with the set-up's collectives as records whose fields say how
they reduce over ranks. What it is asked to do is `options.PowerLimitOptions`'."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.state_guard import job_gpu_overlap
from zeus_callbacks.core.power_limit.grid import ALLOW_RAISING_ENV, milliwatts, power_limit_grid
from zeus_callbacks.core.power_limit.meter import StepMeter
from zeus_callbacks.core.power_limit.options import PowerLimitOptions
from zeus_callbacks.core.power_limit.power_budget import POWER_BUDGET_ENV
from zeus_callbacks.core.power_limit.profile_file import ProfileContext
from zeus_callbacks.core.power_limit.ranks import JobMembership
from zeus_callbacks.version import __version__

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = ["ALLOW_RAISING_ENV", "Job", "find_job", "profile_context"]


logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")
_T = TypeVar("_T")


@dataclass(frozen=True)
class _GridRange:
    """The GPUs' power-limit ranges as the job sees them: every rank profiles the same grid, within the range
    every GPU accepts (the intersection) and, unless raising is allowed, at most the lowest limit in force."""

    lo_mw: int = field(metadata=dist.reduce_by("max"))  # the intersection: the highest minimum
    hi_mw: int = field(metadata=dist.reduce_by("min"))  # ... and the lowest maximum
    union_lo_mw: int = field(metadata=dist.reduce_by("min"))  # the union, to tell whether the ranges differ
    union_hi_mw: int = field(metadata=dist.reduce_by("max"))
    in_force_mw: int = field(metadata=dist.reduce_by("min"))  # the lowest limit in force at the start
    # The GPU model by a hash of its name: ranks of one model have equal lowest and highest hashes.
    model_lo: int = field(metadata=dist.reduce_by("min"))
    model_hi: int = field(metadata=dist.reduce_by("max"))
    models: int = field(metadata=dist.reduce_by("max"))  # a rank's count of GPU models (1 unless mixed)
    unsupported: bool = field(metadata=dist.reduce_by("max"))  # a rank whose GPUs have no power-limit control


@dataclass(frozen=True)
class _JobSize:
    """The job's GPUs, and the ranks that may not change their power limits."""

    gpus: int = field(metadata=dist.reduce_by("sum"))
    denied_ranks: int = field(metadata=dist.reduce_by("sum"))


@dataclass(frozen=True)
class _Board:
    """One GPU's power-limit range and the limit in force when the job started (mW)."""

    index: int  # CUDA's
    lo_mw: int
    hi_mw: int
    in_force_mw: int


@dataclass(frozen=True)
class Job:
    """What set-up learned of the job: its GPUs (every rank's), whether every rank may change their power
    limits, and the `grid` every rank profiles (W, highest first); or why the optimizer stands down
    (`inactive`)."""

    num_gpus: int
    may_set: bool = True
    grid: list[float] = field(default_factory=list)
    inactive: str = ""
    within_budget: bool = False  # a power budget lowered the grid's top: it is set before anything else

    @property
    def max_power_w(self) -> float:
        """The job's maximum power: the highest limit it profiles, times its GPUs."""
        return self.grid[0] * self.num_gpus if self.grid else 0.0


def _boards(gpus: Sequence[GPU]) -> list[_Board]:
    """Each GPU's range and the limit in force when this process first found it: the one set (or what the
    state guard recorded before this process changed it), or the enforced one where another limiter holds
    the board lower (a real GH200: 700 W enforced under a 900 W request).

    Raises:
        GPUError: a GPU without power-limit control (NVML: NOT_SUPPORTED), or one that does not answer.
    """
    out = []
    for g in gpus:
        lo, hi = g.power_limit_constraints_mw()
        out.append(_Board(g.index, lo, hi, g.starting_power_limit_mw()))
    return out


def _model_hash(name: str) -> int:
    return zlib.crc32(name.encode())  # < 2**32: exact in the float all_reduce carries


def find_job(
    meter: StepMeter,
    membership: JobMembership,
    pl_step: int,
    allow_raising: bool = False,
    budget_w: Callable[[int], float | None] | None = None,
) -> Job:
    """Learn the job (collectives when every rank takes part: `meter.collective` is set here).

    The grid spans the range every GPU of the job accepts (boards of one model may differ: real V100 nodes
    hold 100 W and 150 W minimums side by side), and tops out at the lowest limit in force when the job
    started unless `allow_raising`, and never above a power budget: `budget_w(num_gpus)`, each GPU's share
    (W) of its job's budget, or None.

    Raises:
        ValueError: the job mixes GPU models, its GPUs' ranges have no limit in common, or the budget is
            below every limit they accept.
    """
    gpus = meter.gpus
    meter.collective = dist.is_distributed() and membership.settle()
    names = {g.name for g in gpus}
    try:
        boards = _boards(gpus)
    except GPUError as e:  # e.g. no power-limit control on this GPU: every rank stands down below
        logger.warning(
            "GlobalPowerLimitOptimizer cannot act. %s Training goes on, the GPUs left as they are.", e
        )
        boards = []
    hashes = [_model_hash(n) for n in names]
    job_range = meter.reduce(
        _GridRange(
            max((b.lo_mw for b in boards), default=0),
            min((b.hi_mw for b in boards), default=0),
            min((b.lo_mw for b in boards), default=0),
            max((b.hi_mw for b in boards), default=0),
            min((b.in_force_mw for b in boards), default=0),
            min(hashes),
            max(hashes),
            len(names),
            not boards,
        )
    )
    if job_range.unsupported:
        return Job(len(gpus), inactive="a GPU does not support power-limit control")
    if meter.collective or not dist.is_distributed():
        overlap = job_gpu_overlap(gpus)  # before any change, on every rank
        if overlap is not None:
            logger.warning("GlobalPowerLimitOptimizer: %s", overlap)
            return Job(len(gpus), inactive="GPUs shared between ranks")
    if job_range.models > 1 or job_range.model_lo != job_range.model_hi:
        raise ValueError(
            "GlobalPowerLimitOptimizer needs one GPU model on every rank; this job mixes GPU models. Plan "
            "per-GPU limits with `zeus-callbacks plan` (the heterogeneous planner) instead."
        )
    lo, hi = job_range.lo_mw, job_range.hi_mw
    if lo > hi:
        raise ValueError(
            f"GlobalPowerLimitOptimizer: the job's GPUs have no power limit in common ({_ranges(boards)} on this "
            f"rank; the highest minimum is {lo / 1000:g} W, the lowest maximum {hi / 1000:g} W). Run it on GPUs "
            "whose ranges overlap, or plan per-GPU limits with `zeus-callbacks plan` (the heterogeneous planner)."
        )
    if hi > lo and milliwatts(pl_step) > hi - lo:
        raise ValueError(
            f"`GlobalPowerLimitOptimizer(pl_step={pl_step})`: the stride (W) is wider than the GPUs' whole "
            f"power-limit range, {lo / 1000:g}-{hi / 1000:g} W, so only its two ends would be profiled. Pass a "
            f"stride that fits several limits in it, e.g. pl_step={PowerLimitOptions.pl_step} (the default)."
        )
    if (job_range.union_lo_mw, job_range.union_hi_mw) != (lo, hi):
        _say_ranges_differ(gpus[0].name, boards, lo, hi)
    size = meter.reduce(_JobSize(len(gpus), int(not all(g.may_change_settings() for g in gpus))))
    top = hi if allow_raising else max(lo, min(hi, job_range.in_force_mw))
    if top < hi:
        _say_capped(top, hi)
    budget = budget_w(size.gpus) if budget_w is not None else None
    if budget is not None and milliwatts(budget) < top:
        top = _budget_top(budget, lo, top)
        return Job(
            size.gpus,
            size.denied_ranks == 0,
            power_limit_grid(lo / 1000, top / 1000, pl_step),
            within_budget=True,
        )
    if top == lo:
        why = f"the only power limit {'every GPU accepts' if top == hi else 'not above the one in force'}"
        logger.warning(
            "GlobalPowerLimitOptimizer has nothing to choose: %g W is %s. Training on; energy is still measured.",
            lo / 1000,
            why,
        )
        return Job(len(gpus), inactive=f"{lo / 1000:g} W is {why}")
    return Job(size.gpus, size.denied_ranks == 0, power_limit_grid(lo / 1000, top / 1000, pl_step))


def _budget_top(budget_w: float, lo_mw: int, top_mw: int) -> int:
    """The grid's top under a power budget of `budget_w` per GPU (said once, by rank 0).

    Raises:
        ValueError: the budget is below the GPUs' lowest settable limit.
    """
    cap = milliwatts(budget_w)
    if cap < lo_mw:
        raise ValueError(
            f"GlobalPowerLimitOptimizer: the power budget, {budget_w:g} W per GPU, is below the lowest limit the "
            f"GPUs accept ({lo_mw / 1000:g} W): raise the budget (MaxPowerConstraint, {POWER_BUDGET_ENV}) or "
            "run on GPUs that go that low."
        )
    if dist.rank() == 0:
        logger.info(
            "GlobalPowerLimitOptimizer: no power limit above the budget, %g W per GPU (of %g W in force), is set.",
            budget_w,
            top_mw / 1000,
        )
    return min(cap, top_mw)


def _ranges(boards: Sequence[_Board]) -> str:
    """`GPUs 0, 4: 150-300 W; GPUs 1, 2: 100-300 W`: the boards (CUDA indices) grouped by range."""
    by_range: dict[tuple[int, int], list[str]] = {}
    for b in boards:
        by_range.setdefault((b.lo_mw, b.hi_mw), []).append(str(b.index))
    return "; ".join(
        f"GPU{'s' if len(ids) > 1 else ''} {', '.join(ids)}: {lo / 1000:g}-{hi / 1000:g} W"
        for (lo, hi), ids in by_range.items()
    )


def _say_ranges_differ(model: str, boards: Sequence[_Board], lo: int, hi: int) -> None:
    """One line (rank 0's) naming the boards' ranges and the common one profiled."""
    if dist.rank() != 0:
        return
    where = "" if not dist.is_distributed() else " on rank 0; other ranks' differ"
    logger.warning(
        "GlobalPowerLimitOptimizer: the %s boards' power-limit ranges differ (%s%s); profiling %g-%g W, the "
        "range every one of them accepts.",
        model,
        _ranges(boards),
        where,
        lo / 1000,
        hi / 1000,
    )


def _say_capped(top: int, hi: int) -> None:
    if dist.rank() == 0:
        logger.info(
            "GlobalPowerLimitOptimizer profiles no power limit above %g W, the one in force when the job "
            "started (the GPUs allow up to %g W); pass allow_raising_limit=True or set %s=1 to profile up to it.",
            top / 1000,
            hi / 1000,
            ALLOW_RAISING_ENV,
        )


def profile_context(job: Job, meter: StepMeter, pl_step: int) -> ProfileContext:
    """What this job's profile is measured on (a profile is only reused on the same)."""
    lo, hi = job.grid[-1], job.grid[0]
    return ProfileContext(
        meter.gpus[0].name, (lo, hi), pl_step, job.num_gpus, meter.monitor.simulated, __version__
    )
