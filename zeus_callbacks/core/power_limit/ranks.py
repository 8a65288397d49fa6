"""Which ranks of a torch.distributed job run a power-limit optimizer: all of them, or only some.

The optimizer reaches one decision for the whole job with collectives, which every rank must call.
Zeus's data-parallel example builds the optimizer on rank 0 only; collectives there would wait forever.
So each optimizer registers in the job's store as soon as it knows it is a rank (when it is built under
a process group, else at its first step's beginning), and the membership is settled at the end of its
first step: a data-parallel job synchronises its ranks in every step (DDP's, FSDP's, DeepSpeed's gradient
collectives), so by the time any rank ends its first step every rank has begun its own, and every rank
that runs an optimizer has registered, however late it started. No clock decides: the first rank to
settle writes the verdict, `all` (collectives) or `alone` (each optimizer decides for its own GPUs, with
a warning: the rank-0-only case), and every rank follows it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from zeus_callbacks.core import distributed as dist

__all__ = ["JobMembership", "all_ranks_take_part"]

logger = logging.getLogger(__name__)

_sequence = itertools.count()  # the n-th optimizer registered in this process meets the n-th of the others


def _store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # an older torch, or a process group without a store
        return None


class JobMembership:
    """One optimizer's place in the job: `register()` early, `settle()` once a step synchronised the ranks."""

    def __init__(self, what: str = "GlobalPowerLimitOptimizer") -> None:
        self.what = what
        self._key: str | None = None
        self._verdict: bool | None = None

    @property
    def settled(self) -> bool:
        """Whether `settle` has decided."""
        return self._verdict is not None

    def register(self) -> None:
        """Say in the job's store that this rank runs one (once; nothing outside torch.distributed)."""
        if self._key is not None or not dist.is_distributed():
            return
        store = _store()
        if store is None:
            return
        self._key = f"zeus_callbacks/{self.what}/{next(_sequence)}"
        store.add(f"{self._key}/count", 1)

    def settle(self) -> bool:
        """True when every rank of the job runs this optimizer (decide together), False when this one
        decides alone. Call it after a step every rank synchronised on; not distributed: True."""
        if self._verdict is not None:
            return self._verdict
        if not dist.is_distributed() or dist.world_size() == 1:
            return True
        self.register()
        store = _store()
        if store is None or self._key is None:
            self._verdict = True
            return True
        world = dist.world_size()
        count = store.add(f"{self._key}/count", 0)
        verdict = store.compare_set(f"{self._key}/verdict", "", "all" if count >= world else "alone")
        self._verdict = verdict == b"all"
        if not self._verdict:
            logger.warning(
                "%s: only %d of the job's %d ranks run one (Zeus's data-parallel example builds it on rank 0 "
                "only), so this rank decides for its own GPU(s) alone; build it on every rank for one "
                "decision for the whole job.",
                self.what,
                count,
                world,
            )
        return self._verdict


def all_ranks_take_part(what: str = "GlobalPowerLimitOptimizer") -> bool:
    """`JobMembership(what)` registered and settled at once: for a caller past a synchronising step."""
    return JobMembership(what).settle()
