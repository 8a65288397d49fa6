"""Per-epoch time and energy logs and a per-GPU power log, in the file formats of Zeus's profiler."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core import files
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor import checks
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

__all__ = [
    "LOG_PREFIX_ENV",
    "MONITOR_SLEEP_MS_ENV",
    "EpochRecord",
    "EpochLog",
    "PowerLog",
    "subset_scaling_factor",
    "subset_indices",
    "scale_to_full_epoch",
    "default_gpu_indices",
    "monitor_for",
]

logger = logging.getLogger(__name__)

LOG_PREFIX_ENV = "ZEUS_LOG_PREFIX"
MONITOR_SLEEP_MS_ENV = "ZEUS_MONITOR_SLEEP_MS"
_DEFAULT_SLEEP_MS = 100
# A sampler that never sleeps would keep a core busy, which also reads as GPU work on a simulated GPU.
_MIN_SLEEP_S = 0.001


def subset_indices(dataset_len: int, subset_proportion: float) -> list[int]:
    """Every `round(1 / subset_proportion)`-th sample, as Zeus's `ProfileDataLoader` slices its subset.

    Raises:
        ValueError: `subset_proportion` outside (0, 1].
    """
    if not 0.0 < subset_proportion <= 1.0:
        raise ValueError(f"subset_proportion must be in (0, 1]; got {subset_proportion!r}.")
    return list(range(0, dataset_len, round(1 / subset_proportion)))


def subset_scaling_factor(dataset_len: int, subset_len: int, batch_size: int) -> float:
    """Factor that scales the time of batches 2..N of a subset epoch up to the full dataset (Zeus's formula).

    The first batch is timed apart (data loading warms up on it), so the rest of the subset holds
    `subset_len - batch_size` samples; `dataset_len / (subset_len - batch_size)` scales them to the full set.

    Raises:
        ValueError: the subset holds no more than one batch, so nothing is left to scale.
    """
    rest = subset_len - batch_size
    if rest <= 0:
        raise ValueError(
            f"A subset of {subset_len} samples holds no more than one batch of {batch_size}: nothing to scale "
            "from. Raise subset_proportion or lower the batch size."
        )
    return dataset_len / rest


def scale_to_full_epoch(first_batch: float, rest: float, scaling_factor: float) -> float:
    """The first batch as measured plus the rest scaled to the full epoch."""
    return first_batch + scaling_factor * rest


def default_gpu_indices() -> list[int]:
    """This process's GPU under torch.distributed (`local_rank()`), else every visible GPU (an empty list)."""
    if dist.is_distributed():
        return [dist.local_rank()]
    return []


@dataclass(frozen=True)
class EpochRecord:
    """Time and energy of one epoch, measured and scaled to the full dataset.

    Attributes:
        epoch: 1-based epoch number of its split.
        split: "train" or "eval".
        time_s: Epoch time scaled to the full dataset (equal to `measured_time_s` without a subset).
        energy_j: Energy per GPU index, scaled as the time is.
        measured_time_s: Time of the epoch as run.
        measured_energy_j: Energy per GPU index of the epoch as run.
        simulated: The GPUs are simulated.
    """

    epoch: int
    split: str
    time_s: float
    energy_j: dict[int, float]
    measured_time_s: float
    measured_energy_j: dict[int, float]
    simulated: bool

    def average_power_w(self, gpu_index: int) -> float:
        """Measured average power of one GPU over the epoch (W)."""
        return self.measured_energy_j[gpu_index] / self.measured_time_s if self.measured_time_s > 0 else 0.0


class PowerLog:
    """Sample each GPU's power in the background into `{prefix}+gpu{index}.power.csv` (`Time,Power`, mW).

    The format of Zeus's `zeus_monitor` binary, so its analysis tools read it; the sampler runs in this
    process, through the same NVML layer as the monitor (real or simulated GPUs).
    """

    def __init__(self, monitor: ZeusMonitor, prefix: str | Path, interval_s: float) -> None:
        self._gpus = [monitor.gpus[i] for i in monitor.gpu_indices]
        self._interval = max(_MIN_SLEEP_S, interval_s)
        self._files: list[files.LogFile] = []
        for g in self._gpus:
            f = files.open_log(f"{prefix}+gpu{g.index}.power.csv", "power log")
            f.write("Time,Power\n")
            self._files.append(f)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zeus-callbacks-power-log", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        for g, f in zip(self._gpus, self._files, strict=True):
            try:
                f.write(f"{stamp},{int(g.power_mw())}\n")
            except Exception as e:  # a lost GPU: log, keep the other rows
                logger.warning("Power log: %s", e)
        for f in self._files:
            f.flush()

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self._interval):
            self._sample()

    def close(self) -> None:
        """Stop sampling and close the files."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5 * self._interval + 1)
        for f in self._files:
            f.close()


class EpochLog:
    """Time and energy of each epoch from monitor windows, written in Zeus's profiler files.

    Files (by the GPU's owner: the time log by rank 0, the energy and power logs by each rank for its GPUs):
    - `{prefix}.time.csv`: `epoch,split,time`, the epoch time scaled to the full dataset (Zeus's format);
    - `{prefix}+gpu{i}.energy.csv`: `epoch,split,time,energy,average_power,measured_time,measured_energy,simulated`;
    - `{prefix}+gpu{i}.power.csv`: power sampled every `ZEUS_MONITOR_SLEEP_MS` (as Zeus's power monitor).

    An epoch is `begin(split)`, optionally `first_batch_done(split)` (the rest of the epoch is then scaled
    by `scaling_factor`, the first batch is not), and `end(split)`. Epochs of different splits may nest
    (evaluation inside a training epoch); the outer one's time includes the inner one's.

    Args:
        monitor: Measures this process's GPUs; default `monitor_for(None)` (this rank's GPU under
            torch.distributed, else every visible GPU).
        log_prefix: Prefix of the files; default `$ZEUS_LOG_PREFIX`.
        sleep_ms: Power sampling period; default `$ZEUS_MONITOR_SLEEP_MS` or 100. 0: no power log.

    Raises:
        ValueError: no prefix given and `ZEUS_LOG_PREFIX` unset.

    Example::

        log = EpochLog(ZeusMonitor(gpu_indices=[0]), log_prefix="logs/run1")
        for epoch in range(3):
            log.begin("train")
            train_one_epoch()
            record = log.end("train")  # record.time_s, record.energy_j[0]
        log.close()
    """

    def __init__(
        self,
        monitor: ZeusMonitor | None = None,
        log_prefix: str | Path | None = None,
        sleep_ms: int | None = None,
    ) -> None:
        prefix = log_prefix if log_prefix is not None else os.environ.get(LOG_PREFIX_ENV)
        if not prefix:
            raise ValueError(
                f"No log prefix: pass `log_prefix=` or set {LOG_PREFIX_ENV} (files go to PREFIX.time.csv, "
                "PREFIX+gpu<i>.energy.csv, PREFIX+gpu<i>.power.csv)."
            )
        if sleep_ms is None:
            text = os.environ.get(MONITOR_SLEEP_MS_ENV) or _DEFAULT_SLEEP_MS
            sleep_ms = checks.sleep_ms(MONITOR_SLEEP_MS_ENV, text, from_env=True)
        checks.sleep_ms(MONITOR_SLEEP_MS_ENV, sleep_ms, from_env=False)
        checks.require_zeus_monitor("EpochLog", monitor)
        self.monitor = monitor if monitor is not None else monitor_for(None)
        self.log_prefix = str(prefix)
        self.sleep_ms = int(sleep_ms)
        self._epochs: dict[str, int] = {}
        self._open_splits: dict[str, bool] = {}  # split -> first batch done
        self._power: PowerLog | None = None
        self._energy_files: dict[int, files.LogFile] = {}
        self._time_file: files.LogFile | None = None
        self._opened = False
        self.records: list[EpochRecord] = []

    def _key(self, split: str, part: str) -> str:
        return f"__EpochLog_{id(self)}_{split}_{part}"

    def _open(self) -> None:
        self._opened = True
        try:
            os.close(files.open_directory(Path(self.log_prefix).parent, create=True))
        except OSError as e:
            raise InvalidInputError(
                f"The log prefix {self.log_prefix!r} (log_prefix= or {LOG_PREFIX_ENV}): its folder cannot be "
                f"created ({e.strerror or e}); pass a prefix in a folder you may write."
            ) from None
        if dist.rank() == 0:
            self._time_file = files.open_log(f"{self.log_prefix}.time.csv", "epoch time log")
            self._time_file.write("epoch,split,time\n")
            self._time_file.flush()
        for i in self.monitor.gpu_indices:
            f = files.open_log(f"{self.log_prefix}+gpu{i}.energy.csv", "epoch energy log")
            f.write("epoch,split,time,energy,average_power,measured_time,measured_energy,simulated\n")
            f.flush()
            self._energy_files[i] = f
        if self.sleep_ms > 0:
            self._power = PowerLog(self.monitor, self.log_prefix, self.sleep_ms / 1000)

    def is_open(self, split: str) -> bool:
        """Whether an epoch of `split` is being measured."""
        return split in self._open_splits

    def begin(self, split: str) -> None:
        """Start an epoch of `split` ("train" or "eval"); an open epoch of the same split is abandoned."""
        if not self._opened:
            self._open()
        if split in self._open_splits:
            self._cancel(split)
        self._open_splits[split] = False
        self.monitor.begin_window(self._key(split, "epoch"))

    def first_batch_done(self, split: str) -> None:
        """Mark the end of the epoch's first batch: what follows is scaled, the first batch is not."""
        if self._open_splits.get(split, True):
            return
        self._open_splits[split] = True
        self.monitor.begin_window(self._key(split, "rest"))

    def end(self, split: str, scaling_factor: float = 1.0) -> EpochRecord | None:
        """Close the epoch of `split`, write its rows and return its record (None when none is open)."""
        if split not in self._open_splits:
            return None
        first_done = self._open_splits.pop(split)
        rest = self.monitor.end_window(self._key(split, "rest")) if first_done else None
        whole = self.monitor.end_window(self._key(split, "epoch"))
        if rest is None:
            time_s = whole.time * scaling_factor
            energy = {i: e * scaling_factor for i, e in whole.gpu_energy.items()}
        else:
            time_s = scale_to_full_epoch(whole.time - rest.time, rest.time, scaling_factor)
            energy = {
                i: scale_to_full_epoch(e - rest.gpu_energy[i], rest.gpu_energy[i], scaling_factor)
                for i, e in whole.gpu_energy.items()
            }
        epoch = self._epochs[split] = self._epochs.get(split, 0) + 1
        record = EpochRecord(
            epoch, split, time_s, energy, whole.time, dict(whole.gpu_energy), whole.simulated
        )
        self.records.append(record)
        self._write(record)
        return record

    def _write(self, r: EpochRecord) -> None:
        if self._time_file is not None:
            self._time_file.write(f"{r.epoch},{r.split},{r.time_s}\n")
            self._time_file.flush()
        for i, f in self._energy_files.items():
            f.write(
                f"{r.epoch},{r.split},{r.time_s},{r.energy_j[i]},{r.average_power_w(i)},"
                f"{r.measured_time_s},{r.measured_energy_j[i]},{int(r.simulated)}\n"
            )
            f.flush()
        sim = " (SIMULATED GPUs)" if r.simulated else ""
        logger.info("epoch %d %s time consumed: %.2fs%s", r.epoch, r.split, r.time_s, sim)

    def _cancel(self, split: str) -> None:
        self._open_splits.pop(split, None)
        for part in ("rest", "epoch"):
            if self._key(split, part) in self.monitor.open_windows:
                self.monitor.end_window(self._key(split, part), sync_execution=False, cancel=True)

    def close(self) -> None:
        """Abandon open epochs, stop the power log and close the files."""
        for split in list(self._open_splits):
            self._cancel(split)
        if self._power is not None:
            self._power.close()
            self._power = None
        for f in [self._time_file, *self._energy_files.values()]:
            if f is not None:
                f.close()
        self._time_file, self._energy_files = None, {}


def monitor_for(gpu_indices: Sequence[int] | None) -> ZeusMonitor:
    """A monitor of `gpu_indices`, or of this process's GPU (see `default_gpu_indices`)."""
    indices = list(gpu_indices) if gpu_indices is not None else default_gpu_indices() or None
    return ZeusMonitor(gpu_indices=indices)
