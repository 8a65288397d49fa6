"""HuggingFace `transformers.Trainer` adapter of `PipelineFrequencyOptimizer`, for pipeline-parallel steps."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from typing_extensions import override

from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.pipeline_frequency.pipelining import find_stage, instrument
from zeus_callbacks.huggingface import _log, _run_before_trackers

__all__ = ["HFPipelineFrequencyOptimizer"]

PIPELINE_PREFIX = "pipeline_frequency_optimizer/"
"""Prefix of the metrics `HFPipelineFrequencyOptimizer` adds to the trainer's logs."""


class HFPipelineFrequencyOptimizer(TrainerCallback):
    """Perseus for a `Trainer` whose training step runs a `torch.distributed.pipelining` schedule.

    Drives `zeus_callbacks.PipelineFrequencyOptimizer` (see it for the method and the arguments):
    `on_train_begin` finds this rank's pipeline stage (`stage`, else an attribute of the model that is a
    `PipelineStage` or a single-stage schedule) and reports its `forward_one_chunk`/`backward_one_chunk`
    calls as instructions; `on_step_begin`/`on_step_end` → the optimizer's hooks of the same names (one
    training step = one pipeline iteration); `on_train_end` → `PipelineFrequencyOptimizer.on_train_end`
    (clocks reset). If training raises, the GPU-state guard resets the clocks at exit or on SIGINT/SIGTERM.
    Every log event gets `PipelineFrequencyOptimizer.metrics()`, prefixed `pipeline_frequency_optimizer/`.

    Args:
        stage: This rank's `PipelineStage`, or None to find it on the model at `on_train_begin`.
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
        self.stage = stage
        self.optimizer = PipelineFrequencyOptimizer(*args, **kwargs)
        self._undo: Any = None

    @override
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_init_end` → run before the `report_to` trackers, so that they get the metrics."""
        _run_before_trackers(self)

    @override
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_train_begin` → instrument the pipeline stage's forward and backward chunks."""
        _run_before_trackers(self)
        stage = self.stage if self.stage is not None else find_stage(kwargs.get("model"))
        if find_stage(stage) is None:
            raise ValueError(
                "HFPipelineFrequencyOptimizer is attached to a job with no pipeline stage: pass "
                "`HFPipelineFrequencyOptimizer(stage=...)` with this rank's torch.distributed.pipelining "
                "PipelineStage (or keep it, or its schedule, as an attribute of the model). For training "
                "without pipeline parallelism, use HFGlobalPowerLimitOptimizer."
            )
        if self._undo is None:
            self._undo = instrument(find_stage(stage), None, self.optimizer)

    @override
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_step_begin` → `PipelineFrequencyOptimizer.on_step_begin`."""
        self.optimizer.on_step_begin()

    @override
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_step_end` (after the optimizer step) → `PipelineFrequencyOptimizer.on_step_end`."""
        self.optimizer.on_step_end()

    @override
    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs
    ):
        """`on_log` → `PipelineFrequencyOptimizer.metrics`, added to `logs` under `pipeline_frequency_optimizer/`."""
        _log(state, logs, {f"{PIPELINE_PREFIX}{k}": v for k, v in self.optimizer.metrics().items()})

    @override
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_train_end` → `PipelineFrequencyOptimizer.on_train_end` (clocks reset)."""
        self.optimizer.on_train_end()
        if self._undo is not None:
            self._undo()
            self._undo = None
