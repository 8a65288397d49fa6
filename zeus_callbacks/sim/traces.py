"""Measured time/power curves of real GPUs over power limits, loaded from the shipped (or a user's) files."""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

__all__ = ["Trace", "load_trace", "shipped_workloads", "DATA_FORMATS_HELP"]

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
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if [r["dataset"], r["network"], r["batch_size"]] != parts[:3]:
                continue
            if len(parts) == 4 and r["optimizer"] != parts[3]:
                continue
            pts = rows.setdefault(r["optimizer"], {})
            pts[float(r["power_limit"])] = (float(r["time_per_epoch"]), float(r["average_power"]))
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


def _nsdi23_keys(path: Path) -> list[str]:
    with path.open(newline="") as f:
        keys = {
            f"{r['dataset']}/{r['network']}/{r['batch_size']}/{r['optimizer']}" for r in csv.DictReader(f)
        }
    return sorted(keys)


def _load_zeus2(path: Path, key: str, gpu: str) -> Trace:
    data = json.loads(path.read_text())
    batch = key.strip("/").split("/")[-1] if key else ""
    if batch not in data:
        raise ValueError(f"Batch size {batch!r} is not in {path}; measured: {sorted(data, key=int)}.")
    pts = {
        float(p["power_limit"]): (float(p["time"]), float(p["energy"]) / float(p["time"]))
        for p in data[batch]
    }
    return _from_points(gpu, f"{path.stem}/{batch}", str(path), pts)


def _load_monitor_csv(path: Path, key: str, gpu: str) -> Trace:
    pts: dict[float, tuple[float, float]] = {}
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            m = re.fullmatch(r"__GlobalPowerLimitOptimizer_(\d+)", r["window_name"])
            if not m:
                continue
            energies = [float(v) for k, v in r.items() if k.startswith("gpu") and k.endswith("_energy")]
            t = float(r["elapsed_time"])
            # One GPU's view of the job: the mean GPU energy over the window gives its average power.
            pts[float(m.group(1))] = (t, sum(energies) / len(energies) / t)
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
    with path.open(newline="") as f:
        header = f.readline().strip().split(",")
    if "time_per_epoch" in header:
        return _load_nsdi23(path, key, gpu)
    if "window_name" in header:
        return _load_monitor_csv(path, key, gpu)
    raise ValueError(f"Cannot tell the format of {path} from its header {header}. {DATA_FORMATS_HELP}")


# Shipped traces per simulated GPU kind: (file, default workload key).
_SHIPPED: dict[str, tuple[str, str]] = {
    "a40": ("nsdi23/summary_power_a40.csv", "imagenet/resnet50/256"),
    "v100": ("nsdi23/summary_power_v100.csv", "imagenet/resnet50/256"),
    "a10g": ("zeus2_aws/cifar_a10.json", "cifar100/shufflenetv2/1024"),
    "t4": ("zeus2_aws/cifar_t4.json", "cifar100/shufflenetv2/1024"),
}


def shipped_trace(kind: str, workload: str | None = None) -> Trace:
    """The shipped trace of a simulated GPU kind (`a40`, `v100`, `a10g`, `t4`) for a workload key."""
    file, default = _SHIPPED[kind]
    key = workload or default
    path = _data_dir() / file
    if "/" not in key and path.suffix == ".csv" and (_data_dir() / "zeus_profiles").is_dir():
        # A bare model name selects a Zeus monitor log, e.g. `a40:resnet50`.
        prefix = {"a40": "A40", "v100": "V100"}[kind]
        path = _data_dir() / "zeus_profiles" / f"{prefix}+{key}+gpu0.csv"
    return load_trace(path, key, gpu_model=kind)


def shipped_workloads(kind: str) -> list[str]:
    """Workload keys shipped for a simulated GPU kind."""
    file, _ = _SHIPPED[kind]
    path = _data_dir() / file
    if path.suffix == ".json":
        return [f"cifar100/shufflenetv2/{b}" for b in sorted(json.loads(path.read_text()), key=int)]
    keys = _nsdi23_keys(path)
    prefix = {"a40": "A40", "v100": "V100"}[kind]
    keys += sorted(p.name.split("+")[1] for p in (_data_dir() / "zeus_profiles").glob(f"{prefix}+*+gpu0.csv"))
    return keys
