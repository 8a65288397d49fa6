"""Objectives that pick the best operating point from time and energy measurements."""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "PowerLimitMeasurement",
    "OptimumSelector",
    "Time",
    "Energy",
    "ZeusCost",
    "MaxSlowdownConstraint",
    "MaxPowerConstraint",
    "select_power_limit",
]


@dataclass(frozen=True)
class PowerLimitMeasurement:
    """Time and energy measured at one power limit (summed over every GPU of the job)."""

    power_limit: float  # W, as in Zeus (whole watts there; a fractional grid here: 137.5)
    energy: float  # J
    time: float  # s


class OptimumSelector:
    """Base class of the objectives: lower `score` is better.

    Subclasses implement `score`, vectorised over candidates and non-decreasing in time and in energy,
    so that the same objective serves the power-limit optimizer (a handful of measurements, with early
    pruning) and the planners (millions of candidates). A Zeus-style subclass that overrides only
    `select(measurements)` still works with the power-limit optimizer, which then measures every power
    limit for `profile_steps` steps (as Zeus) and calls `select(measurements)` with Zeus's one argument.
    """

    def score(
        self,
        time_s: np.ndarray,
        energy_j: np.ndarray,
        max_power_w: float,
        reference_time_s: float,
    ) -> np.ndarray:
        """Cost of each candidate; `np.inf` marks an infeasible one.

        Args:
            time_s: Time of each candidate.
            energy_j: Energy of each candidate (all GPUs of the job).
            max_power_w: The job's maximum power: the sum of every GPU's maximum power limit.
            reference_time_s: Time of the reference operating point (every GPU at its maximum power limit).
        """
        raise NotImplementedError(f"{type(self).__name__} implements only `select`.")

    def has_score(self) -> bool:
        """Whether this selector implements the vectorised `score` (else only `select`)."""
        return type(self).score is not OptimumSelector.score

    def select(
        self, measurements: Sequence[PowerLimitMeasurement], max_power_w: float | None = None
    ) -> float:
        """The power limit (W) of the best measurement.

        `max_power_w` is the job's maximum power (sum over GPUs); it defaults to the largest measured
        power limit, which is right for one GPU only.
        """
        if not measurements:
            raise ValueError(f"`{type(self).__name__}.select` needs at least one measurement; got none.")
        top = max(measurements, key=lambda m: m.power_limit)
        time_s = np.array([m.time for m in measurements], dtype=float)
        energy_j = np.array([m.energy for m in measurements], dtype=float)
        scores = self.score(time_s, energy_j, float(max_power_w or top.power_limit), top.time)
        if not np.isfinite(scores).any():
            return top.power_limit
        best = float(np.min(scores))
        # Ties (flat curves) go to the higher power limit: the same cost for less risk of slowdown.
        tied = [m for m, s in zip(measurements, scores, strict=True) if s <= best]
        return max(m.power_limit for m in tied)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class Time(OptimumSelector):
    """The fastest operating point."""

    def score(  # noqa: D102
        self, time_s: np.ndarray, energy_j: np.ndarray, max_power_w: float, reference_time_s: float
    ) -> np.ndarray:
        return np.asarray(time_s, dtype=float)


class Energy(OptimumSelector):
    """The operating point that uses the least energy."""

    def score(  # noqa: D102
        self, time_s: np.ndarray, energy_j: np.ndarray, max_power_w: float, reference_time_s: float
    ) -> np.ndarray:
        return np.asarray(energy_j, dtype=float)


# A slowdown bound at which a factor is more likely a percentage (10 for 10%) than meant (twice as slow).
_UNLIKELY_SLOWDOWN = 2.0


