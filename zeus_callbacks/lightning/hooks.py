"""The Lightning callbacks' hooks, written once for `lightning.pytorch` and `pytorch_lightning` alike.

Each class here is a mixin of hook bodies; `zeus_callbacks.lightning` (on `lightning.pytorch.Callback`) and
`zeus_callbacks.lightning.pl` (on `pytorch_lightning.Callback`) define the callbacks as
`class LightningX(XHooks, Callback)`. This module imports no Lightning package at runtime, and the state a
callback saves in checkpoints is the same under both packages. The hooks take the `protocols.Trainer` part of
either package's trainer, so that the type checker accepts them as overrides of both packages' hooks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack, override

from zeus_callbacks.core.heterogeneous.training import (
    RankPlan,
    apply_power_limit,
    restore_power_limits,
    weight_gradients,
)
from zeus_callbacks.core.monitor.epoch_log import EpochLog
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import pipeline_frequency_metrics
from zeus_callbacks.core.monitor.session import EnergySession
from zeus_callbacks.core.pipeline_frequency.attach import StageAttachment
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.power_limit.keywords import PowerLimitArguments
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.options import PowerLimitOptions, takes_power_limit_options
from zeus_callbacks.core.power_limit.selectors import OptimumSelector
from zeus_callbacks.core.power_limit.session import PowerLimitSession
from zeus_callbacks.core.wrong_framework import OneFramework

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from zeus_callbacks.lightning.protocols import CallbackHooks, Trainer
else:
    CallbackHooks = object  # the mixins come before the package's `Callback` in each callback's bases

__all__ = [
    "ZeusMonitorHooks",
    "GlobalPowerLimitOptimizerHooks",
    "PipelineFrequencyOptimizerHooks",
    "HeterogeneousHooks",
    "EpochLogHooks",
]


def _log_metrics(trainer: Trainer, metrics: dict[str, Any]) -> None:
    """Send `metrics` to every logger of `trainer`, at the step its own metrics use (as `LearningRateMonitor`)."""
    if not metrics:
        return
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _is_logging_step(trainer: Trainer) -> bool:
    """Whether this batch is one the trainer logs at (`log_every_n_steps`)."""
    return trainer._logger_connector.should_update_logs


class ZeusMonitorHooks(OneFramework, CallbackHooks):
    """Log the GPU energy of training to the trainer's loggers, per logging interval and for the run.

    A thin adapter of an `EnergySession` (the adapter contract, in `zeus_callbacks.core.monitor.session`):
    `on_train_start` → `start` (the run and the first interval); `on_train_batch_start`/`_end` →
    `step_begin`/`step_end`; at each logging step (`log_every_n_steps` optimizer steps) or at each
    `on_train_epoch_end` → `interval_metrics`, logged; `on_train_end` → `summary` (logged), then `end`;
    `on_exception` → `fail` (no collective). Intervals are contiguous, so validation run inside
    training counts towards the interval it falls in. Metric names: `energy/interval_j`,
    `energy/interval_time_s`, `energy/interval_avg_power_w`, `energy/gpu<i>_interval_j`,
    `energy/total_j`, `energy/total_time_s`, `energy/total_avg_power_w` and `energy/simulated`.
    Under DDP each rank measures the GPUs of its own `monitor`; the loggers write rank 0's figures.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s), e.g.
            `ZeusMonitor(gpu_indices=[local_rank()])`.
        logging_interval: `"step"` to log every `log_every_n_steps` optimizer steps, `"epoch"` to log
            once per training epoch.
        carbon_intensity: As `HFZeusMonitor`'s: CO2eq figures beside the energy (same names), from a number
            or a region; default the environment's, else none.
        price_per_kwh: As `HFZeusMonitor`'s: cost figures beside the energy (same names), from a number or a
            region; default the environment's, else none.
        report_path: Write the run's HTML report there at train end (`zeus-callbacks report`'s).

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

    _what = "a Lightning callback"
    _does = "energy"

    def __init__(
        self,
        monitor: ZeusMonitor,
        logging_interval: str = "step",
        carbon_intensity: float | str | None = None,
        price_per_kwh: float | str | None = None,
        report_path: str | Path | None = None,
    ) -> None:
        super().__init__()
        if logging_interval not in ("step", "epoch"):
            raise ValueError(
                f"`LightningZeusMonitor(logging_interval={logging_interval!r})` is not supported. "
                "Expected 'step' or 'epoch'."
            )
        self._session = EnergySession(
            "LightningZeusMonitor", monitor, carbon_intensity, price_per_kwh, report_path
        )
        self.monitor = monitor
        self.logging_interval = logging_interval

    def total_energy_j(self) -> float:
        """GPU energy of the last finished run (J), summed over this process's monitored GPUs."""
        return self._session.total_energy_j

    def total_time_s(self) -> float:
        """Duration of the last finished run (s), from train start to train end."""
        return self._session.total_time_s

    @override
    def on_train_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `start`: the run and its first interval begin."""
        self._session.start()

    @override
    def on_train_batch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Drives `step_begin` with the optimizer steps so far (steps under gradient accumulation)."""
        self._session.step_begin(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Drives `step_end`; logs `interval_metrics` after an optimizer step that is a logging step."""
        stepped = self._session.step_end(trainer.global_step)
        if stepped and self.logging_interval == "step" and _is_logging_step(trainer):
            _log_metrics(trainer, self._session.interval_metrics())

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Logs `interval_metrics` once per epoch with `logging_interval="epoch"`."""
        if self.logging_interval == "epoch":
            _log_metrics(trainer, self._session.interval_metrics())

    @override
    def on_train_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Logs `summary` (the run's totals), then drives `end`."""
        _log_metrics(trainer, self._session.summary())
        self._session.end()

    @override
    def on_exception(self, trainer: Trainer, pl_module: torch.nn.Module, exception: BaseException) -> None:
        """Drives `fail`: the windows are closed without figures and without a collective (the other ranks
        may not have failed); nothing is logged."""
        self._session.fail()

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: torch.nn.Module, checkpoint: Any) -> None:
        """Drives `checkpoint`: this rank's energy ledger line so far."""
        self._session.checkpoint(trainer.global_step)


class GlobalPowerLimitOptimizerHooks(OneFramework, CallbackHooks):
    """Find the best GPU power limit during training and keep it (Zeus's `GlobalPowerLimitOptimizer`).

    A thin adapter of a `PowerLimitSession` (the adapter contract, in
    `zeus_callbacks.core.power_limit.session`) of `zeus_callbacks.GlobalPowerLimitOptimizer`, which holds
    all state and does the measuring, deciding and restoring. Which Lightning hook drives which call:

    - `on_train_start` → `start`;
    - `on_train_batch_start` / `on_train_batch_end` → `step_begin` / `step_end` with the optimizer steps
      so far: with `accumulate_grad_batches=k` one profiled step is k micro-batches and their optimizer
      step, and validation or checkpointing between steps is not charged to a power limit;
    - `on_train_epoch_end` → `epoch_end`;
    - `on_train_end` → `summary` (logged), then `end`: the GPUs' settings are restored; `on_exception` →
      `fail`;
    - `state_dict`/`load_state_dict` → the session's, so the profile is saved in Lightning checkpoints and
      a run resumed from one applies the chosen limit without profiling again (a corrupted state is
      refused with one warning naming the checkpoint).

    Its figures (`power_limit_optimizer/power_limit_w`, `.../optimal_power_limit_w`,
    `.../profiling_steps`, `.../profiling_energy_j`, and the interval's energy unless a
    `LightningZeusMonitor` of the same monitor logs it) go to the trainer's loggers every
    `log_every_n_steps` optimizer steps, and the run's totals at train end. Under DDP (`strategy="ddp"`, launched by
    Lightning or torchrun) every rank measures its own GPU and all ranks apply the same limit at the same
    step. `strategy="ddp_spawn"` is refused with a message saying what to use instead: it pickles the
    callbacks into the processes it spawns, and a monitor holds NVML handles and the GPU-state guard
    belongs to the process that made the changes.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU, e.g.
            `ZeusMonitor(gpu_indices=[local_rank()])`.
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        **options: The other options (`wait_steps`, ..., `report_path`), by keyword: `PowerLimitOptions`,
            where each is documented, named and defaulted once.

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

    _what = "a Lightning callback"
    _does = "power_limit"

    @takes_power_limit_options()
    def __init__(
        self,
        monitor: ZeusMonitor,
        optimum_selector: OptimumSelector | None = None,
        **options: Unpack[PowerLimitArguments],
    ) -> None:
        super().__init__()
        name = type(self).__name__
        opts = PowerLimitOptions(owner=name, optimum_selector=optimum_selector, **options)
        self._session = PowerLimitSession(name, monitor, opts)

    @property
    def optimizer(self) -> GlobalPowerLimitOptimizer:
        """The core optimizer: `phase`, `optimal_power_limit_w`, `metrics()`, `report()`."""
        return self._session.optimizer

    @override
    def on_train_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `start`: the run's energy is measured from here."""
        self._session.start()

    def __getstate__(self) -> dict[str, Any]:
        # Only `strategy="ddp_spawn"` (and other spawning launchers) pickle a trainer's callbacks.
        raise TypeError(
            f"`{type(self).__name__}` cannot be sent to processes started with the `spawn` method "
            '(`Trainer(strategy="ddp_spawn")`): its monitor holds NVML handles, and the GPUs it changes '
            'are restored by the process that changed them. Use `strategy="ddp"` (Lightning starts the '
            "processes itself) or launch the script with torchrun; each process then builds its own "
            "callback with `ZeusMonitor(gpu_indices=[local_rank()])`."
        )

    @override
    def on_train_batch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Drives `step_begin` with the optimizer steps so far."""
        self._session.step_begin(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Drives `step_end`; logs `interval_metrics` on logging steps."""
        if self._session.step_end(trainer.global_step) and _is_logging_step(trainer):
            _log_metrics(trainer, self._session.interval_metrics())

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `epoch_end`."""
        self._session.epoch_end()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Logs `summary` (energy, time, average power, profiling cost, the choice and its saving), then
        drives `end`, which restores the GPUs' settings."""
        _log_metrics(trainer, self._session.summary())
        self._session.end()

    @override
    def on_exception(self, trainer: Trainer, pl_module: torch.nn.Module, exception: BaseException) -> None:
        """Drives `fail`: the GPUs' settings are restored when training fails too."""
        self._session.fail()

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: torch.nn.Module, checkpoint: Any) -> None:
        """Drives `checkpoint`: this rank's energy ledger line so far."""
        self._session.checkpoint(trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The session's `state_dict()`: plain numbers and strings."""
        return self._session.state_dict()

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: torch.nn.Module, checkpoint: dict[str, Any]
    ) -> None:
        """Notes the checkpoint being resumed (`trainer.ckpt_path`, before `load_state_dict`) for its message."""
        self._ckpt_path = trainer.ckpt_path

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`load_state`: a finished profile is applied without profiling again; a corrupted state is refused
        with one warning naming the checkpoint, and profiling carries on from the `profile_path` profile,
        else starts afresh."""
        self._session.load_state(
            state_dict, getattr(self, "_ckpt_path", None) or "the checkpoint being resumed"
        )


class PipelineFrequencyOptimizerHooks(CallbackHooks):
    """Perseus for a `LightningModule` whose `training_step` runs a `torch.distributed.pipelining` schedule.

    Drives `zeus_callbacks.PipelineFrequencyOptimizer` (see it for the method and the arguments):
    `on_train_start` finds this rank's pipeline stage (`stage`, else an attribute of the module that is
    a `PipelineStage` or a schedule; with a multi-stage schedule such as `ScheduleInterleaved1F1B`, all its
    stages and its order) and reports its `forward_one_chunk`/`backward_one_chunk`
    calls as instructions (`StageAttachment.attach`); `on_train_batch_start`/`on_train_batch_end` →
    `on_step_begin`/`on_step_end` (one batch = one pipeline iteration); `on_train_end` and `on_exception` →
    `StageAttachment.detach` (clocks reset). At each logging step the trainer's loggers get
    `PipelineFrequencyOptimizer.metrics()` (numbers only), prefixed `pipeline_frequency_optimizer/`.

    Args:
        stage: This rank's `PipelineStage` (or its schedule), or None to find it on the module at
            `on_train_start`.
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
        self.optimizer = PipelineFrequencyOptimizer(*args, **kwargs)
        self._stage = StageAttachment(
            self.optimizer,
            stage,
            adapter="LightningPipelineFrequencyOptimizer",
            alternative="LightningGlobalPowerLimitOptimizer",
        )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `StageAttachment.attach` on the LightningModule."""
        self._stage.attach(pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Drives `PipelineFrequencyOptimizer.on_step_begin`."""
        self.optimizer.on_step_begin()

    @override
    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Drives `PipelineFrequencyOptimizer.on_step_end`; logs its metrics at logging steps."""
        self.optimizer.on_step_end()
        if _is_logging_step(trainer):
            _log_metrics(trainer, pipeline_frequency_metrics(self.optimizer.metrics(), numbers_only=True))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `StageAttachment.detach` (clocks reset)."""
        self._stage.detach()

    @override
    def on_exception(self, trainer: Trainer, pl_module: torch.nn.Module, exception: BaseException) -> None:
        """Drives `StageAttachment.detach`: the clocks are reset when training raises too."""
        self._stage.detach()


