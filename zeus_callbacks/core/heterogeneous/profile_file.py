"""The Zeus² profile file of the heterogeneous planner: its rows, its writer and its reader (`GPUProfile`).

A profile maps each local batch size to one measured window per power limit,
`{"<batch>": [{"power_limit": W, "energy": J, "time": s}, ...], "metadata": {...}}`. `zeus-callbacks profile`
writes it from one `BatchSizeRun` per batch size (each written by the profiled script with `write_run`);
`load_profile` reads it for the planner.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.files import ForeignFileError, read_regular, write_atomic
from zeus_callbacks.version import __version__

__all__ = [
    "DEFAULT_IDLE_POWER_FRACTION",
    "DEFAULT_STEPS_PER_WINDOW",
    "SHIPPED_PROFILES",
    "PowerLimitWindow",
    "BatchSizeRun",
    "write_run",
    "read_run",
    "build_profile",
    "write_profile",
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


def shipped_profiles_dir() -> Path:
    """Where the shipped Zeus² profiles live (`data/zeus2_aws/` beside this module; see its `NOTICE.md`)."""
    return Path(str(resources.files("zeus_callbacks"))) / "core" / "heterogeneous" / "data" / "zeus2_aws"


class ExtrapolationError(ValueError):
    """A plan would need a local batch size outside the measured range."""


@dataclass(frozen=True)
class PowerLimitWindow:
    """One measured window of `steps` training steps at a power limit: one row of a Zeus² profile."""

    power_limit_w: int
    time_s: float
    energy_j: float
    steps: int

    def to_row(self) -> dict[str, float]:
        """The row as the profile file holds it (time and energy of the whole window)."""
        return {"power_limit": self.power_limit_w, "energy": self.energy_j, "time": self.time_s}

    @classmethod
    def from_row(cls, row: Mapping[str, Any], steps: int) -> PowerLimitWindow:
        """A row of the profile file, whose windows are `steps` steps long."""
        return cls(int(row["power_limit"]), float(row["time"]), float(row["energy"]), steps)


@dataclass(frozen=True)
class BatchSizeRun:
    """What one run of the profiled script measured at one batch size, handed to `zeus-callbacks profile`.

    Attributes:
        batch_size: The local batch size the run trained with (None outside `zeus-callbacks profile`).
        gpu_model: The GPU's model name, as NVML reports it.
        gpu_index: The GPU measured.
        simulated: The GPU is simulated.
        warmup_steps: Unmeasured steps run at each power limit.
        steps_per_window: Steps in each measured window.
        memory_peak_bytes: Peak CUDA memory of the run (None on simulated GPUs or without CUDA).
        oom: The run ran out of GPU memory (its windows are those measured before).
        windows: One window per power limit, highest limit first.
    """

    batch_size: int | None
    gpu_model: str
    gpu_index: int
    simulated: bool
    warmup_steps: int
    steps_per_window: int
    memory_peak_bytes: int | None
    oom: bool
    windows: tuple[PowerLimitWindow, ...]


def write_run(path: str | os.PathLike[str], run: BatchSizeRun) -> None:
    """Write one batch size's run as JSON (read back by `read_run`)."""
    write_atomic(path, json.dumps(asdict(run), indent=2))


def read_run(path: str | os.PathLike[str]) -> BatchSizeRun | None:
    """The run written by `write_run` at `path`; None when the script wrote none."""
    if not Path(path).is_file():
        return None
    data = json.loads(read_regular(path, chooses="a batch size and power limit"))
    windows = tuple(PowerLimitWindow(**w) for w in data.pop("windows"))
    return BatchSizeRun(**data, windows=windows)


