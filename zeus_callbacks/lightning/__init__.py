"""Lightning `Callback` adapters of the core, for `lightning.pytorch` and `pytorch_lightning` trainers.

`from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer` gives callbacks built on
`lightning.pytorch.Callback` (defined in `zeus_callbacks.lightning.pytorch`); `zeus_callbacks.lightning.pl`
has the same classes built on `pytorch_lightning.Callback`, for the standalone `pytorch_lightning` package.
Both are `class LightningX(XHooks, Callback)` over the hook bodies of `zeus_callbacks.lightning.hooks`, and
their checkpoint state is interchangeable. The classes are imported on first access, so that this package
imports no Lightning and `zeus_callbacks.lightning.pl` works without the `lightning` package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeus_callbacks.lazy import lazy_exports

__all__ = [
    "LightningZeusMonitor",
    "LightningGlobalPowerLimitOptimizer",
    "LightningPipelineFrequencyOptimizer",
    "LightningHeterogeneous",
    "LightningEpochLog",
]

if TYPE_CHECKING:  # pragma: no cover
    from zeus_callbacks.lightning.pytorch import (
        LightningEpochLog,
        LightningGlobalPowerLimitOptimizer,
        LightningHeterogeneous,
        LightningPipelineFrequencyOptimizer,
        LightningZeusMonitor,
    )

__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, "zeus_callbacks.lightning.pytorch"))
