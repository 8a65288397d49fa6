"""The power-limit optimizer's saved profile: what was measured, and on what."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from zeus_callbacks.core.power_limit.search import PowerLimitStats

__all__ = ["ProfileContext", "save_profile", "load_profile"]

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


def save_profile(
    path: Path, context: ProfileContext, stats: dict[int, PowerLimitStats], complete: bool
) -> None:
    """Write the profile atomically (a partial one too, so a preempted job resumes)."""
    data = {
        "format": _FORMAT,
        "version": 1,
        "context": {**context.__dict__, "power_limit_range_w": list(context.power_limit_range_w)},
        "complete": complete,
        "measurements": [s.to_dict() for s in sorted(stats.values(), key=lambda s: -s.power_limit_w)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def load_profile(path: Path, context: ProfileContext) -> tuple[dict[int, PowerLimitStats], bool]:
    """Read a saved profile; returns (stats per power limit, whether the search had finished).

    Raises:
        ValueError: the file is not such a profile, or it was measured on something else.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Cannot read the power-limit profile {str(path)!r}: {e}. Delete it to profile again."
        ) from e
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(
            f"{str(path)!r} is not a zeus_callbacks power-limit profile (a Zeus profile lacks what it was measured "
            "on). Pass another profile_path, or delete the file to profile again."
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
    return stats, bool(data.get("complete"))
