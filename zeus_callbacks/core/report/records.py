"""The run record's on-disk schema: typed records, written as versioned JSON and read back with checks."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.files import UnsafePathError, read_regular, write_atomic

__all__ = [
    "FORMAT",
    "VERSION",
    "GPUInfo",
    "PowerSample",
    "StepSpan",
    "PowerLimitRow",
    "PowerLimitSummary",
    "PlannedInstruction",
    "PipelinePlan",
    "RankRecord",
    "write_record",
    "read_record",
]

FORMAT = "zeus_callbacks.run_record"
VERSION = 1


@dataclass(frozen=True)
class GPUInfo:
    """One recorded GPU: its index in the process (CUDA's numbering), UUID, model and limit range (W)."""

    index: int
    uuid: str
    name: str
    min_power_limit_w: float | None = None
    max_power_limit_w: float | None = None


@dataclass(frozen=True)
class PowerSample:
    """Power and power limit of each recorded GPU (in `RankRecord.gpus` order) at `t_s` after the start.

    None where a GPU did not answer.
    """

    t_s: float
    power_w: tuple[float | None, ...]
    power_limit_w: tuple[float | None, ...]


@dataclass(frozen=True)
class StepSpan:
    """Training steps `first_step..last_step` (one step unless merged to bound the record's size).

    `end_s` is when the last one ended (s after the start), `time_s` their summed time, `energy_j` their
    summed energy per GPU, `power_limit_w` the limit in force per GPU at the end.
    """

    first_step: int
    last_step: int
    end_s: float
    time_s: float
    energy_j: tuple[float | None, ...]
    power_limit_w: tuple[float | None, ...]

    @property
    def num_steps(self) -> int:
        """How many steps the span holds."""
        return self.last_step - self.first_step + 1


@dataclass(frozen=True)
class PowerLimitRow:
    """One profiled power limit: mean time and energy per step, the selector's cost (None: no score)."""

    power_limit_w: int
    time_per_step_s: float
    energy_per_step_j: float
    cost: float | None
    steps: int
    pruned: bool


@dataclass(frozen=True)
class PowerLimitSummary:
    """The power-limit optimizer's report at the end of the run (`GlobalPowerLimitOptimizer.report()`)."""

    selector: str
    search: str
    phase: str
    rows: tuple[PowerLimitRow, ...]
    optimal_power_limit_w: int | None
    applied: bool
    profiling_steps: int
    profiling_energy_j: float
    energy_saved_pct: float | None = None
    time_lost_pct: float | None = None  # never negative (older records: the measured figure)
    reason: str | None = None
    reference_power_limit_w: int | None = None  # what the saving is against (the grid's first limit)
    energy_saved_margin_pct: float | None = None
    time_lost_measured_pct: float | None = None  # negative when the steps measured faster
    time_lost_margin_pct: float | None = None


@dataclass(frozen=True)
class PlannedInstruction:
    """One instruction of the planned pipeline iteration, as the plan predicts it runs."""

    stage: int
    kind: str
    microbatch: int
    virtual_stage: int | None
    frequency_mhz: int
    start_s: float
    duration_s: float
    critical: bool


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline-frequency optimizer's plan: per-stage clocks over the iteration, predicted figures.

    `instructions` is empty when the schedule is not one this package can rebuild (then only
    `stage_frequencies_mhz` is known).
    """

    phase: str
    schedule: str
    num_stages: int
    num_microbatches: int
    stage_frequencies_mhz: tuple[tuple[int, ...], ...]
    instructions: tuple[PlannedInstruction, ...]
    max_clock_iteration_time_s: float
    iteration_time_s: float
    max_clock_energy_j: float
    energy_j: float
    applied: bool
    reason: str | None = None


@dataclass
class RankRecord:
    """What one process recorded of a run (its own GPUs), as saved in `record.rank{rank}.json`."""

    rank: int
    simulated: bool
    title: str
    started_unix_s: float
    duration_s: float
    gpus: list[GPUInfo]
    samples: list[PowerSample] = field(default_factory=list)
    steps: list[StepSpan] = field(default_factory=list)
    total_energy_j: list[float | None] = field(default_factory=list)
    total_energy_bound_j: list[float | None] = field(default_factory=list)  # how far the truth may lie (J)
    sample_interval_s: float = 0.5
    carbon_intensity_gco2_per_kwh: float | None = None
    price_per_kwh: float | None = None
    currency: str = "USD"
    carbon_intensity_source: str | None = None  # where the intensity comes from, said in the report
    price_source: str | None = None
    power_limit: PowerLimitSummary | None = None
    pipeline: PipelinePlan | None = None
    finished: bool = False
    failed: str | None = None
    package_version: str = ""


def _plain(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null, tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_record(path: Path, record: RankRecord) -> None:
    """Write `record` atomically and privately (a reader never sees half a file; `files.write_atomic`).

    Raises:
        OSError: it cannot be written (the last complete record is kept).
    """
    data = {"format": FORMAT, "version": VERSION, **_plain(asdict(record))}
    write_atomic(path, json.dumps(data, separators=(",", ":")))


def _build(cls: type, raw: Any, where: str) -> Any:
    """`cls(**raw)` with tuples for sequences and nested records built; a clear error otherwise."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    return cls(**values)


def _number(value: Any, where: str, optional: bool = True) -> None:
    ok = (value is None and optional) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    )
    if not ok:
        raise ValueError(f"{where}: {value!r} is not a finite number")


