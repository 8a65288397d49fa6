"""Each stage's clocks to profile, agreed by the pipeline's ranks at the first step.

`JobClocks` is what they agree on (each stage's clocks, whether they may be locked); the GPU's power limit
is put at its default for the profile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.gpus import GPU
from zeus_callbacks.core.device.state_guard import job_gpu_overlap
from zeus_callbacks.core.pipeline_frequency.clock_sweep import clock_sweep, stage_clocks
from zeus_callbacks.core.pipeline_frequency.options import bad
from zeus_callbacks.core.pipeline_frequency.phases import UNLOCKED
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow

__all__ = ["JobClocks", "agree_on_clocks", "clocks_to_profile", "default_power_limit"]

logger = logging.getLogger("zeus_callbacks.core.pipeline_frequency.optimizer")


@dataclass(frozen=True)
class JobClocks:
    """What every rank agreed on at the first step."""

    clocks: dict[int, list[int]]  # each stage's clocks to profile, highest first (its replicas' common ones)
    may_set: bool  # whether every rank may lock SM clocks on its GPU
    why_not_set: str  # why `may_set` is False, in words ("" when it is True)


def agree_on_clocks(
    group: dist.Group,
    gpu: GPU,
    stage: int,
    frequency_stride_mhz: int,
    min_frequency_mhz: int | None,
    pp_degree: int | None,
) -> JobClocks:
    """Every rank's stage and clocks, gathered (a collective: every rank of `group` calls it).

    Raises:
        ValueError: on every rank, when `min_frequency_mhz` is above a rank's GPU clocks or the ranks
            report other than `pp_degree` stages (so that none waits for the others at a collective).
    """
    sweep, may_set = _own_sweep(gpu, frequency_stride_mhz, min_frequency_mhz)
    infos = group.all_gather(
        {
            "stage": stage,
            "sweep": sweep,
            "may_set": may_set,
            "bad": _clock_range_error(gpu, min_frequency_mhz),
        }
    )
    error = next((i["bad"] for i in infos if i["bad"]), None)
    if error is not None:  # raised on every rank, so that none waits for the others at a collective
        raise ValueError(error)
    clocks = stage_clocks((i["stage"], i["sweep"]) for i in infos)
    if pp_degree is not None and pp_degree != len(clocks):
        raise ValueError(
            f"`PipelineFrequencyOptimizer(pp_degree={pp_degree})`: the ranks report {len(clocks)} stages."
        )
    may_set, why_not_set = all(i["may_set"] and i["sweep"] for i in infos), ""
    if not all(i["sweep"] for i in infos):
        why_not_set = "SM clocks cannot be locked: a rank's GPU or driver does not support it"
    elif not may_set:
        why_not_set = "no permission to lock SM clocks (needs root or CAP_SYS_ADMIN on every rank)"
    overlap = job_gpu_overlap([gpu])  # before any change, on every rank
    if overlap is not None:
        logger.warning("PipelineFrequencyOptimizer: %s", overlap)
        may_set, why_not_set = False, "ranks share a GPU"
    return JobClocks(clocks, may_set, why_not_set)


def _clock_range_error(gpu: GPU, min_frequency_mhz: int | None) -> str | None:
    """Why `min_frequency_mhz` does not fit `gpu` (above its highest SM clock), or None."""
    if min_frequency_mhz is None:
        return None
    try:
        supported = gpu.supported_sm_clocks_mhz()
    except GPUError:
        return None  # reported by `_own_sweep`
    if not supported or min_frequency_mhz <= max(supported):
        return None
    return str(
        bad(
            "min_frequency_mhz",
            min_frequency_mhz,
            f"above the highest SM clock, {max(supported)} MHz, of {gpu.label}; pass a clock in "
            f"{min(supported)}..{max(supported)} MHz, or None (its lowest)",
        )
    )


def _own_sweep(gpu: GPU, frequency_stride_mhz: int, min_frequency_mhz: int | None) -> tuple[list[int], bool]:
    """The clocks `gpu` would profile, and whether this rank may lock them."""
    may_set = gpu.may_change_settings()
    try:
        supported = gpu.supported_sm_clocks_mhz()
    except GPUError as e:
        logger.warning("PipelineFrequencyOptimizer: cannot read %s's SM clocks: %s", gpu.label, e)
        return [], False
    if not supported:
        logger.warning(
            "PipelineFrequencyOptimizer: %s lists no supported SM clocks (NVML answered an empty list of "
            "memory or SM clocks), so clock locking is not supported on it.",
            gpu.label,
        )
        return [], False
    return clock_sweep(supported, frequency_stride_mhz, min_frequency_mhz), may_set


def clocks_to_profile(job: JobClocks, replay: list[ProfileRow] | None) -> dict[int, list[int]]:
    """Each stage's sweep: in full, only its maximum (replaying the profile `replay`), or the clock in force
    (`UNLOCKED`, when clocks may not be locked)."""
    if not job.may_set:
        logger.warning(
            "PipelineFrequencyOptimizer: %s, so no per-clock profile can be taken and no plan applied. "
            "Time and energy are still measured at the current clock%s.",
            job.why_not_set,
            "; the plan from profile_path is reported, not applied" if replay else "",
        )
        return dict.fromkeys(job.clocks, [UNLOCKED])
    clocks = job.clocks
    if replay is not None:
        clocks = {s: c[:1] for s, c in clocks.items()}
    if any(not c for c in clocks.values()):
        raise ValueError("PipelineFrequencyOptimizer: the replicas of a stage share no SM clock.")
    return clocks


def default_power_limit(gpu: GPU) -> None:
    """Put `gpu`'s power limit at its default before profiling clocks, as Zeus does: a low limit left by
    someone else would cap every clock and make the profile wrong (journaled, restored at the end)."""
    try:
        default = gpu.default_power_limit_mw()
        if gpu.power_limit_mw() != default:
            logger.info(
                "PipelineFrequencyOptimizer: %s's power limit set to its default %g W for the clock profile.",
                gpu.label,
                default / 1000,
            )
            gpu.set_power_limit_mw(default)
    except GPUError as e:
        logger.warning("PipelineFrequencyOptimizer: the power limit stays as it is (%s).", e)
