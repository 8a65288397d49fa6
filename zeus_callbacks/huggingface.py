"""HuggingFace `transformers.Trainer` adapters: every transformers class of zeus_callbacks, trainer hooks in,
core calls out.

- `HFZeusMonitor`: the GPUs' energy per logging interval and for the run, in the trainer's logs.
- `HFGlobalPowerLimitOptimizer`: Zeus's power-limit optimizer (`GlobalPowerLimitOptimizer`).
- `HFPipelineFrequencyOptimizer`: Perseus (`PipelineFrequencyOptimizer`) for pipeline-parallel steps.
- `HeterogeneousTrainer` and `HFHeterogeneousCallback`: training on a heterogeneous plan.
- `HFEpochLog`: each epoch's time, energy and power in Zeus's profiler files (`EpochLog`).
- `HFSimulatedGPUWork`: toy steps paced by simulated GPU work (examples and tests on simulated GPUs).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import weakref
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from typing_extensions import override

from zeus_callbacks.core.arguments import require_monitor
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.heterogeneous.training import (
    RankPlan,
    UnevenDistributedSampler,
    apply_power_limit,
    restore_power_limits,
    unshard_dataloader,
)
from zeus_callbacks.core.monitor.epoch_log import EpochLog
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import (
    EnergyReporter,
    Rates,
    pipeline_frequency_metrics,
    power_limit_metrics,
    run_summary,
)
from zeus_callbacks.core.pipeline_frequency.attach import StageAttachment
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import OptimumSelector

try:
    from transformers.trainer_callback import ExportableState
except ImportError:  # pragma: no cover - transformers < 4.41 keeps no callback state in checkpoints

    class ExportableState:  # type: ignore[no-redef]
        """Stand-in for transformers' `ExportableState` (checkpoints of this version carry no callback state)."""


__all__ = [
    "HFZeusMonitor",
    "HFGlobalPowerLimitOptimizer",
    "HFPipelineFrequencyOptimizer",
    "HFHeterogeneousCallback",
    "HeterogeneousTrainer",
    "HFEpochLog",
    "HFSimulatedGPUWork",
]

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name of the trainer state in a checkpoint
_CHECKPOINT_STEP = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)")


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


class _LogsFirst(TrainerCallback):
    """A callback that adds metrics to the logs: it runs before the `report_to` trackers, so they get them."""

    @override
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_init_end` → move this callback before the trackers."""
        _run_before_trackers(self)

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → move this callback before the trackers (added after `on_init_end`)."""
        _run_before_trackers(self)


def _undo_gpu_changes(trainer: Trainer) -> None:
    """Call `_train_failed` on every `_RestoresOnException` callback of `trainer`; `train()` raised."""
    for callback in list(getattr(getattr(trainer, "callback_handler", None), "callbacks", ())):
        if isinstance(callback, _RestoresOnException):
            try:
                callback._train_failed()
            except Exception:  # the training error is the one to see
                logger.warning("%s could not undo its GPU changes.", type(callback).__name__, exc_info=True)


def _trainer_state_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint`'s trainer_state.json cannot be resumed from (missing, cut short, not a state), or None."""
    path = checkpoint / TRAINER_STATE_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "is missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"is unreadable or cut short ({type(e).__name__}: {e})"
    if not isinstance(data, dict) or not isinstance(data.get("global_step"), int):
        return "holds no trainer state"
    return None


