"""The saved form of a power-limit measurement, shared by profile files and checkpoints (`state_dict()`).

Version 2 (`SCHEMA_VERSION`): each limit's measurement is a dict of the `PowerLimitStats` fields, its chunks
dicts of the `Chunk` fields. Version 1 (positional chunk lists) was written only by development commits (up
to 1e9a50b) and is refused with what to do (`retired_version`), as is a version this module does not know.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.power_limit.chunk import Chunk, ChunkError
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats

__all__ = [
    "SCHEMA_VERSION",
    "retired_version",
    "saved_stats",
    "stats_from_saved",
    "measurement_problem",
    "CorruptedStateError",
    "SavedState",
    "parse_state",
    "state_dict",
]

SCHEMA_VERSION = 2
# Steps measured at one limit: a billion is 11 days of 1 ms steps, far past any profile; a count beyond it
# (issue 38 saw 1e20) would make a limit's per-step figures look exact and change the choice.
MAX_STEPS = 10**9
_RETIRED = {1: "written only by development versions of zeus_callbacks (up to commit 1e9a50b)"}


def retired_version(version: Any) -> str | None:
    """Why a saved `version` other than `SCHEMA_VERSION` is not read (one this package once wrote and no
    longer reads, or one it does not know), or None for `SCHEMA_VERSION`."""
    if version == SCHEMA_VERSION:
        return None
    if version in _RETIRED:
        return f"schema version {version!r}, {_RETIRED[version]}, which this version no longer reads"
    return f"unknown schema version {version!r} (this zeus_callbacks reads {SCHEMA_VERSION})"


def saved_stats(s: PowerLimitStats) -> dict[str, Any]:
    """One limit's measurement as plain numbers (`SCHEMA_VERSION`)."""
    return s.to_dict()


def stats_from_saved(entry: Any) -> PowerLimitStats:
    """One limit's measurement as `saved_stats` wrote it.

    Raises:
        TypeError: not a dict of `PowerLimitStats` fields.
        ChunkError: a chunk that is not one (a `ValueError`).
    """
    if not isinstance(entry, Mapping):
        raise TypeError(f"{entry!r} is not a dict of measurement fields")
    chunks = entry.get("chunks", [])
    if not isinstance(chunks, list):
        raise ChunkError(f"chunks {chunks!r} is not a list")
    return PowerLimitStats(**{**entry, "chunks": [Chunk.from_saved(c) for c in chunks]})


def measurement_problem(
    s: PowerLimitStats, range_w: tuple[float, float] | None, saved: Mapping[str, Any] | None = None
) -> str | None:
    """What makes one limit's saved measurement unusable (a limit outside `range_w` when given, no count of
    steps, a sum that is not finite and non-negative), or None; shared by profile files and checkpoints.
    `saved` is the entry as read: the sums are checked as written too, since `PowerLimitStats` recounts
    them from its chunks."""
    if not _power_limit(s.power_limit_w):
        return f"power limit {s.power_limit_w!r} is not a power limit in watts (whole milliwatts, > 0)"
    if range_w is not None and not range_w[0] <= s.power_limit_w <= range_w[1]:
        return f"power limit {s.power_limit_w} W is outside the GPU's range {range_w[0]}-{range_w[1]} W"
    for values in ([saved] if saved is not None else []) + [asdict(s)]:
        problem = _sums_problem(s.power_limit_w, values, s.pruned)
        if problem is not None:
            return problem
    return None


