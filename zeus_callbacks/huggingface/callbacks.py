"""The transformers callbacks of the energy monitor, the power-limit optimizer and Zeus's epoch log: trainer hooks
in, session calls out (`HFZeusMonitor`, `HFGlobalPowerLimitOptimizer`, `HFEpochLog`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from typing_extensions import Unpack, override

from zeus_callbacks.core.monitor.epoch_log import EpochLog
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.session import EnergySession
from zeus_callbacks.core.power_limit.keywords import PowerLimitArguments
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.options import PowerLimitOptions, takes_power_limit_options
from zeus_callbacks.core.power_limit.selectors import OptimumSelector
from zeus_callbacks.core.power_limit.session import PowerLimitSession
from zeus_callbacks.core.wrong_framework import OneFramework
from zeus_callbacks.huggingface.checkpoints import (
    TRAINER_STATE_NAME,
    checkpoint_state,
    earlier_checkpoints,
    optimizer_state_in,
    resumed_checkpoint,
    warn_if_newest_checkpoint_is_cut_short,
)

try:
    from transformers.trainer_callback import ExportableState
except ImportError:  # pragma: no cover - transformers < 4.41 keeps no callback state in checkpoints

    class ExportableState:  # type: ignore[no-redef]
        """Stand-in for transformers' `ExportableState` (checkpoints of this version carry no callback state)."""


from zeus_callbacks.huggingface.trainer import (
    LogsFirst,
    RestoresOnException,
    ResumesFromCheckpoint,
    log_metrics,
)

__all__ = ["HFZeusMonitor", "HFGlobalPowerLimitOptimizer", "HFEpochLog"]

logger = logging.getLogger("zeus_callbacks.huggingface")


_COPYING = "_zeus_callbacks_copying"  # `BuiltByTheUser.__getnewargs_ex__`


class BuiltByTheUser:
    """A callback that needs arguments (the monitor): built with none, it says what went wrong.

    transformers' `Trainer(callbacks=[...])` takes classes too and builds them with no arguments
    (`CallbackHandler.add_callback`), so a class passed there instead of an instance would fail with
    Python's bare "missing ... 'monitor'".
    """

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """`copy` (and `pickle`) build a copy with this marker, not as a class built with no arguments."""
        return (), {_COPYING: True}

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            raise TypeError(
                f"`{cls.__name__}()` was built without arguments: it needs the zeus_callbacks.ZeusMonitor of this "
                "process's GPU(s). Given to Trainer(callbacks=[...]) as a class, transformers builds it so: "
                f"pass an instance, `callbacks=[{cls.__name__}(ZeusMonitor(gpu_indices=[local_rank]))]`."
            )
        return super().__new__(cls)