def _earlier_checkpoints(checkpoint: Path) -> list[Path]:
    """The `checkpoint-N` folders beside `checkpoint` with a smaller N, newest first."""
    match = _CHECKPOINT_STEP.fullmatch(checkpoint.name)
    if match is None or not checkpoint.parent.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in checkpoint.parent.iterdir()
        if (m := _CHECKPOINT_STEP.fullmatch(p.name)) and p.is_dir() and int(m.group(1)) < int(match.group(1))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def _complete_checkpoint(trainer: Trainer, resume: Any) -> Any:
    """The checkpoint `trainer.train(resume_from_checkpoint=resume)` can resume from.

    transformers writes a checkpoint in place (weights, optimizer, RNG state, then trainer_state.json, whose
    writing is not atomic) and `get_last_checkpoint` takes the newest folder whatever it holds, so a process
    killed while saving leaves a checkpoint that `train()` cannot load (a missing or cut-short
    trainer_state.json: a traceback). Such a checkpoint is skipped, with one warning naming the file, for
    the newest complete one before it, or none (training starts over, said so).
    """
    if resume is None or resume is False:
        return resume
    target = get_last_checkpoint(trainer.args.output_dir) if resume is True else resume
    if target is None:
        return resume  # transformers' own error: no checkpoint at all
    target = Path(target)
    problem = _trainer_state_problem(target)
    if problem is None:
        return str(target)
    earlier = next((p for p in _earlier_checkpoints(target) if _trainer_state_problem(p) is None), None)
    logger.warning(
        "%s %s: that checkpoint was cut short while being saved. %s",
        target / TRAINER_STATE_NAME,
        problem,
        f"Resuming from {earlier}, the last complete checkpoint."
        if earlier is not None
        else f"No complete checkpoint before it in {target.parent}: training starts from the beginning.",
    )
    return str(earlier) if earlier is not None else None


