"""What the Lightning hooks read from a trainer, typed so that `lightning.pytorch` and `pytorch_lightning` fit.

The two packages ship the same classes under two names (`pytorch_lightning` is generated from
`lightning.pytorch`), so a hook annotated with one package's `Trainer` is not an override of the other's
`Callback` hook. The hooks in `zeus_callbacks.lightning.hooks` take a `Trainer` protocol instead: the part of
a trainer they read, which both packages' trainers have. Nothing here imports Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Logger", "Trainer", "CallbackHooks"]


class Logger(Protocol):
    """A trainer's logger (`lightning.pytorch.loggers.Logger` and `pytorch_lightning`'s)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


class _TrainingEpochLoop(Protocol):
    _batches_that_stepped: int  # the step the trainer's own logged metrics use


class _FitLoop(Protocol):
    @property
    def epoch_loop(self) -> _TrainingEpochLoop: ...


class _LoggerConnector(Protocol):
    @property
    def should_update_logs(self) -> bool: ...


class Trainer(Protocol):
    """The part of a Lightning `Trainer` (either package's) that the hooks read."""

    @property
    def global_step(self) -> int: ...

    @property
    def loggers(self) -> Sequence[Logger]: ...

    @property
    def ckpt_path(self) -> str | os.PathLike[str] | None: ...

    @property
    def sanity_checking(self) -> bool: ...

    @property
    def fit_loop(self) -> _FitLoop: ...

    @property
    def _logger_connector(self) -> _LoggerConnector: ...


class CallbackHooks:
    """The `Callback` hooks the mixins define, as the type checker sees the mixins' base (at run time it is
    `object`: the package's `Callback` comes after the mixin in each callback's bases). Either package's
    `LightningModule` is a `torch.nn.Module`, all the hooks need of it."""

    def on_fit_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_fit_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_train_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_train_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: torch.nn.Module) -> None: ...

    def on_train_batch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None: ...

    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None: ...

    def on_exception(
        self, trainer: Trainer, pl_module: torch.nn.Module, exception: BaseException
    ) -> None: ...

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: torch.nn.Module, checkpoint: dict[str, Any]
    ) -> None: ...

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: torch.nn.Module, checkpoint: dict[str, Any]
    ) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}  # as `Callback.state_dict`

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
