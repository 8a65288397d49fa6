"""The pipeline-frequency optimizer's phases: one object per phase.

Each phase's `name` is what `PipelineFrequencyOptimizer.phase` reports; its docstring says what moves it
on. Every rank of the pipeline is in the same phase at the same step, except `fallback`, which a stage
enters on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from zeus_callbacks.core.pipeline_frequency.recorder import ClockMeasurements, InstructionRecorder

__all__ = ["UNLOCKED", "Waiting", "Profiling", "Applying", "Fallback", "Inactive", "Phase"]

UNLOCKED = 0  # `Profiling.frequency_mhz` of measurements at the clock the GPU chose (no permission to lock)


@dataclass
class Waiting:
    """`waiting`: the first `wait_steps` steps run unchanged (a schedule's first step sets it up).

    Next: `profiling` at the end of the last of them (at the first step when `wait_steps` is 0).
    """

    name: ClassVar[str] = "waiting"
    steps_left: int


@dataclass
class Profiling:
    """`profiling`: this rank's GPU at one clock of its stage's sweep (its maximum once the stage is done):
    `warmup_left` steps dropped, then `profile_steps` steps measured.

    Next, after the measured steps, when every rank has shared its measurements: `profiling` at the next
    clock while a stage's sweep goes on; `applying` once every stage is done and a plan was found;
    `inactive` when a GPU failed, no plan could be made, or the job may not lock clocks.
    """

    name: ClassVar[str] = "profiling"
    frequency_mhz: int
    warmup_left: int
    steps_done: int = 0
    measurements: ClockMeasurements = field(default_factory=ClockMeasurements)

    def count_step(self, recorder: InstructionRecorder, profile_steps: int) -> bool:
        """Count a step of `recorder`'s: dropped while warming up, else measured; True once `profile_steps`
        steps are measured at this clock."""
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return False
        self.measurements.add_step(recorder)
        self.steps_done += 1
        return self.steps_done >= profile_steps


@dataclass
class Applying:
    """`applying`: each instruction of a step runs at its planned clock (`frequencies_mhz[i]` for the
    `i`-th, of kind `kinds[i]`: the kind, with its virtual stage where recorded).

    Next: `fallback` when a step's instructions differ from the plan or a clock change fails.
    """

    name: ClassVar[str] = "applying"
    kinds: list[str | tuple[str, int]]
    frequencies_mhz: list[int]
    max_clock_mhz: int | None = None  # while set, every instruction runs at it (`hold_max_clocks`)

    def clock(self, index: int) -> int:
        """The clock of the `index`-th instruction of a step."""
        return self.max_clock_mhz if self.max_clock_mhz is not None else self.frequencies_mhz[index]

    def off_plan(self, index: int, key: str | tuple[str, int]) -> str | None:
        """Why the `index`-th instruction of a step, of kind `key`, is not the plan's (None: it is)."""
        if index < len(self.kinds) and self.kinds[index] == key:
            return None
        expected = f"a {_said(self.kinds[index])}" if index < len(self.kinds) else f"only {len(self.kinds)}"
        return f"instruction {index} of the step is a {_said(key)}, but the plan expects {expected}"


@dataclass
class Fallback:
    """`fallback`: this stage runs at its maximum clock until training ends; `reason` says why. Final."""

    name: ClassVar[str] = "fallback"
    reason: str


@dataclass
class Inactive:
    """`inactive`: the GPU's clocks are as they were found; time and energy are still measured. Final."""

    name: ClassVar[str] = "inactive"
    reason: str


Phase = Waiting | Profiling | Applying | Fallback | Inactive


def _said(key: str | tuple[str, int]) -> str:
    """An instruction's kind in words, with its virtual stage when there is one."""
    return f"{key[0]} of virtual stage {key[1]}" if isinstance(key, tuple) else key
