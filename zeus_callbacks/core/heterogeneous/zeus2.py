"""The original Zeus² planner for one GPU of each of two types: its quadratic fits, cost and search."""

from __future__ import annotations

import numpy as np

from zeus_callbacks.core.heterogeneous.plan_records import CostCurve, HeteroPlan, TypePlan
from zeus_callbacks.core.heterogeneous.profile_file import GPUProfile

__all__ = ["ZEUS2_METHODS", "outside_measured_range", "zeus2_cost_curve", "zeus2_search"]

ZEUS2_METHODS = ("naive", "heuristic", "baseline")


def outside_measured_range(profile: GPUProfile, batch: np.ndarray) -> np.ndarray:
    """Whether each local batch in `batch` lies outside `profile`'s measured batch sizes."""
    lo, hi = profile.measured_range
    return (batch < lo) | (batch > hi)


def _fit(profile: GPUProfile, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Zeus²'s quadratic fits over batch size, per power limit: window time and average power, clipped at 0."""
    window_time = profile.time_s * profile.steps_per_window
    power = profile.average_power_w
    x = profile.batch_sizes.astype(float)
    # One least-squares fit per power limit (the rows), all at once; then the polynomials at every batch size.
    coeffs = np.polyfit(x, np.vstack([window_time, power]).T, 2)
    values = (np.vander(np.asarray(batch, dtype=float), 3) @ coeffs).T
    time_s, power_w = values[: len(window_time)], values[len(window_time) :]
    return np.maximum(time_s, 0.0), np.maximum(power_w, 0.0)


def _costs(
    profile_a: GPUProfile, profile_b: GPUProfile, b_a: np.ndarray, b_b: np.ndarray, eta: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zeus² cost, step time and energy per step for every (limit a, limit b, split): shape (La, Lb, N)."""
    time_a, power_a = _fit(profile_a, b_a)
    time_b, power_b = _fit(profile_b, b_b)
    limits_a = profile_a.power_limits_w[:, None].astype(float)
    limits_b = profile_b.power_limits_w[:, None].astype(float)
    cost_a = (eta * power_a + (1 - eta) * limits_a) * time_a
    cost_b = (eta * power_b + (1 - eta) * limits_b) * time_b
    cost = cost_a[:, None, :] + cost_b[None, :, :]
    step = np.maximum(
        time_a[:, None, :] / profile_a.steps_per_window, time_b[None, :, :] / profile_b.steps_per_window
    )
    energy = (power_a * time_a / profile_a.steps_per_window)[:, None, :] + (
        power_b * time_b / profile_b.steps_per_window
    )[None, :, :]
    return cost, step, energy


def zeus2_cost_curve(
    profile_a: GPUProfile, profile_b: GPUProfile, global_batch: int, eta: float
) -> CostCurve:
    """Zeus²'s best cost over power limits of every split `1 <= b_a < global_batch` (for plotting)."""
    b_a = np.arange(1, global_batch)
    cost, step, energy = _costs(profile_a, profile_b, b_a, global_batch - b_a, eta)
    flat = cost.reshape(-1, len(b_a))
    pick = np.argmin(flat, axis=0)
    cols = np.arange(len(b_a))
    outside = outside_measured_range(profile_a, b_a) | outside_measured_range(profile_b, global_batch - b_a)
    return CostCurve(
        b_a,
        global_batch - b_a,
        flat[pick, cols],
        step.reshape(-1, len(b_a))[pick, cols],
        energy.reshape(-1, len(b_a))[pick, cols],
        outside,
    )


def zeus2_search(
    profile_a: GPUProfile,
    profile_b: GPUProfile,
    global_batch: int = 4096,
    method: str = "naive",
    eta: float = 0.5,
) -> HeteroPlan:
    """The original Zeus² planner for one GPU of each of two types, vectorised.

    Per GPU and power limit `PL`, window time `T(b)` and average power `P(b) = energy / time` are fitted as
    quadratics in the local batch size `b` (least squares over the measured sizes, negative values clipped
    to 0); the split `b_a + b_b = global_batch`, `1 <= b_a < global_batch`, minimises
    `sum_i (eta * P_i(b_i) + (1 - eta) * PL_i) * T_i(b_i)`. `"naive"` tries every pair of power limits,
    `"heuristic"` pins the stronger GPU (faster at its top limit on the largest measured batch) to its lowest
    limit, `"baseline"` fixes the even split. The fits are extrapolated silently and step time is not the
    slower GPU's: this is the model that `plan(cost_model="sync")` corrects.

    Raises:
        ValueError: Unknown method or a global batch below 2.
    """
    if method not in ZEUS2_METHODS:
        raise ValueError(f"`zeus2_search(method={method!r})`: method must be one of {ZEUS2_METHODS}.")
    if global_batch < 2:
        raise ValueError(f"`zeus2_search(global_batch={global_batch!r})`: need at least 2 samples.")
    b_a = np.array([global_batch // 2]) if method == "baseline" else np.arange(1, global_batch)
    b_b = global_batch - b_a
    cost, step, energy = _costs(profile_a, profile_b, b_a, b_b, eta)
    if method == "heuristic":
        top = min(profile_a.batch_sizes[-1], profile_b.batch_sizes[-1])
        time_a = profile_a.interpolate(top)[0][-1, 0]
        time_b = profile_b.interpolate(top)[0][-1, 0]
        pinned = np.full(cost.shape, np.inf)
        if time_a <= time_b:
            pinned[0] = cost[0]
        else:
            pinned[:, 0] = cost[:, 0]
        cost = pinned
    ia, ib, n = np.unravel_index(int(np.argmin(cost)), cost.shape)
    per_type = []
    for profile, b, i in ((profile_a, b_a[n], ia), (profile_b, b_b[n], ib)):
        time_s, power_w = _fit(profile, np.array([b]))
        lo, hi = profile.measured_range
        per_type.append(
            TypePlan(
                gpu_name=profile.gpu_name,
                count=1,
                local_batch=int(b),
                power_limit_w=int(profile.power_limits_w[i]),
                compute_time_s=float(time_s[i, 0]) / profile.steps_per_window,
                energy_j=float(power_w[i, 0] * time_s[i, 0]) / profile.steps_per_window,
                extrapolated=not lo <= b <= hi,
            )
        )
    even = np.array([global_batch / 2])
    ref_cost, ref_step, ref_energy = (x[-1, -1, 0] for x in _costs(profile_a, profile_b, even, even, eta))
    return HeteroPlan(
        cost_model="zeus2",
        objective=f"Zeus2Cost(eta={eta!r}, method={method!r})",
        global_batch=int(global_batch),
        types=tuple(per_type),
        step_time_s=float(step[ia, ib, n]),
        energy_j=float(energy[ia, ib, n]),
        cost=float(cost[ia, ib, n]),
        max_power_w=float(profile_a.max_power_limit_w + profile_b.max_power_limit_w),
        reference_local_batch=float(even[0]),
        reference_step_time_s=float(ref_step),
        reference_energy_j=float(ref_energy),
        reference_cost=float(ref_cost),
        reference_extrapolated=any(outside_measured_range(p, even)[0] for p in (profile_a, profile_b)),
    )
