"""What a pipeline-frequency optimizer shows: the recent iterations' figures (`RecentIterations`), and the
numbers trackers take and the report, as functions of the parts they read.

`PipelineFrequencyOptimizer` owns the parts (its phase, `ClockSweep`, plan, controller) and exposes these as
its `metrics()` and `report()`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from zeus_callbacks.core.pipeline_frequency.clock_sweep import ClockSweep
from zeus_callbacks.core.pipeline_frequency.phases import Applying, Fallback, Inactive, Phase

__all__ = ["RecentIterations", "pipeline_metrics", "pipeline_report"]

# Iteration energy is averaged over the recent steps that span this long (20 refreshes of a 100 ms counter).
_ITERATION_WINDOW_S = 2.0


class RecentIterations:
    """The last iteration's time and the mean energy of the recent iterations spanning about 2 s: a counter
    that moves only every 20-100 ms reads 0 J or a whole refresh for a single short step."""

    def __init__(self) -> None:
        self.time_s: float | None = None  # the last iteration's
        self.energy_j: float | None = None  # the recent iterations' mean
        self._steps: deque[tuple[float, float]] = deque()

    def add(self, time_s: float, energy_j: float) -> None:
        """One iteration's time and counter energy."""
        recent = self._steps
        recent.append((time_s, energy_j))
        while len(recent) > 1 and sum(t for t, _ in recent) - recent[0][0] >= _ITERATION_WINDOW_S:
            recent.popleft()
        self.time_s = time_s
        self.energy_j = sum(e for _, e in recent) / len(recent)


def pipeline_metrics(
    phase: Phase,
    profiling_steps: int,
    iterations: RecentIterations,
    frequency_mhz: int | None,
    plan: dict[str, Any] | None,
) -> dict[str, float | str]:
    """Numbers for the trainer's loggers: phase, this rank's last iteration, the plan's prediction."""
    out: dict[str, float | str] = {"phase": phase.name, "profiling_steps": float(profiling_steps)}
    if iterations.time_s is not None and iterations.energy_j is not None:
        out["iteration_time_s"] = iterations.time_s
        out["iteration_energy_j"] = iterations.energy_j
    if frequency_mhz is not None:
        out["frequency_mhz"] = float(frequency_mhz)
    if plan and "predicted" in plan:
        for k, v in plan["predicted"].items():
            out[f"plan_{k}"] = float(v)
    return out


def pipeline_report(
    phase: Phase, sweep: ClockSweep | None, plan: dict[str, Any] | None, facts: dict[str, Any]
) -> dict[str, Any]:
    """Plain data: phase, the profile (`sweep`'s rows), blocking power, the plan and its predicted time and
    energy against all maximum clocks; `facts` are the optimizer's own (`simulated`, `stage`,
    `may_lock_clocks`, `profiling_steps`, and `job_metadata` when given)."""
    out: dict[str, Any] = {
        "phase": phase.name,
        **{k: v for k, v in facts.items() if k != "job_metadata" or v is not None},
        "profile": [r.__dict__ for r in sweep.profile_rows()] if sweep is not None else [],
        "blocking_power_w": sweep.blocking_power_w() if sweep is not None else {},
    }
    if isinstance(phase, (Inactive, Fallback)):
        out["reason"] = phase.reason
    if plan is not None:
        out.update({k: v for k, v in plan.items() if k != "stage_plans"})
        out["plan_applied"] = isinstance(phase, Applying)
    return out
