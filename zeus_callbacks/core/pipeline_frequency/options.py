"""`PipelineFrequencyOptimizer`'s constructor arguments: their checks (with `core.arguments`' wording) and the
records it keeps them in."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.arguments import bad_argument, positive_number, whole_number
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.dag import MULTI_STAGE_SCHEDULES, SCHEDULES

__all__ = [
    "JobLayout",
    "PipelineOptions",
    "bad",
    "check_options",
    "check_limits",
    "check_ranks",
    "rank_monitor",
]

_OWNER = "PipelineFrequencyOptimizer"


@dataclass(frozen=True)
class PipelineOptions:
    """How to profile (steps per clock, which clocks, when a stage stops) and plan (target, margin, the
    profile file): the optimizer's keyword arguments of the same names, checked (`check_options`,
    `check_limits`)."""

    wait_steps: int = 1
    warmup_steps: int = 2
    profile_steps: int = 3
    frequency_stride_mhz: int = 90
    min_frequency_mhz: int | None = None
    patience: int = 2
    target_time_s: float | None = None
    slack_margin: float = 0.0
    profile_path: Path | None = None


@dataclass(frozen=True)
class JobLayout:
    """What the caller said of the job (Zeus's positional arguments): checked against torch.distributed
    (`check_ranks`), `pp_degree` against the ranks at the first step, `job_metadata` shown in the report;
    `rank`, `dp_rank` and `tp_rank` are accepted for compatibility."""

    rank: int | None = None
    dp_rank: int = 0
    tp_rank: int = 0
    pp_degree: int | None = None
    job_metadata: str | None = None


def bad(name: str, value: Any, want: str) -> ValueError:
    """The error of a bad constructor argument: names it with its value, says what to pass (one line)."""
    return bad_argument(_OWNER, name, value, want)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_options(schedule: Any, wait: Any, warmup: Any, profile: Any, stride: Any, patience: Any) -> None:
    """The schedule's name and the step counts (`core.arguments`' checks), else a clear error."""
    if schedule is not None and schedule not in SCHEDULES + MULTI_STAGE_SCHEDULES:
        raise bad(
            "schedule", schedule, f"pass one of {SCHEDULES + MULTI_STAGE_SCHEDULES}, or None (detected)"
        )
    for name, value, low in (
        ("wait_steps", wait, 0),
        ("warmup_steps", warmup, 0),
        ("profile_steps", profile, 1),
        ("frequency_stride_mhz", stride, 1),
        ("patience", patience, 1),
    ):
        whole_number(_OWNER, name, value, low)


def check_limits(min_frequency_mhz: Any, target_time_s: Any, slack_margin: Any) -> None:
    """The lowest clock, the iteration-time target and the planning margin, else a clear error."""
    if min_frequency_mhz is not None:
        whole_number(_OWNER, "min_frequency_mhz", min_frequency_mhz, 1)
    if target_time_s is not None:
        positive_number(_OWNER, "target_time_s", target_time_s)
    if not (_is_number(slack_margin) and 0.0 <= slack_margin < 1.0):
        raise bad("slack_margin", slack_margin, "pass a number in [0, 1), e.g. 0 (the default)")


def check_ranks(
    rank: int | None, world_size: int | None, pp_rank: int | None, dp_degree: int, tp_degree: int
) -> None:
    """This rank's place in the job, against torch.distributed where it runs, else a clear error."""
    if rank is not None and dist.is_distributed() and rank != dist.rank():
        raise bad("rank", rank, f"this process is rank {dist.rank()} of torch.distributed")
    if world_size is not None and dist.is_distributed() and world_size != dist.world_size():
        raise bad("world_size", world_size, f"torch.distributed has {dist.world_size()} ranks")
    if pp_rank is None and (dp_degree > 1 or tp_degree > 1):
        raise bad("pp_rank", pp_rank, "is required with data or tensor parallelism (the stage of this rank)")


def rank_monitor(monitor: ZeusMonitor | None, device_id: int | None) -> ZeusMonitor:
    """`monitor`, checked to measure exactly this rank's GPU; default: a new one on `device_id` (else the
    local rank's GPU)."""
    if monitor is None:
        if device_id is None:
            device_id = dist.local_rank()
        return ZeusMonitor(gpu_indices=[device_id])
    if len(monitor.gpu_indices) != 1 or (device_id is not None and monitor.gpu_indices != [device_id]):
        raise bad(
            "monitor",
            f"ZeusMonitor(gpu_indices={monitor.gpu_indices})",
            "must measure exactly this rank's GPU"
            + (f" (device_id={device_id})" if device_id is not None else ""),
        )
    return monitor
