"""What the adaptive search spends, in training steps: the least a limit is measured, the settling of a
visit, the budget that caps the whole search, and what was spent (see `search`)."""

from __future__ import annotations

import math

from zeus_callbacks.core.power_limit.estimates import PowerLimitStats

__all__ = ["min_measured_steps", "adaptive_budget_steps", "settle_steps", "spent_steps"]


def min_measured_steps(profile_steps: int) -> int:
    """Samples every limit of the adaptive search is measured before it may stop (3 at least, so that
    a stalled one can be told from the others)."""
    return min(profile_steps, max(3, -(-profile_steps // 8)))


def adaptive_budget_steps(
    num_limits: int, warmup_steps: int, profile_steps: int, per_sample: float = 1.0
) -> int:
    """Steps (warm-up included) past which the adaptive search does not refine: 3/4 of a sweep's, a
    sweep measuring `profile_steps` samples of `per_sample` steps (`chunk_steps`) at each limit."""
    return int(num_limits * (warmup_steps + profile_steps * max(1.0, per_sample)) * 3 // 4)


def settle_steps(warmup_steps: int, per_sample: float = 1.0) -> int:
    """Unmeasured steps the adaptive search runs at a limit after the first it profiles in a run.

    A power limit takes effect within milliseconds; what lags is the energy counter (up to one refresh),
    so a visit skips one sample's worth of steps (`chunk_steps`), never more than `warmup_steps`. The
    first limit of a run gets all `warmup_steps`: that is where the job itself warms up.
    """
    return min(warmup_steps, max(1, math.ceil(per_sample - 1e-9)))


def spent_steps(stats: dict[float, PowerLimitStats], warmup_steps: int) -> int:
    """Steps the search has spent on `stats` so far: each visit's warm-up (`warmup_steps` a visit where
    the limit does not say) and every measured step."""
    return sum(
        s.spent_steps + (s.warmed_steps if s.warmed_steps >= 0 else warmup_steps * s.visits)
        for s in stats.values()
    )
