"""Zeus's small utilities with Zeus's signatures: `get_env` (`zeus.utils.env`), `zeus_cost` (`zeus.utils.metric`)."""

from __future__ import annotations

import os
from typing import TypeVar, cast

__all__ = ["get_env", "zeus_cost"]

T = TypeVar("T")

_BOOLEANS = {"true": True, "false": False}


def get_env(name: str, valtype: type[T], default: T | None = None) -> T:
    """The environment variable `name` as a `valtype`, as Zeus's `zeus.utils.env.get_env`.

    A `bool` is read from `true` or `false` (any case); any other type is `valtype(value)`.

    Args:
        name: The variable, e.g. `"ZEUS_MAX_SLOWDOWN"`.
        valtype: The type to read it as, e.g. `float`, `int`, `str` or `bool`.
        default: Returned when the variable is unset; `None` (as in Zeus) means the variable is required.

    Raises:
        ValueError: the variable is unset and there is no default, or its value is not a `valtype`; the
            message names the variable and says what to set.

    Example::

        factor = get_env("ZEUS_MAX_SLOWDOWN", float, 1.1)
    """
    try:
        raw = os.environ[name]
    except KeyError:
        if default is not None:
            return default
        raise ValueError(
            f"Missing environment variable '{name}': set it (e.g. `export {name}=...`) or pass a default "
            f"to `get_env({name!r}, {getattr(valtype, '__name__', valtype)}, default=...)`."
        ) from None
    if valtype is bool:
        value = _BOOLEANS.get(raw.lower())
        if value is None:
            raise ValueError(
                f"Strange boolean environment variable value {name}={raw!r}: expected true or false."
            )
        return cast(T, value)
    try:
        return valtype(raw)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        raise ValueError(
            f"Environment variable {name}={raw!r} is not a valid {getattr(valtype, '__name__', valtype)}; "
            "set it to one, or unset it to use the default."
        ) from None


def zeus_cost(energy: float, time: float, eta_knob: float, max_power: int | float) -> float:
    """Zeus's energy-time cost of a run, as `zeus.utils.metric.zeus_cost`:
    `eta_knob * energy + (1 - eta_knob) * max_power * time` (what `ZeusCost(eta_knob)` minimises).

    Args:
        energy: Energy (J).
        time: Time (s).
        eta_knob: Weight of energy against time, in [0, 1] (not checked, as in Zeus).
        max_power: The maximum power limit (W), summed over the GPUs that `energy` is of.

    Example::

        cost = zeus_cost(energy=2050.0, time=9.2, eta_knob=0.5, max_power=300)
    """
    return eta_knob * energy + (1 - eta_knob) * max_power * time
