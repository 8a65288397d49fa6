"""Heterogeneous-GPU planner: split a global batch over GPU types and pick each type's power limit."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zeus_callbacks.core.heterogeneous.plan_records import CostCurve, HeteroPlan, TypePlan
from zeus_callbacks.core.heterogeneous.profile_file import (
    ExtrapolationError,
    GPUProfile,
    load_profile,
)
from zeus_callbacks.core.heterogeneous.zeus2 import (
    ZEUS2_METHODS,  # noqa: F401  (re-exported: the Zeus² methods, beside COST_MODELS)
    outside_measured_range,
    zeus2_cost_curve,
    zeus2_search,
)
from zeus_callbacks.core.power_limit.selectors import OptimumSelector, ZeusCost

__all__ = [
    "CostCurve",
    "ExtrapolationError",
    "GPUProfile",
    "HeteroPlan",
    "TypePlan",
    "cost_curve",
    "load_profile",
    "plan",
    "zeus2_search",
]

logger = logging.getLogger(__name__)

COST_MODELS = ("sync", "zeus2")
# Below this many (split, power-limit) candidates the search is exhaustive; above it, coarse-to-fine.
_EXHAUSTIVE_BUDGET = 4_000_000
# Candidates of the coarse grid that starts the coarse-to-fine search.
_COARSE_BUDGET = 1_000_000
# Candidates evaluated per vectorised chunk, and splits kept between refinement levels.
_CHUNK = 2_000_000
_TOP_K = 16


@dataclass(frozen=True)
class _Type:
    """A GPU type prepared for the search: its profile, GPU count and allowed local batch range."""

    profile: GPUProfile
    count: int
    lo: int
    hi: int

    def tables(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Compute time, active energy above idle of all its GPUs, and extrapolation: shapes (N, L), (N, L), (N,)."""
        time_s, power_w, extrapolated = self.profile.interpolate(batch)
        active_j = (power_w - self.profile.idle_power_w) * time_s * self.count
        return time_s.T, active_j.T, extrapolated


