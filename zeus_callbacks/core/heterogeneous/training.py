"""Data-parallel training with a heterogeneous plan: uneven local batches, exact gradients, per-rank power limits.

A plan (`zeus_callbacks.core.heterogeneous.planner.plan`) gives each GPU type a local batch `b_r` and a
power limit, with `sum_r b_r = B`, the global batch. Three things make DDP train on it as on the full batch:

- **Data.** `UnevenDistributedSampler` hands rank r the slice `[offset_r, offset_r + b_r)` of every global
  batch of a shared permutation, so each step's global batch is covered exactly once; every rank runs the same
  number of steps (DDP's collectives need it), the last global batch padded from the start when needed.
- **Gradients.** DDP averages gradients over the `W` ranks. With each rank's loss the mean over its own
  `b_r` samples, the average would weight a sample on a small rank more. Multiplying rank r's loss (or its
  gradients) by `W * b_r / B` makes the average `sum_r (b_r / B) grad(mean_r) = grad(mean over B)`: the
  update of the full global batch. We scale instead of a comm hook or `no_sync` plus a manual all-reduce
  because scaling leaves DDP's bucketing and its overlap of communication with backward untouched and works
  unchanged under the HF Trainer, Lightning and Accelerate, which wrap the model in DDP themselves.
  `weight_gradients` applies the factor to the gradients (hooks on the parameters), so the logged loss stays
  the rank's plain mean; `RankPlan.loss_scale` is the factor for scaling the loss yourself.
- **Power.** `apply_power_limit` sets the rank's planned limit through the GPU-state guard, which restores
  it at the end of the process (or by `restore_power_limits()`).

The equivalence holds for losses that are means over samples and models without cross-sample layers in
training mode (BatchNorm normalises over each rank's own, now uneven, batch).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.gpus import GPU, get_gpus
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.heterogeneous.planner import HeteroPlan

__all__ = [
    "RankPlan",
    "rank_plans",
    "rank_plan",
    "match_gpu_type",
    "loss_scale",
    "weight_gradients",
    "UnevenDistributedSampler",
    "apply_power_limit",
    "restore_power_limits",
    "steps_per_epoch",
    "uneven_dataloader",
    "unshard_dataloader",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlan:
    """What one rank does under a heterogeneous plan.

    Attributes:
        rank: The rank.
        world_size: Ranks in the job.
        gpu_name: The plan's GPU type of this rank (`TypePlan.gpu_name`).
        local_batch: Samples this rank takes from each global batch.
        global_batch: Samples per step over all ranks.
        offset: Where this rank's slice of each global batch begins.
        power_limit_w: The planned power limit of this rank's GPU.
    """

    rank: int
    world_size: int
    gpu_name: str
    local_batch: int
    global_batch: int
    offset: int
    power_limit_w: int

    @property
    def loss_scale(self) -> float:
        """`world_size * local_batch / global_batch`: the factor on this rank's mean loss under DDP."""
        return loss_scale(self.local_batch, self.global_batch, self.world_size)


def loss_scale(local_batch: int, global_batch: int, world_size: int) -> float:
    """Factor on a rank's mean loss that makes DDP's gradient average the gradient of the global mean.

    DDP computes `(1 / W) sum_r s_r grad(L_r)`, with `L_r` the mean over `b_r` samples; the gradient of the
    mean over all `B` samples is `sum_r (b_r / B) grad(L_r)`, so `s_r = W b_r / B`.
    """
    if not 0 < local_batch <= global_batch or world_size < 1:
        raise ValueError(
            f"`loss_scale(local_batch={local_batch}, global_batch={global_batch}, world_size={world_size})`: "
            "need 0 < local_batch <= global_batch and world_size >= 1."
        )
    return world_size * local_batch / global_batch


