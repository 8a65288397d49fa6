"""Zeus's public state classes of the power-limit optimizer (`GlobalPowerLimitOptimizer.state`).

Power limits here are in milliwatts, as Zeus reports them (`Done.optimal_power_limit`); the optimizer's
own figures (`optimal_power_limit_w`, `metrics()`) are in watts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Ready", "Warmup", "Profiling", "Done", "Inactive", "PowerLimitState"]


@dataclass(frozen=True)
class Ready:
    """Waiting before profiling: `steps` more steps at the GPU's own limit, then the warm-up at
    `next_power_limit` (mW; None until the optimizer knows its GPUs' range)."""

    next_power_limit: int | None
    steps: int


@dataclass(frozen=True)
class Warmup:
    """Warming up at `current_power_limit` (mW) for `steps` more steps before it is measured."""

    current_power_limit: int
    steps: int


@dataclass(frozen=True)
class Profiling:
    """Measuring `current_power_limit` (mW) for at most `steps` more steps (the adaptive search may stop
    sooner)."""

    current_power_limit: int
    steps: int


@dataclass(frozen=True)
class Done:
    """Profiling is over; `optimal_power_limit` (mW) is in force."""

    optimal_power_limit: int


@dataclass(frozen=True)
class Inactive:
    """Not in Zeus: the GPUs are left as they were found (no permission, a GPU failed, nothing could be
    measured); `reason` says why, `optimal_power_limit` (mW) is the choice it would apply, if any."""

    reason: str
    optimal_power_limit: int | None = None


PowerLimitState = Ready | Warmup | Profiling | Done | Inactive