def plan(
    profiles: Sequence[GPUProfile],
    counts: Sequence[int],
    global_batch: int,
    objective: OptimumSelector,
    cost_model: str = "sync",
    allow_extrapolation: bool = False,
    batch_granularity: int = 1,
    max_batch_size: Sequence[int | None] | None = None,
    zeus2_method: str = "naive",
) -> HeteroPlan:
    """The best split of `global_batch` over GPU types and the best power limit of each type.

    Cost model `"sync"` (default): a synchronous data-parallel step lasts as long as the slowest GPU,
    `T = max_i T_i(b_i)`, and energy per step is `sum_i count_i * (P_i T_i + idle_i (T - T_i))`; time and
    power are interpolated piecewise linearly between measured batch sizes. Every GPU of one type gets the
    same local batch `b_i`, a multiple of `batch_granularity`, with `sum_i count_i * b_i == global_batch`.
    The objective's `score(T, E, max_power, reference_time)` is minimised, where `max_power` is the sum of
    every GPU's maximum power limit and the reference is the even split at maximum power limits; the
    objective must not decrease when time or energy grows (true of `Time`, `Energy`, `ZeusCost`,
    `MaxSlowdownConstraint`). Cost model `"zeus2"` reproduces the original Zeus² planner (see `zeus2_search`).

    Args:
        profiles: One profile per GPU type.
        counts: GPUs of each type.
        global_batch: Samples per step over all GPUs.
        objective: What to minimise.
        cost_model: `"sync"` or `"zeus2"`.
        allow_extrapolation: Allow local batches outside the measured ranges (flagged in the plan).
        batch_granularity: Local batch sizes are multiples of this.
        max_batch_size: Memory limit per type, overriding the profile's `max_batch_size`.
        zeus2_method: Search of the `"zeus2"` model: `"naive"`, `"heuristic"` or `"baseline"`.

    Raises:
        ExtrapolationError: No split fits the measured ranges (the message lists them).
        ValueError: Inconsistent arguments, or no split meets the objective's constraint.
    """
    call = f"`plan(global_batch={global_batch!r}, cost_model={cost_model!r})`"
    if cost_model not in COST_MODELS:
        raise ValueError(f"{call}: cost_model must be one of {COST_MODELS}.")
    if not profiles or len(profiles) != len(counts):
        raise ValueError(
            f"{call}: need one count per profile; got {len(profiles)} profiles, {len(counts)} counts."
        )
    if any(c < 1 for c in counts) or batch_granularity < 1 or global_batch < 1:
        raise ValueError(f"{call}: counts, batch_granularity and global_batch must be >= 1.")
    if cost_model == "zeus2":
        if len(profiles) != 2 or list(counts) != [1, 1]:
            raise ValueError(f"{call}: the Zeus² model plans one GPU of each of two types.")
        if not isinstance(objective, ZeusCost):
            raise ValueError(
                f"{call}: the Zeus² model has its own cost; pass a ZeusCost (eta 0.5 is the original)."
            )
        return zeus2_search(profiles[0], profiles[1], global_batch, zeus2_method, eta=objective.eta_knob)
    types = _prepare(profiles, counts, global_batch, allow_extrapolation, batch_granularity, max_batch_size)
    max_power_w = float(sum(t.count * t.profile.max_power_limit_w for t in types))
    ref_batch, ref_time, ref_energy, ref_extrapolated = _reference(types, global_batch)
    if ref_extrapolated:
        logger.warning(
            "The even split (%.1f per GPU) lies outside a measured range; reference extrapolated.", ref_batch
        )
    batch, limits = _search(types, global_batch, batch_granularity, objective, max_power_w, ref_time)
    if batch is None:
        raise ValueError(f"{call}: no split meets the objective {objective!r}.")
    step_time, energy, per_type = _evaluate_plan(types, batch, limits)
    score = objective.score(np.array([step_time]), np.array([energy]), max_power_w, ref_time)
    ref_score = objective.score(np.array([ref_time]), np.array([ref_energy]), max_power_w, ref_time)
    return HeteroPlan(
        cost_model="sync",
        objective=repr(objective),
        global_batch=global_batch,
        types=per_type,
        step_time_s=step_time,
        energy_j=energy,
        cost=float(score[0]),
        max_power_w=max_power_w,
        reference_local_batch=ref_batch,
        reference_step_time_s=ref_time,
        reference_energy_j=ref_energy,
        reference_cost=float(ref_score[0]),
        reference_extrapolated=ref_extrapolated,
    )


