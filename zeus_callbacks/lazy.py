"""The one lazy-export mechanism: a module's names imported from other modules on first access (PEP 562)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    module: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `module`, whose names in `exports` are imported on first access.

    `exports` maps each name to the module that defines it. A name is imported the first time it is read and
    then kept in `module`'s globals, so the next access costs nothing.

    Example::

        # zeus_callbacks/lightning/__init__.py
        __getattr__, __dir__ = lazy_exports(__name__, {"LightningZeusMonitor": "zeus_callbacks.lightning.pytorch"})
    """

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(exports))

    return __getattr__, __dir__