def rank_plans(plan: HeteroPlan, rank_types: Sequence[str]) -> list[RankPlan]:
    """Each rank's share of `plan`, given the plan's GPU type (`TypePlan.gpu_name`) of each rank in order.

    Raises:
        ValueError: a type not in the plan, or a number of ranks per type different from the plan's counts.
    """
    by_name = {t.gpu_name: t for t in plan.types}
    unknown = sorted({n for n in rank_types if n not in by_name})
    if unknown:
        raise ValueError(f"GPU types {unknown} are not in the plan (its types: {sorted(by_name)}).")
    counts = {n: sum(1 for r in rank_types if r == n) for n in by_name}
    wrong = {n: (counts[n], t.count) for n, t in by_name.items() if counts[n] != t.count}
    if wrong:
        detail = ", ".join(f"{n}: {have} rank(s), plan {want}" for n, (have, want) in wrong.items())
        raise ValueError(f"The ranks do not match the plan's GPU counts ({detail}).")
    out, offset = [], 0
    world = len(rank_types)
    for r, name in enumerate(rank_types):
        t = by_name[name]
        out.append(RankPlan(r, world, name, t.local_batch, plan.global_batch, offset, t.power_limit_w))
        offset += t.local_batch
    if offset != plan.global_batch:  # pragma: no cover - the planner guarantees it
        raise ValueError(
            f"The plan's local batches sum to {offset}, not the global batch {plan.global_batch}."
        )
    return out


def _words(name: str) -> str:
    return re.sub(r"^(nvidia|tesla)\s+", "", name.strip().lower())


def match_gpu_type(plan: HeteroPlan, gpu_name: str) -> str:
    """The plan's type of a GPU, from its NVML name (`"NVIDIA A10G"` -> `"a10"`): the type whose name begins
    the model name (without "NVIDIA"/"Tesla") and is not followed by a digit (`a10` is not an A100); the
    longest one when several match.

    Raises:
        ValueError: no type, or two equally long ones, match; pass the types explicitly then.
    """
    model = _words(gpu_name).replace(" ", "")
    hits = [
        t.gpu_name
        for t in plan.types
        if re.match(re.escape(_words(t.gpu_name).replace(" ", "")) + r"(?!\d)", model)
    ]
    longest = max((len(h) for h in hits), default=0)
    best = [h for h in hits if len(h) == longest]
    if len(best) != 1:
        raise ValueError(
            f"Cannot tell which of the plan's GPU types {[t.gpu_name for t in plan.types]} GPU {gpu_name!r} is; "
            "pass rank_types=[...] (one type per rank)."
        )
    return best[0]


def _signature(plan: HeteroPlan) -> tuple:
    return plan.global_batch, tuple((t.gpu_name, t.count, t.local_batch, t.power_limit_w) for t in plan.types)


def rank_plan(
    plan: HeteroPlan,
    rank_types: Sequence[str] | None = None,
    gpu_index: int | None = None,
) -> RankPlan:
    """This process's share of `plan` under torch.distributed (or the whole plan's one rank).

    Every rank must call it: the ranks' plans are compared (and, by default, their GPU types gathered) in one
    collective, and an error on any rank is raised on all of them.

    Args:
        plan: The heterogeneous plan, identical on every rank.
        rank_types: The plan's GPU type of every rank, in rank order. Default: each rank's GPU (`gpu_index`)
            matched by name (`match_gpu_type`).
        gpu_index: This rank's GPU when matching by name; default `local_rank()`.

    Raises:
        ValueError: the ranks hold different plans, or do not match the plan's types and counts.
    """
    mine: str | None = None
    error = ""
    if rank_types is None:
        index = gpu_index if gpu_index is not None else dist.local_rank()
        try:
            mine = match_gpu_type(plan, get_gpus()[index].name)
        except (ValueError, IndexError) as e:
            error = f"rank {dist.rank()}: {e}"
    gathered = dist.all_gather_object((mine, _signature(plan), error))
    errors = [g[2] for g in gathered if g[2]]
    if errors:
        raise ValueError("; ".join(errors))
    if len({g[1] for g in gathered}) != 1:
        raise ValueError(
            "The ranks hold different plans; compute the plan once and give every rank the same."
        )
    if rank_types is None:
        rank_types = [g[0] for g in gathered]
    plans = rank_plans(plan, list(rank_types))
    world = dist.world_size()
    if len(plans) != world:
        raise ValueError(f"rank_types names {len(plans)} ranks but the job has {world}.")
    return plans[dist.rank()]


