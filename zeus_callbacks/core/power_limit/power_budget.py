"""A power budget per job: the highest power limit a job may set on its GPUs, from its selector
(`MaxPowerConstraint`) and from the site (`ZEUS_CALLBACKS_POWER_BUDGET_W`, W per GPU), whichever is lower."""

from __future__ import annotations

import math
import os

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.power_limit.selectors import MaxPowerConstraint, OptimumSelector

__all__ = ["POWER_BUDGET_ENV", "site_budget_w", "per_gpu_cap_w", "for_job"]

POWER_BUDGET_ENV = "ZEUS_CALLBACKS_POWER_BUDGET_W"
"""A site's power budget for every job: W per GPU. No power limit above it is set, profiling included."""


def site_budget_w() -> float | None:
    """`ZEUS_CALLBACKS_POWER_BUDGET_W` (W per GPU), None when unset.

    Raises:
        InvalidInputError: not a number of watts > 0.
    """
    text = os.environ.get(POWER_BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise InvalidInputError(
            f"{POWER_BUDGET_ENV}={text!r} is not a power in watts > 0: set it to each GPU's budget, e.g. 250, "
            "or unset it."
        )
    return value


def per_gpu_cap_w(selector: OptimumSelector, num_gpus: int) -> float | None:
    """The highest power limit (W) any GPU of a `num_gpus`-GPU job may be set to, None without a budget."""
    caps = [site_budget_w()]
    if isinstance(selector, MaxPowerConstraint):
        caps.append(selector.per_gpu_w(num_gpus))
    known = [c for c in caps if c is not None]
    return min(known) if known else None


def for_job(selector: OptimumSelector, num_gpus: int) -> OptimumSelector:
    """`selector` as the search uses it: a `MaxPowerConstraint` bound to the job's size, any other as it is."""
    return selector.for_job(num_gpus) if isinstance(selector, MaxPowerConstraint) else selector
