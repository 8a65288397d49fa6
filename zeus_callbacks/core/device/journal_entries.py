"""The entries of the GPU-state journal: one setting as it was before a change, checked and put back."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core.device import setters
from zeus_callbacks.core.device.errors import GPUError, InvalidInputError

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = ["KNOBS", "JournalEntry", "apply_entry", "entry_for", "invalid_reason", "to_record"]

logger = logging.getLogger(__name__)

KNOBS = ("power_limit", "sm_clocks", "persistence")


@dataclass(frozen=True)
class JournalEntry:
    """A setting of one GPU as it was before this package changed it, and the route the change took."""

    uuid: str
    name: str
    knob: str  # power_limit | sm_clocks | persistence
    original: Any  # mW for power_limit, bool for persistence, None for sm_clocks (unlocked)
    route: str = "direct"  # direct | zeusd (| nvml, direct's old name): how the change was made and is undone
    zeusd: str | None = None  # zeusd's endpoint (`unix:PATH` or `tcp:HOST:PORT`) when route is zeusd
    # A change sent to zeusd that got no answer: it may be applied later (zeusd runs every queued command),
    # so the restore sends the original even where the GPU still reads it.
    unconfirmed: bool = False


def entry_for(gpu: GPU, knob: str, original: Any) -> JournalEntry:
    """An entry for a change this process makes now, through its route."""
    r = setters.route()
    endpoint = getattr(r, "endpoint", None)
    return JournalEntry(
        gpu.uuid, gpu.name, knob, original, r.name, None if endpoint is None else str(endpoint)
    )


def to_record(entry: JournalEntry) -> dict[str, Any]:
    """The entry as journaled: `unconfirmed` only where set (journals of confirmed changes stay as they were)."""
    return {k: v for k, v in asdict(entry).items() if k != "unconfirmed" or v}


def _routes(gpu: GPU, entry: JournalEntry) -> list[setters.Route]:
    """The routes to undo `entry` through: the one that made the change first, then this process's own,
    then the vendor's library in this process where it may use it (a daemon gone since, or a run made as
    root)."""
    out = [setters.route_for(entry.route, entry.zeusd)]
    try:
        out.append(setters.route())
    except InvalidInputError as e:
        logger.debug("Not restoring through this process's route: %s", e)
    in_process = setters.direct_route()
    if in_process.may_change(gpu):
        out.append(in_process)
    return list({id(r): r for r in out}.values())


def apply_entry(gpu: GPU, entry: JournalEntry) -> None:
    """Put `entry`'s original value back on `gpu`, through the first of its routes that works.

    Raises:
        GPUError: no route could restore it (the first route's error).
    """
    what = f"Restoring {entry.knob}"
    # Already back (restored by another process, or never changed): nothing to do, no permission needed.
    # Unless the change is unconfirmed: it may still be waiting in zeusd's queue, to run after this read.
    if entry.knob == "power_limit" and not entry.unconfirmed and gpu.power_limit_mw() == int(entry.original):
        return
    first: GPUError | None = None
    for r in _routes(gpu, entry):
        try:
            if entry.knob == "power_limit":
                r.set_power_limit_mw(gpu, int(entry.original), what)
            elif entry.knob == "sm_clocks":
                r.reset_sm_clocks(gpu, what)
            elif entry.knob == "persistence":
                r.set_persistence_mode(gpu, bool(entry.original), what)
            return
        except GPUError as e:
            first = first or e
    assert first is not None
    raise first


def invalid_reason(gpu: GPU, entry: JournalEntry) -> str | None:
    """Why `entry` must not be applied to `gpu` (None: it may)."""
    if entry.knob not in KNOBS:
        return f"unknown setting {entry.knob!r}"
    try:
        setters.route_for(entry.route, entry.zeusd)
    except ValueError as e:
        return str(e)
    if entry.knob == "power_limit":
        if type(entry.original) is not int:
            return f"power limit {entry.original!r} is not a number of mW"
        lo, hi = gpu.power_limit_constraints_mw()
        if not lo <= entry.original <= hi:
            return f"power limit {entry.original / 1000:g} W is outside [{lo / 1000:g}, {hi / 1000:g}] W"
    elif entry.knob == "persistence" and type(entry.original) is not bool:
        return f"persistence mode {entry.original!r} is not true or false"
    elif entry.knob == "sm_clocks" and entry.original is not None:
        return f"SM clocks {entry.original!r} are not `null` (unlocked)"
    return None
