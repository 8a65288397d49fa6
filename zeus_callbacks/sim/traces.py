"""Measured time/power curves of real GPUs over power limits, loaded from the shipped (or a user's) files."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.sim.specs import GPUSpec, spec_for

__all__ = [
    "Trace",
    "load_trace",
    "scaled_trace",
    "operating_point",
    "provenance",
    "shipped_workloads",
    "DATA_FORMATS_HELP",
]

DATA_FORMATS_HELP = (
    "Supported trace files: Zeus NSDI'23 summary CSV (dataset,network,batch_size,optimizer,power_limit,"
    "time_per_epoch,average_power; key DATASET/NETWORK/BATCH[/OPTIMIZER]), Zeus² JSON "
    '({"<batch_size>": [{"power_limit", "energy", "time"}]}; key BATCH or .../BATCH) and Zeus monitor CSV '
    "(start_time,window_name,elapsed_time,gpu<i>_energy with windows __GlobalPowerLimitOptimizer_<W>)."
)


@dataclass(frozen=True)
class Trace:
    """Time and average power of one workload on one GPU model, measured at several power limits.

    `time_s` is the time of one unit of work (an epoch, or a window of steps) at each power limit; the
    simulator only uses it relative to the time at the highest limit.
    """

    gpu_model: str
    workload: str
    source: str
    power_limits_w: np.ndarray  # ascending
    time_s: np.ndarray
    power_w: np.ndarray
    scaled_from: str | None = None  # the traced GPU model a modelled curve was scaled from (`scaled_trace`)

    def __post_init__(self) -> None:
        if len(self.power_limits_w) < 1:
            raise ValueError(f"Trace {self.workload!r} from {self.source} has no measurements.")
        if np.any(self.time_s <= 0) or np.any(self.power_w <= 0):
            raise ValueError(f"Trace {self.workload!r} from {self.source} has non-positive time or power.")

    @property
    def min_power_limit_w(self) -> float:
        """Lowest measured power limit."""
        return float(self.power_limits_w[0])

    @property
    def max_power_limit_w(self) -> float:
        """Highest measured power limit."""
        return float(self.power_limits_w[-1])

    def relative_time(self, power_limit_w: float) -> float:
        """Time of the same work at `power_limit_w` over the time at the highest limit (>= ~1)."""
        t = np.interp(power_limit_w, self.power_limits_w, self.time_s)
        return float(t / self.time_s[-1])

    def power(self, power_limit_w: float) -> float:
        """Average power draw (W) while busy at `power_limit_w`, interpolated between measured limits."""
        return float(np.interp(power_limit_w, self.power_limits_w, self.power_w))

    def relative_energy(self, power_limit_w: float) -> float:
        """Energy of the same work at `power_limit_w` over the energy at the highest limit."""
        return self.relative_time(power_limit_w) * self.power(power_limit_w) / float(self.power_w[-1])

    def monotone_relative_time(self) -> np.ndarray:
        """Relative time per measured limit made non-increasing in the limit (for the clock mapping)."""
        rel = self.time_s / self.time_s[-1]
        return np.maximum.accumulate(rel[::-1])[::-1]


def _data_dir() -> Path:
    return Path(str(resources.files("zeus_callbacks"))) / "sim" / "data"


def _shipped_file(file: str) -> Path:
    if file.startswith("zeus2_aws/"):
        from zeus_callbacks.core.heterogeneous.profile_file import shipped_profiles_dir

        return shipped_profiles_dir() / file.removeprefix("zeus2_aws/")
    return _data_dir() / file


def _number(path: Path, where: str, field: str, value: object, positive: bool = True) -> float:
    """`value` of `field` as a finite (positive) number, or an error naming the file, line and field."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or (number <= 0 if positive else number < 0):
        expected = "a positive number" if positive else "a number >= 0"
        raise InvalidInputError(
            f"{path}, {where}: {field} is {value!r}, expected {expected}. Fix or remove that entry."
        )
    return number