def build_profile(
    runs: Mapping[int, BatchSizeRun],
    *,
    gpu_name: str,
    command: Sequence[str],
    simulation: Mapping[int, str] | None = None,
    oom_at: int | None = None,
) -> dict[str, Any]:
    """The Zeus² profile of one GPU type from its runs, one per batch size, as `write_profile` writes it.

    Args:
        runs: The run of each measured batch size.
        gpu_name: The GPU type's name in plans (`"a10"`).
        command: The profiled command, kept in the metadata.
        simulation: The simulation spec of each batch size, when the GPUs were simulated.
        oom_at: The batch size that ran out of memory; the largest measured one becomes `max_batch_size`.

    Raises:
        ValueError: fewer than two batch sizes measured, or runs that measured different power limits.
    """
    if len(runs) < 2:
        raise ValueError(
            f"only {len(runs)} batch size(s) measured{f' (out of memory at {oom_at})' if oom_at else ''}; "
            "a profile needs two or more"
        )
    limit_sets = {b: sorted(w.power_limit_w for w in r.windows) for b, r in runs.items()}
    if len({tuple(v) for v in limit_sets.values()}) != 1:
        raise ValueError(f"the runs measured different power limits: {limit_sets}")
    first = next(iter(runs.values()))
    profile: dict[str, Any] = {
        str(b): [w.to_row() for w in sorted(r.windows, key=lambda w: -w.power_limit_w)]
        for b, r in sorted(runs.items())
    }
    metadata: dict[str, Any] = {
        "gpu": gpu_name,
        "gpu_model": first.gpu_model,
        "steps_per_window": first.steps_per_window,
        "warmup_steps": first.warmup_steps,
        "power_limits": next(iter(limit_sets.values())),
        "memory_peak_bytes": {str(b): r.memory_peak_bytes for b, r in sorted(runs.items())},
        "simulated": any(r.simulated for r in runs.values()),
        "command": list(command),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "zeus_callbacks": __version__,
    }
    if oom_at is not None:
        metadata["max_batch_size"] = max(runs)
        metadata["out_of_memory_at"] = oom_at
    if simulation:
        metadata["simulation"] = {str(b): simulation[b] for b in sorted(runs)}
    profile["metadata"] = metadata
    return profile


def write_profile(path: str | os.PathLike[str], profile: Mapping[str, Any]) -> None:
    """Write a profile built by `build_profile` (read back by `load_profile`), atomically; others may read
    it (mode 644 less the umask), to plan from a copy of their own.

    Raises:
        OSError: it cannot be written.
    """
    write_atomic(path, json.dumps(profile, indent=2), mode=0o644)


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
        if not np.all(time_s > 0) or not np.all(energy_j >= 0) or not np.all(np.isfinite(time_s + energy_j)):
            raise ValueError(f"{where}: times must be finite and > 0, and energies finite and >= 0.")
        if limits[0] <= 0:
            raise ValueError(f"{where}: power limits must be > 0 W; got {limits.tolist()}.")
        if self.idle_power_w is not None and not 0 <= self.idle_power_w < math.inf:
            raise ValueError(
                f"{where}: idle_power_w must be a number of watts >= 0; got {self.idle_power_w!r}."
            )
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
            idle_power_w=None if self.idle_power_w is None else self.idle_power_w * power_factor,
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
        try:
            text = read_regular(path, chooses="a batch size and power limit").decode()
            source, default_name = str(path), path.stem.removeprefix("cifar_")
        except ForeignFileError as e:
            raise InvalidInputError(f"profile {path} {e.strerror}.") from None
        except UnicodeDecodeError:
            raise InvalidInputError(
                f"profile {path}: not a text file; expected a Zeus² profile JSON."
            ) from None
    else:
        key = name.lower().removeprefix("cifar_").removesuffix(".json")
        if key not in SHIPPED_PROFILES or os.sep in name:
            raise FileNotFoundError(
                f"`load_profile({name!r})`: no such file and not a shipped profile (shipped: {sorted(SHIPPED_PROFILES)})."
            )
        resource = shipped_profiles_dir() / SHIPPED_PROFILES[key]
        text, source, default_name = resource.read_text(), f"shipped:{SHIPPED_PROFILES[key]}", key
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInputError(
            f"profile {source}, line {e.lineno} column {e.colno}: not valid JSON ({e.msg}); the file may be "
            "truncated. Expected a Zeus² profile."
        ) from None
    return _parse(data, default_name, source)


