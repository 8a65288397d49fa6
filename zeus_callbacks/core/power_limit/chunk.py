"""One sample of a power limit's measurement: a `Chunk` of contiguous steps, and how it is saved.

Profiles and checkpoints keep every chunk (`schema`), each as a dict of the `Chunk` fields (`to_saved`,
`from_saved`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["Chunk", "ChunkError"]


class ChunkError(ValueError):
    """A saved chunk that is not a dict of the `Chunk` fields, as finite numbers."""


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class Chunk:
    """`steps` contiguous steps of one visit to a limit, each step's time maxed and its energy summed
    over ranks.

    A sample (`settling=False`) is measured: `time_s` and `energy_j` in all, ending at `end_s` on the
    monitor's clock, with the job's GPUs drawing `power_w` on average over the second before it (None:
    not read). A settling step (`settling=True`) runs at the limit before it is measured: only its time
    counts (`energy_j` 0; the counter still lags), to see a burst begin and to fill a power window.
    """

    steps: int
    time_s: float
    energy_j: float
    visit: int = 1
    power_w: float | None = None
    end_s: float | None = None
    settling: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ChunkError(f"{self!r} has no steps (a chunk spans one step or more)")

    @property
    def step_s(self) -> float:
        """Mean time of one of its steps (s)."""
        return self.time_s / self.steps

    @property
    def dated(self) -> bool:
        """Whether it carries both its one-second power and its end time (a power window may end at it)."""
        return self.power_w is not None and self.end_s is not None

    def to_saved(self) -> dict[str, Any]:
        """Plain numbers; None for a reading not taken."""
        return asdict(self)

    @classmethod
    def from_saved(cls, saved: Any) -> Chunk:
        """A chunk as `to_saved` wrote it.

        Raises:
            ChunkError: not such a dict; the message says what is wrong.
        """
        if not isinstance(saved, Mapping):
            raise ChunkError(f"chunk {saved!r} is not a dict of chunk fields")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(saved) - names)
        if unknown or not {"steps", "time_s", "energy_j"} <= set(saved):
            raise ChunkError(
                f"chunk {dict(saved)!r} does not have the fields of a chunk ({', '.join(sorted(names))})"
            )
        numbers = [saved[k] for k in ("steps", "time_s", "energy_j", "visit") if k in saved]
        readings = [saved.get(k) for k in ("power_w", "end_s")]
        if (
            not all(_finite(x) for x in numbers)
            or not all(x is None or (_finite(x) and x >= 0) for x in readings)
            or not isinstance(saved.get("settling", False), bool)
        ):
            raise ChunkError(f"chunk {dict(saved)!r} is not made of finite numbers")
        return cls(
            int(saved["steps"]),
            float(saved["time_s"]),
            float(saved["energy_j"]),
            int(saved.get("visit", 1)),
            _or_none(readings[0]),
            _or_none(readings[1]),
            saved.get("settling", False),
        )


def _or_none(value: Any) -> float | None:
    return None if value is None else float(value)
