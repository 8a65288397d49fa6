"""The HF `Trainer` opt-in shared by the transformers adapters: `ZeusTrainerMixin` / `restoring_gpus` (GPUs
back the moment `train()` raises, cut-short checkpoints skipped, metrics before the `report_to` trackers), and
the callback bases it acts on."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from typing_extensions import override

from zeus_callbacks.huggingface.checkpoints import (
    complete_checkpoint,
)
from zeus_callbacks.huggingface.trackers import TagsSimulatedRuns

__all__ = [
    "ZeusTrainerMixin",
    "restoring_gpus",
    "LogsFirst",
    "RestoresOnException",
    "ResumesFromCheckpoint",
    "log_metrics",
    "undo_gpu_changes",
]

logger = logging.getLogger("zeus_callbacks.huggingface")


class LogsFirst(TrainerCallback):
    """A callback that adds metrics to the logs. transformers hands the logs to the `report_to` trackers
    before the user's callbacks, so the trackers get these metrics only when the callback runs before them:
    `ZeusTrainerMixin` moves it there. On a plain `Trainer` the metrics reach `state.log_history` and the
    callbacks after this one, and one line says so when `report_to` names a tracker."""

    _in_zeus_trainer = False  # set by ZeusTrainerMixin.train
    _said_trackers: ClassVar[bool] = False

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → say once where the metrics go when the trackers run first."""
        report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
        trackers = [t for t in report_to if t and t != "none"]
        if trackers and not self._in_zeus_trainer and not LogsFirst._said_trackers:
            LogsFirst._said_trackers = True
            logger.warning(
                "%s's metrics reach state.log_history and the callbacks after it, not the report_to "
                "trackers %s, which run first: train with a Trainer that mixes in "
                "zeus_callbacks.huggingface.ZeusTrainerMixin to send them there too.",
                type(self).__name__,
                trackers,
            )


def log_metrics(state: TrainerState, logs: dict[str, Any] | None, metrics: dict[str, Any]) -> None:
    """Add `metrics` to the logs being sent and to the copy already kept in `state.log_history`."""
    if logs is not None:
        logs.update(metrics)
    if state.log_history:
        state.log_history[-1].update(metrics)


