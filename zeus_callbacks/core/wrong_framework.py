"""A callback of one framework given to another framework's trainer: the error says so and names the class to
use there (issue 37's adapter mistakes).

Each framework looks up its first hook on whatever it is handed: transformers' `Trainer` calls
`on_init_end` on every callback when it is built, Lightning's `Trainer` reads `state_key` (of a callback
with a state) when it is built and calls `setup` on every callback when `fit` begins. A class of this package that lacks that hook (it belongs to another
framework, or to none: the core optimizer, the Accelerate and Ignite helpers) mixes in `OneFramework`, and
the lookup fails with an `AttributeError` that names the mistake and the fix instead of Python's bare one.
Framework-free: the classes are named, never imported.
"""

from __future__ import annotations

from typing import ClassVar, NoReturn

__all__ = ["OneFramework"]

# The framework, as the message names it -> the hooks it looks up first.
_FIRST_HOOKS = {
    "transformers' Trainer(callbacks=[...])": ("on_init_end",),
    # `on_exception`: Lightning calls it on every callback once `setup` has raised; the same message again.
    "Lightning's Trainer(callbacks=[...])": ("state_key", "setup", "on_exception"),
}
# What a user wants, by framework: the class that does it there.
_USE = {
    "power_limit": {
        "transformers' Trainer(callbacks=[...])": "zeus_callbacks.HFGlobalPowerLimitOptimizer(monitor, ...)",
        "Lightning's Trainer(callbacks=[...])": "zeus_callbacks.LightningGlobalPowerLimitOptimizer(monitor, ...)",
    },
    "energy": {
        "transformers' Trainer(callbacks=[...])": "zeus_callbacks.HFZeusMonitor(monitor)",
        "Lightning's Trainer(callbacks=[...])": "zeus_callbacks.LightningZeusMonitor(monitor)",
    },
}


class OneFramework:
    """Mixed into a class for one framework (or none). `_what` says what it is (`"the framework-free
    power-limit optimizer"`), `_does` which of `"power_limit"` or `"energy"` it does."""

    _what: ClassVar[str]
    _does: ClassVar[str]

    def __getattr__(self, name: str) -> NoReturn:
        """Called only for an attribute the class lacks: the first hook of another framework raises an
        `AttributeError` naming the mistake and the class to use; any other name Python's own."""
        for framework, hooks in _FIRST_HOOKS.items():
            if name in hooks:
                raise AttributeError(
                    f"{type(self).__name__} was given to {framework}, but it is {self._what}, not a callback "
                    f"of that trainer (it has no `{name}`). Pass {_USE[self._does][framework]} there instead."
                )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
