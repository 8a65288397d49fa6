"""The route GPU settings are changed through: the GPU's vendor library in this process, or Zeus's daemon `zeusd`.

Every change of a power limit, SM clock lock or persistence mode, and every restore of one, goes through a
route (`route()` for this process's changes; `for_journal(...)` for a journaled one). Reads always use the
`Device` in this process. The in-process route is named `direct` (journals, `ZEUS_CALLBACKS_SETTERS`, `doctor`)
for every vendor; `nvml`, its name before there were other vendors, is still accepted: journals that say it are
restored in this process, and `ZEUS_CALLBACKS_SETTERS=nvml` means `direct`.

`ZEUS_CALLBACKS_SETTERS` chooses: `auto` (default: zeusd when `ZEUSD_SOCK_PATH` or `ZEUSD_HOST_PORT` is set,
as Zeus does, else in this process), `direct` (in this process even where zeusd is configured), `zeusd` (zeusd,
and an error when it is not configured).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

from zeus_callbacks.core.device import zeusd
from zeus_callbacks.core.device.errors import InvalidInputError

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = [
    "SETTERS_ENV",
    "ROUTES",
    "Route",
    "DirectRoute",
    "route",
    "route_for",
    "direct_route",
    "describe_choice",
    "forget",
]

SETTERS_ENV = "ZEUS_CALLBACKS_SETTERS"
ROUTES = ("direct", "zeusd")
OLD_NAMES = {"nvml": "direct"}  # names journals and environments may still hold
_CHOICES = ("auto", *ROUTES)


class Route(Protocol):
    """How settings reach a GPU. `name` is `direct` or `zeusd`; `endpoint` is zeusd's (None in this process)."""

    name: str

    def may_change(self, gpu: GPU) -> bool: ...
    def set_power_limit_mw(self, gpu: GPU, value_mw: int, what: str = ...) -> None: ...
    def lock_sm_clocks(self, gpu: GPU, min_mhz: int, max_mhz: int, what: str = ...) -> None: ...
    def reset_sm_clocks(self, gpu: GPU, what: str = ...) -> None: ...
    def set_persistence_mode(self, gpu: GPU, enabled: bool, what: str = ...) -> None: ...


class DirectRoute:
    """The GPU's own vendor library (NVML, amdsmi), called in this process (needs CAP_SYS_ADMIN or root): it
    calls whichever vendor's `Device` the GPU is."""

    name = "direct"
    endpoint = None

    def __repr__(self) -> str:
        return "DirectRoute()"

    def may_change(self, gpu: GPU) -> bool:
        """Whether this process may change the GPU itself (for a real GPU: it holds CAP_SYS_ADMIN)."""
        return gpu.backend.may_change_settings(gpu.device)

    def set_power_limit_mw(self, gpu: GPU, value_mw: int, what: str = "Setting the power limit") -> None:
        gpu.device.set_power_limit_mw(int(value_mw))

    def lock_sm_clocks(self, gpu: GPU, min_mhz: int, max_mhz: int, what: str = "Locking SM clocks") -> None:
        gpu.device.lock_sm_clocks(int(min_mhz), int(max_mhz))

    def reset_sm_clocks(self, gpu: GPU, what: str = "Resetting SM clocks") -> None:
        gpu.device.reset_sm_clocks()

    def set_persistence_mode(self, gpu: GPU, enabled: bool, what: str = "Setting persistence mode") -> None:
        gpu.device.set_persistence_mode(bool(enabled))


_DIRECT = DirectRoute()
_cache: tuple[tuple[str | None, ...], Route] | None = None
_lock = threading.Lock()


def _env_key() -> tuple[str | None, ...]:
    names = (SETTERS_ENV, zeusd.SOCK_ENV, zeusd.HOST_PORT_ENV, zeusd.TOKEN_ENV, zeusd.TIMEOUT_ENV)
    return tuple(os.environ.get(n) for n in names)


