"""The records a heterogeneous plan is made of: each GPU type's share, the plan, and a two-type cost curve."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["CostCurve", "HeteroPlan", "TypePlan"]


@dataclass(frozen=True)
class TypePlan:
    """What one GPU type does in a plan. Times and energies are per training step."""

    gpu_name: str
    count: int
    local_batch: int  # samples per GPU of this type
    power_limit_w: int
    compute_time_s: float  # this type's own compute time; the step lasts the slowest type's
    energy_j: float  # all GPUs of this type, idle wait at the all-reduce included
    extrapolated: bool  # the local batch lies outside the measured range


@dataclass(frozen=True)
class HeteroPlan:
    """A heterogeneous plan and the reference it is compared with: the even split at maximum power limits.

    `cost` is the objective's score in the units of the cost model; for `"zeus2"` it is the original's cost
    per profiled window (10 steps), for `"sync"` per step.
    """

    cost_model: str
    objective: str
    global_batch: int
    types: tuple[TypePlan, ...]
    step_time_s: float
    energy_j: float
    cost: float
    max_power_w: float
    reference_local_batch: float
    reference_step_time_s: float
    reference_energy_j: float
    reference_cost: float
    reference_extrapolated: bool

    @property
    def extrapolated(self) -> bool:
        """Whether any local batch of the plan lies outside its type's measured range."""
        return any(t.extrapolated for t in self.types)

    @property
    def energy_saving(self) -> float:
        """Fraction of the reference's energy saved."""
        return 1.0 - self.energy_j / self.reference_energy_j

    @property
    def slowdown(self) -> float:
        """Step time relative to the reference (1.05 = 5% slower)."""
        return self.step_time_s / self.reference_step_time_s

    @property
    def cost_saving(self) -> float:
        """Fraction of the reference's cost saved."""
        return 1.0 - self.cost / self.reference_cost

    def to_dict(self) -> dict:
        """Plain numbers and strings, for JSON."""
        out = asdict(self)
        out["types"] = [asdict(t) for t in self.types]
        out.update(
            extrapolated=self.extrapolated,
            energy_saving=self.energy_saving,
            slowdown=self.slowdown,
            cost_saving=self.cost_saving,
        )
        return out


@dataclass(frozen=True)
class CostCurve:
    """Best cost (over power limits) of every split of the global batch between two GPU types."""

    local_batch_a: np.ndarray  # per GPU of the first type
    local_batch_b: np.ndarray
    cost: np.ndarray
    step_time_s: np.ndarray
    energy_j: np.ndarray
    extrapolated: np.ndarray  # bool per split
