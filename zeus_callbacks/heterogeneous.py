"""Train on a heterogeneous plan with the HF Trainer, Lightning or Accelerate: thin adapters of
`zeus_callbacks.core.heterogeneous.training`.

Every adapter does the same three things, each through one core call: the rank's data is its slice of
every global batch (`UnevenDistributedSampler`), its gradients are weighted by `RankPlan.loss_scale` so
that DDP's average equals the full-batch gradient, and its GPU runs at the planned power limit
(`apply_power_limit`, restored at the end). The framework classes are built on first access, so importing
this module imports neither transformers nor lightning.

- HF: `HeterogeneousTrainer(..., rank_plan=rp)` (a `Trainer` with the sampler, the loss scale and
  `HFHeterogeneousCallback`, which applies the power limit).
- Lightning: `uneven_dataloader(dataset, rp)` plus `LightningHeterogeneous(rp)`, with
  `Trainer(use_distributed_sampler=False)` optional (the sampler is already distributed).
- Accelerate: `loader, scale = prepare_accelerate_dataloader(accelerator, dataset, rp)`; multiply the loss by
  `scale`; `apply_power_limit(rp, gpu_index)` once.
"""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import DataLoader

from zeus_callbacks.core.heterogeneous.training import (
    RankPlan,
    UnevenDistributedSampler,
    apply_power_limit,
    loss_scale,
    match_gpu_type,
    rank_plan,
    rank_plans,
    restore_power_limits,
    steps_per_epoch,
    weight_gradients,
)

__all__ = [
    "RankPlan",
    "UnevenDistributedSampler",
    "apply_power_limit",
    "loss_scale",
    "match_gpu_type",
    "rank_plan",
    "rank_plans",
    "restore_power_limits",
    "steps_per_epoch",
    "weight_gradients",
    "uneven_dataloader",
    "prepare_accelerate_dataloader",
]


def _gpu_index(gpu_index: int | None) -> int:
    return gpu_index if gpu_index is not None else int(os.environ.get("LOCAL_RANK", 0))


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


def _unshard(loader: Any) -> Any:
    """Undo Accelerate's sharding of an already rank-aware loader (as the HF Trainer does for its own)."""
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and hasattr(shard, "num_processes") and hasattr(shard, "process_index"):
        shard.num_processes, shard.process_index = 1, 0
    return loader


def prepare_accelerate_dataloader(
    accelerator: Any, dataset: Any, rank_plan: RankPlan, **kwargs: Any
) -> tuple[Any, float]:
    """Accelerate: `accelerator.prepare` this rank's uneven loader; returns it and the loss scale.

    Accelerate shards every loader it prepares over the processes; this one already holds only this rank's
    samples, so the sharding is switched off after `prepare` (device placement and `set_epoch` stay).
    Multiply each step's mean loss by the returned scale before `accelerator.backward`.

    Example::

        loader, scale = prepare_accelerate_dataloader(accelerator, train_set, rp)
        for x, y in loader:
            accelerator.backward(loss_fn(model(x), y) * scale)
    """
    loader = accelerator.prepare(uneven_dataloader(dataset, rank_plan, **kwargs))
    return _unshard(loader), rank_plan.loss_scale


# -- framework classes, built on first access ---------------------------------------------------------------


def _build_hf_callback() -> type:
    from transformers import TrainerCallback

    class HFHeterogeneousCallback(TrainerCallback):
        """Run this rank's GPU at its planned power limit during `trainer.train()`.

        `on_train_begin` -> `apply_power_limit(rank_plan, gpu_index)`; `on_train_end` ->
        `restore_power_limits()` (also done at exit and on signals by the GPU-state guard).

        Args:
            rank_plan: This rank's share of the plan (`rank_plan(plan)`).
            gpu_index: This rank's GPU; default `LOCAL_RANK`, else 0.
        """

        def __init__(self, rank_plan: RankPlan, gpu_index: int | None = None) -> None:
            self.rank_plan = rank_plan
            self.gpu_index = _gpu_index(gpu_index)

        def on_train_begin(self, args, state, control, **kwargs):
            apply_power_limit(self.rank_plan, self.gpu_index)

        def on_train_end(self, args, state, control, **kwargs):
            restore_power_limits()

    return HFHeterogeneousCallback


