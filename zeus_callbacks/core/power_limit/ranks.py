"""Which ranks of a torch.distributed job run a power-limit optimizer: all of them, or only some.

The optimizer reaches one decision for the whole job with collectives, which every rank must call.
Zeus's data-parallel example builds the optimizer on rank 0 only; collectives there would wait forever.
So each optimizer registers in the job's store when it is set up and waits (a few seconds at most) for
the other ranks' to register; the first rank to conclude writes the verdict, and every rank follows it:
`all` (collectives) or `alone` (each optimizer decides for its own GPUs, with a warning).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

from zeus_callbacks.core import distributed as dist

__all__ = ["all_ranks_take_part", "JOIN_TIMEOUT_ENV"]

logger = logging.getLogger(__name__)

# Seconds a rank waits for the others' optimizers to register (ranks build them at about the same time:
# after init_process_group and the model's wrapping, which are collectives themselves).
JOIN_TIMEOUT_ENV = "ZEUS_CALLBACKS_JOIN_TIMEOUT_S"
_DEFAULT_TIMEOUT_S = 10.0
_POLL_S = 0.02

_sequence = itertools.count()  # the n-th optimizer set up in this process meets the n-th of the others


def _store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # an older torch, or a process group without a store
        return None


def all_ranks_take_part(what: str = "GlobalPowerLimitOptimizer") -> bool:
    """True when every rank of the job runs this optimizer (decide together), False when this one
    decides alone. Not distributed: True (there is nobody else)."""
    if not dist.is_distributed() or dist.world_size() == 1:
        return True
    store = _store()
    if store is None:
        return True
    key = f"zeus_callbacks/{what}/{next(_sequence)}"
    world = dist.world_size()
    count = store.add(f"{key}/count", 1)
    timeout_s = float(os.environ.get(JOIN_TIMEOUT_ENV, _DEFAULT_TIMEOUT_S))
    deadline = time.monotonic() + timeout_s
    while count < world and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        count = store.add(f"{key}/count", 0)
    verdict = store.compare_set(f"{key}/verdict", "", "all" if count >= world else "alone")
    if verdict == b"all":
        return True
    logger.warning(
        "%s: only %d of the job's %d ranks run one (Zeus's data-parallel example builds it on rank 0 "
        "only), so this rank decides for its own GPU(s) alone; build it on every rank for one decision "
        "for the whole job.",
        what,
        count,
        world,
    )
    return False