class SessionCallback(BuiltByTheUser, OneFramework, RestoresOnException, LogsFirst):
    """The trainer hooks that drive either session the same way (`PowerLimitSession`, `EnergySession`; the
    contract is in `zeus_callbacks.core.power_limit.session`): `on_step_begin`/`on_step_end` → `step_begin`/
    `step_end` (transformers' step hooks fire once per optimizer step), `on_log` → `interval_metrics`, or
    `summary` on the end-of-training log (the one that carries `train_runtime`), the figures added to `logs`
    and `state.log_history`; `on_train_end` → `end`; `train()` raising → `fail` (with `ZeusTrainerMixin` /
    `restoring_gpus`: no collective). A subclass sets `_session` and starts it at `on_train_begin`."""

    _session: PowerLimitSession | EnergySession

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_begin` → `step_begin` (one call per optimizer step)."""
        self._session.step_begin()

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_end` (after the optimizer step) → `step_end`."""
        self._session.step_end()

    @override
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """`on_log` → `interval_metrics`, or `summary` (the run's totals) on the end-of-training log; added
        to `logs` and `state.log_history` (strings too: the trainer's logs take them)."""
        final = logs is not None and "train_runtime" in logs
        session = self._session
        log_metrics(state, logs, session.summary(False) if final else session.interval_metrics(False))

    @override
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_save` (a checkpoint was written) → `checkpoint`: this rank's energy ledger line so far."""
        self._session.checkpoint(state.global_step)

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `end`."""
        self._run_ended()
        self._session.end()

    @override
    def _train_failed(self) -> None:
        """`trainer.train()` raised → `fail`."""
        self._session.fail()


class HFZeusMonitor(SessionCallback):
    """Report the GPUs' energy to the trainer's loggers (`report_to`) and `state.log_history`.

    Drives an `EnergySession` (the adapter contract, in `zeus_callbacks.core.monitor.session`):
    `on_train_begin` → `start`, the rest as `SessionCallback` says; `train()` raising → `fail` with
    `ZeusTrainerMixin` / `restoring_gpus` (no collective).
    At every log event the logs get the energy of the logging interval (`energy/interval_j`, its average
    power and duration, per GPU too, and `energy/simulated`); the end-of-training summary also gets the
    run's totals (`energy/total_j`, ...). The names come from `EnergyReporter`.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s) (under torch.distributed, this rank's).
        carbon_intensity: gCO2eq/kWh or a region (`"DE"`): the logs also get `energy/interval_co2eq_g` and
            `energy/total_co2eq_g`. Default `$ZEUS_CALLBACKS_CARBON_INTENSITY`, else none.
        price_per_kwh: Price per kWh or a U.S. state (`"US-CA"`): `energy/interval_cost`,
            `energy/total_cost`. Default `$ZEUS_CALLBACKS_ELECTRICITY_PRICE`, else none.
        report_path: Write the run's HTML report there at train end (`zeus-callbacks report`'s): power over
            time, energy per step, the run's energy, CO2eq and cost.

    Raises:
        TypeError: `monitor` is not a `ZeusMonitor`.

    Example::

        from transformers import Trainer
        from zeus_callbacks import HFZeusMonitor, ZeusMonitor

        trainer = Trainer(model, args, train_dataset=ds, callbacks=[HFZeusMonitor(ZeusMonitor(gpu_indices=[0]))])
        trainer.train()
        total_j = trainer.state.log_history[-1]["energy/total_j"]
    """

    _what = "a transformers TrainerCallback"
    _does = "energy"
    _session: EnergySession

    def __init__(
        self,
        monitor: ZeusMonitor,
        carbon_intensity: float | str | None = None,
        price_per_kwh: float | str | None = None,
        report_path: str | Path | None = None,
    ) -> None:
        self._session = EnergySession(
            type(self).__name__, monitor, carbon_intensity, price_per_kwh, report_path
        )
        self.monitor = monitor

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → `EnergySession.start` (the run and the first interval begin)."""
        super().on_train_begin(args, state, control, **kwargs)
        self._session.start()


class RebuiltAsItself:
    """A stateful callback that transformers' resume rebuilds as itself.

    With `restore_callback_states_from_checkpoint`, `Trainer._load_callback_state` rebuilds each stateful
    callback as `type(cb)(**cb.state()["args"])` and swaps the rebuild in for `cb`. Each instance of a
    subclass has a class of its own (of the same name, so checkpoints name it as before) that knows it, so
    the rebuild is the instance itself: the user's reference stays the callback in use, with its monitor
    and options, and no registry of instances is kept. `__init__` returns at once on an instance already
    built.
    """

    _itself: ClassVar[RebuiltAsItself | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls._itself is not None:  # a copy (`copy.copy`) is a new instance; a rebuild is the instance
            return super().__new__(cls, *args, **kwargs) if _COPYING in kwargs else cls._itself
        own = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        own.__doc__ = cls.__doc__
        assert issubclass(own, RebuiltAsItself)  # the checker sees `type(...)` build a `type`
        instance = super().__new__(own, *args, **kwargs)  # `BuiltByTheUser`: not without arguments
        own._itself = instance
        return instance


def _output_dir(args: TrainingArguments) -> str:
    """`args.output_dir`: typed optional, but `TrainingArguments.__post_init__` sets `"trainer_output"` for None."""
    assert args.output_dir is not None
    return args.output_dir


def _saved_state(state: TrainerState, name: str) -> Any:
    """The optimizer state a resumed run's trainer state holds for the callback class `name`, or None on a
    fresh run."""
    return optimizer_state_in(state.stateful_callbacks, name) if state.global_step else None


class HFGlobalPowerLimitOptimizer(RebuiltAsItself, SessionCallback, ResumesFromCheckpoint, ExportableState):
    """Find the best GPU power limit during training and keep it (Zeus's `HFGlobalPowerLimitOptimizer`).

    Drives a `PowerLimitSession` (the adapter contract, in `zeus_callbacks.core.power_limit.session`) of
    `zeus_callbacks.GlobalPowerLimitOptimizer` (see it for the method) from the trainer's steps:
    `on_train_begin` → `start`, `on_step_begin`/`on_step_end`/`on_epoch_end` → `step_begin`/`step_end`/
    `epoch_end`, `on_log` → `interval_metrics` (`summary` on the end-of-training log), `on_train_end` →
    `end` (the GPUs get their settings back).
    If `trainer.train()` raises, the GPUs get their settings back before the exception leaves `train()` with
    `ZeusTrainerMixin` / `restoring_gpus` (as with Lightning's `on_exception`); without them, when the
    notebook cell ends, or at the next `train()` or the process's end (`RestoresOnException`). Every log event gets
    `GlobalPowerLimitOptimizer.metrics()` and the energy of the logging interval, prefixed
    `power_limit_optimizer/`. Checkpoints carry the optimizer's state (`state()`); `trainer.train(
    resume_from_checkpoint=...)` resumes it, with or without `restore_callback_states_from_checkpoint`: a
    chosen limit is applied without profiling again, a partial profile carries on at the next limit, and
    the profiling counters and `report()` carry on; training resumes from exactly the checkpoint named.
    A corrupted optimizer state in it is refused, with one warning naming the file, for the `profile_path`
    profile's (first an earlier checkpoint's state). A newest checkpoint cut short by a
    kill while it was being saved is said in one line with the last complete one to resume from
    (`ZeusTrainerMixin` resumes from it itself).

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s) (under torch.distributed, this rank's).
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        wait_steps, warmup_steps, profile_steps, pl_step, profile_path: Zeus's, positional as in Zeus.
        search, allow_raising_limit, report_path: by keyword. Every option is documented, named and
            defaulted once, in `PowerLimitOptions`.

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

    _what = "a transformers TrainerCallback"
    _does = "power_limit"
    _session: PowerLimitSession

    @takes_power_limit_options(zeus_positional=True)
    def __init__(
        self,
        monitor: ZeusMonitor,
        optimum_selector: OptimumSelector | None = None,
        **options: Unpack[PowerLimitArguments],
    ) -> None:
        if "_session" in self.__dict__:
            return  # transformers' rebuild on resume, which is this instance (`RebuiltAsItself`)
        self._checkpoint: Path | None = None  # the checkpoint `train()` resumes from (ZeusTrainerMixin)
        self._said_cut_short: str | None = None
        opts = PowerLimitOptions(owner=type(self).__name__, optimum_selector=optimum_selector, **options)
        self._session = PowerLimitSession(type(self).__name__, monitor, opts)

    @property
    def optimizer(self) -> GlobalPowerLimitOptimizer:
        """The core optimizer: `phase`, `optimal_power_limit_w`, `metrics()`, `report()`."""
        return self._session.optimizer

    # -- checkpoints (transformers' ExportableState) -----------------------------------------------
    @override
    def state(self) -> dict[str, Any]:
        """What `Trainer` saves in a checkpoint: the optimizer's `state_dict()` (plain numbers and strings)."""
        return {"args": {"monitor": None}, "attributes": {"optimizer_state": self._session.state_dict()}}

    @property
    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's `state_dict()`; setting it (as `Trainer` does on resume) is left to `on_train_begin`,
        which loads the same state through the session."""
        return self._session.state_dict()

    @optimizer_state.setter
    def optimizer_state(self, value: dict[str, Any]) -> None:
        # transformers sets it on resume (`restore_callback_states_from_checkpoint`); `on_train_begin` loads
        # the same state from the trainer state through the session (one path, one refusal message).
        pass

    def _resume(self, saved: Any) -> None:
        """Load the checkpoint's optimizer state (`PowerLimitSession.load_state`); one that is cut short or
        corrupted is refused with one warning naming the file, for an earlier checkpoint's state."""
        name = type(self).__name__
        source = (
            self._checkpoint / TRAINER_STATE_NAME if self._checkpoint else "the checkpoint's trainer state"
        )
        earlier = (
            (c / TRAINER_STATE_NAME, checkpoint_state(c, name))
            for c in (earlier_checkpoints(self._checkpoint) if self._checkpoint else [])
        )
        self._session.load_state(saved, source, earlier)

    def _say_cut_short_checkpoint(self, args: TrainingArguments) -> None:
        """Once per output folder: its newest checkpoint is cut short (how to resume from the last complete)."""
        output_dir = _output_dir(args)
        if self._said_cut_short != output_dir:
            self._said_cut_short = output_dir
            warn_if_newest_checkpoint_is_cut_short(output_dir)

    # -- trainer hooks -----------------------------------------------------------------------------
    @override
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_init_end` → one line when the newest checkpoint is cut short (before a resume from it fails)."""
        if not self._in_zeus_trainer:
            self._say_cut_short_checkpoint(args)

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → on a resumed run `PowerLimitSession.load_state` with the state the checkpoint's
        trainer state holds, whatever `restore_callback_states_from_checkpoint` says (`_resume`: a corrupted
        one is refused), then `PowerLimitSession.start`."""
        super().on_train_begin(args, state, control, **kwargs)
        if not self._in_zeus_trainer and not state.global_step:
            self._say_cut_short_checkpoint(args)
        if self._checkpoint is None and state.global_step:
            self._checkpoint = resumed_checkpoint(_output_dir(args), state.global_step)
        saved = _saved_state(state, type(self).__name__)
        if saved is not None:
            self._resume(saved)
        self._session.start()

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_epoch_end` → `PowerLimitSession.epoch_end`."""
        self._session.epoch_end()

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `PowerLimitSession.end` (the GPUs get their settings back)."""
        super().on_train_end(args, state, control, **kwargs)
        self._checkpoint = None

    @override
    def _train_failed(self) -> None:
        """`trainer.train()` raised → `PowerLimitSession.fail` (the GPUs' settings back, the energy windows
        closed, the report marked failed)."""
        super()._train_failed()
        self._checkpoint = None


class HFEpochLog(TrainerCallback):
    """Log each training epoch's time, energy and power to Zeus's profiler files (see `EpochLog`).

    `on_epoch_begin` → `EpochLog.begin("train")`, `on_epoch_end` → `EpochLog.end("train")`, `on_evaluate`
    is not timed (evaluation falls inside the training epoch, as in Zeus), `on_train_end` → `EpochLog.close()`.

    Args:
        monitor: Measures this process's GPU (default: `local_rank()`'s under torch.distributed, else every
            visible GPU).
        log_prefix: Overrides `ZEUS_LOG_PREFIX`.

    Raises:
        ValueError: no `log_prefix` and `ZEUS_LOG_PREFIX` unset.
    """

    def __init__(self, monitor: ZeusMonitor | None = None, log_prefix: str | None = None) -> None:
        self.log = EpochLog(monitor=monitor, log_prefix=log_prefix)

    @override
    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_epoch_begin` → `EpochLog.begin("train")`."""
        self.log.begin("train")

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_epoch_end` → `EpochLog.end("train")`."""
        self.log.end("train")

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `EpochLog.close()`."""
        self.log.close()
