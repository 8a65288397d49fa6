"""Lightning `Callback` adapters of the core, for `lightning.pytorch` trainers.

`from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer` gives callbacks built on
`lightning.pytorch.Callback`; `zeus_callbacks.lightning.pl` has the same classes built on
`pytorch_lightning.Callback`, for the standalone `pytorch_lightning` package. Both come from one
implementation (`zeus_callbacks.lightning._callbacks`), and their checkpoint state is interchangeable.
Lightning is imported on first use of a class, so that `zeus_callbacks.lightning.pl` works without the
`lightning` package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LightningZeusMonitor", "LightningGlobalPowerLimitOptimizer"]

if TYPE_CHECKING:  # pragma: no cover
    from zeus_callbacks.lightning.pl import LightningGlobalPowerLimitOptimizer, LightningZeusMonitor


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lightning.pytorch import Callback

    from zeus_callbacks.lightning._callbacks import build_callbacks

    globals().update(zip(__all__, build_callbacks(Callback, __name__), strict=True))
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(__all__)
