"""Zeus's callback surface: one base class with every hook, and a set that calls many callbacks."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Callback", "CallbackSet"]


class Callback:
    """Base class of the framework-free callbacks, with Zeus's hooks (`zeus.callback.Callback`).

    Every hook does nothing unless a subclass overrides it, so a plain training loop may call all of them
    on any callback (Zeus's documented loop calls `on_epoch_begin`, `on_step_begin`, `on_step_end`,
    `on_epoch_end`).
    """

    def on_train_begin(self) -> None:
        """Called once before the first epoch."""

    def on_train_end(self) -> None:
        """Called once after the last epoch."""

    def on_epoch_begin(self) -> None:
        """Called at the beginning of each epoch."""

    def on_epoch_end(self) -> None:
        """Called at the end of each epoch."""

    def on_step_begin(self) -> None:
        """Called at the beginning of each training step."""

    def on_step_end(self) -> None:
        """Called at the end of each training step."""

    def on_evaluate(self, metric: float) -> None:
        """Called after an evaluation, with its metric."""

    def on_instruction_begin(self, name: str) -> None:
        """Called at the beginning of a pipeline instruction (`forward`, `backward`, ...)."""

    def on_instruction_end(self, name: str) -> None:
        """Called at the end of a pipeline instruction."""


class CallbackSet(Callback):
    """Calls each hook on every callback of `callbacks`, in order (`zeus.callback.CallbackSet`)."""

    def __init__(self, callbacks: Iterable[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_train_begin(self) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_train_begin()

    def on_train_end(self) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_train_end()

    def on_epoch_begin(self) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_epoch_begin()

    def on_epoch_end(self) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_epoch_end()

    def on_step_begin(self) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_step_begin()

    def on_step_end(self) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_step_end()

    def on_evaluate(self, metric: float) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_evaluate(metric)

    def on_instruction_begin(self, name: str) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_instruction_begin(name)

    def on_instruction_end(self, name: str) -> None:  # noqa: D102
        for cb in self.callbacks:
            cb.on_instruction_end(name)
