"""HuggingFace `transformers.Trainer` adapters: trainer hooks in, core calls out."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler
from typing_extensions import override

from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import EnergyReporter
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import OptimumSelector

try:
    from transformers.trainer_callback import ExportableState
except ImportError:  # pragma: no cover - transformers < 4.41 keeps no callback state in checkpoints

    class ExportableState:  # type: ignore[no-redef]
        """Stand-in for transformers' `ExportableState` (checkpoints of this version carry no callback state)."""


__all__ = ["HFZeusMonitor", "HFGlobalPowerLimitOptimizer"]

OPTIMIZER_PREFIX = "power_limit_optimizer/"
"""Prefix of the metrics `HFGlobalPowerLimitOptimizer` adds to the trainer's logs."""


def _run_before_trackers(callback: TrainerCallback) -> None:
    """Move `callback` to the front of the trainer's callbacks; call it from a hook only.

    transformers puts the `report_to` trackers before the user's callbacks, and `on_log` hands them the
    logs in that order, so metrics added to the logs reach only the callbacks after ours. No hook receives
    the `CallbackHandler`; the hook's caller (maybe through a wrapper or two) is its `call_event`, whose
    loop skips nothing when a callback moves itself forward. Without that handler, metrics still reach
    `state.log_history` and the callbacks after this one.
    """
    frame, handler = sys._getframe(2), None
    for _ in range(4):
        if frame is None or isinstance(handler := frame.f_locals.get("self"), CallbackHandler):
            break
        frame = frame.f_back
    if not isinstance(handler, CallbackHandler) or handler.callbacks[0] is callback:
        return
    if any(cb is callback for cb in handler.callbacks):
        handler.callbacks.remove(callback)
        handler.callbacks.insert(0, callback)


def _log(state: TrainerState, logs: dict[str, Any] | None, metrics: dict[str, Any]) -> None:
    """Add `metrics` to the logs being sent and to the copy already kept in `state.log_history`."""
    if logs is not None:
        logs.update(metrics)
    if state.log_history:
        state.log_history[-1].update(metrics)


class HFZeusMonitor(TrainerCallback):
    """Report the GPUs' energy to the trainer's loggers (`report_to`) and `state.log_history`.

    At every log event the logs get the energy of the logging interval (`energy/interval_j`, its average
    power and duration, per GPU too, and `energy/simulated`); the end-of-training summary also gets the
    run's totals (`energy/total_j`, ...). The names come from `EnergyReporter`.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s) (under torch.distributed, this rank's).

    Example::

        from transformers import Trainer
        from zeus_callbacks import HFZeusMonitor, ZeusMonitor

        trainer = Trainer(model, args, train_dataset=ds, callbacks=[HFZeusMonitor(ZeusMonitor(gpu_indices=[0]))])
        trainer.train()
        total_j = trainer.state.log_history[-1]["energy/total_j"]
    """

    def __init__(self, monitor: ZeusMonitor) -> None:
        if not isinstance(monitor, ZeusMonitor):
            raise TypeError(
                f"`HFZeusMonitor(monitor={monitor!r})`: expected a zeus_callbacks.ZeusMonitor "
                "(`from zeus_callbacks import ZeusMonitor`)."
            )
        self.monitor = monitor
        self._reporter = EnergyReporter(monitor)

    @override
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_init_end` → run before the `report_to` trackers, so that they get the energy metrics."""
        _run_before_trackers(self)

    @override
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_train_begin` → `EnergyReporter.start` (the run and the first interval begin)."""
        _run_before_trackers(self)
        self._reporter.start()

    @override
    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs
    ):
        """`on_log` → `EnergyReporter.interval`, and `EnergyReporter.stop` on the end-of-training summary
        (the log that carries `train_runtime`); the figures are added to `logs` and `state.log_history`."""
        final = logs is not None and "train_runtime" in logs
        _log(state, logs, {**self._reporter.interval(), **(self._reporter.stop() if final else {})})

    @override
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_train_end` → `EnergyReporter.stop` if no summary log did (totals go to `state.log_history`)."""
        _log(state, None, self._reporter.stop())