def _csv_rows(path: Path, needed: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV file whose header has `needed`; short rows are errors naming the line."""
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in needed if c not in (reader.fieldnames or [])]
            if missing:
                raise InvalidInputError(
                    f"{path}, line 1: the header lacks {', '.join(missing)}. {DATA_FORMATS_HELP}"
                )
            rows = []
            for r in reader:
                if None in r.values() or None in r:
                    raise InvalidInputError(
                        f"{path}, line {reader.line_num}: {len(r) - (None in r)} fields where the header has "
                        f"{len(reader.fieldnames or [])}. Fix or remove that row."
                    )
                rows.append((reader.line_num, r))
            return rows
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path} is not a text file. {DATA_FORMATS_HELP}") from None
    except csv.Error as e:
        raise InvalidInputError(f"{path}: not a readable CSV file ({e}). {DATA_FORMATS_HELP}") from None


def _from_points(gpu: str, workload: str, source: str, pts: dict[float, tuple[float, float]]) -> Trace:
    pls = np.array(sorted(pts), dtype=float)
    return Trace(
        gpu_model=gpu,
        workload=workload,
        source=source,
        power_limits_w=pls,
        time_s=np.array([pts[p][0] for p in pls], dtype=float),
        power_w=np.array([pts[p][1] for p in pls], dtype=float),
    )


def _load_nsdi23(path: Path, key: str, gpu: str) -> Trace:
    parts = key.strip("/").split("/")
    if len(parts) not in (3, 4):
        raise ValueError(f"Workload {key!r} for {path.name}: expected DATASET/NETWORK/BATCH[/OPTIMIZER].")
    rows: dict[str, dict[float, tuple[float, float]]] = {}
    for line, r in _csv_rows(path, _NSDI23_COLUMNS):
        if [r["dataset"], r["network"], r["batch_size"]] != parts[:3]:
            continue
        if len(parts) == 4 and r["optimizer"] != parts[3]:
            continue
        pts = rows.setdefault(r["optimizer"], {})
        at = f"line {line}"
        pts[_number(path, at, "power_limit", r["power_limit"])] = (
            _number(path, at, "time_per_epoch", r["time_per_epoch"]),
            _number(path, at, "average_power", r["average_power"]),
        )
    if not rows:
        known = _nsdi23_keys(path)
        # The keys of the same dataset/network first: those are what a typo most likely meant.
        near = [k for k in known if k.startswith("/".join(parts[:2]) + "/")] or known
        more = ", ..." if len(near) > 12 else ""
        raise ValueError(f"Workload {key!r} is not in {path}. Known: {', '.join(near[:12])}{more}")
    if len(rows) > 1:
        raise ValueError(
            f"Workload {key!r} in {path.name} has optimizers {sorted(rows)}: add /OPTIMIZER to the key."
        )
    opt, pts = next(iter(rows.items()))
    return _from_points(gpu, "/".join(parts[:3] + [opt]), str(path), pts)


_NSDI23_COLUMNS = (
    "dataset",
    "network",
    "batch_size",
    "optimizer",
    "power_limit",
    "time_per_epoch",
    "average_power",
)


def _nsdi23_keys(path: Path) -> list[str]:
    rows = _csv_rows(path, _NSDI23_COLUMNS)
    return sorted({f"{r['dataset']}/{r['network']}/{r['batch_size']}/{r['optimizer']}" for _, r in rows})


def _read_zeus2(path: Path) -> dict[str, list[dict[str, object]]]:
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path} is not a text file. {DATA_FORMATS_HELP}") from None
    except json.JSONDecodeError as e:
        raise InvalidInputError(
            f"{path}, line {e.lineno} column {e.colno}: not valid JSON ({e.msg}); the file may be truncated."
        ) from None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise InvalidInputError(f"{path} is not a Zeus² profile. {DATA_FORMATS_HELP}")
    bad = [k for k in data if not k.isdigit()]
    if bad:
        raise InvalidInputError(f"{path}: key {bad[0]!r} is not a batch size. {DATA_FORMATS_HELP}")
    return data


def _load_zeus2(path: Path, key: str, gpu: str) -> Trace:
    data = _read_zeus2(path)
    batch = key.strip("/").split("/")[-1] if key else ""
    if batch not in data:
        raise InvalidInputError(f"Batch size {batch!r} is not in {path}; measured: {sorted(data, key=int)}.")
    pts = {}
    for i, p in enumerate(data[batch]):
        at = f'batch size "{batch}", entry {i}'
        if not isinstance(p, dict) or not {"power_limit", "time", "energy"} <= set(p):
            raise InvalidInputError(
                f"{path}, {at}: expected power_limit, time and energy. {DATA_FORMATS_HELP}"
            )
        time_s = _number(path, at, "time", p["time"])
        pts[_number(path, at, "power_limit", p["power_limit"])] = (
            time_s,
            _number(path, at, "energy", p["energy"]) / time_s,
        )
    return _from_points(gpu, f"{path.stem}/{batch}", str(path), pts)


def _load_monitor_csv(path: Path, key: str, gpu: str) -> Trace:
    pts: dict[float, tuple[float, float]] = {}
    for line, r in _csv_rows(path, ("window_name", "elapsed_time")):
        m = re.fullmatch(r"__GlobalPowerLimitOptimizer_(\d+)", r["window_name"])
        if not m:
            continue
        at = f"line {line}"
        energies = [
            _number(path, at, k, v) for k, v in r.items() if k.startswith("gpu") and k.endswith("_energy")
        ]
        if not energies:
            raise InvalidInputError(f"{path}, line 1: no gpu<i>_energy column. {DATA_FORMATS_HELP}")
        t = _number(path, at, "elapsed_time", r["elapsed_time"])
        # One GPU's view of the job: the mean GPU energy over the window gives its average power.
        pts[_number(path, at, "power limit", m.group(1))] = (t, sum(energies) / len(energies) / t)
    if not pts:
        raise ValueError(f"{path} has no __GlobalPowerLimitOptimizer_<W> windows. {DATA_FORMATS_HELP}")
    return _from_points(gpu, path.stem, str(path), pts)


def load_trace(path: str | Path, key: str = "", gpu_model: str = "") -> Trace:
    """Load one workload's curve from a trace file in any supported format (see `DATA_FORMATS_HELP`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Trace file {str(path)!r} does not exist. {DATA_FORMATS_HELP}")
    gpu = gpu_model or path.stem.split("+")[0]
    if path.suffix == ".json":
        return _load_zeus2(path, key, gpu)
    try:
        with path.open(newline="") as f:
            header = f.readline().strip().split(",")
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path} is not a text file. {DATA_FORMATS_HELP}") from None
    if "time_per_epoch" in header:
        return _load_nsdi23(path, key, gpu)
    if "window_name" in header:
        return _load_monitor_csv(path, key, gpu)
    raise InvalidInputError(f"Cannot tell the format of {path} from its header {header}. {DATA_FORMATS_HELP}")


