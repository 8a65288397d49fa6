"""Lightning `Callback` adapter of `PipelineFrequencyOptimizer`, for training steps that run a pipeline schedule.

`LightningPipelineFrequencyOptimizer` is built on `lightning.pytorch.Callback` on first access;
`build_callback(pytorch_lightning.Callback, module)` builds the same class for the standalone package (as
`zeus_callbacks.lightning.pl` does for the other adapters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.pipeline_frequency.pipelining import find_stage, instrument
from zeus_callbacks.lightning._callbacks import _log_metrics

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    LightningPipelineFrequencyOptimizer: type  # built on first access, see `__getattr__`

__all__ = ["LightningPipelineFrequencyOptimizer", "build_callback"]

_PREFIX = "pipeline_frequency_optimizer/"


def build_callback(callback: type, module: str) -> type:
    """Build `LightningPipelineFrequencyOptimizer` on `callback` (`lightning.pytorch.Callback` or
    `pytorch_lightning.Callback`), named as if defined in `module`."""

    class LightningPipelineFrequencyOptimizer(callback):  # type: ignore[valid-type,misc]
        """Perseus for a `LightningModule` whose `training_step` runs a `torch.distributed.pipelining` schedule.

        Drives `zeus_callbacks.PipelineFrequencyOptimizer` (see it for the method and the arguments):
        `on_train_start` finds this rank's pipeline stage (`stage`, else an attribute of the module that is
        a `PipelineStage` or a single-stage schedule) and reports its `forward_one_chunk`/`backward_one_chunk`
        calls as instructions; `on_train_batch_start`/`on_train_batch_end` → `on_step_begin`/`on_step_end`
        (one batch = one pipeline iteration); `on_train_end` and `on_exception` →
        `PipelineFrequencyOptimizer.on_train_end` (clocks reset). At each logging step the trainer's loggers
        get `PipelineFrequencyOptimizer.metrics()` (numbers only), prefixed `pipeline_frequency_optimizer/`.

        Args:
            stage: This rank's `PipelineStage`, or None to find it on the module at `on_train_start`.
            *args: Positional arguments of `PipelineFrequencyOptimizer` (Zeus's: rank, dp_rank, pp_rank, ...).
            **kwargs: Keyword arguments of `PipelineFrequencyOptimizer` (monitor, schedule, profile_path, ...).

        Raises:
            ValueError: at `on_train_start`, when the job has no pipeline stage to instrument.

        Example::

            class PipelineModule(LightningModule):
                def __init__(self, stage, schedule):
                    super().__init__()
                    self.stage, self.schedule = stage, schedule
                    self.automatic_optimization = False

                def training_step(self, batch, batch_idx):
                    ...  # self.schedule.step(...), then the optimizer step

            pfo = LightningPipelineFrequencyOptimizer(monitor=ZeusMonitor(gpu_indices=[local_rank]))
            Trainer(callbacks=[pfo]).fit(PipelineModule(stage, schedule))
        """

        def __init__(self, stage: Any = None, *args: Any, **kwargs: Any) -> None:
            super().__init__()
            self.stage = stage
            self.optimizer = PipelineFrequencyOptimizer(*args, **kwargs)
            self._undo: Any = None

        @override
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Instruments the pipeline stage's forward and backward chunks."""
            stage = find_stage(self.stage if self.stage is not None else pl_module)
            if stage is None:
                raise ValueError(
                    "LightningPipelineFrequencyOptimizer is attached to a job with no pipeline stage: pass "
                    "`LightningPipelineFrequencyOptimizer(stage=...)` with this rank's torch.distributed."
                    "pipelining PipelineStage (or keep it, or its schedule, as an attribute of the "
                    "LightningModule). Without pipeline parallelism, use LightningGlobalPowerLimitOptimizer."
                )
            if self._undo is None:
                self._undo = instrument(stage, None, self.optimizer)

        @override
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            """Drives `PipelineFrequencyOptimizer.on_step_begin`."""
            self.optimizer.on_step_begin()

        @override
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            """Drives `PipelineFrequencyOptimizer.on_step_end`; logs its metrics at logging steps."""
            self.optimizer.on_step_end()
            if trainer._logger_connector.should_update_logs:
                metrics = self.optimizer.metrics()
                _log_metrics(
                    trainer, {f"{_PREFIX}{k}": v for k, v in metrics.items() if isinstance(v, float)}
                )

        @override
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Drives `PipelineFrequencyOptimizer.on_train_end` (clocks reset)."""
            self._close()

        @override
        def on_exception(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
        ) -> None:
            """Resets the clocks when training raises."""
            self._close()

        def _close(self) -> None:
            self.optimizer.on_train_end()
            if self._undo is not None:
                self._undo()
                self._undo = None

    LightningPipelineFrequencyOptimizer.__module__ = module
    return LightningPipelineFrequencyOptimizer


def __getattr__(name: str) -> Any:
    if name != "LightningPipelineFrequencyOptimizer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lightning.pytorch import Callback

    globals()[name] = build_callback(Callback, __name__)
    return globals()[name]