class HeterogeneousHooks(CallbackHooks):
    """Weight this rank's gradients and run its GPU at the planned power limit during `fit`.

    `on_fit_start` → `weight_gradients(pl_module, rank_plan)` and `apply_power_limit(rank_plan, gpu_index)`;
    `on_fit_end` → remove the weights and `restore_power_limits()`. Give the `Trainer` this rank's
    `uneven_dataloader(dataset, rank_plan)`: its sampler is a `DistributedSampler`, so Lightning keeps it.

    Args:
        rank_plan: This rank's share of the plan (`rank_plan(plan)`).
        gpu_index: This rank's GPU; default `local_rank()`.

    Example::

        rp = rank_plan(plan(profiles, counts, global_batch=1024))
        Trainer(callbacks=[LightningHeterogeneous(rp)]).fit(model, uneven_dataloader(train_set, rp))
    """

    def __init__(self, rank_plan: RankPlan, gpu_index: int | None = None) -> None:
        super().__init__()
        self.rank_plan = rank_plan
        self.gpu_index = gpu_index
        self._weights: Any = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `weight_gradients` and `apply_power_limit`."""
        self._weights = weight_gradients(pl_module, self.rank_plan)
        apply_power_limit(self.rank_plan, self.gpu_index)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Removes the gradient weights; drives `restore_power_limits`."""
        if self._weights is not None:
            self._weights.remove()
            self._weights = None
        restore_power_limits()