def scaled_trace(trace: Trace, gpu_model: str, min_limit_w: float, max_limit_w: float) -> Trace:
    """`trace` stretched over another board's settable range: a MODELLED curve, not a measurement.

    A limit at a given fraction of the traced board's range behaves as the limit at the same fraction of
    the new range: the same slowdown, and power drawn at the same place in the range (power maps by the
    same affine map as the limits, so the draw keeps its distance below the cap in proportion). This keeps
    the shape of the traced curve (where it flattens, where lowering the limit starts to cost time) and
    nothing more; no measurement of the modelled board supports it.
    """
    lo, hi = trace.min_power_limit_w, trace.max_power_limit_w
    scale = (max_limit_w - min_limit_w) / (hi - lo) if hi > lo else max_limit_w / hi
    return Trace(
        gpu_model=gpu_model,
        workload=trace.workload,
        source=f"{trace.source}, scaled to {min_limit_w:g}-{max_limit_w:g} W (modelled, not traced)",
        power_limits_w=min_limit_w + (trace.power_limits_w - lo) * scale,
        time_s=trace.time_s.copy(),
        power_w=np.maximum(min_limit_w + (trace.power_w - lo) * scale, 1.0),
        scaled_from=trace.gpu_model,
    )


def operating_point(
    trace: Trace, spec: GPUSpec, pl_w: float, locked: tuple[int, int] | None
) -> tuple[float, float]:
    """(time of work relative to the maximum limit, busy power in W) at limit `pl_w` and SM clock lock `locked`.

    A clock cap moves the GPU along the same time/power curve a power cap does: time scales as 1/f, and each
    traced limit corresponds to the clock f_max / relative_time it achieves.
    """
    rel, power = trace.relative_time(pl_w), trace.power(pl_w)
    if locked is None:
        return rel, power
    f_max = spec.max_sm_clock_mhz
    mono = trace.monotone_relative_time()
    f_pl = f_max / float(np.interp(pl_w, trace.power_limits_w, mono))
    f = min(float(locked[1]), f_pl)
    if f >= f_pl:
        return rel, power
    f_low = f_max / float(mono[0])
    if f >= f_low:
        # Find the lowest traced limit that runs at clock f (mono is non-increasing in the limit).
        eq_pl = float(np.interp(f_max / f, mono[::-1], trace.power_limits_w[::-1]))
        return f_max / f, trace.power(eq_pl)
    # Below every traced limit: continue the traced power-vs-clock line of the two lowest limits (never below
    # idle), so energy per unit of work keeps the trend the trace shows there instead of a model the data does
    # not support.
    p_low = trace.power(trace.min_power_limit_w)
    slope = 0.0
    if len(mono) > 1:
        f_next = f_max / float(mono[1])
        if f_next > f_low:
            slope = max(0.0, (trace.power(float(trace.power_limits_w[1])) - p_low) / (f_next - f_low))
    return f_max / f, max(spec.idle_power_w, p_low - slope * (f_low - f))