def _restoring_on_exception(train: Any) -> Any:
    """`Trainer.train`, made to call `_undo_gpu_changes` before an exception leaves it; with an
    `HFGlobalPowerLimitOptimizer` attached, it also resumes from the last complete checkpoint
    (`_complete_checkpoint`) and tells the optimizers which one."""

    @functools.wraps(train)
    def restoring_train(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        stateful = [
            cb
            for cb in getattr(getattr(self, "callback_handler", None), "callbacks", ())
            if isinstance(cb, HFGlobalPowerLimitOptimizer)
        ]
        if stateful:
            if args:
                args = (_complete_checkpoint(self, args[0]), *args[1:])
                resume = args[0]
            else:
                resume = kwargs["resume_from_checkpoint"] = _complete_checkpoint(
                    self, kwargs.get("resume_from_checkpoint")
                )
            for cb in stateful:
                cb._checkpoint = Path(resume) if isinstance(resume, (str, Path)) else None
        try:
            return train(self, *args, **kwargs)
        except BaseException:
            _undo_gpu_changes(self)
            raise

    restoring_train._zeus_callbacks_restores = True  # type: ignore[attr-defined]
    return restoring_train


class _RestoresOnException(TrainerCallback):
    """A callback whose GPU changes are undone the moment `trainer.train()` raises.

    transformers has no exception hook (Lightning has `on_exception`), so when `train()` raises and the
    process lives on (a notebook cell, a caller that catches) no hook runs. Building the first such
    callback therefore wraps `Trainer.train` once: an exception leaving any trainer's `train()` calls
    `_train_failed` on the callbacks of this kind attached to that trainer, then propagates unchanged.
    Other trainers see no difference; a subclass whose `train` does not call `Trainer.train` is not
    covered (its GPUs are restored at exit, as before).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> _RestoresOnException:
        if not getattr(Trainer.train, "_zeus_callbacks_restores", False):
            Trainer.train = _restoring_on_exception(Trainer.train)  # type: ignore[method-assign]
        return super().__new__(cls)

    def _train_failed(self) -> None:
        """Undo this callback's GPU changes; `train()` raised. No collective: the other ranks may not."""
        raise NotImplementedError


_ENERGY_MONITORS: weakref.WeakSet[HFZeusMonitor] = weakref.WeakSet()


class HFZeusMonitor(_LogsFirst):
    """Report the GPUs' energy to the trainer's loggers (`report_to`) and `state.log_history`.

    At every log event the logs get the energy of the logging interval (`energy/interval_j`, its average
    power and duration, per GPU too, and `energy/simulated`); the end-of-training summary also gets the
    run's totals (`energy/total_j`, ...). The names come from `EnergyReporter`.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s) (under torch.distributed, this rank's).
        carbon_intensity: gCO2eq/kWh or a region (`"DE"`): the logs also get `energy/interval_co2eq_g` and
            `energy/total_co2eq_g`. Default `$ZEUS_CALLBACKS_CARBON_INTENSITY`, else none.
        price_per_kwh: Price per kWh or a U.S. state (`"US-CA"`): `energy/interval_cost`,
            `energy/total_cost`. Default `$ZEUS_CALLBACKS_ELECTRICITY_PRICE`, else none.

    Raises:
        TypeError: `monitor` is not a `ZeusMonitor`.

    Example::

        from transformers import Trainer
        from zeus_callbacks import HFZeusMonitor, ZeusMonitor

        trainer = Trainer(model, args, train_dataset=ds, callbacks=[HFZeusMonitor(ZeusMonitor(gpu_indices=[0]))])
        trainer.train()
        total_j = trainer.state.log_history[-1]["energy/total_j"]
    """

    def __init__(
        self,
        monitor: ZeusMonitor,
        carbon_intensity: float | str | None = None,
        price_per_kwh: float | str | None = None,
    ) -> None:
        if not isinstance(monitor, ZeusMonitor):
            raise TypeError(
                f"`HFZeusMonitor(monitor={monitor!r})`: expected a zeus_callbacks.ZeusMonitor "
                "(`from zeus_callbacks import ZeusMonitor`)."
            )
        self.monitor = monitor
        self._reporter = EnergyReporter(monitor, rates=Rates.resolve(carbon_intensity, price_per_kwh))
        _ENERGY_MONITORS.add(self)

    def reports_energy_of(self, monitor: ZeusMonitor) -> bool:
        """Whether this callback is reporting `monitor`'s energy in a training run now."""
        return self.monitor is monitor and self._reporter.running

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → `EnergyReporter.start` (the run and the first interval begin)."""
        super().on_train_begin(args, state, control, **kwargs)
        self._reporter.start()

    @override
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """`on_log` → `EnergyReporter.interval`, or `EnergyReporter.stop` (the run's totals, not the last
        few ms) on the end-of-training summary (the log that carries `train_runtime`); the figures are
        added to `logs` and `state.log_history`."""
        final = logs is not None and "train_runtime" in logs
        _log(state, logs, self._reporter.stop() if final else self._reporter.interval())

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `EnergyReporter.stop` if no summary log did (totals go to `state.log_history`)."""
        _log(state, None, self._reporter.stop())


def _optimizer_state_in(stateful_callbacks: Any, name: str) -> Any:
    """The optimizer state that a trainer state's `stateful_callbacks` hold for the callback class `name`
    (its first instance): None when they hold none, `{}` for an entry not shaped as `state()` makes it."""
    if not isinstance(stateful_callbacks, dict) or name not in stateful_callbacks:
        return None
    data = stateful_callbacks[name]
    if isinstance(data, list):
        data = data[0] if data else {}
    attributes = data.get("attributes") if isinstance(data, dict) else None
    return attributes.get("optimizer_state", {}) if isinstance(attributes, dict) else {}


def _saved_state(state: TrainerState, name: str) -> Any:
    """The optimizer state a resumed run's trainer state holds for the callback class `name`, or None on a
    fresh run."""
    return _optimizer_state_in(state.stateful_callbacks, name) if state.global_step else None


def _checkpoint_state(checkpoint: Path, name: str) -> Any:
    """The optimizer state `checkpoint`'s trainer_state.json holds for `name`, or None (none, or unreadable)."""
    try:
        data = json.loads((checkpoint / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return _optimizer_state_in(data.get("stateful_callbacks") if isinstance(data, dict) else None, name)


class HFGlobalPowerLimitOptimizer(_RestoresOnException, _LogsFirst, ExportableState):
    """Find the best GPU power limit during training and keep it (Zeus's `HFGlobalPowerLimitOptimizer`).

    Drives `zeus_callbacks.GlobalPowerLimitOptimizer` (see it for the method and the arguments) from the
    trainer's steps: `on_step_begin`/`on_step_end`/`on_epoch_end` → the optimizer's hooks of the same
    names, `on_train_end` → `GlobalPowerLimitOptimizer.on_train_end` (the GPUs get their settings back).
    If `trainer.train()` raises, the GPUs get their settings back before the exception leaves it
    (`GlobalPowerLimitOptimizer.on_train_end`), as with Lightning's `on_exception`. Every log event gets
    `GlobalPowerLimitOptimizer.metrics()` and the energy of the logging interval, prefixed
    `power_limit_optimizer/`. Checkpoints carry the optimizer's state (`state()`); `trainer.train(
    resume_from_checkpoint=...)` resumes it, with or without `restore_callback_states_from_checkpoint`: a
    chosen limit is applied without profiling again, a partial profile carries on at the next limit, and
    the profiling counters and `report()` carry on. A checkpoint cut short by a hard kill while it was
    being saved is skipped for the last complete one, and a corrupted optimizer state in it is refused for
    the last complete state (an earlier checkpoint's, else `profile_path`'s): each with one warning naming
    the file.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s) (under torch.distributed, this rank's).
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        wait_steps: Steps to let pass before profiling starts.
        warmup_steps: Steps run at a power limit before it is measured (the adaptive search: at the
            first limit only; later ones, in force at once, settle for a step or two).
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
        self._checkpoint: Path | None = None  # the checkpoint `train()` resumes from (set by its wrapper)
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
            self.optimizer, self._reporter, self._checkpoint = (
                owner.optimizer,
                owner._reporter,
                owner._checkpoint,
            )
            return
        require_monitor(type(self).__name__, monitor)
        self.optimizer = GlobalPowerLimitOptimizer(
            monitor=monitor,
            optimum_selector=optimum_selector,
            wait_steps=wait_steps,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            pl_step=pl_step,
            profile_path=profile_path,
            search=search,
        )
        self._reporter = EnergyReporter.for_power_limit_optimizer(monitor)
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
        try:
            self.optimizer.load_state_dict(value)
        except InvalidInputError:
            pass  # `on_train_begin` reads the same state from the trainer state, refuses it and says why

    def _resume(self, saved: Any) -> None:
        """Load the checkpoint's optimizer state; one that is cut short or corrupted is refused with one
        warning naming the file, and the last complete state is used instead: an earlier checkpoint's, else
        the `profile_path` profile, else none (profiling starts afresh)."""
        try:
            self.optimizer.load_state_dict(saved)
            return
        except InvalidInputError as e:
            refused = e
        name = type(self).__name__
        source = (
            self._checkpoint / TRAINER_STATE_NAME if self._checkpoint else "the checkpoint's trainer state"
        )
        then = ""
        for earlier in _earlier_checkpoints(self._checkpoint) if self._checkpoint else []:
            older = _checkpoint_state(earlier, name)
            if older is None:
                continue
            try:
                self.optimizer.load_state_dict(older)
            except InvalidInputError:
                continue
            then = f"profiling resumes from {earlier / TRAINER_STATE_NAME}, the last complete state"
            break
        self.optimizer.refused_state_warning(source, name, refused, then)

    # -- trainer hooks -----------------------------------------------------------------------------
    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → `EnergyReporter.start` (energy per logging interval); on a resumed run,
        `GlobalPowerLimitOptimizer.load_state_dict` with the state the checkpoint's trainer state holds,
        whatever `restore_callback_states_from_checkpoint` says (`_resume`: a corrupted one is refused)."""
        super().on_train_begin(args, state, control, **kwargs)
        self._training = True
        saved = _saved_state(state, type(self).__name__)
        if saved is not None:
            self._resume(saved)
        self._reporter.start()

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_begin` → `GlobalPowerLimitOptimizer.on_step_begin`."""
        self.optimizer.on_step_begin()

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_end` (after the optimizer step) → `GlobalPowerLimitOptimizer.on_step_end`."""
        self.optimizer.on_step_end()

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_epoch_end` → `GlobalPowerLimitOptimizer.on_epoch_end`."""
        self.optimizer.on_epoch_end()

    @override
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """`on_log` → `GlobalPowerLimitOptimizer.metrics` and the interval's energy (unless an
        `HFZeusMonitor` of the same monitor reports it: each figure once); on the end-of-training summary
        (the log with `train_runtime`) the run's totals instead (`run_summary`: energy, time, average
        power, profiling cost, the choice and its saving). Added to `logs` and `state.log_history` under
        `power_limit_optimizer/`."""
        metrics = power_limit_metrics(self.optimizer.metrics())
        if logs is not None and "train_runtime" in logs:
            _log(state, logs, {**metrics, **run_summary(self.optimizer.report(), self._reporter.stop())})
            return
        interval = self._reporter.interval()
        if any(m.reports_energy_of(self.optimizer.monitor) for m in _ENERGY_MONITORS):
            interval = {}
        _log(state, logs, {**metrics, **interval})

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `GlobalPowerLimitOptimizer.on_train_end` (the GPUs get their settings back)."""
        self._reporter.stop()
        self.optimizer.on_train_end()
        self._training = False

    @override
    def _train_failed(self) -> None:
        """`trainer.train()` raised → `GlobalPowerLimitOptimizer.on_train_end` (the GPUs' settings back)."""
        self.optimizer.on_train_end()
        self._training = False


class HFPipelineFrequencyOptimizer(_RestoresOnException, _LogsFirst):
    """Perseus for a `Trainer` whose training step runs a `torch.distributed.pipelining` schedule.

    Drives `zeus_callbacks.PipelineFrequencyOptimizer` (see it for the method and the arguments):
    `on_train_begin` finds this rank's pipeline stage (`stage`, else an attribute of the model that is a
    `PipelineStage` or a schedule; with a multi-stage schedule such as `ScheduleInterleaved1F1B`, all its
    stages and its order) and reports its `forward_one_chunk`/`backward_one_chunk`
    calls as instructions (`StageAttachment.attach`); `on_step_begin`/`on_step_end` → the optimizer's hooks
    of the same names (one training step = one pipeline iteration); `on_train_end` →
    `StageAttachment.detach` (clocks reset), also when `trainer.train()` raises, before the exception leaves
    it. Every log event gets `PipelineFrequencyOptimizer.metrics()`, prefixed
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
        _log(state, logs, pipeline_frequency_metrics(self.optimizer.metrics()))

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `StageAttachment.detach` (clocks reset, instrumentation removed)."""
        self._stage.detach()

    @override
    def _train_failed(self) -> None:
        """`trainer.train()` raised → `StageAttachment.detach` (clocks reset, instrumentation removed)."""
        self._stage.detach()


class HFHeterogeneousCallback(_RestoresOnException):
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
        apply_power_limit(self.rank_plan, self.gpu_index)

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_end` → `restore_power_limits`."""
        restore_power_limits()

    @override
    def _train_failed(self) -> None:
        """`trainer.train()` raised → `restore_power_limits`."""
        restore_power_limits()


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
        gpu_index: This rank's GPU; default `local_rank()`.
        **kwargs: As `Trainer`'s.

    Example::

        rp = rank_plan(plan(profiles, counts, global_batch=1024))
        HeterogeneousTrainer(model, training_args, train_dataset=ds, rank_plan=rp).train()
    """

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
        return result * self.rank_plan.loss_scale


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


class HFSimulatedGPUWork(TrainerCallback):
    """On simulated GPUs, each training step also queues `work_s` seconds of GPU work (at the maximum limit
    and clock, no host CPU: `zeus_callbacks.sim.enqueue_work`), so a toy model's step is paced by the
    simulated GPU, slowed by the limit in force, rather than by the host's speed and load. Nothing happens
    without an active simulation, so a script that uses it runs unchanged on real GPUs.

    Args:
        gpu: The simulated GPU's CUDA index (this process's `local_rank()` under torch.distributed).
        work_s: Seconds of work per step, >= 0.
    """

    def __init__(self, gpu: int = 0, work_s: float = 0.012) -> None:
        from zeus_callbacks import sim

        self.gpu, self.work_s = int(gpu), sim.work_seconds("HFSimulatedGPUWork", work_s)

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_begin` → `sim.enqueue_if_simulated(gpu, work_s)`."""
        from zeus_callbacks import sim

        sim.enqueue_if_simulated(self.gpu, self.work_s)
