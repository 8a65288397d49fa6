"""The clock profile across the pipeline's ranks: read, gathered clock by clock, planned from, written.

A profile at `profile_path` is read for every rank; each clock's measurements are gathered into the sweep;
the plan is solved on the group's first rank, which writes the profile.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.pipeline_frequency.clock_sweep import ClockSweep
from zeus_callbacks.core.pipeline_frequency.dag import Instruction
from zeus_callbacks.core.pipeline_frequency.phases import Profiling
from zeus_callbacks.core.pipeline_frequency.planning import plan_pipeline
from zeus_callbacks.core.pipeline_frequency.profile_file import (
    ProfileRow,
    edge_delays_path,
    read_profile,
    write_edge_delays,
    write_profile,
)

__all__ = ["read_profile_everywhere", "share_clock", "solve_plan", "save_profile"]

logger = logging.getLogger("zeus_callbacks.core.pipeline_frequency.optimizer")


def read_profile_everywhere(group: dist.Group, profile_path: Path | None) -> list[ProfileRow] | None:
    """The rows of `profile_path` if it exists (read by the group's first rank, sent to every rank); a
    bad file raises on every rank, so that none waits for the others at a collective.

    Raises:
        InvalidInputError: the file cannot be read or is not a profile.
    """
    read: tuple[list[ProfileRow] | None, str | None] = (None, None)
    if profile_path is not None and profile_path.exists() and group.rank() == 0:
        try:
            read = (read_profile(profile_path), None)
        except (OSError, ValueError) as e:
            read = (None, f"`PipelineFrequencyOptimizer(profile_path={str(profile_path)!r})`: {e}")
    rows, error = group.broadcast(read)
    if error is not None:
        raise InvalidInputError(error + " Fix or remove the file (it is written again after profiling).")
    return rows


def share_clock(
    group: dist.Group,
    sweep: ClockSweep,
    stage: int,
    phase: Profiling,
    sequence: tuple[str | tuple[str, int], ...],
    failed: str | None,
) -> str | None:
    """Add every rank's measurements at the clock `phase` profiled to `sweep` (a collective); returns why
    profiling stops instead (a rank's GPU failed, measurements that do not fit together), or None.

    Args:
        group: The pipeline's ranks.
        sweep: The sweep every rank keeps alike.
        stage: This rank's stage.
        phase: This rank's profiling phase, its measured steps done.
        sequence: The instructions this rank ran in a step, in order.
        failed: This rank's first GPU error, if any.
    """
    sample = None if sweep.done(stage) else phase.measurements.sample(stage, phase.frequency_mhz, sequence)
    gathered = group.all_gather(
        {
            "sample": sample,
            "stage": stage,
            "sequence": sequence,
            "failed": failed,
            "timelines": phase.measurements.timelines,
        }
    )
    failures = [g["failed"] for g in gathered if g["failed"]]
    if failures:
        return f"a GPU failed during profiling ({failures[0]})"
    try:
        timelines: dict[int, Any] = {}
        for g in gathered:  # one replica of each stage: the first rank that runs it
            timelines.setdefault(g["stage"], g["timelines"])
        sweep.add(
            (g["sample"] for g in gathered if g["sample"] is not None),
            {g["stage"]: g["sequence"] for g in gathered},
            timelines,
        )
    except ValueError as e:
        return str(e)
    return None


def solve_plan(
    sweep: ClockSweep,
    replay: list[ProfileRow] | None,
    why_not_set: str | None,
    schedule: str | None,
    target_time_s: float | None,
    slack_margin: float,
    order: tuple[tuple[Instruction, ...], ...] | None,
) -> dict[str, Any]:
    """The plan (`planning.plan_pipeline`) from `replay` or else `sweep`'s profile, or `{"error": why}` when
    there is none (plain data, to broadcast).

    Args:
        sweep: The finished sweep (sequences, blocking power and timelines; its profile unless replaying).
        replay: The profile read from `profile_path`, if any.
        why_not_set: Why clocks may not be locked, in words; None when they may.
        schedule: The schedule's name, or None (detected).
        target_time_s: Iteration-time target; None: the all-max-clock time.
        slack_margin: Extra planning margin of a lowered clock (fraction of its time).
        order: Every stage's instructions, as given to `use_schedule`, if any.
    """
    if replay is None and why_not_set is not None:
        return {
            "error": f"{why_not_set}, so no per-clock profile can be taken; "
            "measurements at the current clock are in report()['profile']"
        }
    rows = replay if replay is not None else sweep.profile_rows()
    try:
        return plan_pipeline(
            sweep.sequences,
            rows,
            sweep.blocking_power_w(),
            schedule,
            target_time_s,
            slack_margin,
            order,
            timelines=sweep.timelines,
            fit_times=replay is None,  # its own sweep: times read off one curve per type
        )
    except ValueError as e:
        return {"error": f"no plan: {e}"}


def save_profile(profile_path: Path, rows: Sequence[ProfileRow], plan: dict[str, Any]) -> None:
    """Write `rows` to `profile_path`, and the plan's measured edge delays beside it; a failure is logged."""
    try:
        write_profile(profile_path, rows)
        if "edge_delays" in plan:
            write_edge_delays(edge_delays_path(profile_path), plan["edge_delays"])
    except OSError as e:
        logger.warning("PipelineFrequencyOptimizer: cannot write %s: %s", profile_path, e)