def _prepare(profiles, counts, global_batch, allow_extrapolation, granularity, max_batch_size) -> list[_Type]:
    """Allowed local batch ranges (multiples of the granularity), or an error that says why none fits."""
    caps = list(max_batch_size) if max_batch_size is not None else [None] * len(profiles)
    if len(caps) != len(profiles):
        raise ValueError(f"`plan`: need one max_batch_size per profile; got {len(caps)} for {len(profiles)}.")
    if global_batch % granularity or global_batch // granularity % math.gcd(*counts):
        raise ValueError(
            f"`plan`: global batch {global_batch} cannot be split into local batches that are multiples of "
            f"{granularity} over counts {list(counts)}."
        )
    bounds = []
    for profile, cap in zip(profiles, caps, strict=True):
        lo, hi = profile.batch_range(allow_extrapolation)
        if cap is not None:
            hi = cap if hi is None else min(hi, cap)
        bounds.append((lo, hi if hi is not None else global_batch))
    # Tighten each range by what the other types can take at least and at most.
    total_lo = sum(c * lo for c, (lo, _) in zip(counts, bounds, strict=True))
    total_hi = sum(c * hi for c, (_, hi) in zip(counts, bounds, strict=True))
    types = []
    for profile, count, (lo, hi) in zip(profiles, counts, bounds, strict=True):
        lo = max(lo, -(-(global_batch - (total_hi - count * hi)) // count))
        hi = min(hi, (global_batch - (total_lo - count * lo)) // count)
        lo, hi = -(-lo // granularity) * granularity, hi // granularity * granularity
        types.append(_Type(profile, int(count), int(lo), int(hi)))
    if total_lo > global_batch or total_hi < global_batch or any(t.lo > t.hi for t in types):
        ranges = ", ".join(
            f"{c} x {p.gpu_name}: local batch {lo}..{hi}"
            for p, c, (lo, hi) in zip(profiles, counts, bounds, strict=True)
        )
        hint = (
            "" if allow_extrapolation else " Pass allow_extrapolation=True to go beyond the measured ranges."
        )
        raise ExtrapolationError(
            f"`plan`: global batch {global_batch} cannot be split within the allowed local batch sizes "
            f"({ranges}; global {total_lo}..{total_hi}, multiples of {granularity}).{hint}"
        )
    return types


def _reference(types: list[_Type], global_batch: int) -> tuple[float, float, float, bool]:
    """The even split at every GPU's maximum power limit: local batch, step time, energy, extrapolated."""
    batch = global_batch / sum(t.count for t in types)
    times, actives, extrapolated = [], [], False
    for t in types:
        time_s, active_j, ext = t.tables(np.array([batch]))
        times.append(time_s[0, -1])
        actives.append(active_j[0, -1])
        capped = t.profile.max_batch_size is not None and batch > t.profile.max_batch_size
        extrapolated |= bool(ext[0]) or capped
    step = float(max(times))
    idle = sum(t.count * float(t.profile.idle_power_w or 0.0) for t in types)  # never None once built
    return batch, step, float(sum(actives) + step * idle), extrapolated


def _evaluate_plan(types, batch, limits) -> tuple[float, float, tuple[TypePlan, ...]]:
    step = 0.0
    rows = []
    for t, b, li in zip(types, batch, limits, strict=True):
        time_s, active_j, ext = t.tables(np.array([float(b)]))
        rows.append((float(time_s[0, li]), float(active_j[0, li]), bool(ext[0])))
        step = max(step, rows[-1][0])
    per_type = tuple(
        TypePlan(
            gpu_name=t.profile.gpu_name,
            count=t.count,
            local_batch=int(b),
            power_limit_w=int(t.profile.power_limits_w[li]),
            compute_time_s=time_s,
            energy_j=active_j + t.count * t.profile.idle_power_w * step,
            extrapolated=ext,
        )
        for t, b, li, (time_s, active_j, ext) in zip(types, batch, limits, rows, strict=True)
    )
    return step, float(sum(p.energy_j for p in per_type)), per_type


def _score_splits(types, batch, objective, max_power_w, ref_time):
    """Score every power-limit combination of each split; `batch` is (N, K). Returns score, energy, time (N, L...)."""
    k = len(types)
    step = active = None
    for i, t in enumerate(types):
        time_s, active_j, _ = t.tables(batch[:, i])
        shape = (len(batch),) + (1,) * i + (time_s.shape[1],) + (1,) * (k - 1 - i)
        step = time_s.reshape(shape) if step is None else np.maximum(step, time_s.reshape(shape))
        active = active_j.reshape(shape) if active is None else active + active_j.reshape(shape)
    energy = active + step * sum(t.count * t.profile.idle_power_w for t in types)
    step = np.broadcast_to(step, energy.shape)
    score = objective.score(step.ravel(), energy.ravel(), max_power_w, ref_time).reshape(energy.shape)
    n = len(batch)
    return score.reshape(n, -1), energy.reshape(n, -1), step.reshape(n, -1)


def _best(score, energy, step) -> int | None:
    """Flat index of the lowest score; ties go to lower energy, then lower time."""
    low = float(np.min(score)) if score.size else math.inf
    if not math.isfinite(low):
        return None
    tied = np.flatnonzero(score.ravel() <= low + 1e-12 * abs(low))
    order = np.lexsort((step.ravel()[tied], energy.ravel()[tied], score.ravel()[tied]))
    return int(tied[order[0]])


class _Tracker:
    """Best candidate seen so far, over chunks and refinement levels."""

    def __init__(self) -> None:
        self.key = (math.inf, math.inf, math.inf)
        self.batch: np.ndarray | None = None
        self.limits: tuple[int, ...] | None = None

    def offer(self, types, batch, score, energy, step) -> None:
        flat = _best(score, energy, step)
        if flat is None:
            return
        row, col = divmod(flat, score.shape[1])
        key = (float(score[row, col]), float(energy[row, col]), float(step[row, col]))
        low = self.key[0]
        better = key[0] < low - 1e-12 * abs(low) or (
            key[0] <= low + 1e-12 * abs(low) and key[1:] < self.key[1:]
        )
        if better or self.batch is None:
            self.key, self.batch = key, batch[row].copy()
            self.limits = tuple(
                int(x) for x in np.unravel_index(col, [len(t.profile.power_limits_w) for t in types])
            )


def _complete(types, free: np.ndarray, global_batch: int, granularity: int, exact: bool) -> np.ndarray:
    """Append the last type's local batch to splits of the others, dropping the infeasible ones."""
    last = types[-1]
    rest = global_batch - free @ np.array([t.count for t in types[:-1]], dtype=np.int64)
    b_last = rest / last.count
    ok = (b_last >= last.lo) & (b_last <= last.hi)
    if exact:
        ok &= rest % (last.count * granularity) == 0
    return np.column_stack([free.astype(float), b_last])[ok]


def _grid(axes: list[np.ndarray]) -> np.ndarray:
    """Every combination of the values on `axes`, one row each: shape (prod(len(axis)), len(axes))."""
    if not axes:
        return np.zeros((1, 0), dtype=np.int64)
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(axes))


class _SplitSearch:
    """One search for the best split: the types in search order (the last takes the remainder) and the best
    candidate found so far."""

    def __init__(
        self,
        types: list[_Type],
        global_batch: int,
        granularity: int,
        objective: OptimumSelector,
        max_power_w: float,
        ref_time: float,
    ) -> None:
        self.types = types
        self.free = types[:-1]
        self.global_batch, self.granularity = global_batch, granularity
        self.objective, self.max_power_w, self.ref_time = objective, max_power_w, ref_time
        self.n_limits = math.prod(len(t.profile.power_limits_w) for t in types)
        self.lo = np.array([t.lo for t in self.free])
        self.hi = np.array([t.hi for t in self.free])
        self.tracker = _Tracker()

    def run(self) -> None:
        """Search exhaustively when the candidates are few, else coarse-to-fine."""
        n_splits = math.prod((t.hi - t.lo) // self.granularity + 1 for t in self.free)
        if n_splits * self.n_limits <= _EXHAUSTIVE_BUDGET:
            self.evaluate(_grid([np.arange(t.lo, t.hi + 1, self.granularity) for t in self.free]), exact=True)
        else:
            self._coarse_to_fine(n_splits)

    def evaluate(self, free_batches: np.ndarray, exact: bool, keep: int = 0) -> np.ndarray:
        """Score the splits of `free_batches` (the free types' local batches) in chunks, offering exact ones
        to the tracker; returns the free batches of the `keep` best-scoring splits (finite scores only)."""
        splits = _complete(self.types, free_batches, self.global_batch, self.granularity, exact)
        rows = max(1, _CHUNK // self.n_limits)
        best_rows = []
        for start in range(0, len(splits), rows):
            chunk = splits[start : start + rows]
            score, energy, step = _score_splits(
                self.types, chunk, self.objective, self.max_power_w, self.ref_time
            )
            if exact:
                self.tracker.offer(self.types, chunk, score, energy, step)
            if keep:
                row_low = score.min(axis=1)
                top = np.argsort(row_low, kind="stable")[:keep]
                best_rows.append((row_low[top], chunk[top, :-1]))
        if not best_rows:
            return np.empty((0, len(self.free)))
        lows = np.concatenate([r[0] for r in best_rows])
        cands = np.concatenate([r[1] for r in best_rows])
        top = np.argsort(lows, kind="stable")[:keep]
        return cands[top][np.isfinite(lows[top])].astype(np.int64)

    def _coarse_to_fine(self, n_splits: int) -> None:
        """A coarse grid, refined around its best splits level by level down to single steps; then polish."""
        target = max(1.0, _COARSE_BUDGET / self.n_limits)
        step = max(1, math.ceil((n_splits / target) ** (1 / len(self.free))))
        axes = [np.unique(np.r_[np.arange(t.lo, t.hi + 1, step * self.granularity), t.hi]) for t in self.free]
        centers = self.evaluate(_grid(axes), exact=False, keep=_TOP_K)
        while step > 1:
            finer = max(1, step // 4)
            centers = self.evaluate(self._window(centers, step, finer), exact=finer == 1, keep=_TOP_K)
            step = finer
        self._polish(centers)

    def _polish(self, centers: np.ndarray) -> None:
        """Exact neighbourhoods around the best splits until nothing better turns up."""
        radius = 2
        for _ in range(64):
            before = self.tracker.key
            found = self.evaluate(self._window(centers, radius, 1), exact=True, keep=_TOP_K)
            if self.tracker.batch is None:
                radius *= 2
                continue
            if self.tracker.key == before:
                break
            centers = found if len(found) else centers

    def _window(self, centers: np.ndarray, radius: int, spacing: int) -> np.ndarray:
        """The distinct splits within `radius` granules of each center, `spacing` granules apart, clipped to
        the allowed ranges."""
        offsets = _grid([np.arange(-radius, radius + 1, spacing) * self.granularity] * len(self.free))
        window = np.clip((centers[:, None, :] + offsets[None]).reshape(-1, len(self.free)), self.lo, self.hi)
        return np.unique(window, axis=0)


def _search(types, global_batch, granularity, objective, max_power_w, ref_time):
    """Best (local batches, power-limit indices), exhaustive when small, else coarse-to-fine."""
    # The type with the fewest GPUs takes the remainder, so that exact splits are dense among the others'.
    order = sorted(range(len(types)), key=lambda i: types[i].count)[::-1]
    search = _SplitSearch(
        [types[i] for i in order], global_batch, granularity, objective, max_power_w, ref_time
    )
    search.run()
    tracker = search.tracker
    if tracker.batch is None:
        return None, None
    batch = [0] * len(types)
    limits = [0] * len(types)
    for pos, i in enumerate(order):
        batch[i] = int(round(tracker.batch[pos]))
        limits[i] = tracker.limits[pos]
    return batch, limits


def cost_curve(
    profiles: Sequence[GPUProfile],
    counts: Sequence[int],
    global_batch: int,
    objective: OptimumSelector,
    cost_model: str = "sync",
    allow_extrapolation: bool = False,
    batch_granularity: int = 1,
) -> CostCurve:
    """The best cost over power limits of every split between two GPU types (for plotting).

    Raises:
        ValueError: Not exactly two types, or as `plan`.
    """
    if len(profiles) != 2:
        raise ValueError(f"`cost_curve`: needs exactly two GPU types; got {len(profiles)}.")
    if cost_model == "zeus2":
        eta = objective.eta_knob if isinstance(objective, ZeusCost) else 0.5
        return zeus2_cost_curve(profiles[0], profiles[1], global_batch, eta)
    types = _prepare(profiles, counts, global_batch, allow_extrapolation, batch_granularity, None)
    max_power_w = float(sum(t.count * t.profile.max_power_limit_w for t in types))
    _, ref_time, _, _ = _reference(types, global_batch)
    free = np.arange(types[0].lo, types[0].hi + 1, batch_granularity)[:, None]
    splits = _complete(types, free, global_batch, batch_granularity, exact=True)
    score, energy, step = _score_splits(types, splits, objective, max_power_w, ref_time)
    pick = np.argmin(score, axis=1)
    rows = np.arange(len(splits))
    extrapolated = outside_measured_range(profiles[0], splits[:, 0]) | outside_measured_range(
        profiles[1], splits[:, 1]
    )
    return CostCurve(
        splits[:, 0].astype(np.int64),
        splits[:, 1].astype(np.int64),
        score[rows, pick],
        step[rows, pick],
        energy[rows, pick],
        extrapolated,
    )
