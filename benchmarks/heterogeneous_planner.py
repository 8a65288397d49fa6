"""Timings of the heterogeneous planner: Zeus² search (vectorised vs pure-Python loop) and the sync planner.

Run: `PYTHONPATH=. python benchmarks/heterogeneous_planner.py`
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import numpy as np

from zeus_callbacks.core.heterogeneous import planner as hetero
from zeus_callbacks.core.heterogeneous.planner import GPUProfile, load_profile, plan, zeus2_search
from zeus_callbacks.core.power_limit.selectors import ZeusCost


def timed(fn, repeat: int = 5) -> tuple[float, object]:
    """Median wall time (s) over `repeat` runs, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def original_naive(
    profile_a: GPUProfile, profile_b: GPUProfile, global_batch: int
) -> tuple[float, int, int, int]:
    """The original Zeus² brute force, re-implemented as it is written: scalar polynomials in Python loops."""
    fits = []
    for profile in (profile_a, profile_b):
        x = profile.batch_sizes.astype(float)
        per_limit = {}
        for i, limit in enumerate(profile.power_limits_w):
            window_time = profile.time_s[i] * profile.steps_per_window
            power = profile.energy_j[i] / profile.time_s[i]
            per_limit[int(limit)] = (
                np.poly1d(np.polyfit(x, window_time, 2)),
                np.poly1d(np.polyfit(x, power, 2)),
            )
        fits.append(per_limit)
    best = (math.inf, 0, 0, 0)
    for limit_a, (time_a, power_a) in fits[0].items():
        for limit_b, (time_b, power_b) in fits[1].items():
            for b_a in range(1, global_batch):
                b_b = global_batch - b_a
                t_a, p_a = max(time_a(b_a), 0.0), max(power_a(b_a), 0.0)
                t_b, p_b = max(time_b(b_b), 0.0), max(power_b(b_b), 0.0)
                cost = (0.5 * p_a + 0.5 * limit_a) * t_a + (0.5 * p_b + 0.5 * limit_b) * t_b
                if cost < best[0]:
                    best = (cost, b_a, limit_a, limit_b)
    return best


def main() -> None:
    logging.disable(logging.WARNING)  # the extrapolated references below are intended
    a10, t4 = load_profile("a10"), load_profile("t4")
    # Synthetic types derived by scaling the measured ones (not measurements): a bigger, faster A10-like GPU
    # measured up to local batch 2048 and a slower, larger-memory T4-like GPU measured up to 4096.
    big = a10.scaled("a10x2", batch_factor=2, time_factor=1.1, power_factor=1.2)
    wide = t4.scaled("t4x4", batch_factor=4, time_factor=2.5, power_factor=0.9)
    rows = []

    t_orig, orig = timed(lambda: original_naive(a10, t4, 4096), repeat=1)
    t_ours, ours = timed(lambda: zeus2_search(a10, t4, 4096, "naive"))
    same = (ours.types[0].local_batch, ours.types[0].power_limit_w, ours.types[1].power_limit_w) == orig[1:]
    same &= round(ours.cost, 4) == round(orig[0], 4)
    rows.append(("zeus2 naive, a10+t4 @4096: pure-Python loop (full run)", t_orig, ""))
    rows.append(
        (
            "zeus2 naive, a10+t4 @4096: vectorised",
            t_ours,
            f"x{t_orig / t_ours:,.0f} faster, same answer: {same}",
        )
    )
    for method in ("heuristic", "baseline"):
        t_m, _ = timed(lambda m=method: zeus2_search(a10, t4, 4096, m))
        rows.append((f"zeus2 {method}, a10+t4 @4096: vectorised", t_m, ""))

    objective = ZeusCost(0.5)
    t_sync, _ = timed(lambda: plan([a10, t4], [4, 4], 4096, objective))
    rows.append(("sync, 4 a10 + 4 t4 @4096 (measured range, exhaustive)", t_sync, ""))
    t_sync, _ = timed(lambda: plan([a10, t4], [1, 1], 4096, objective, allow_extrapolation=True))
    rows.append(("sync, 1 a10 + 1 t4 @4096 (allow_extrapolation, exhaustive)", t_sync, ""))

    four, counts = [a10, t4, big, wide], [16, 16, 16, 16]
    for granularity in (1, 8):
        t_four, result = timed(
            lambda g=granularity: plan(four, counts, 65536, objective, batch_granularity=g)
        )
        note = "coarse-to-fine" + (" (extrapolated!)" if result.extrapolated else ", measured range")
        rows.append((f"sync, 16 each of a10,t4,a10x2,t4x4 @65536, granularity {granularity}", t_four, note))

    # What an exhaustive search of the 4-type case would cost, from the measured candidate throughput.
    types = hetero._prepare(four, counts, 65536, False, 1, None)
    n_limits = math.prod(len(p.power_limits_w) for p in four)
    n_splits = math.prod(t.hi - t.lo + 1 for t in types[:-1])
    probe = np.column_stack([np.full(2000, float(t.lo)) for t in types])
    t_probe, _ = timed(lambda: hetero._score_splits(types, probe, objective, 1.0, 1.0))
    per_candidate = t_probe / (len(probe) * n_limits)
    estimate = n_splits * n_limits * per_candidate
    rows.append(
        (f"  exhaustive equivalent: {n_splits * n_limits:.2e} candidates", estimate, "ESTIMATE (not run)")
    )

    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'time':>11}  note")
    for name, seconds, note in rows:
        shown = f"{seconds * 1e3:9.2f} ms" if seconds < 10 else f"{seconds:10,.0f} s"
        print(f"{name:<{width}}  {shown:>11}  {note}")
    print(
        f"\nzeus2 naive answer: a10 {orig[1]} @ {orig[2]} W, t4 {4096 - orig[1]} @ {orig[3]} W, cost {orig[0]:.4f}"
    )


if __name__ == "__main__":
    main()