def _build_hf_trainer() -> type:
    from transformers import Trainer

    class HeterogeneousTrainer(Trainer):
        """A `Trainer` on a heterogeneous plan: uneven local batches, full-batch gradients, per-rank power.

        `get_train_dataloader` gives this rank `rank_plan.local_batch` samples of every global batch
        (`per_device_train_batch_size` is ignored for training); `compute_loss` multiplies the training loss
        by `rank_plan.loss_scale`, except when the Trainer already normalises it by the number of items over
        all ranks (`average_tokens_across_devices` with a model that takes `num_items_in_batch`), which is
        exact for uneven batches as it is; `HFHeterogeneousCallback` applies the power limit. The logged
        loss, averaged over ranks by the Trainer, is then the mean over the global batch.

        Args:
            *args: As `Trainer`'s.
            rank_plan: This rank's share of the plan.
            gpu_index: This rank's GPU; default `LOCAL_RANK`, else 0.
            **kwargs: As `Trainer`'s.
        """

        def __init__(self, *args: Any, rank_plan: RankPlan, gpu_index: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.rank_plan = rank_plan
            self.add_callback(_lazy("HFHeterogeneousCallback")(rank_plan, gpu_index))

        def get_train_dataloader(self) -> DataLoader:
            if self.train_dataset is None:
                raise ValueError("Trainer: training requires a train_dataset.")
            sampler = UnevenDistributedSampler.from_rank_plan(
                self.train_dataset, self.rank_plan, seed=self.args.seed, drop_last=True
            )
            loader = self._get_dataloader(
                dataset=self.train_dataset,
                description="Training",
                batch_size=self.rank_plan.local_batch,
                sampler_fn=lambda _: sampler,
                is_training=True,
            )
            return _unshard(loader)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            over_ranks = (
                self.args.average_tokens_across_devices
                and (self.model_accepts_loss_kwargs or self.compute_loss_func)
                and num_items_in_batch is not None
            )
            if not model.training or over_ranks:
                return result
            if return_outputs:
                loss, outputs = result
                return loss * self.rank_plan.loss_scale, outputs
            return result * self.rank_plan.loss_scale

    return HeterogeneousTrainer


def _build_lightning_callback() -> type:
    from lightning.pytorch.callbacks import Callback

    class LightningHeterogeneous(Callback):
        """Weight this rank's gradients and run its GPU at the planned power limit during `fit`.

        `on_fit_start` -> `weight_gradients(pl_module, rank_plan)` and `apply_power_limit(...)`;
        `on_fit_end` -> remove the weights and `restore_power_limits()`. Give the `Trainer` this rank's
        `uneven_dataloader(dataset, rank_plan)`: it is a `DistributedSampler`, so Lightning keeps it.

        Args:
            rank_plan: This rank's share of the plan.
            gpu_index: This rank's GPU; default `LOCAL_RANK`, else 0.
        """

        def __init__(self, rank_plan: RankPlan, gpu_index: int | None = None) -> None:
            self.rank_plan = rank_plan
            self.gpu_index = _gpu_index(gpu_index)
            self._weights: Any = None

        def on_fit_start(self, trainer, pl_module):
            self._weights = weight_gradients(pl_module, self.rank_plan)
            apply_power_limit(self.rank_plan, self.gpu_index)

        def on_fit_end(self, trainer, pl_module):
            if self._weights is not None:
                self._weights.remove()
                self._weights = None
            restore_power_limits()

    return LightningHeterogeneous


_LAZY = {
    "HFHeterogeneousCallback": _build_hf_callback,
    "HeterogeneousTrainer": _build_hf_trainer,
    "LightningHeterogeneous": _build_lightning_callback,
}
__all__ += list(_LAZY)


def _lazy(name: str) -> type:
    if name not in globals():
        cls = _LAZY[name]()
        cls.__module__ = __name__
        globals()[name] = cls
    return globals()[name]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _lazy(name)


def __dir__() -> list[str]:
    return sorted(__all__)
