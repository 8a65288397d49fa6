"""The Lightning adapters built on `pytorch_lightning.Callback`, for trainers of the standalone package."""

from __future__ import annotations

from pytorch_lightning import Callback

from zeus_callbacks.lightning._callbacks import build_callbacks

__all__ = ["LightningZeusMonitor", "LightningGlobalPowerLimitOptimizer"]

LightningZeusMonitor, LightningGlobalPowerLimitOptimizer = build_callbacks(Callback, __name__)
