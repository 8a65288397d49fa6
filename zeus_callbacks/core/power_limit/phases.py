"""The power-limit optimizer's phases: one object per phase, whose `name` is what
`GlobalPowerLimitOptimizer.phase` reports; each says what moves it on. Under torch.distributed every rank
is in the same phase at the same step. (Zeus's public state classes are in `states`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zeus_callbacks.core.power_limit.estimates import PowerLimitStats

__all__ = ["Waiting", "Warmup", "Profiling", "OpenChunk", "Done", "Inactive", "Phase"]


@dataclass
class Waiting:
    """`waiting`: `wait_steps` steps pass at the GPU's own power limit (again when a later run starts after
    `on_train_end` interrupted profiling; none after an epoch's end interrupted it with `search="zeus"`).

    Next: `warmup` (or `profiling` when `warmup_steps` is 0) at the next limit to profile, at the end of the
    last waiting step (at the next step's beginning when none is left); `done` when a complete profile
    (from `profile_path` or a checkpoint) leaves nothing to profile; `inactive` when the job may not change
    power limits or a GPU fails.
    """

    name: ClassVar[str] = "waiting"
    steps_left: int


@dataclass
class Warmup:
    """`warmup`: `steps_left` more steps at `power_limit_w` before it is measured (they count as profiling
    cost, not as samples).

    Next: `profiling` at the same limit after the last of them; `inactive` when a GPU fails; `waiting`
    when an epoch ends first with `search="zeus"`.
    """

    name: ClassVar[str] = "warmup"
    power_limit_w: float
    steps_left: int
    stats: PowerLimitStats  # what the measurement adds to: empty, or the samples of earlier visits
    settling: bool = False  # a later visit's settling steps: their times help see a burst begin


@dataclass
class OpenChunk:
    """The chunk being measured: its steps so far, their time (each step's maxed over ranks), this rank's
    energy, and this rank's own time."""

    steps: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    own_s: float = 0.0


@dataclass
class Profiling:
    """`profiling`: each step at `power_limit_w` is measured (energy summed, time maxed over ranks) until
    the search has seen enough of this limit.

    Next: `warmup`/`profiling` at the next limit the search picks (a new one, or a near-tie revisited);
    `done` when the search is over and the chosen limit is applied; `inactive` when a GPU fails, no limit
    could be measured, or the choice may not be applied; `waiting` when an epoch ends first with
    `search="zeus"` (this visit's samples are dropped and the limit is profiled again).
    """

    name: ClassVar[str] = "profiling"
    power_limit_w: float
    stats: PowerLimitStats
    samples_done: int = 0  # chunks closed, valid or not
    chunk: OpenChunk = field(default_factory=lambda: OpenChunk())  # the chunk being measured
    # `search="zeus"`: the limit's last step, measured, is counted at the next step's beginning, as Zeus
    # closes its window there (an epoch's end before that interrupts the limit). A 1-tuple once held.
    held: tuple[Any] | None = None


@dataclass
class Done:
    """`done`: the chosen `power_limit_w` is in force for the rest of training (applied again when the
    optimizer drives a later run). Final."""

    name: ClassVar[str] = "done"
    power_limit_w: float


@dataclass
class Inactive:
    """`inactive`: the GPUs are left as they were found; energy is still measured; `reason` says why.
    Final."""

    name: ClassVar[str] = "inactive"
    reason: str
    power_limit_w: float | None = None  # the choice it would apply, when a complete profile gave one


Phase = Waiting | Warmup | Profiling | Done | Inactive