def read_record(path: Path) -> RankRecord:
    """Read one rank's record.

    Raises:
        InvalidInputError: the file is not JSON, not a run record, of a newer version, or corrupted.
    """
    try:
        data = json.loads(read_regular(path).decode("utf-8"))  # a FIFO is refused, not waited on
    except UnsafePathError as e:
        raise InvalidInputError(f"{e}: expected a run record (JSON).") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path}: not a text file; expected a run record (JSON).") from None
    except ValueError as e:
        raise InvalidInputError(
            f"{path}: not valid JSON ({e}); the run was cut off while writing, or this is not a run record."
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidInputError(f'{path}: not a zeus_callbacks run record (no "format": {FORMAT!r}).')
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise InvalidInputError(
            f"{path}: run record version {version!r}; this zeus-callbacks reads version {VERSION}. "
            "Upgrade zeus-callbacks."
        )
    try:
        return _record(data)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidInputError(f"{path}: corrupted run record ({type(e).__name__}: {e}).") from None


def _record(data: dict[str, Any]) -> RankRecord:
    raw = {k: v for k, v in data.items() if k not in ("format", "version")}
    raw["gpus"] = [_build(GPUInfo, g, "gpus") for g in raw.get("gpus", [])]
    samples = [_build(PowerSample, s, "samples") for s in raw.get("samples", [])]
    steps = [_build(StepSpan, s, "steps") for s in raw.get("steps", [])]
    n = len(raw["gpus"])
    for s in samples:
        _number(s.t_s, "samples.t_s", optional=False)
        if len(s.power_w) != n or len(s.power_limit_w) != n:
            raise ValueError(f"a sample at {s.t_s} s has not one value per GPU ({n})")
        for v in (*s.power_w, *s.power_limit_w):
            _number(v, "samples")
    for s in steps:
        _number(s.end_s, "steps.end_s", optional=False)
        _number(s.time_s, "steps.time_s", optional=False)
        if len(s.energy_j) != n:
            raise ValueError(f"step {s.first_step} has not one energy per GPU ({n})")
        for v in s.energy_j:
            _number(v, "steps.energy_j")
    raw["samples"], raw["steps"] = samples, steps
    pl = raw.get("power_limit")
    if pl is not None:
        pl = dict(pl)
        pl["rows"] = [_build(PowerLimitRow, r, "power_limit.rows") for r in pl.get("rows", [])]
        raw["power_limit"] = _build(PowerLimitSummary, pl, "power_limit")
    pp = raw.get("pipeline")
    if pp is not None:
        pp = dict(pp)
        pp["instructions"] = [
            _build(PlannedInstruction, i, "pipeline.instructions") for i in pp.get("instructions", [])
        ]
        pp["stage_frequencies_mhz"] = [tuple(f) for f in pp.get("stage_frequencies_mhz", [])]
        raw["pipeline"] = _build(PipelinePlan, pp, "pipeline")
    record = _build(RankRecord, raw, "record")
    # `_build` turned the lists into tuples; the record's own lists stay lists.
    record.gpus, record.samples, record.steps = list(record.gpus), samples, steps
    _check_totals(record)
    return record


def _check_totals(record: RankRecord) -> None:
    """The run's figures are numbers (per GPU: its energy and bound, lists again after `_build`)."""
    record.total_energy_j = list(record.total_energy_j)
    record.total_energy_bound_j = list(record.total_energy_bound_j)
    for name in ("total_energy_j", "total_energy_bound_j"):
        for v in getattr(record, name):
            _number(v, name)
    for name in ("duration_s", "started_unix_s"):
        _number(getattr(record, name), name, optional=False)
    for name in ("carbon_intensity_gco2_per_kwh", "price_per_kwh"):
        _number(getattr(record, name), name)