def _require_number(owner: str, name: str, value: object, example: str) -> None:
    """A TypeError naming the call and the type when `value` is not a real number (a string, None, a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{owner}({name}={value!r})`: {name} must be a number, {example}, not {type(value).__name__}."
        )
    if not math.isfinite(value):
        raise ValueError(f"`{owner}({name}={value!r})`: {name} must be a finite number, {example}.")


class ZeusCost(OptimumSelector):
    """Zeus's time-energy cost: `eta * energy + (1 - eta) * max_power * time`.

    Args:
        eta_knob: Weight of energy against time, in [0, 1].
        world_size: Kept for Zeus compatibility. The optimizer passes the job's summed maximum power,
            so the value is only used by `select` calls that do not.

    Raises:
        TypeError: `eta_knob` is not a number (e.g. the string '0.5'), or `world_size` not a whole number.
        ValueError: `eta_knob` outside [0, 1] or `world_size` < 1.
    """

    eta_knob: float
    world_size: int

    def __init__(self, eta_knob: float, world_size: int = 1) -> None:
        _require_number("ZeusCost", "eta_knob", eta_knob, "a weight in [0, 1] such as 0.5")
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
            raise TypeError(
                f"`ZeusCost(world_size={world_size!r})`: world_size must be a whole number of GPUs, "
                f"not {type(world_size).__name__}."
            )
        if not 0.0 <= eta_knob <= 1.0:
            meant = f"; for {eta_knob:g}% pass {eta_knob / 100:g}" if 1 < eta_knob <= 100 else ""
            raise ValueError(f"`ZeusCost(eta_knob={eta_knob!r})`: eta_knob must be in [0, 1]{meant}.")
        if world_size < 1:
            raise ValueError(f"`ZeusCost(world_size={world_size!r})`: world_size must be at least 1.")
        self.eta_knob = float(eta_knob)
        self.world_size = int(world_size)

    def score(  # noqa: D102
        self, time_s: np.ndarray, energy_j: np.ndarray, max_power_w: float, reference_time_s: float
    ) -> np.ndarray:
        return self.eta_knob * np.asarray(energy_j, dtype=float) + (
            1.0 - self.eta_knob
        ) * max_power_w * np.asarray(time_s, dtype=float)

    def select(
        self, measurements: Sequence[PowerLimitMeasurement], max_power_w: float | None = None
    ) -> float:  # noqa: D102
        if max_power_w is None and measurements:
            max_power_w = max(m.power_limit for m in measurements) * self.world_size
        return super().select(measurements, max_power_w)


class MaxSlowdownConstraint(OptimumSelector):
    """The least energy among operating points at most `factor` times slower than the reference.

    Zeus picks the *lowest power limit* among the allowed ones instead; where the energy curve turns up
    again at low limits (the GPU runs so long that idle power dominates) that costs energy for nothing,
    so the least energy is the default here. `prefer="lowest_power_limit"` gives Zeus's choice (the
    optimizer then measures every limit fully, as Zeus, since that rule has no cost to prune with).

    Args:
        factor: The largest allowed slowdown against every GPU at its maximum power limit, >= 1.
        prefer: "least_energy" (default) or "lowest_power_limit" (Zeus's rule).

    Raises:
        TypeError: `factor` is not a number (e.g. the string '1.1').
        ValueError: `factor` < 1, or an unknown `prefer`.

    Warns:
        UserWarning: `factor` of 2 or more (twice as slow), e.g. 10 where 1.10 (10% slower) was meant.
    """

    PREFERENCES = ("least_energy", "lowest_power_limit")
    factor: float
    prefer: str

    def __init__(self, factor: float, prefer: str = "least_energy") -> None:
        _require_number(
            "MaxSlowdownConstraint", "factor", factor, "a slowdown factor such as 1.1 (10% slower)"
        )
        if not factor >= 1.0:
            meant = f"; for {factor:g} as a fraction slower, pass {1 + factor:g}" if 0 < factor < 1 else ""
            raise ValueError(
                f"`MaxSlowdownConstraint(factor={factor!r})`: factor must be >= 1.0 (1.1 = 10% slower){meant}."
            )
        if factor >= _UNLIKELY_SLOWDOWN:
            warnings.warn(
                f"`MaxSlowdownConstraint(factor={factor!r})` lets each step take up to {factor:g}x as long as at "
                f"the maximum power limit ({100 * (factor - 1):.0f}% slower). Did you mean "
                f"{1 + factor / 100:.2f} ({factor:g}% slower)? The factor is 1 + the slowdown as a fraction.",
                UserWarning,
                stacklevel=2,
            )
        if prefer not in self.PREFERENCES:
            raise ValueError(
                f"`MaxSlowdownConstraint(prefer={prefer!r})`: must be one of {self.PREFERENCES}."
            )
        self.factor = float(factor)
        self.prefer = prefer

    def has_score(self) -> bool:  # noqa: D102
        return self.prefer == "least_energy"

    def score(  # noqa: D102
        self, time_s: np.ndarray, energy_j: np.ndarray, max_power_w: float, reference_time_s: float
    ) -> np.ndarray:
        if self.prefer != "least_energy":
            raise NotImplementedError(
                "`MaxSlowdownConstraint(prefer='lowest_power_limit')` ranks power limits, not costs; it has "
                "no `score` (use `select`)."
            )
        time_s = np.asarray(time_s, dtype=float)
        return np.where(time_s <= self.factor * reference_time_s, np.asarray(energy_j, dtype=float), np.inf)

    def select(
        self, measurements: Sequence[PowerLimitMeasurement], max_power_w: float | None = None
    ) -> float:  # noqa: D102
        if self.prefer == "least_energy" or not measurements:
            return super().select(measurements, max_power_w)
        top = max(measurements, key=lambda m: m.power_limit)
        return min(m.power_limit for m in measurements if m.time <= self.factor * top.time)

    def __repr__(self) -> str:
        extra = "" if self.prefer == "least_energy" else f", prefer={self.prefer!r}"
        return f"MaxSlowdownConstraint(factor={self.factor!r}{extra})"


class MaxPowerConstraint(OptimumSelector):
    """The fastest operating point whose measured average power keeps the job within a power budget.

    The budget is `watts` per GPU (`per="gpu"`, default) or for the whole job (`per="job"`: shared evenly
    by its GPUs). It also caps the power limits the optimizer profiles (no GPU is set above its share,
    profiling included), as `ZEUS_CALLBACKS_POWER_BUDGET_W` (W per GPU) does for every job of a site.
    Ties go to the higher power limit, as for every selector.

    Args:
        watts: The budget (W), > 0.
        per: "gpu" or "job".

    Raises:
        ValueError: `watts` is not a positive number, or an unknown `per`.
    """

    SCOPES = ("gpu", "job")

    def __init__(self, watts: float, per: str = "gpu") -> None:
        if isinstance(watts, bool) or not isinstance(watts, (int, float)) or not 0 < watts < float("inf"):
            raise ValueError(
                f"`MaxPowerConstraint(watts={watts!r})`: expected a power budget in watts > 0, e.g. 250."
            )
        if per not in self.SCOPES:
            raise ValueError(f"`MaxPowerConstraint(per={per!r})`: must be one of {self.SCOPES}.")
        self.watts = float(watts)
        self.per = per
        self._job_watts: float | None = None  # set on the copy `for_job` returns

    def per_gpu_w(self, num_gpus: int) -> float:
        """Each GPU's share of the budget (W)."""
        return self.watts / num_gpus if self.per == "job" else self.watts

    def for_job(self, num_gpus: int) -> MaxPowerConstraint:
        """A copy that knows the job's budget (its `num_gpus` GPUs'), for `score`."""
        bound = MaxPowerConstraint(self.watts, self.per)
        bound._job_watts = self.per_gpu_w(num_gpus) * num_gpus
        return bound

    def score(  # noqa: D102
        self, time_s: np.ndarray, energy_j: np.ndarray, max_power_w: float, reference_time_s: float
    ) -> np.ndarray:
        time_s, energy_j = np.asarray(time_s, dtype=float), np.asarray(energy_j, dtype=float)
        budget = self._job_watts if self._job_watts is not None else max_power_w
        with np.errstate(divide="ignore", invalid="ignore"):
            power = np.where(time_s > 0, energy_j / time_s, np.inf)
        return np.where(power <= budget, time_s, np.inf)

    def __repr__(self) -> str:
        extra = "" if self.per == "gpu" else f", per={self.per!r}"
        return f"MaxPowerConstraint(watts={self.watts!r}{extra})"


def _takes_max_power(select) -> bool:
    """Whether a `select` method accepts a second argument (ours) or only the measurements (Zeus's)."""
    try:
        params = list(inspect.signature(select).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2


def select_power_limit(
    selector: OptimumSelector, measurements: Sequence[PowerLimitMeasurement], max_power_w: float
) -> int:
    """`selector.select(measurements, max_power_w)`, or `select(measurements)` for a Zeus-style selector
    whose `select` takes only the measurements."""
    if _takes_max_power(selector.select):
        return int(selector.select(measurements, max_power_w))
    return int(selector.select(list(measurements)))