def _choice() -> str:
    text = (os.environ.get(SETTERS_ENV) or "auto").strip().lower()
    text = OLD_NAMES.get(text, text)
    if text not in _CHOICES:
        raise InvalidInputError(
            f"{SETTERS_ENV}={os.environ[SETTERS_ENV]!r} is not one of {', '.join(_CHOICES)}: `zeusd` sends GPU "
            "settings to Zeus's daemon, `direct` changes them in this process through the GPU's library (NVML, "
            f"amdsmi), `auto` (default) uses zeusd when {zeusd.SOCK_ENV} or {zeusd.HOST_PORT_ENV} is set."
        )
    return text


def route() -> Route:
    """The route this process's changes take (chosen from the environment; chosen again when it changes).

    Raises:
        InvalidInputError: `ZEUS_CALLBACKS_SETTERS` or a `ZEUSD_*` variable holds an unusable value, or
            `ZEUS_CALLBACKS_SETTERS=zeusd` while no zeusd is configured.
    """
    global _cache
    key = _env_key()
    with _lock:
        if _cache is not None and _cache[0] == key:
            return _cache[1]
    choice = _choice()
    endpoint = None if choice == "direct" else zeusd.ZeusdEndpoint.from_env()
    if choice == "zeusd" and endpoint is None:
        raise InvalidInputError(
            f"{SETTERS_ENV}=zeusd, but neither {zeusd.SOCK_ENV} nor {zeusd.HOST_PORT_ENV} says where zeusd "
            "listens: set one (e.g. ZEUSD_SOCK_PATH=/run/zeusd/zeusd.sock), or unset ZEUS_CALLBACKS_SETTERS."
        )
    if endpoint is not None:
        zeusd.timeout_s()  # a malformed timeout is said now, not at the first change
    chosen: Route = (
        _DIRECT if endpoint is None else zeusd.client_for(endpoint, os.environ.get(zeusd.TOKEN_ENV))
    )
    with _lock:
        _cache = (key, chosen)
    return chosen


def route_for(name: str, endpoint: str | None) -> Route:
    """The route a journaled change was made through (`name`, zeusd's `endpoint`), to undo it the same way
    (`nvml`, the in-process route's old name, is `direct`).

    Raises:
        ValueError: an unknown route, or a zeusd route without a readable endpoint.
    """
    if OLD_NAMES.get(name, name) == "direct":
        return _DIRECT
    if name == "zeusd" and endpoint is not None:
        return zeusd.client_for(zeusd.ZeusdEndpoint.parse(endpoint), os.environ.get(zeusd.TOKEN_ENV))
    raise ValueError(f"unknown route {name!r} (endpoint {endpoint!r})")


def direct_route() -> Route:
    """The vendor's library in this process (restores fall back to it where this process may use it)."""
    return _DIRECT


def describe_choice() -> dict[str, Any]:
    """For `zeus-callbacks doctor`: the route (`direct`/`zeusd`), why, and zeusd's endpoint; `error` when the
    environment is unusable."""
    try:
        chosen = route()
    except InvalidInputError as e:
        return {"route": None, "why": None, "endpoint": None, "error": str(e)}
    choice = _choice()
    if chosen.name == "zeusd":
        source = zeusd.SOCK_ENV if os.environ.get(zeusd.SOCK_ENV) is not None else zeusd.HOST_PORT_ENV
        why = f"{SETTERS_ENV}=zeusd" if choice == "zeusd" else f"{source} is set"
    elif choice == "direct":
        why = f"{SETTERS_ENV}={os.environ.get(SETTERS_ENV, '').strip()}"
    else:
        why = f"neither {zeusd.SOCK_ENV} nor {zeusd.HOST_PORT_ENV} is set"
    endpoint = getattr(chosen, "endpoint", None)
    return {
        "route": chosen.name,
        "why": why,
        "endpoint": None if endpoint is None else str(endpoint),
        "error": None,
    }


def forget() -> None:
    """Choose again and ask zeusd again (the GPU set changed)."""
    global _cache
    with _lock:
        _cache = None
    zeusd.forget_clients()
