"""The power-limit optimizer's saved profile: what was measured, on what, and for which selector.

The measurements are in the versioned form of `schema`; a file of a retired or unknown version is refused
with what to do (delete it: the GPUs are profiled again).

Reads Zeus's profile files too (`{"measurements": [{"power_limit", "energy", "time"}, ...]}`, each a
window of Zeus's `profile_steps` steps at one limit); they do not say what they were measured on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.files import ForeignFileError, read_regular, write_atomic
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats
from zeus_callbacks.core.power_limit.options import PowerLimitOptions
from zeus_callbacks.core.power_limit.schema import (
    SCHEMA_VERSION,
    measurement_problem,
    retired_version,
    saved_stats,
    stats_from_saved,
)
from zeus_callbacks.core.power_limit.search import Search

__all__ = ["ProfileContext", "SavedProfile", "save_profile", "load_profile", "reuse_profile"]

logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")

_FORMAT = "zeus_callbacks.power_limit_profile"


@dataclass(frozen=True)
class ProfileContext:
    """What a profile was measured on; a profile is only reused on the same."""

    gpu_model: str
    power_limit_range_w: tuple[float, float]  # the grid's ends (W; a board's may be fractional)
    pl_step_w: int
    num_gpus: int
    simulated: bool
    package_version: str = field(default="", compare=False)

    def describe(self) -> str:
        sim = " (simulated)" if self.simulated else ""
        lo, hi = self.power_limit_range_w
        return f"{self.num_gpus} x {self.gpu_model}{sim}, {lo:g}-{hi:g} W in {self.pl_step_w} W steps"


@dataclass
class SavedProfile:
    """A profile as read back.

    Attributes:
        stats: Per power limit, the steps measured (a Zeus window becomes `profile_steps` equal steps).
        complete: Whether the search that wrote it had finished.
        selector: `repr` of the selector it was searched for (None for Zeus's files).
        search: The search that wrote it ("adaptive", "sweep", "zeus"; "zeus" for Zeus's files).
        written_by_zeus: A Zeus profile: every limit measured fully, the GPU it was measured on unknown.
    """

    stats: dict[float, PowerLimitStats]
    complete: bool
    selector: str | None
    search: str
    written_by_zeus: bool = False


def save_profile(
    path: Path,
    context: ProfileContext,
    stats: dict[float, PowerLimitStats],
    complete: bool,
    selector: str = "",
    search: str = PowerLimitOptions.search,
) -> None:
    """Write the profile atomically and privately (`files.write_atomic`; a partial one too, so a preempted
    job resumes).

    Raises:
        OSError: it cannot be written (the last complete profile is kept).
    """
    data = {
        "format": _FORMAT,
        "version": SCHEMA_VERSION,
        "context": {**context.__dict__, "power_limit_range_w": list(context.power_limit_range_w)},
        "complete": complete,
        "selector": selector,
        "search": search,
        "measurements": [saved_stats(s) for s in sorted(stats.values(), key=lambda s: -s.power_limit_w)],
    }
    write_atomic(path, json.dumps(data, indent=1))


def _is_zeus_profile(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and "format" not in data
        and isinstance(data.get("measurements"), list)
        and all(
            isinstance(m, dict) and {"power_limit", "energy", "time"} <= set(m) for m in data["measurements"]
        )
    )


def _zeus_stats(path: Path, data: dict, steps: int) -> dict[float, PowerLimitStats]:
    """Zeus's windows as `steps` equal steps each (its files keep no per-step spread)."""
    stats: dict[float, PowerLimitStats] = {}
    for m in data["measurements"]:
        pl, energy, time_s = int(m["power_limit"]), float(m["energy"]), float(m["time"])
        if pl <= 0 or energy <= 0 or time_s <= 0:
            raise ValueError(f"The Zeus profile {str(path)!r} holds a non-positive measurement: {m!r}.")
        stats[pl] = PowerLimitStats(
            pl, steps, time_s, energy, time_s * time_s / steps, energy * energy / steps
        )
    if not stats:
        raise ValueError(f"The Zeus profile {str(path)!r} holds no measurements. Delete it to profile again.")
    return stats


def _check_measurement(
    path: Path, s: PowerLimitStats, range_w: tuple[float, float], saved: Mapping[str, Any] | None = None
) -> None:
    problem = measurement_problem(s, range_w, saved)
    if problem is not None:
        raise InvalidInputError(
            f"The power-limit profile {str(path)!r} is corrupted: {problem}. Delete it to profile again, or pass "
            "another profile_path."
        )


def load_profile(
    path: Path, context: ProfileContext, profile_steps: int = PowerLimitOptions.profile_steps
) -> SavedProfile:
    """Read a saved profile (ours, or Zeus's: then `profile_steps` is the number of steps each of its
    windows becomes).

    Raises:
        ValueError: the file is not such a profile, or (ours) it was measured on something else, or
            (Zeus's) its limits are outside this GPU's range.
    """
    try:
        data = json.loads(read_regular(path, chooses="the power limit"))
    except ForeignFileError as e:
        raise InvalidInputError(f"The power-limit profile {e.filename!r} {e.strerror}.") from None
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Cannot read the power-limit profile {str(path)!r}: {e}. Delete it to profile again."
        ) from e
    if _is_zeus_profile(data):
        stats = _zeus_stats(path, data, profile_steps)
        lo, hi = context.power_limit_range_w
        outside = sorted(pl for pl in stats if not lo <= pl <= hi)
        if outside:
            raise ValueError(
                f"The Zeus profile {str(path)!r} has power limits {outside} W outside this job's range "
                f"{lo:g}-{hi:g} W ({context.describe()}): it was measured on another GPU. Pass another "
                "profile_path, or delete the file to profile again."
            )
        return SavedProfile(stats, True, None, "zeus", written_by_zeus=True)
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(
            f"{str(path)!r} is neither a zeus_callbacks nor a Zeus power-limit profile. Pass another "
            "profile_path, or delete the file to profile again."
        )
    retired = retired_version(data.get("version", 1))  # the first files had no version
    if retired is not None:
        raise ValueError(
            f"The power-limit profile {str(path)!r} has {retired}. Delete it: the GPUs are profiled again at the "
            "next run (or upgrade zeus_callbacks, for a newer version)."
        )
    try:
        raw = dict(data["context"])
        raw["power_limit_range_w"] = tuple(raw["power_limit_range_w"])
        saved = ProfileContext(**raw)
        measurements = [(m, stats_from_saved(m)) for m in data["measurements"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"The power-limit profile {str(path)!r} is corrupted ({type(e).__name__}: {e}). Delete it to profile again."
        ) from None
    if saved != context:
        raise ValueError(
            f"The power-limit profile {str(path)!r} was measured on {saved.describe()}, but this job runs on "
            f"{context.describe()}. Pass another profile_path, or delete the file to profile again."
        )
    for entry, s in measurements:
        _check_measurement(path, s, context.power_limit_range_w, entry)
    stats = {s.power_limit_w: s for _, s in measurements}
    # Files written before the selector was recorded: valid for no selector in particular.
    return SavedProfile(
        stats, bool(data.get("complete")), data.get("selector"), str(data.get("search", "adaptive"))
    )


def reuse_profile(
    saved: SavedProfile, search: Search, selector: str, mode: str, path: Path, context: ProfileContext
) -> bool | None:
    """Take the profile `saved` at `path` into `search`: its answer when it holds one for `selector` (a repr)
    and the search `mode` (a Zeus profile, which measured every limit fully, answers any), else its
    measurements, profiling going on with what this selector still needs first. Says which in one line.

    Returns:
        None when profiling goes on; else whether the answer is to be saved again (searched for another
        selector).
    """
    if saved.written_by_zeus:
        logger.warning(
            "%s is a profile written by Zeus: it does not say which GPU it was measured on, so that could not "
            "be checked against this job's %s. Using it.",
            path,
            context.describe(),
        )
        search.stats = saved.stats
        return False
    same = saved.selector == selector and saved.search == mode
    search.reuse(saved.stats, same)
    if same and saved.complete or search.next_power_limit() is None and search.stats:
        logger.info("Loaded the power-limit profile %s.", path)
        return not same
    logger.info(
        "Loaded %s power-limit profile from %s%s; profiling what is missing.",
        "the" if saved.complete else "a partial",
        path,
        "" if same else f" (searched for {saved.selector or 'another selector'}, not {selector})",
    )
    return None
