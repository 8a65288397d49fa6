"""What a pipeline-frequency optimizer shows: its phase, clocks, profile, plan, metrics and report.

`PipelineFrequencyReadout` is the base of `PipelineFrequencyOptimizer`, which adds the hooks, the phase
machine and the clock changes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from zeus_callbacks.core.callback import Callback
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.clock_sweep import ClockSweep
from zeus_callbacks.core.pipeline_frequency.controller import FrequencyController
from zeus_callbacks.core.pipeline_frequency.phases import Applying, Fallback, Inactive, Phase
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow

__all__ = ["PipelineFrequencyReadout"]

# Iteration energy is averaged over the recent steps that span this long (20 refreshes of a 100 ms counter).
_ITERATION_WINDOW_S = 2.0


class PipelineFrequencyReadout(Callback):
    """The read-only side of `PipelineFrequencyOptimizer` (see there); the attributes are set by it."""

    monitor: ZeusMonitor
    stage: int | None  # this rank's pipeline stage (known at the first step)
    may_set: bool  # whether every rank may lock SM clocks
    job_metadata: str | None
    iteration_time_s: float | None  # the last iteration's time
    iteration_energy_j: float | None  # the mean energy of the recent iterations
    profiling_steps: int
    # Recent steps (time, counter energy): an iteration's energy is their mean, over enough steps for a
    # counter that moves only every 20-100 ms (a single short step reads 0 J or a whole refresh).
    _recent_steps: deque[tuple[float, float]]
    _phase: Phase
    _sweep: ClockSweep | None  # made at the first step, from every rank's clocks
    _controller: FrequencyController | None
    _plan: dict[str, Any] | None  # plain data, the same on every rank

    @property
    def phase(self) -> str:
        """`waiting`, `profiling`, `applying`, `fallback` or `inactive` (see `PipelineFrequencyOptimizer`)."""
        return self._phase.name

    @property
    def frequency_mhz(self) -> int | None:
        """The SM clock this optimizer last locked (None: not locked)."""
        return None if self._controller is None else self._controller.frequency_mhz

    @property
    def plan_frequencies_mhz(self) -> list[int] | None:
        """This stage's planned clock of each instruction, in execution order (None before planning)."""
        return list(self._phase.frequencies_mhz) if isinstance(self._phase, Applying) else None

    def metrics(self) -> dict[str, float | str]:
        """Numbers for the trainer's loggers: phase, this rank's last iteration, the plan's prediction."""
        out: dict[str, float | str] = {"phase": self.phase, "profiling_steps": float(self.profiling_steps)}
        if self.iteration_time_s is not None and self.iteration_energy_j is not None:
            out["iteration_time_s"] = self.iteration_time_s
            out["iteration_energy_j"] = self.iteration_energy_j
        if self.frequency_mhz is not None:
            out["frequency_mhz"] = float(self.frequency_mhz)
        if self._plan and "predicted" in self._plan:
            for k, v in self._plan["predicted"].items():
                out[f"plan_{k}"] = float(v)
        return out

    def profile_rows(self) -> list[ProfileRow]:
        """The profile measured so far (every stage, replicas merged), as written to `profile_path`."""
        return [] if self._sweep is None else self._sweep.profile_rows()

    def blocking_power_w(self) -> dict[int, float]:
        """Measured power (W) of each stage while blocked between instructions (replicas summed).

        A blocked GPU draws no more than a computing one: when the gaps are too short for the energy
        counter's millijoule resolution, the figure is capped at the stage's lowest computing power.
        """
        return {} if self._sweep is None else self._sweep.blocking_power_w()

    def report(self) -> dict[str, Any]:
        """Plain data: phase, the profile, blocking power, the plan and its predicted time and energy
        against all maximum clocks (labelled `simulated` when the GPUs are)."""
        out: dict[str, Any] = {
            "phase": self.phase,
            "simulated": self.monitor.simulated,
            "stage": self.stage,
            "may_lock_clocks": self.may_set,
            "profile": [r.__dict__ for r in self.profile_rows()],
            "blocking_power_w": self.blocking_power_w(),
            "profiling_steps": self.profiling_steps,
        }
        if self.job_metadata is not None:
            out["job_metadata"] = self.job_metadata
        if isinstance(self._phase, (Inactive, Fallback)):
            out["reason"] = self._phase.reason
        if self._plan is not None:
            out.update({k: v for k, v in self._plan.items() if k != "stage_plans"})
            out["plan_applied"] = isinstance(self._phase, Applying)
        return out

    def _record_iteration(self, time_s: float, energy_j: float) -> None:
        """The last iteration's time, and the mean energy of the recent iterations spanning ~2 s."""
        recent = self._recent_steps
        recent.append((time_s, energy_j))
        while len(recent) > 1 and sum(t for t, _ in recent) - recent[0][0] >= _ITERATION_WINDOW_S:
            recent.popleft()
        self.iteration_time_s = time_s
        self.iteration_energy_j = sum(e for _, e in recent) / len(recent)
