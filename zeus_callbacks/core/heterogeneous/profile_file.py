"""Per-GPU-type profiles for the heterogeneous planner: loading, validation and interpolation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_IDLE_POWER_FRACTION",
    "DEFAULT_STEPS_PER_WINDOW",
    "SHIPPED_PROFILES",
    "GPUProfile",
    "ExtrapolationError",
    "load_profile",
]

# Zeus² profiles measure one window of 10 training steps (after 5 warm-up steps).
DEFAULT_STEPS_PER_WINDOW = 10
# A GPU waiting at the all-reduce still holds its clocks and spins a NCCL kernel; without a measured value we
# take 0.3x its lowest power limit (A10G: 30 W, T4: 18 W), close to the 20-35 W those boards draw when busy-idle.
DEFAULT_IDLE_POWER_FRACTION = 0.3
# Shipped profiles, by short name: CIFAR-100/ShuffleNetV2 on AWS (Zeus² extension).
SHIPPED_PROFILES = {"a10": "cifar_a10.json", "t4": "cifar_t4.json"}


class ExtrapolationError(ValueError):
    """A plan would need a local batch size outside the measured range."""


@dataclass(frozen=True, eq=False)
class GPUProfile:
    """Step time and energy of one GPU type, measured at every (local batch size, power limit).

    Args:
        gpu_name: GPU model, as the user calls it (`"a10"`).
        batch_sizes: Measured local batch sizes, ascending.
        power_limits_w: Measured power limits (W), ascending.
        time_s: Time of one training step, shape `(len(power_limits_w), len(batch_sizes))`.
        energy_j: Energy of one GPU for one training step, same shape.
        idle_power_w: Power drawn while waiting for slower GPUs at the all-reduce; `None` for
            `DEFAULT_IDLE_POWER_FRACTION` times the lowest power limit.
        max_batch_size: Largest local batch that fits in memory (`None`: no limit known).
        steps_per_window: Steps in one window of the source file (the Zeus² cost model works per window).
        source: Where the profile came from.

    Raises:
        ValueError: Shapes that do not match, unsorted or duplicate axes, or non-positive times.
    """

    gpu_name: str
    batch_sizes: np.ndarray
    power_limits_w: np.ndarray
    time_s: np.ndarray
    energy_j: np.ndarray
    idle_power_w: float | None = None
    max_batch_size: int | None = None
    steps_per_window: int = 1
    source: str = ""
    _last_slope: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        batch = np.asarray(self.batch_sizes, dtype=np.int64)
        limits = np.asarray(self.power_limits_w, dtype=np.int64)
        time_s = np.asarray(self.time_s, dtype=float)
        energy_j = np.asarray(self.energy_j, dtype=float)
        where = f"`GPUProfile({self.gpu_name!r})`"
        if batch.ndim != 1 or len(batch) < 2 or np.any(np.diff(batch) <= 0) or batch[0] < 1:
            raise ValueError(
                f"{where}: need at least two distinct ascending batch sizes >= 1; got {batch.tolist()}."
            )
        if limits.ndim != 1 or len(limits) < 1 or np.any(np.diff(limits) <= 0):
            raise ValueError(f"{where}: power limits must be distinct and ascending; got {limits.tolist()}.")
        shape = (len(limits), len(batch))
        if time_s.shape != shape or energy_j.shape != shape:
            raise ValueError(
                f"{where}: time and energy must have shape {shape} (power limits x batch sizes)."
            )
        if not np.all(time_s > 0) or not np.all(energy_j >= 0):
            raise ValueError(f"{where}: times must be > 0 and energies >= 0.")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"{where}: max_batch_size must be >= 1; got {self.max_batch_size}.")
        idle = self.idle_power_w
        if idle is None:
            idle = DEFAULT_IDLE_POWER_FRACTION * float(limits[0])
        for name, value in (
            ("batch_sizes", batch),
            ("power_limits_w", limits),
            ("time_s", time_s),
            ("energy_j", energy_j),
            ("idle_power_w", float(idle)),
        ):
            object.__setattr__(self, name, value)
        # Time per extra sample beyond the largest measured batch: the slope of the last segment.
        slope = (time_s[:, -1] - time_s[:, -2]) / float(batch[-1] - batch[-2])
        object.__setattr__(self, "_last_slope", np.maximum(slope, 0.0))

    @property
    def average_power_w(self) -> np.ndarray:
        """Average power over a step, `energy_j / time_s`."""
        return self.energy_j / self.time_s

    @property
    def max_power_limit_w(self) -> int:
        """The highest measured power limit."""
        return int(self.power_limits_w[-1])

    @property
    def measured_range(self) -> tuple[int, int]:
        """Smallest and largest measured local batch size."""
        return int(self.batch_sizes[0]), int(self.batch_sizes[-1])

    def batch_range(self, allow_extrapolation: bool = False) -> tuple[int, int | None]:
        """Local batch sizes a plan may use: the measured range (or from 1 when extrapolating), capped by memory."""
        lo, hi = self.measured_range
        upper: int | None = hi
        if allow_extrapolation:
            lo, upper = 1, None
        if self.max_batch_size is not None:
            upper = self.max_batch_size if upper is None else min(upper, self.max_batch_size)
        return lo, upper

    def interpolate(self, batch: np.ndarray | float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step time and average power at (possibly unmeasured) local batch sizes.

        Piecewise linear in batch size between measured sizes. Outside them: below the smallest, time and
        power are held (a GPU is not faster than its per-step overhead); above the largest, time grows with the
        last segment's slope and power is held.

        Returns:
            `(time_s, power_w, extrapolated)`: the first two of shape `(len(power_limits_w), len(batch))`,
            the last a boolean mask per batch size.
        """
        b = np.atleast_1d(np.asarray(batch, dtype=float))
        lo, hi = self.measured_range
        bs = self.batch_sizes.astype(float)
        time_s = np.stack([np.interp(b, bs, row) for row in self.time_s])
        power_w = np.stack([np.interp(b, bs, row) for row in self.average_power_w])
        above = np.maximum(b - hi, 0.0)
        time_s = time_s + self._last_slope[:, None] * above[None, :]
        return time_s, power_w, (b < lo) | (b > hi)

    def scaled(
        self, gpu_name: str, *, batch_factor: int = 1, time_factor: float = 1.0, power_factor: float = 1.0
    ) -> GPUProfile:
        """A synthetic GPU type derived from this one (for benchmarks and what-if studies).

        Batch sizes are multiplied by `batch_factor`, step times by `time_factor`, power limits and power by
        `power_factor`.
        """
        return GPUProfile(
            gpu_name=gpu_name,
            batch_sizes=self.batch_sizes * int(batch_factor),
            power_limits_w=np.round(self.power_limits_w * power_factor).astype(np.int64),
            time_s=self.time_s * time_factor,
            energy_j=self.energy_j * time_factor * power_factor,
            idle_power_w=self.idle_power_w * power_factor,
            max_batch_size=None if self.max_batch_size is None else self.max_batch_size * int(batch_factor),
            steps_per_window=self.steps_per_window,
            source=f"{self.source} (scaled)",
        )


