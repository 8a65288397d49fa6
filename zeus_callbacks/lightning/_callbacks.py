"""The Lightning callbacks, written once and built on the `Callback` of lightning.pytorch or pytorch_lightning."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import EnergyReporter
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import OptimumSelector

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__ = ["build_callbacks"]

_POWER_LIMIT_PREFIX = "power_limit_optimizer/"


def _log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send `metrics` to every logger of `trainer`, at the step its own metrics use (as `LearningRateMonitor`)."""
    if not metrics:
        return
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class _OptimizerSteps:
    """Which micro-batches begin and end an optimizer step.

    With gradient accumulation Lightning calls the batch hooks once per micro-batch, but a training step
    for the power-limit optimizer is an optimizer step: it begins at the first micro-batch after the
    previous optimizer step and ends at the batch during which `trainer.global_step` moved. This also
    holds under manual optimization, where `global_step` counts the optimizer's `step()` calls.
    """

    def __init__(self) -> None:
        self._begun_at: int | None = None

    def begins(self, trainer: pl.Trainer) -> bool:
        """Whether this batch (`on_train_batch_start`) opens an optimizer step."""
        if self._begun_at is not None:
            return False
        self._begun_at = trainer.global_step
        return True

    def ends(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizer stepped during this batch (`on_train_batch_end`), closing the step."""
        if self._begun_at is None or trainer.global_step == self._begun_at:
            return False
        self._begun_at = None
        return True


def build_callbacks(callback: type, module: str) -> tuple[type, type]:
    """Build `(LightningZeusMonitor, LightningGlobalPowerLimitOptimizer)` as subclasses of `callback`.

    `callback` is `lightning.pytorch.Callback` or `pytorch_lightning.Callback`; the classes are named as if
    defined in `module`, so that they pickle and their checkpoint state keys are the same for both.
    """

    class LightningZeusMonitor(callback):  # type: ignore[valid-type,misc]
        """Log the GPU energy of training to the trainer's loggers, per logging interval and for the run.

        Lightning's `on_train_start` opens the run and the first interval (`EnergyReporter.start`); at each
        logging step (`log_every_n_steps` optimizer steps, from `on_train_batch_end`) or at each
        `on_train_epoch_end` the interval is closed and logged (`EnergyReporter.interval`); `on_train_end`
        logs the run's totals (`EnergyReporter.stop`). Intervals are contiguous, so validation run inside
        training counts towards the interval it falls in. Metric names: `energy/interval_j`,
        `energy/interval_time_s`, `energy/interval_avg_power_w`, `energy/gpu<i>_interval_j`,
        `energy/total_j`, `energy/total_time_s`, `energy/total_avg_power_w` and `energy/simulated`.
        Under DDP each rank measures the GPUs of its own `monitor`; the loggers write rank 0's figures.

        Args:
            monitor: The `ZeusMonitor` measuring this process's GPU(s), e.g.
                `ZeusMonitor(gpu_indices=[local_rank])`.
            logging_interval: `"step"` to log every `log_every_n_steps` optimizer steps, `"epoch"` to log
                once per training epoch.

        Raises:
            ValueError: If `logging_interval` is neither `"step"` nor `"epoch"`.

        Example::

            from lightning.pytorch import Trainer
            from zeus_callbacks import ZeusMonitor
            from zeus_callbacks.lightning import LightningZeusMonitor

            energy = LightningZeusMonitor(ZeusMonitor(gpu_indices=[0]), logging_interval="epoch")
            trainer = Trainer(callbacks=[energy])
            trainer.fit(model)
            total_j = energy.total_energy_j()
        """

        def __init__(self, monitor: ZeusMonitor, logging_interval: str = "step") -> None:
            super().__init__()
            if logging_interval not in ("step", "epoch"):
                raise ValueError(
                    f"`LightningZeusMonitor(logging_interval={logging_interval!r})` is not supported. "
                    "Expected 'step' or 'epoch'."
                )
            self.monitor = monitor
            self.logging_interval = logging_interval
            self._reporter = EnergyReporter(monitor)
            self._steps = _OptimizerSteps()

        def total_energy_j(self) -> float:
            """GPU energy of the last finished run (J), summed over this process's monitored GPUs."""
            return self._reporter.total_energy_j

        def total_time_s(self) -> float:
            """Duration of the last finished run (s), from train start to train end."""
            return self._reporter.total_time_s

        @override
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Drives `EnergyReporter.start`: the run and its first interval begin."""
            self._reporter.start()

        @override
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            """Notes where an optimizer step begins (for step intervals under gradient accumulation)."""
            self._steps.begins(trainer)

        @override
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            """Drives `EnergyReporter.interval` after an optimizer step that is a logging step."""
            stepped = self._steps.ends(trainer)
            if stepped and self.logging_interval == "step" and trainer._logger_connector.should_update_logs:
                _log_metrics(trainer, self._reporter.interval())

        @override
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Drives `EnergyReporter.interval` once per epoch with `logging_interval="epoch"`."""
            if self.logging_interval == "epoch":
                _log_metrics(trainer, self._reporter.interval())

        @override
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Drives `EnergyReporter.stop` and logs the run's totals."""
            _log_metrics(trainer, self._reporter.stop())

        @override
        def on_exception(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
        ) -> None:
            """Drives `EnergyReporter.stop` so that the monitor's windows are closed; nothing is logged."""
            self._reporter.stop()

    class LightningGlobalPowerLimitOptimizer(callback):  # type: ignore[valid-type,misc]
        """Find the best GPU power limit during training and keep it (Zeus's `GlobalPowerLimitOptimizer`).

        A thin adapter of `zeus_callbacks.core.power_limit.optimizer.GlobalPowerLimitOptimizer`, which holds all state
        and does the measuring, deciding and restoring. Which Lightning hook drives which core call:

        - `on_train_batch_start` → `on_step_begin`, at the first micro-batch of an optimizer step;
        - `on_train_batch_end` → `on_step_end`, at the micro-batch during which the optimizer stepped, so
          with `accumulate_grad_batches=k` one profiled step is k micro-batches and their optimizer step,
          and validation or checkpointing between steps is not charged to a power limit;
        - `on_train_epoch_end` → `on_epoch_end`;
        - `on_train_end` and `on_exception` → `on_train_end`: the GPUs' settings are restored;
        - `state_dict`/`load_state_dict` → the core's, so the profile is saved in Lightning checkpoints and
          a run resumed from one applies the chosen limit without profiling again.

        Its figures (`power_limit_optimizer/power_limit_w`, `.../optimal_power_limit_w`,
        `.../profiling_steps`, `.../profiling_energy_j`) go to the trainer's loggers every
        `log_every_n_steps` optimizer steps and at train end. Under DDP (`strategy="ddp"`, launched by
        Lightning or torchrun) every rank measures its own GPU and all ranks apply the same limit at the same
        step. `strategy="ddp_spawn"` is not supported: it pickles the callbacks, and a monitor holds NVML
        handles.

        Args:
            monitor: The `ZeusMonitor` measuring this process's GPU, e.g.
                `ZeusMonitor(gpu_indices=[int(os.environ.get("LOCAL_RANK", 0))])`.
            optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
            wait_steps: Optimizer steps to let pass before profiling starts.
            warmup_steps: Optimizer steps run at each power limit before it is measured.
            profile_steps: Optimizer steps measured at each power limit.
            pl_step: Stride between profiled power limits (W).
            profile_path: JSON file of the profile, loaded if it exists and written by rank 0.
            search: `"adaptive"` (default) or `"sweep"` (every limit, as Zeus).

        Raises:
            ValueError: A bad argument; the message names it.

        Example::

            from lightning.pytorch import Trainer
            from zeus_callbacks import MaxSlowdownConstraint, ZeusMonitor
            from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer

            plo = LightningGlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), MaxSlowdownConstraint(1.1))
            trainer = Trainer(callbacks=[plo])
            trainer.fit(model)
            chosen_w = plo.optimizer.optimal_power_limit_w
        """

        def __init__(
            self,
            monitor: ZeusMonitor,
            optimum_selector: OptimumSelector | None = None,
            wait_steps: int = 1,
            warmup_steps: int = 10,
            profile_steps: int = 40,
            pl_step: int = 25,
            profile_path: str | Path | None = None,
            search: str = "adaptive",
        ) -> None:
            super().__init__()
            self._optimizer = GlobalPowerLimitOptimizer(
                monitor,
                optimum_selector,
                wait_steps,
                warmup_steps,
                profile_steps,
                pl_step,
                profile_path,
                search,
            )
            self._steps = _OptimizerSteps()

        @property
        def optimizer(self) -> GlobalPowerLimitOptimizer:
            """The core optimizer: `phase`, `optimal_power_limit_w`, `metrics()`, `report()`."""
            return self._optimizer

        @override
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            """Drives `on_step_begin` at the first micro-batch of an optimizer step."""
            if self._steps.begins(trainer):
                self._optimizer.on_step_begin()

        @override
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            """Drives `on_step_end` once the optimizer stepped; logs the optimizer's figures on logging steps."""
            if self._steps.ends(trainer):
                self._optimizer.on_step_end()
                self._log(trainer, force=False)

        @override
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Drives `on_epoch_end`."""
            self._optimizer.on_epoch_end()

        @override
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            """Logs the final figures, then drives `on_train_end`, which restores the GPUs' settings."""
            self._log(trainer, force=True)
            self._optimizer.on_train_end()

        @override
        def on_exception(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
        ) -> None:
            """Drives `on_train_end`: the GPUs' settings are restored when training fails too."""
            self._optimizer.on_train_end()

        @override
        def state_dict(self) -> dict[str, Any]:
            """The core's `state_dict()`: plain numbers and strings."""
            return self._optimizer.state_dict()

        @override
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            """The core's `load_state_dict()`: a finished profile is applied without profiling again."""
            self._optimizer.load_state_dict(state_dict)

        def _log(self, trainer: pl.Trainer, force: bool) -> None:
            if force or trainer._logger_connector.should_update_logs:
                metrics = self._optimizer.metrics()
                numbers = {f"{_POWER_LIMIT_PREFIX}{k}": v for k, v in metrics.items() if isinstance(v, float)}
                _log_metrics(trainer, numbers)

    for cls in (LightningZeusMonitor, LightningGlobalPowerLimitOptimizer):
        cls.__module__ = module
        cls.__qualname__ = cls.__name__
    return LightningZeusMonitor, LightningGlobalPowerLimitOptimizer
