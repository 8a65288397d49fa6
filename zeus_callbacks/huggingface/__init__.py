"""HuggingFace `transformers.Trainer` adapters: every transformers class of zeus_callbacks, trainer hooks in,
session calls out.

- `HFZeusMonitor`: the GPUs' energy per logging interval and for the run, in the trainer's logs.
- `HFGlobalPowerLimitOptimizer`: Zeus's power-limit optimizer (`GlobalPowerLimitOptimizer`).
- `HFEpochLog`: each epoch's time, energy and power in Zeus's profiler files (`EpochLog`).
- `HFPipelineFrequencyOptimizer` (Perseus for pipeline-parallel steps), `HeterogeneousTrainer` and
  `HFHeterogeneousCallback` (training on a heterogeneous plan), from `parallel`;
- `ZeusTrainerMixin` / `restoring_gpus`, the opt-in for GPUs back the moment `train()` raises, cut-short
  checkpoints skipped, and metrics before the `report_to` trackers, from `trainer`. Nothing is patched
  process-wide.

Inside the package: `callbacks` (the three callbacks above), `parallel`, `trainer` (the opt-in and the
callback bases it acts on: `LogsFirst`, `RestoresOnException`, `ResumesFromCheckpoint`, `log_metrics`),
`checkpoints` (transformers' checkpoints as the adapter reads them).
"""

from __future__ import annotations

from zeus_callbacks.huggingface.callbacks import HFEpochLog, HFGlobalPowerLimitOptimizer, HFZeusMonitor
from zeus_callbacks.huggingface.parallel import (
    HeterogeneousTrainer,
    HFHeterogeneousCallback,
    HFPipelineFrequencyOptimizer,
)
from zeus_callbacks.huggingface.trainer import ZeusTrainerMixin, restoring_gpus

__all__ = [
    "HFZeusMonitor",
    "HFGlobalPowerLimitOptimizer",
    "HFPipelineFrequencyOptimizer",
    "HFHeterogeneousCallback",
    "HeterogeneousTrainer",
    "HFEpochLog",
    "ZeusTrainerMixin",
    "restoring_gpus",
]