class RestoresOnException(TrainerCallback):
    """A callback whose GPU changes are undone when `train()` raises.

    transformers has no exception hook (Lightning has `on_exception`). With the opt-in (`ZeusTrainerMixin` /
    `restoring_gpus`) the changes are undone before the exception leaves `train()`. Without it, in IPython
    (a notebook, `ipython`), when the cell whose `train()` raised ends (IPython's `post_run_cell` event,
    registered for the run), with one warning; elsewhere, at this callback's next `on_train_begin` (a caller
    that caught the exception and trains again), with one warning, else when the process ends (exit, a
    signal, or the restore watchdog after a hard death). Subclasses call `super().on_train_begin(...)` and,
    in `on_train_end`, `_run_ended()`.
    """

    _in_run = False  # between on_train_begin and on_train_end (or the undo)

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` → undo what an earlier run that raised unseen left; in IPython, watch the cell."""
        super().on_train_begin(args, state, control, **kwargs)
        if self._in_run:
            self._undo(
                "the last trainer.train() raised and left the GPUs changed until now; they are put back"
            )
        self._in_run = True
        shell = _ipython()
        if shell is not None:
            shell.events.register("post_run_cell", self._after_cell)

    def _run_ended(self) -> None:
        """The run ended (`on_train_end`, or undone): stop watching IPython's cells."""
        self._in_run = False
        shell = _ipython()
        if shell is not None and self._after_cell in shell.events.callbacks.get("post_run_cell", ()):
            shell.events.unregister("post_run_cell", self._after_cell)

    def _after_cell(self, result: Any = None) -> None:
        """IPython's `post_run_cell`: the cell ended before the run did, so its `train()` raised."""
        if self._in_run:
            self._undo("trainer.train() raised in this cell; the GPUs' settings are put back now")
        else:
            self._run_ended()

    def _undo(self, said: str | None = None) -> None:
        """End the run and undo this callback's GPU changes, after the warning `said` (None: the opt-in's)."""
        self._run_ended()
        if said is not None:
            logger.warning(
                "%s: %s. Train with a Trainer that mixes in zeus_callbacks.huggingface.ZeusTrainerMixin, or "
                "`with restoring_gpus(trainer): trainer.train()`, to have them put back as the exception "
                "leaves train().",
                type(self).__name__,
                said,
            )
        self._train_failed()

    def _train_failed(self) -> None:
        """Undo this callback's GPU changes; `train()` raised. No collective: the other ranks may not."""
        raise NotImplementedError


def _ipython() -> Any:
    """IPython's running shell (a notebook's kernel, `ipython`), or None. IPython is never imported here."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython() if callable(get_ipython) else None


class ResumesFromCheckpoint(TrainerCallback):
    """A callback told which checkpoint `ZeusTrainerMixin.train` resumes from (after skipping cut-short ones)."""

    _checkpoint: Path | None = None


def undo_gpu_changes(trainer: Trainer) -> None:
    """Undo the GPU changes of every `RestoresOnException` callback of `trainer`; `train()` raised."""
    for callback in list(getattr(getattr(trainer, "callback_handler", None), "callbacks", ())):
        if isinstance(callback, RestoresOnException):
            try:
                callback._undo()
            except Exception:  # the training error is the one to see
                logger.warning("%s could not undo its GPU changes.", type(callback).__name__, exc_info=True)


@contextlib.contextmanager
def restoring_gpus(trainer: Trainer) -> Iterator[Trainer]:
    """`with restoring_gpus(trainer): trainer.train()`: if `train()` raises, the GPU changes of the
    trainer's zeus_callbacks callbacks are undone before the exception leaves the block, unchanged.
    Resumption is left as transformers does it."""
    try:
        yield trainer
    except BaseException:
        undo_gpu_changes(trainer)
        raise


class ZeusTrainerMixin:
    """Opt-in, for a `Trainer` subclass: `class MyTrainer(ZeusTrainerMixin, Trainer)` (or `SFTTrainer`).

    - `train()` raising undoes the zeus_callbacks callbacks' GPU changes before the exception leaves it
      (`restoring_gpus`);
    - `train(resume_from_checkpoint=...)` given a checkpoint that a kill cut short while it was being saved
      resumes from the last complete one before it (one warning naming the file), or starts over when there
      is none; the power-limit optimizer then also falls back to an earlier checkpoint's state when the
      resumed one's is corrupted. `skip_cut_short_checkpoints = False` on the subclass keeps transformers'
      resumption;
    - the callbacks that add metrics run before the `report_to` trackers, so the trackers get them.
    - on simulated GPUs, each tracker's run is tagged SIMULATED in its metadata (`huggingface.trackers`).
    """

    skip_cut_short_checkpoints: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for callback in kwargs.get("callbacks") or ():
            if isinstance(callback, LogsFirst):
                callback._in_zeus_trainer = True
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, with the behaviours of the class docstring."""
        trainer: Any = self
        callbacks = trainer.callback_handler.callbacks
        for callback in [cb for cb in callbacks if isinstance(cb, LogsFirst)][::-1]:
            callbacks.remove(callback)
            callbacks.insert(0, callback)
            callback._in_zeus_trainer = True
        if not any(isinstance(cb, TagsSimulatedRuns) for cb in callbacks):
            callbacks.append(TagsSimulatedRuns(callbacks))  # after the trackers: their runs are set up
        if self.skip_cut_short_checkpoints:
            resume_from_checkpoint = complete_checkpoint(trainer.args.output_dir, resume_from_checkpoint)
            resumed = (
                Path(resume_from_checkpoint) if isinstance(resume_from_checkpoint, (str, Path)) else None
            )
            for callback in callbacks:
                if isinstance(callback, ResumesFromCheckpoint):
                    callback._checkpoint = resumed
        with restoring_gpus(trainer):
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
