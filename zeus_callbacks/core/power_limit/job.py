"""What a power-limit optimizer is asked to do (`Options`) and what it learns of its job at set-up (`Job`:
the grid every rank profiles, the job's GPUs, whether it may change their limits), with the set-up's
collectives as records whose fields say how they reduce over ranks."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.arguments import bad_argument, require_monitor, whole_number
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.state_guard import job_gpu_overlap
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.grid import power_limit_grid
from zeus_callbacks.core.power_limit.meter import StepMeter
from zeus_callbacks.core.power_limit.profile_file import ProfileContext
from zeus_callbacks.core.power_limit.ranks import JobMembership
from zeus_callbacks.core.power_limit.search import SEARCHES
from zeus_callbacks.core.power_limit.selectors import OptimumSelector, ZeusCost

__all__ = ["Options", "Option", "Job", "find_job", "profile_context"]

logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Options:
    """The optimizer's constructor arguments, checked (`checked`)."""

    optimum_selector: OptimumSelector
    wait_steps: int
    warmup_steps: int
    profile_steps: int
    pl_step: int
    profile_path: Path | None
    search: str

    @classmethod
    def checked(
        cls,
        monitor: ZeusMonitor,
        optimum_selector: Any,
        wait_steps: Any,
        warmup_steps: Any,
        profile_steps: Any,
        pl_step: Any,
        profile_path: Any,
        search: Any,
    ) -> Options:
        """The arguments of `GlobalPowerLimitOptimizer(...)`, or a `ValueError`/`TypeError` naming the bad one."""
        owner = "GlobalPowerLimitOptimizer"
        require_monitor(owner, monitor)
        wait_steps = whole_number(owner, "wait_steps", wait_steps, 0)
        warmup_steps = whole_number(owner, "warmup_steps", warmup_steps, 0)
        profile_steps = whole_number(owner, "profile_steps", profile_steps, 1)
        pl_step = whole_number(owner, "pl_step", pl_step, 1)
        if search not in SEARCHES:
            raise bad_argument(owner, "search", search, f"must be one of {SEARCHES}")
        if optimum_selector is not None and not isinstance(optimum_selector, OptimumSelector):
            want = "must be an OptimumSelector (Time(), Energy(), ...)"
            raise bad_argument(owner, "optimum_selector", optimum_selector, want)
        if profile_path is not None and not isinstance(profile_path, (str, os.PathLike)):
            raise bad_argument(
                owner, "profile_path", profile_path, "must be a path (str or pathlib.Path) or None"
            )
        return cls(
            optimum_selector or ZeusCost(eta_knob=0.5),
            wait_steps,
            warmup_steps,
            profile_steps,
            int(pl_step),
            Path(profile_path) if profile_path is not None else None,
            search,
        )


class Option(Generic[_T]):
    """A read-only attribute of the optimizer: the `Options` field of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> _T:
        if obj is None:
            return self  # type: ignore[return-value]
        return getattr(obj._options, self.name)


@dataclass(frozen=True)
class _GridRange:
    """The GPUs' power-limit range as the job sees it (every rank must profile the same grid)."""

    lo_mw: int = field(metadata=dist.reduce_by("min"))
    hi_mw: int = field(metadata=dist.reduce_by("max"))
    mixed: bool = field(metadata=dist.reduce_by("max"))  # a rank whose GPUs have different ranges
    unsupported: bool = field(metadata=dist.reduce_by("max"))  # a rank whose GPUs have no power-limit control


@dataclass(frozen=True)
class _JobSize:
    """The job's GPUs, and the ranks that may not change their power limits."""

    gpus: int = field(metadata=dist.reduce_by("sum"))
    denied_ranks: int = field(metadata=dist.reduce_by("sum"))


@dataclass(frozen=True)
class Job:
    """What set-up learned of the job: its GPUs (every rank's), whether every rank may change their power
    limits, and the `grid` every rank profiles; or why the optimizer stands down (`inactive`)."""

    num_gpus: int
    may_set: bool = True
    grid: list[int] = field(default_factory=list)
    inactive: str = ""

    @property
    def max_power_w(self) -> float:
        """The job's maximum power: every GPU's maximum limit summed."""
        return self.grid[0] * self.num_gpus if self.grid else 0.0


def find_job(meter: StepMeter, membership: JobMembership, pl_step: int) -> Job:
    """Learn the job (collectives when every rank takes part: `meter.collective` is set here).

    Raises:
        ValueError: the ranks' GPUs have different power-limit ranges (mixed GPU models).
    """
    gpus = meter.gpus
    meter.collective = dist.is_distributed() and membership.settle()
    try:
        constraints = {g.power_limit_constraints_mw() for g in gpus}
    except GPUError as e:  # e.g. no power-limit control on this GPU: every rank stands down below
        logger.warning("GlobalPowerLimitOptimizer: %s Training on without it; energy is still measured.", e)
        constraints = {(0, 0)}
    lo, hi = min(c[0] for c in constraints), max(c[1] for c in constraints)
    # Every rank must profile the same grid: refuse mixed GPU models rather than guess.
    job_range = meter.reduce(_GridRange(lo, hi, len(constraints) > 1, hi == 0))
    if job_range.unsupported:
        return Job(len(gpus), inactive="a GPU does not support power-limit control")
    if meter.collective or not dist.is_distributed():
        overlap = job_gpu_overlap(gpus)  # before any change, on every rank
        if overlap is not None:
            logger.warning("GlobalPowerLimitOptimizer: %s", overlap)
            return Job(len(gpus), inactive="GPUs shared between ranks")
    if len(constraints) > 1 or job_range.lo_mw != lo or job_range.hi_mw != hi or job_range.mixed:
        raise ValueError(
            "GlobalPowerLimitOptimizer needs GPUs with the same power-limit range on every rank; this job mixes "
            "GPU models. Plan per-GPU limits with `zeus-callbacks plan` (the heterogeneous planner) instead."
        )
    size = meter.reduce(_JobSize(len(gpus), int(not all(g.may_change_settings() for g in gpus))))
    return Job(size.gpus, size.denied_ranks == 0, power_limit_grid(lo / 1000, hi / 1000, pl_step))


def profile_context(job: Job, meter: StepMeter, pl_step: int) -> ProfileContext:
    """What this job's profile is measured on (a profile is only reused on the same)."""
    from zeus_callbacks import __version__

    lo, hi = job.grid[-1], job.grid[0]
    return ProfileContext(
        meter.gpus[0].name, (lo, hi), pl_step, job.num_gpus, meter.monitor.simulated, __version__
    )