class EpochLogHooks(CallbackHooks):
    """Log each train and validation epoch's time, energy and power to Zeus's profiler files (`EpochLog`).

    `on_train_epoch_start/end` → `EpochLog.begin/end("train")`, `on_validation_epoch_start/end` →
    `EpochLog.begin/end("eval")` (sanity checks excluded), `on_fit_end` → `EpochLog.close()`.

    Args:
        monitor: Measures this process's GPU (default: `local_rank()`'s under torch.distributed, else every
            visible GPU).
        log_prefix: Overrides `ZEUS_LOG_PREFIX`.

    Raises:
        ValueError: no `log_prefix` and `ZEUS_LOG_PREFIX` unset.
    """

    def __init__(self, monitor: ZeusMonitor | None = None, log_prefix: str | None = None) -> None:
        super().__init__()
        self.log = EpochLog(monitor=monitor, log_prefix=log_prefix)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `EpochLog.begin("train")`."""
        self.log.begin("train")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `EpochLog.end("train")`."""
        self.log.end("train")

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `EpochLog.begin("eval")`, except in the sanity check."""
        if not trainer.sanity_checking:
            self.log.begin("eval")

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `EpochLog.end("eval")`, except in the sanity check."""
        if not trainer.sanity_checking:
            self.log.end("eval")

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None:
        """Drives `EpochLog.close()`."""
        self.log.close()
