"""HF `Trainer` adapters for parallel training: Perseus on pipeline stages (`HFPipelineFrequencyOptimizer`)
and heterogeneous plans (`HFHeterogeneousCallback`, `HeterogeneousTrainer`). Re-exported by
`zeus_callbacks.huggingface`."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments
from typing_extensions import override

from zeus_callbacks.core.heterogeneous.training import (
    RankPlan,
    UnevenDistributedSampler,
    apply_power_limit,
    restore_power_limits,
    unshard_dataloader,
)
from zeus_callbacks.core.monitor.reporting import pipeline_frequency_metrics
from zeus_callbacks.core.pipeline_frequency.attach import StageAttachment
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.huggingface.trainer import LogsFirst, RestoresOnException, ZeusTrainerMixin, log_metrics

__all__ = ["HFPipelineFrequencyOptimizer", "HFHeterogeneousCallback", "HeterogeneousTrainer"]

logger = logging.getLogger("zeus_callbacks.huggingface")


class HFPipelineFrequencyOptimizer(RestoresOnException, LogsFirst):
    """Perseus for a `Trainer` whose training step runs a `torch.distributed.pipelining` schedule.

    Drives `zeus_callbacks.PipelineFrequencyOptimizer` (see it for the method and the arguments):
    `on_train_begin` finds this rank's pipeline stage (`stage`, else an attribute of the model that is a
    `PipelineStage` or a schedule; with a multi-stage schedule such as `ScheduleInterleaved1F1B`, all its
    stages and its order) and reports its `forward_one_chunk`/`backward_one_chunk`
    calls as instructions (`StageAttachment.attach`); `on_step_begin`/`on_step_end` → the optimizer's hooks
    of the same names (one training step = one pipeline iteration); `on_train_end` →
    `StageAttachment.detach` (clocks reset); when `trainer.train()` raises, at exit, or before the exception
    leaves it with `ZeusTrainerMixin` / `restoring_gpus`. Every log event gets `PipelineFrequencyOptimizer.metrics()`, prefixed
    `pipeline_frequency_optimizer/`.

    Args:
        stage: This rank's `PipelineStage` (or its schedule), or None to find it on the model at
            `on_train_begin`.
        *args: Positional arguments of `PipelineFrequencyOptimizer` (Zeus's: rank, dp_rank, pp_rank, ...).
        **kwargs: Keyword arguments of `PipelineFrequencyOptimizer` (monitor, schedule, profile_path, ...).

    Raises:
        ValueError: at `on_train_begin`, when the job has no pipeline stage to instrument.

    Example::

        class PipelineTrainer(Trainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                ...  # schedule.step(...) on this rank's stage

        pfo = HFPipelineFrequencyOptimizer(stage, monitor=ZeusMonitor(gpu_indices=[local_rank]))
        PipelineTrainer(model, training_args, train_dataset=ds, callbacks=[pfo]).train()
        report = pfo.optimizer.report()
    """

    def __init__(self, stage: Any = None, *args: Any, **kwargs: Any) -> None:
        self.optimizer = PipelineFrequencyOptimizer(*args, **kwargs)
        self._stage = StageAttachment(
            self.optimizer,
            stage,
            adapter="HFPipelineFrequencyOptimizer",
            alternative="HFGlobalPowerLimitOptimizer",
        )

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → `StageAttachment.attach` on the trainer's model."""
        super().on_train_begin(args, state, control, **kwargs)
        self._stage.attach(kwargs.get("model"))

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_begin` → `PipelineFrequencyOptimizer.on_step_begin`."""
        self.optimizer.on_step_begin()

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_end` (after the optimizer step) → `PipelineFrequencyOptimizer.on_step_end`."""
        self.optimizer.on_step_end()

    @override
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """`on_log` → `PipelineFrequencyOptimizer.metrics`, added to `logs` under `pipeline_frequency_optimizer/`."""
        log_metrics(state, logs, pipeline_frequency_metrics(self.optimizer.metrics()))

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `StageAttachment.detach` (clocks reset, instrumentation removed)."""
        self._run_ended()
        self._stage.detach()

    @override
    def _train_failed(self) -> None:
        """`trainer.train()` raised → `StageAttachment.detach` (clocks reset, instrumentation removed)."""
        self._stage.detach()


class HFHeterogeneousCallback(RestoresOnException):
    """Run this rank's GPU at its planned power limit during `trainer.train()`.

    `on_train_begin` → `apply_power_limit(rank_plan, gpu_index)`; `on_train_end`, or `trainer.train()`
    raising → `restore_power_limits()` (also done at exit and on signals by the GPU-state guard).
    `HeterogeneousTrainer` adds it itself.

    Args:
        rank_plan: This rank's share of the plan (`rank_plan(plan)`).
        gpu_index: This rank's GPU; default `local_rank()`.
    """

    def __init__(self, rank_plan: RankPlan, gpu_index: int | None = None) -> None:
        self.rank_plan = rank_plan
        self.gpu_index = gpu_index

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → `apply_power_limit`."""
        super().on_train_begin(args, state, control, **kwargs)
        apply_power_limit(self.rank_plan, self.gpu_index)

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `restore_power_limits`."""
        self._run_ended()
        restore_power_limits()

    @override
    def _train_failed(self) -> None:
        """`trainer.train()` raised → `restore_power_limits`."""
        restore_power_limits()


class HeterogeneousTrainer(ZeusTrainerMixin, Trainer):
    """A `Trainer` on a heterogeneous plan: uneven local batches, full-batch gradients, per-rank power.

    `get_train_dataloader` gives this rank `rank_plan.local_batch` samples of every global batch
    (`per_device_train_batch_size` is ignored for training); `compute_loss` multiplies the training loss
    by `rank_plan.loss_scale`, except when the Trainer already normalises it by the number of items over
    all ranks (`average_tokens_across_devices` with a model that takes `num_items_in_batch`), which is
    exact for uneven batches as it is; `HFHeterogeneousCallback` applies the power limit. The logged
    loss, averaged over ranks by the Trainer, is then the mean over the global batch. A `ZeusTrainerMixin`
    that keeps transformers' resumption: `train()` raising puts the GPUs back before it leaves.

    Args:
        *args: As `Trainer`'s.
        rank_plan: This rank's share of the plan.
        gpu_index: This rank's GPU; default `local_rank()`.
        **kwargs: As `Trainer`'s.

    Example::

        rp = rank_plan(plan(profiles, counts, global_batch=1024))
        HeterogeneousTrainer(model, training_args, train_dataset=ds, rank_plan=rp).train()
    """

    skip_cut_short_checkpoints = False

    def __init__(self, *args: Any, rank_plan: RankPlan, gpu_index: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank_plan = rank_plan
        self.add_callback(HFHeterogeneousCallback(rank_plan, gpu_index))

    @override
    def get_train_dataloader(self) -> DataLoader:
        """This rank's slice of every global batch (`UnevenDistributedSampler`), not sharded again."""
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
        return unshard_dataloader(loader)

    @override
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """`Trainer.compute_loss` times `rank_plan.loss_scale` in training (see the class docstring)."""
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
        assert not isinstance(result, tuple)  # without `return_outputs`, the loss alone
        return result * self.rank_plan.loss_scale
