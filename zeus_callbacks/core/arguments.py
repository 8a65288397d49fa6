"""Checks of constructor arguments shared by the optimizers and their adapters: one clear line each, naming
the call and saying what to pass."""

from __future__ import annotations

import math
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError

__all__ = ["whole_number", "positive_number", "require_monitor", "bad_argument"]


def bad_argument(owner: str, name: str, value: Any, want: str) -> InvalidInputError:
    """The error for `owner(name=value)`: "`Owner(name=value)`: <want>."."""
    return InvalidInputError(f"`{owner}({name}={value!r})`: {want}.")


def whole_number(owner: str, name: str, value: Any, minimum: int) -> int:
    """`value` as an int, if it is a whole number (not a bool, a string or a fraction) >= `minimum`."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        ok, value = True, int(value)
    if not ok or value < minimum:
        raise bad_argument(owner, name, value, f"must be a whole number >= {minimum}")
    return int(value)


def positive_number(owner: str, name: str, value: Any) -> float:
    """`value` as a float, if it is a finite number > 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise bad_argument(owner, name, value, "must be a finite number > 0")
    return float(value)


def require_monitor(owner: str, monitor: Any) -> None:
    """`monitor` must be a `ZeusMonitor` that measures at least one GPU."""
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor

    if not isinstance(monitor, ZeusMonitor):
        what = "is the class, not a monitor: " if isinstance(monitor, type) else ""
        raise bad_argument(
            owner,
            "monitor",
            monitor,
            f"{what}pass a zeus_callbacks.ZeusMonitor of this process's GPU(s), e.g. "
            "`ZeusMonitor(gpu_indices=[local_rank])`",
        )
    if not monitor.gpu_indices:
        raise InvalidInputError(
            f"`{owner}(monitor=ZeusMonitor(gpu_indices=[]))`: the monitor measures no GPU, so there is no power "
            "limit to optimize; pass `ZeusMonitor(gpu_indices=[local_rank])`."
        )