def _power_limit(value: Any) -> bool:
    """Whether `value` is a power limit in W as the grid holds them: whole watts (`int`), or a board's
    fractional end (`float`, whole milliwatts: NVML's unit)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value > 0
    return _finite(value) and value > 0 and abs(value * 1000 - round(value * 1000)) < 1e-6


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _sums_problem(power_limit_w: float, values: Mapping[str, Any], pruned: bool) -> str | None:
    steps = values.get("steps", 0)
    if (
        not isinstance(steps, int)
        or isinstance(steps, bool)
        or not 0 <= steps <= MAX_STEPS
        or (steps == 0 and (values.get("time_s") or values.get("energy_j")))
    ):
        return f"{power_limit_w} W: steps={steps!r} is not a count of measured steps"
    # No kept step is a measurement still to come when samples were taken and set aside (a burst): the
    # search measures that limit again. Without any sample, nothing was measured.
    if steps == 0 and not pruned and not values.get("chunks"):
        return f"{power_limit_w} W: steps=0 with no measurement"
    for name in ("time_s", "energy_j", "time_sq", "energy_sq"):
        value = values.get(name, 0.0)
        if not _finite(value) or value < 0:
            return f"{power_limit_w} W: {name}={value!r} is not a finite, non-negative number"
    return None


# -- checkpoints ------------------------------------------------------------------------------------------
class CorruptedStateError(InvalidInputError):
    """A checkpoint state that is not a whole `state_dict()` (cut short or edited); `problem` says why."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"The GlobalPowerLimitOptimizer state is incomplete or corrupted: {problem}. It is not loaded."
        )
        self.problem = problem


@dataclass(frozen=True)
class SavedState:
    """A checked `state_dict()`."""

    stats: dict[float, PowerLimitStats]
    optimal_power_limit_w: float | None
    profiling_steps: int | None  # None: a state saved before the counters were (keep the current ones)
    profiling_energy_j: float


def state_dict(
    stats: dict[float, PowerLimitStats], optimal_power_limit_w: float | None, steps: int, energy_j: float
) -> dict[str, Any]:
    """The optimizer's checkpoint state (`SCHEMA_VERSION`): plain numbers and strings."""
    return {
        "version": SCHEMA_VERSION,
        "optimal_power_limit_w": optimal_power_limit_w,
        "stats": [saved_stats(s) for s in stats.values()],
        "profiling_steps": steps,
        "profiling_energy_j": energy_j,
    }


def _parse_stats(entries: Any) -> dict[float, PowerLimitStats]:
    if not isinstance(entries, list):
        raise CorruptedStateError(f"stats is {type(entries).__name__}, not a list")
    stats: dict[float, PowerLimitStats] = {}
    for i, entry in enumerate(entries):
        try:
            s = stats_from_saved(entry)
        except (TypeError, ChunkError) as e:
            raise CorruptedStateError(f"stats entry {i}: {e}") from None
        problem = measurement_problem(s, None, entry)
        if problem is not None:
            raise CorruptedStateError(f"stats entry {i}: {problem}")
        stats[s.power_limit_w] = s
    return stats


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_state(state: Any) -> SavedState:
    """`state_dict()` read back and checked whole, or `CorruptedStateError` saying what is wrong with it (a
    retired or unknown schema version included: `retired_version`)."""
    if not isinstance(state, dict):
        raise CorruptedStateError(f"expected a dict, got {type(state).__name__}")
    retired = retired_version(state.get("version"))
    if retired is not None:
        raise CorruptedStateError(retired)
    missing = [k for k in ("optimal_power_limit_w", "stats") if k not in state]
    if missing:
        raise CorruptedStateError(f"no {', '.join(missing)}")
    stats = _parse_stats(state["stats"])
    optimal = state["optimal_power_limit_w"]
    if optimal is not None and not _power_limit(optimal):
        raise CorruptedStateError(f"optimal_power_limit_w={optimal!r} is not a power limit in watts")
    steps, energy = state.get("profiling_steps"), state.get("profiling_energy_j", 0.0)
    if steps is None:
        return SavedState(stats, optimal, None, 0.0)
    if not _whole(steps) or steps < 0:
        raise CorruptedStateError(f"profiling_steps={steps!r} is not a count of steps")
    if not _finite(energy) or energy < 0:
        raise CorruptedStateError(f"profiling_energy_j={energy!r} is not a finite, non-negative number")
    return SavedState(stats, optimal, steps, float(energy))
