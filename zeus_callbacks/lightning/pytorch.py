"""The Lightning callbacks on `lightning.pytorch.Callback` (exported by `zeus_callbacks.lightning`)."""

from __future__ import annotations

from lightning.pytorch import Callback

from zeus_callbacks.lightning.hooks import (
    EpochLogHooks,
    GlobalPowerLimitOptimizerHooks,
    HeterogeneousHooks,
    PipelineFrequencyOptimizerHooks,
    ZeusMonitorHooks,
)

__all__ = [
    "LightningZeusMonitor",
    "LightningGlobalPowerLimitOptimizer",
    "LightningPipelineFrequencyOptimizer",
    "LightningHeterogeneous",
    "LightningEpochLog",
]


class LightningZeusMonitor(ZeusMonitorHooks, Callback):
    """The GPU energy of training in the trainer's loggers; see `ZeusMonitorHooks`."""


class LightningGlobalPowerLimitOptimizer(GlobalPowerLimitOptimizerHooks, Callback):
    """Zeus's power-limit optimizer; see `GlobalPowerLimitOptimizerHooks`."""


class LightningPipelineFrequencyOptimizer(PipelineFrequencyOptimizerHooks, Callback):
    """Perseus for pipeline-parallel training steps; see `PipelineFrequencyOptimizerHooks`."""


class LightningHeterogeneous(HeterogeneousHooks, Callback):
    """Training on a heterogeneous plan; see `HeterogeneousHooks`."""


class LightningEpochLog(EpochLogHooks, Callback):
    """Each epoch's time, energy and power in Zeus's profiler files; see `EpochLogHooks`."""