class HFGlobalPowerLimitOptimizer(TrainerCallback, ExportableState):
    """Find the best GPU power limit during training and keep it (Zeus's `HFGlobalPowerLimitOptimizer`).

    Drives `zeus_callbacks.GlobalPowerLimitOptimizer` (see it for the method and the arguments) from the
    trainer's steps: `on_step_begin`/`on_step_end`/`on_epoch_end` → the optimizer's hooks of the same
    names, `on_train_end` → `GlobalPowerLimitOptimizer.on_train_end` (the GPUs get their settings back).
    If training raises, `on_train_end` never runs; the process's GPU-state guard then restores the GPUs at
    exit or on SIGINT/SIGTERM. Every log event gets `GlobalPowerLimitOptimizer.metrics()` and the energy of
    the logging interval, prefixed `power_limit_optimizer/`. Checkpoints carry the optimizer's state
    (`state()`); resuming with `TrainingArguments(restore_callback_states_from_checkpoint=True)` applies
    the chosen limit without profiling again.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s) (under torch.distributed, this rank's).
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        wait_steps: Steps to let pass before profiling starts.
        warmup_steps: Steps run at each power limit before it is measured.
        profile_steps: Steps measured at each power limit.
        pl_step: Stride between profiled power limits (W).
        profile_path: JSON profile: loaded if it exists, written (by rank 0) as profiling goes.
        search: "adaptive" (default) or "sweep" (every limit, as Zeus).

    Raises:
        ValueError: a bad argument; the message names it.

    Example::

        from transformers import Trainer
        from zeus_callbacks import HFGlobalPowerLimitOptimizer, MaxSlowdownConstraint, ZeusMonitor

        monitor = ZeusMonitor(gpu_indices=[training_args.local_process_index])
        plo = HFGlobalPowerLimitOptimizer(monitor, MaxSlowdownConstraint(1.1))
        trainer = Trainer(model, training_args, train_dataset=ds, callbacks=[plo])
        trainer.train()
        report = plo.optimizer.report()
    """

    # Instances built by users, newest last: the candidates for `monitor=None` (see `__init__`).
    _built: ClassVar[list[weakref.ref[HFGlobalPowerLimitOptimizer]]] = []

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
        self._training = False
        if monitor is None:
            # On resume, transformers rebuilds stateful callbacks as `type(cb)(**state()["args"])`
            # (`Trainer._load_callback_state`) and swaps them in; the rebuilt one shares the core of the
            # user's newest instance not in a training run, so the user's reference, monitor and
            # selector stay the ones in use.
            owner = next((cb for ref in reversed(self._built) if (cb := ref()) and not cb._training), None)
            if owner is None:
                raise TypeError(
                    "`HFGlobalPowerLimitOptimizer(monitor=None)`: pass the zeus_callbacks.ZeusMonitor "
                    "measuring this process's GPU(s)."
                )
            self.optimizer, self._reporter = owner.optimizer, owner._reporter
            return
        self.optimizer = GlobalPowerLimitOptimizer(
            monitor, optimum_selector, wait_steps, warmup_steps, profile_steps, pl_step, profile_path, search
        )
        self._reporter = EnergyReporter(monitor, prefix=f"{OPTIMIZER_PREFIX}energy_")
        self._built[:] = [ref for ref in self._built if ref() is not None] + [weakref.ref(self)]

    # -- checkpoints (transformers' ExportableState) -----------------------------------------------
    @override
    def state(self) -> dict[str, Any]:
        """What `Trainer` saves in a checkpoint: the optimizer's `state_dict()` (plain numbers and strings)."""
        return {"args": {"monitor": None}, "attributes": {"optimizer_state": self.optimizer.state_dict()}}

    @property
    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's `state_dict()`; setting it (as `Trainer` does on resume) loads it."""
        return self.optimizer.state_dict()

    @optimizer_state.setter
    def optimizer_state(self, value: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(value)

    # -- trainer hooks -----------------------------------------------------------------------------
    @override
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_init_end` → run before the `report_to` trackers, so that they get the metrics."""
        _run_before_trackers(self)

    @override
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_train_begin` → `EnergyReporter.start` (energy per logging interval)."""
        _run_before_trackers(self)
        self._training = True
        self._reporter.start()

    @override
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_step_begin` → `GlobalPowerLimitOptimizer.on_step_begin`."""
        self.optimizer.on_step_begin()

    @override
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_step_end` (after the optimizer step) → `GlobalPowerLimitOptimizer.on_step_end`."""
        self.optimizer.on_step_end()

    @override
    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_epoch_end` → `GlobalPowerLimitOptimizer.on_epoch_end`."""
        self.optimizer.on_epoch_end()

    @override
    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs
    ):
        """`on_log` → `GlobalPowerLimitOptimizer.metrics` and `EnergyReporter.interval`, added to `logs` and
        `state.log_history` under `power_limit_optimizer/`."""
        metrics = {f"{OPTIMIZER_PREFIX}{k}": v for k, v in self.optimizer.metrics().items()}
        _log(state, logs, {**metrics, **self._reporter.interval()})

    @override
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        """`on_train_end` → `GlobalPowerLimitOptimizer.on_train_end` (the GPUs get their settings back)."""
        self._reporter.stop()
        self.optimizer.on_train_end()
        self._training = False