def steps_per_epoch(dataset_len: int, global_batch: int, drop_last: bool = True) -> int:
    """Steps in one epoch: full global batches, plus a padded last one unless `drop_last`."""
    return dataset_len // global_batch if drop_last else math.ceil(dataset_len / global_batch)


class UnevenDistributedSampler(DistributedSampler):
    """This rank's indices of every global batch: a contiguous, possibly uneven, slice of each.

    Every rank draws the same permutation (seeded by `seed + epoch`), cuts it into global batches of
    `global_batch` samples, and takes `[offset, offset + local_batch)` of each. Use it with
    `DataLoader(dataset, batch_size=local_batch, sampler=sampler)`: each loader batch is this rank's share of
    one global batch, and every rank yields the same number of batches. With `drop_last=False` the last,
    partial global batch is completed with samples from the start of the permutation (as
    `DistributedSampler` pads), so that every step still trains exactly `global_batch` samples.

    It is a `DistributedSampler` so that trainers that replace samplers for distributed training (Lightning)
    recognise it as already distributed and leave it alone.

    Args:
        dataset: The dataset (only its length is used), or its length.
        global_batch: Samples per step over all ranks.
        offset: Start of this rank's slice in each global batch.
        local_batch: This rank's samples per step.
        shuffle: Draw a new permutation each epoch (call `set_epoch`); else in order.
        seed: Seed of the permutation; the same on every rank.
        drop_last: Drop the last partial global batch (default) rather than pad it.

    Raises:
        ValueError: a slice outside the global batch, or a dataset smaller than one global batch.

    Example::

        rp = rank_plan(plan)
        sampler = UnevenDistributedSampler.from_rank_plan(dataset, rp)
        loader = DataLoader(dataset, batch_size=rp.local_batch, sampler=sampler)
    """

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        offset: int,
        local_batch: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        call = f"`UnevenDistributedSampler(global_batch={global_batch}, offset={offset}, local_batch={local_batch})`"
        if local_batch < 1 or offset < 0 or offset + local_batch > global_batch:
            raise ValueError(f"{call}: the slice must lie inside the global batch.")
        if n < global_batch and (drop_last or n == 0):
            raise ValueError(f"{call}: the dataset has {n} samples, fewer than one global batch.")
        self.dataset = dataset
        self.num_replicas = dist.world_size()
        self.rank = dist.rank()
        self.num_samples_total = n
        self.global_batch = global_batch
        self.offset = offset
        self.local_batch = local_batch
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    @classmethod
    def from_rank_plan(cls, dataset: Any, rank_plan: RankPlan, **kwargs: Any) -> UnevenDistributedSampler:
        """The sampler of one rank of a plan; `kwargs` as the constructor's (`shuffle`, `seed`, `drop_last`)."""
        return cls(dataset, rank_plan.global_batch, rank_plan.offset, rank_plan.local_batch, **kwargs)

    @property
    def num_steps(self) -> int:
        """Global batches (training steps) per epoch; the same on every rank."""
        return steps_per_epoch(self.num_samples_total, self.global_batch, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of `epoch` (call on every rank before each epoch when shuffling)."""
        self.epoch = epoch

    def global_order(self) -> list[int]:
        """The epoch's order of samples over all ranks, padded or cut to whole global batches."""
        n = self.num_samples_total
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self.num_steps * self.global_batch
        while len(order) < total:
            order += order[: total - len(order)]
        return order[:total]

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        lo, hi = self.offset, self.offset + self.local_batch
        for step in range(self.num_steps):
            base = step * self.global_batch
            yield from order[base + lo : base + hi]

    def __len__(self) -> int:
        return self.num_steps * self.local_batch

    @property
    def num_samples(self) -> int:  # type: ignore[override]  # DistributedSampler's name for this rank's samples per epoch
        return len(self)

    @property
    def total_size(self) -> int:  # type: ignore[override]  # DistributedSampler's name for the samples per epoch over all ranks
        return self.num_steps * self.global_batch


class _GradientWeights:
    """Hooks that multiply every parameter's gradient by a factor; `remove()` takes them off."""

    def __init__(self, module: torch.nn.Module, factor: float) -> None:
        self.factor = float(factor)
        self._handles = [p.register_hook(self._scale) for p in module.parameters() if p.requires_grad]

    def _scale(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor

    def remove(self) -> None:
        """Stop weighting the gradients."""
        for h in self._handles:
            h.remove()
        self._handles = []


def weight_gradients(module: torch.nn.Module, rank_plan_or_factor: RankPlan | float) -> _GradientWeights:
    """Multiply `module`'s gradients by the rank's `loss_scale` before DDP averages them.

    The hooks sit on the parameters, so they run before the gradient is accumulated and before DDP's
    reducer sees it: call it on the model (wrapped in DDP or not) once, before training; the loss stays
    the rank's own mean for logging. Returns a handle with `remove()`.
    """
    factor = (
        rank_plan_or_factor.loss_scale if isinstance(rank_plan_or_factor, RankPlan) else rank_plan_or_factor
    )
    return _GradientWeights(module, factor)


def apply_power_limit(rank_plan: RankPlan, gpu_index: int | None = None) -> GPU:
    """Set this rank's GPU (`gpu_index`, default `local_rank()`) to its planned power limit, recorded first
    so that it is restored at the end.

    Raises:
        ValueError: the limit is outside the GPU's range (a plan for another GPU model?).
        GPUNoPermissionError: this process may not change power limits.
    """
    gpu = get_gpus()[gpu_index if gpu_index is not None else dist.local_rank()]
    gpu.set_power_limit_mw(rank_plan.power_limit_w * 1000)
    logger.info(
        "Rank %d: %s at %d W, local batch %d of %d%s.",
        rank_plan.rank,
        gpu.label,
        rank_plan.power_limit_w,
        rank_plan.local_batch,
        rank_plan.global_batch,
        " (SIMULATED)" if gpu.simulated else "",
    )
    return gpu


def restore_power_limits() -> bool:
    """Put back every GPU setting this process changed; True if all were restored."""
    return guard().restore()


def uneven_dataloader(
    dataset: Any,
    rank_plan: RankPlan,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    **kwargs: Any,
) -> DataLoader:
    """A `DataLoader` of this rank's slice of every global batch (`batch_size=rank_plan.local_batch`).

    `kwargs` go to `DataLoader` (`num_workers`, `collate_fn`, ...). Call `loader.sampler.set_epoch(epoch)`
    each epoch when shuffling in a plain loop (Lightning does it itself).
    """
    sampler = UnevenDistributedSampler.from_rank_plan(
        dataset, rank_plan, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return DataLoader(dataset, batch_size=rank_plan.local_batch, sampler=sampler, **kwargs)


def unshard_dataloader(loader: Any) -> Any:
    """Undo Accelerate's sharding of a loader that already holds only this rank's samples.

    Accelerate (and the HF Trainer, through it) shards every loader it prepares over the processes; an
    uneven loader is rank-aware already, so its batch sampler is told there is one process. Device placement
    and `set_epoch` stay.
    """
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and hasattr(shard, "num_processes") and hasattr(shard, "process_index"):
        shard.num_processes, shard.process_index = 1, 0
    return loader