def provenance(spec: GPUSpec, trace: Trace) -> str | None:
    """The label of a modelled board's figures (None for a traced board, whatever trace it replays)."""
    if spec.scaled_from is None:
        return None
    if trace.scaled_from is not None:
        return spec.provenance
    return f"modelled {spec.kind.upper()}, power curve from {trace.source}"


# Shipped traces per simulated GPU kind: (file, default workload key); `zeus2_aws/` files are the Zeus²
# profiles shipped with the heterogeneous planner (core/heterogeneous/data), the others are under sim/data.
_SHIPPED: dict[str, tuple[str, str]] = {
    "a40": ("nsdi23/summary_power_a40.csv", "imagenet/resnet50/256"),
    "v100": ("nsdi23/summary_power_v100.csv", "imagenet/resnet50/256"),
    "a10g": ("zeus2_aws/cifar_a10.json", "cifar100/shufflenetv2/1024"),
    "t4": ("zeus2_aws/cifar_t4.json", "cifar100/shufflenetv2/1024"),
}


def shipped_trace(kind: str, workload: str | None = None) -> Trace:
    """The shipped trace of a simulated GPU kind for a workload key: `a40`, `v100`, `a10g` and `t4` replay
    their own traces; the modelled `a100`, `h100` and `h200` the A40's, scaled (`scaled_trace`)."""
    spec = spec_for(kind)
    if spec.scaled_from is not None:
        assert spec.min_power_limit_w is not None and spec.max_power_limit_w is not None
        traced = shipped_trace(spec.scaled_from, workload)
        return scaled_trace(traced, spec.kind, spec.min_power_limit_w, spec.max_power_limit_w)
    kind = spec.kind
    file, default = _SHIPPED[kind]
    key = workload or default
    path = _shipped_file(file)
    if "/" not in key and path.suffix == ".csv" and (_data_dir() / "zeus_profiles").is_dir():
        # A bare model name selects a Zeus monitor log, e.g. `a40:resnet50`.
        prefix = {"a40": "A40", "v100": "V100"}[kind]
        path = _data_dir() / "zeus_profiles" / f"{prefix}+{key}+gpu0.csv"
    return load_trace(path, key, gpu_model=kind)


def shipped_workloads(kind: str) -> list[str]:
    """Workload keys shipped for a simulated GPU kind (a modelled board's: those of the GPU it is scaled from)."""
    kind = spec_for(kind).scaled_from or spec_for(kind).kind
    file, _ = _SHIPPED[kind]
    path = _shipped_file(file)
    if path.suffix == ".json":
        return [f"cifar100/shufflenetv2/{b}" for b in sorted(_read_zeus2(path), key=int)]
    keys = _nsdi23_keys(path)
    prefix = {"a40": "A40", "v100": "V100"}[kind]
    keys += sorted(p.name.split("+")[1] for p in (_data_dir() / "zeus_profiles").glob(f"{prefix}+*+gpu0.csv"))
    return keys