def load_profile(path_or_name: str | os.PathLike[str]) -> GPUProfile:
    """Load a Zeus² profile JSON, or a shipped one by name (`"a10"`, `"t4"`).

    The file maps each local batch size to its measurements,
    `{"<batch>": [{"power_limit": W, "energy": J, "time": s}, ...]}`, measured over a window of
    `steps_per_window` steps, and may hold an extra `"metadata"` object with any of `gpu`, `steps_per_window`
    (default 10), `idle_power_w` and `max_batch_size`.

    Raises:
        FileNotFoundError: Neither a file nor a shipped profile name.
        ValueError: A malformed file, or a batch size missing some power limit.
    """
    path = Path(path_or_name)
    name = str(path_or_name)
    if path.is_file():
        text, source, default_name = path.read_text(), str(path), path.stem.removeprefix("cifar_")
    else:
        key = name.lower().removeprefix("cifar_").removesuffix(".json")
        if key not in SHIPPED_PROFILES or os.sep in name:
            raise FileNotFoundError(
                f"`load_profile({name!r})`: no such file and not a shipped profile (shipped: {sorted(SHIPPED_PROFILES)})."
            )
        resource = resources.files("zeus_callbacks") / "sim" / "data" / "zeus2_aws" / SHIPPED_PROFILES[key]
        text, source, default_name = resource.read_text(), f"shipped:{SHIPPED_PROFILES[key]}", key
    try:
        return _parse(json.loads(text), default_name, source)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"`load_profile({name!r})`: not a Zeus² profile ({type(e).__name__}: {e}).") from e


def _parse(data: dict[str, Any], default_name: str, source: str) -> GPUProfile:
    metadata = dict(data.pop("metadata", None) or {})
    steps = int(metadata.get("steps_per_window", DEFAULT_STEPS_PER_WINDOW))
    batch_sizes = sorted(int(k) for k in data)
    limits = sorted({int(m["power_limit"]) for rows in data.values() for m in rows})
    time_s = np.full((len(limits), len(batch_sizes)), np.nan)
    energy_j = np.full_like(time_s, np.nan)
    column = {b: j for j, b in enumerate(batch_sizes)}
    row = {p: i for i, p in enumerate(limits)}
    for key, rows in data.items():
        for m in rows:
            i, j = row[int(m["power_limit"])], column[int(key)]
            time_s[i, j] = float(m["time"]) / steps
            energy_j[i, j] = float(m["energy"]) / steps
    missing = [(b, p) for p in limits for b in batch_sizes if np.isnan(time_s[row[p], column[b]])]
    if missing:
        raise ValueError(f"profile {source}: (batch size, power limit) pairs not measured: {missing[:5]}.")
    max_batch = metadata.get("max_batch_size")
    idle = metadata.get("idle_power_w")
    return GPUProfile(
        gpu_name=str(metadata.get("gpu", default_name)),
        batch_sizes=np.array(batch_sizes),
        power_limits_w=np.array(limits),
        time_s=time_s,
        energy_j=energy_j,
        idle_power_w=None if idle is None else float(idle),
        max_batch_size=None if max_batch is None else int(max_batch),
        steps_per_window=steps,
        source=source,
    )
