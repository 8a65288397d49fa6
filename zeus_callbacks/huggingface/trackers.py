"""A run on simulated GPUs tagged SIMULATED in the run metadata of the `report_to` trackers (TensorBoard, MLflow,
W&B), beside its metrics: `TagsSimulatedRuns`, which `ZeusTrainerMixin` puts after the trackers."""

from __future__ import annotations

import logging
import sys
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import MLflowCallback, TensorBoardCallback, WandbCallback
from typing_extensions import override

__all__ = ["SIMULATED_KEY", "SIMULATED_TAG", "TagsSimulatedRuns"]

logger = logging.getLogger("zeus_callbacks.huggingface")

SIMULATED_TAG = "SIMULATED"  # the W&B run tag
SIMULATED_KEY = "zeus_callbacks/simulated"  # the TensorBoard text, the MLflow tag, the W&B config key
SIMULATED_TEXT = (
    "SIMULATED GPUs (ZEUS_CALLBACKS_SIMULATE): this run's energy and power figures are a simulation."
)


def _measures_simulated_gpus(callback: TrainerCallback) -> bool:
    """Whether a zeus_callbacks callback's monitor reads simulated GPUs (`HFZeusMonitor.monitor`,
    `HFGlobalPowerLimitOptimizer.optimizer.monitor`)."""
    monitor = getattr(callback, "monitor", None) or getattr(
        getattr(callback, "optimizer", None), "monitor", None
    )
    return bool(getattr(monitor, "simulated", False))


def tag_simulated_run(callbacks: list[TrainerCallback]) -> None:
    """Tag the runs that the tracker callbacks among `callbacks` have set up: TensorBoard a text summary (as transformers writes
    `args`), MLflow a run tag, W&B a run tag and a config entry. Each through the tracker's own current run."""
    for tracker in callbacks:
        if isinstance(tracker, TensorBoardCallback) and tracker.tb_writer is not None:
            tracker.tb_writer.add_text(SIMULATED_KEY, SIMULATED_TEXT)
        elif isinstance(tracker, MLflowCallback) and (mlflow := sys.modules.get("mlflow")) is not None:
            if mlflow.active_run() is not None:
                mlflow.set_tag(SIMULATED_KEY, SIMULATED_TEXT)
        elif isinstance(tracker, WandbCallback) and (wandb := sys.modules.get("wandb")) is not None:
            run = wandb.run
            if run is not None:
                run.tags = (*run.tags, SIMULATED_TAG) if SIMULATED_TAG not in run.tags else run.tags
                run.config.update({SIMULATED_KEY: SIMULATED_TEXT}, allow_val_change=True)


class TagsSimulatedRuns(TrainerCallback):
    """`on_train_begin`, after the trackers have set up their runs: when a zeus_callbacks callback of the same
    trainer measures simulated GPUs, tag each tracker's run SIMULATED (`tag_simulated_run`).

    Args:
        callbacks: The trainer's callbacks (`trainer.callback_handler.callbacks`), this one after the trackers.
    """

    def __init__(self, callbacks: list[TrainerCallback]) -> None:
        self._callbacks = callbacks

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_train_begin` (the trackers' runs are set up) → `tag_simulated_run` on a simulated run."""
        if state.is_world_process_zero and any(_measures_simulated_gpus(cb) for cb in self._callbacks):
            try:
                tag_simulated_run(self._callbacks)
            except Exception:  # a tracker's failure must not stop training; the metrics still say simulated
                logger.warning("Could not tag the trackers' runs SIMULATED.", exc_info=True)
