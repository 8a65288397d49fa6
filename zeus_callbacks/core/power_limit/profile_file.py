"""The power-limit optimizer's saved profile: what was measured, on what, and for which selector.

Reads Zeus's profile files too (`{"measurements": [{"power_limit", "energy", "time"}, ...]}`, each a
window of Zeus's `profile_steps` steps at one limit); they do not say what they were measured on.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.power_limit.search import PowerLimitStats

__all__ = ["ProfileContext", "SavedProfile", "save_profile", "load_profile", "measurement_problem"]

_FORMAT = "zeus_callbacks.power_limit_profile"


@dataclass(frozen=True)
class ProfileContext:
    """What a profile was measured on; a profile is only reused on the same."""

    gpu_model: str
    power_limit_range_w: tuple[int, int]
    pl_step_w: int
    num_gpus: int
    simulated: bool
    package_version: str = field(default="", compare=False)

    def describe(self) -> str:
        sim = " (simulated)" if self.simulated else ""
        lo, hi = self.power_limit_range_w
        return f"{self.num_gpus} x {self.gpu_model}{sim}, {lo}-{hi} W in {self.pl_step_w} W steps"


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

    stats: dict[int, PowerLimitStats]
    complete: bool
    selector: str | None
    search: str
    written_by_zeus: bool = False


def save_profile(
    path: Path,
    context: ProfileContext,
    stats: dict[int, PowerLimitStats],
    complete: bool,
    selector: str = "",
    search: str = "adaptive",
) -> None:
    """Write the profile atomically (a partial one too, so a preempted job resumes)."""
    data = {
        "format": _FORMAT,
        "version": 1,
        "context": {**context.__dict__, "power_limit_range_w": list(context.power_limit_range_w)},
        "complete": complete,
        "selector": selector,
        "search": search,
        "measurements": [s.to_dict() for s in sorted(stats.values(), key=lambda s: -s.power_limit_w)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _is_zeus_profile(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and "format" not in data
        and isinstance(data.get("measurements"), list)
        and all(
            isinstance(m, dict) and {"power_limit", "energy", "time"} <= set(m) for m in data["measurements"]
        )
    )


def _zeus_stats(path: Path, data: dict, steps: int) -> dict[int, PowerLimitStats]:
    """Zeus's windows as `steps` equal steps each (its files keep no per-step spread)."""
    stats: dict[int, PowerLimitStats] = {}
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


def measurement_problem(
    s: PowerLimitStats, range_w: tuple[int, int] | None, saved: Mapping[str, Any] | None = None
) -> str | None:
    """What makes one limit's saved measurement unusable (a limit outside `range_w` when given, no count of
    steps, a sum that is not finite and non-negative, a chunk that is not numbers), or None; shared by
    profile files and checkpoints. `saved` is the entry as read: the sums are checked as written too, since
    `PowerLimitStats` recounts them from its chunks."""
    if not isinstance(s.power_limit_w, int) or isinstance(s.power_limit_w, bool):
        return f"power limit {s.power_limit_w!r} is not a whole number of watts"
    if range_w is not None and not range_w[0] <= s.power_limit_w <= range_w[1]:
        return f"power limit {s.power_limit_w} W is outside the GPU's range {range_w[0]}-{range_w[1]} W"
    for values in ([saved] if saved is not None else []) + [asdict(s)]:
        problem = _sums_problem(s.power_limit_w, values, s.pruned)
        if problem is not None:
            return problem
    for chunk in saved.get("chunks") or [] if saved is not None else []:
        if not isinstance(chunk, list) or not all(_finite(x) for x in chunk) or not chunk or chunk[0] < 0:
            return f"{s.power_limit_w} W: chunk {chunk!r} is not a list of finite numbers"
    return None


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _sums_problem(power_limit_w: int, values: Mapping[str, Any], pruned: bool) -> str | None:
    steps = values.get("steps", 0)
    if (
        not isinstance(steps, int)
        or isinstance(steps, bool)
        or steps < 0
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


def _check_measurement(
    path: Path, s: PowerLimitStats, range_w: tuple[int, int], saved: Mapping[str, Any] | None = None
) -> None:
    problem = measurement_problem(s, range_w, saved)
    if problem is not None:
        raise InvalidInputError(
            f"The power-limit profile {str(path)!r} is corrupted: {problem}. Delete it to profile again, or pass "
            "another profile_path."
        )


def load_profile(path: Path, context: ProfileContext, profile_steps: int = 40) -> SavedProfile:
    """Read a saved profile (ours, or Zeus's: then `profile_steps` is the number of steps each of its
    windows becomes).

    Raises:
        ValueError: the file is not such a profile, or (ours) it was measured on something else, or
            (Zeus's) its limits are outside this GPU's range.
    """
    try:
        data = json.loads(path.read_text())
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
                f"{lo}-{hi} W ({context.describe()}): it was measured on another GPU. Pass another "
                "profile_path, or delete the file to profile again."
            )
        return SavedProfile(stats, True, None, "zeus", written_by_zeus=True)
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(
            f"{str(path)!r} is neither a zeus_callbacks nor a Zeus power-limit profile. Pass another "
            "profile_path, or delete the file to profile again."
        )
    try:
        raw = dict(data["context"])
        raw["power_limit_range_w"] = tuple(raw["power_limit_range_w"])
        saved = ProfileContext(**raw)
        stats = {int(m["power_limit_w"]): PowerLimitStats(**m) for m in data["measurements"]}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"The power-limit profile {str(path)!r} is corrupted ({type(e).__name__}: {e}). Delete it to profile again."
        ) from None
    if saved != context:
        raise ValueError(
            f"The power-limit profile {str(path)!r} was measured on {saved.describe()}, but this job runs on "
            f"{context.describe()}. Pass another profile_path, or delete the file to profile again."
        )
    for entry in data["measurements"]:
        _check_measurement(path, stats[int(entry["power_limit_w"])], context.power_limit_range_w, entry)
    # Files written before the selector was recorded: valid for no selector in particular.
    return SavedProfile(
        stats, bool(data.get("complete")), data.get("selector"), str(data.get("search", "adaptive"))
    )