_PROFILE_FORMAT = (
    'expected {"<batch size>": [{"power_limit": W, "time": s, "energy": J}, ...], "metadata": {...}}'
)


def _field(source: str, where: str, value: Any, kind: type, lowest: float, strict: bool = False) -> Any:
    """`value` as a finite `kind` >= `lowest` (> with `strict`), or an error naming the file and the field."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok and kind is int and isinstance(value, str) and value.strip().isdigit():
        value, ok = int(value), True
    if not ok or not math.isfinite(value) or value < lowest or (strict and value == lowest):
        bound = f"> {lowest:g}" if strict else f">= {lowest:g}"
        what = "a whole number" if kind is int else "a number"
        raise InvalidInputError(
            f"profile {source}, {where} is {value!r}: expected {what} {bound}. Fix the file."
        )
    return kind(value)


def _parse(data: Any, default_name: str, source: str) -> GPUProfile:
    if not isinstance(data, dict):
        raise InvalidInputError(f"profile {source}: not a Zeus² profile; {_PROFILE_FORMAT}.")
    data = dict(data)
    metadata = data.pop("metadata", None) or {}
    if not isinstance(metadata, dict):
        raise InvalidInputError(f'profile {source}: "metadata" must be an object; {_PROFILE_FORMAT}.')
    steps = _field(
        source,
        "metadata.steps_per_window",
        metadata.get("steps_per_window", DEFAULT_STEPS_PER_WINDOW),
        int,
        1,
    )
    for key, rows in data.items():
        _field(source, f"key {key!r} (a batch size)", key, int, 1)
        if not isinstance(rows, list) or not all(isinstance(m, dict) for m in rows):
            raise InvalidInputError(f"profile {source}, batch size {key}: {_PROFILE_FORMAT}.")
        for i, m in enumerate(rows):
            at = f'batch size "{key}", entry {i}'
            missing = [f for f in ("power_limit", "time", "energy") if f not in m]
            if missing:
                raise InvalidInputError(
                    f"profile {source}, {at}: no {', '.join(missing)}; {_PROFILE_FORMAT}."
                )
            _field(source, f"{at}: power_limit", m["power_limit"], float, 0, strict=True)
            _field(source, f"{at}: time", m["time"], float, 0, strict=True)
            _field(source, f"{at}: energy", m["energy"], float, 0)
    if metadata.get("idle_power_w") is not None:
        _field(source, "metadata.idle_power_w", metadata["idle_power_w"], float, 0)
    if metadata.get("max_batch_size") is not None:
        _field(source, "metadata.max_batch_size", metadata["max_batch_size"], int, 1)
    batch_sizes = sorted(int(k) for k in data)
    limits = sorted({int(m["power_limit"]) for rows in data.values() for m in rows})
    time_s = np.full((len(limits), len(batch_sizes)), np.nan)
    energy_j = np.full_like(time_s, np.nan)
    column = {b: j for j, b in enumerate(batch_sizes)}
    row = {p: i for i, p in enumerate(limits)}
    for key, rows in data.items():
        for w in (PowerLimitWindow.from_row(m, steps) for m in rows):
            i, j = row[w.power_limit_w], column[int(key)]
            time_s[i, j] = w.time_s / w.steps
            energy_j[i, j] = w.energy_j / w.steps
    unmeasured = [(b, p) for p in limits for b in batch_sizes if np.isnan(time_s[row[p], column[b]])]
    if unmeasured:
        raise ValueError(f"profile {source}: (batch size, power limit) pairs not measured: {unmeasured[:5]}.")
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
