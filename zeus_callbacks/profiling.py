"""Profiling for planning: Zeus's `ProfileDataLoader`, per-epoch logs, and the power-limit windows behind
`zeus-callbacks profile`.

- `ProfileDataLoader`: a `DataLoader` that logs each epoch's time (scaled from a subset to the full dataset),
  energy and power, as Zeus's does, measured in-process by `ZeusMonitor` instead of Zeus's monitor binary.
- `profile_power_limits(step_fn, ...)`: a window of training steps at each power limit, the measurement
  a Zeus² profile holds; `zeus-callbacks profile` runs a script that calls it once per batch size.
- `HFEpochLog` / `LightningEpochLog`: the per-epoch logs as trainer callbacks (imported lazily).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from torch.utils.data import DataLoader, Subset

from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.monitor.epoch_log import (
    LOG_PREFIX_ENV,
    MONITOR_SLEEP_MS_ENV,
    EpochLog,
    EpochRecord,
    monitor_for,
    subset_indices,
    subset_scaling_factor,
)
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.search import power_limit_grid

__all__ = [
    "ProfileDataLoader",
    "EpochLog",
    "EpochRecord",
    "PowerLimitWindow",
    "profile_power_limits",
    "profile_batch_size",
    "LOG_PREFIX_ENV",
    "MONITOR_SLEEP_MS_ENV",
    "PROFILE_ENV",
]

logger = logging.getLogger(__name__)

# The protocol between `zeus-callbacks profile` and the training script it runs: environment variables.
PROFILE_ENV = {
    "batch_size": "ZEUS_CALLBACKS_PROFILE_BATCH_SIZE",
    "out": "ZEUS_CALLBACKS_PROFILE_OUT",
    "power_limits": "ZEUS_CALLBACKS_PROFILE_POWER_LIMITS",
    "pl_step": "ZEUS_CALLBACKS_PROFILE_PL_STEP",
    "warmup_steps": "ZEUS_CALLBACKS_PROFILE_WARMUP_STEPS",
    "steps_per_window": "ZEUS_CALLBACKS_PROFILE_STEPS_PER_WINDOW",
    "gpu_index": "ZEUS_CALLBACKS_PROFILE_GPU_INDEX",
}


class ProfileDataLoader(DataLoader):
    """A `DataLoader` that logs the time, energy and power of every epoch (Zeus's `ProfileDataLoader`).

    Iterate it as any `DataLoader`. Each epoch's time, from the first batch requested to the end of
    iteration, goes to `{ZEUS_LOG_PREFIX}.time.csv` (`epoch,split,time`); its energy per GPU to
    `{ZEUS_LOG_PREFIX}+gpu<i>.energy.csv`; power sampled every `ZEUS_MONITOR_SLEEP_MS` to
    `{ZEUS_LOG_PREFIX}+gpu<i>.power.csv` (`Time,Power` in mW, as Zeus's power monitor writes). Train and
    eval loaders of one prefix share the files. Time and energy come from `ZeusMonitor` windows in this
    process (no monitor binary; `ZEUS_MONITOR_PATH` is ignored).

    With `subset_proportion < 1`, only every `round(1 / subset_proportion)`-th sample is used and the epoch
    is scaled to the full dataset as Zeus does: the first batch as measured (data loading warms up on it)
    plus the rest times `len(dataset) / (len(subset) - batch_size)`.

    Args:
        *args: Passed to `DataLoader` (the dataset first, unless given as `dataset=`).
        batch_size: Batch size.
        split: "train" or "eval"; labels the rows.
        subset_proportion: Fraction of the dataset to run, in (0, 1].
        only_scale_time: Run the whole dataset but scale the time as if it were the subset of a dataset
            `1 / subset_proportion` times larger (for a dataset you already cut down yourself).
        eat_batch_size: Do not pass `batch_size` on to `DataLoader` (for a `batch_sampler`).
        monitor: The monitor to measure with; default one of this process's GPU (`LOCAL_RANK`) under
            torch.distributed, else of every visible GPU.
        log_prefix: Overrides `ZEUS_LOG_PREFIX`.
        **kwargs: Passed to `DataLoader`.

    Raises:
        ValueError: a bad `split` or `subset_proportion`, a subset of at most one batch, or no log prefix.

    Example::

        # ZEUS_LOG_PREFIX=logs/bs128 ZEUS_CALLBACKS_SIMULATE=a40 python train.py
        train_loader = ProfileDataLoader(train_set, batch_size=128, split="train", subset_proportion=0.1)
        for epoch in range(epochs):
            for x, y in train_loader:
                train_step(x, y)
    """

    _logs: dict[str, EpochLog] = {}

    def __init__(
        self,
        *args: Any,
        batch_size: int,
        split: Literal["train", "eval"],
        subset_proportion: float = 1.0,
        eat_batch_size: bool = False,
        only_scale_time: bool = False,
        monitor: ZeusMonitor | None = None,
        log_prefix: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"`ProfileDataLoader(split={split!r})`: split must be 'train' or 'eval'.")
        if not 0.0 < subset_proportion <= 1.0:
            raise ValueError(
                f"`ProfileDataLoader(subset_proportion={subset_proportion!r})`: must be in (0, 1]."
            )
        dataset = kwargs["dataset"] if "dataset" in kwargs else args[0]
        self._scaling_factor = 1.0
        if subset_proportion < 1.0:
            indices = subset_indices(len(dataset), subset_proportion)
            self._scaling_factor = subset_scaling_factor(len(dataset), len(indices), batch_size)
            if not only_scale_time:
                subset = Subset(dataset, indices)
                if "dataset" in kwargs:
                    kwargs["dataset"] = subset
                else:
                    args = (subset, *args[1:])
        if eat_batch_size:
            super().__init__(*args, **kwargs)
        else:
            super().__init__(*args, batch_size=batch_size, **kwargs)
        self._split = split
        self._log = self._shared_log(monitor, log_prefix)
        self._iterator: Any = None
        self._batches = 0

    @classmethod
    def _shared_log(cls, monitor: ZeusMonitor | None, log_prefix: str | os.PathLike[str] | None) -> EpochLog:
        prefix = str(log_prefix) if log_prefix is not None else os.environ.get(LOG_PREFIX_ENV, "")
        log = cls._logs.get(prefix)
        if log is None or (monitor is not None and log.monitor is not monitor):
            if log is not None:
                log.close()
            log = cls._logs[prefix] = EpochLog(monitor or monitor_for(None), prefix or None)
        return log

    @property
    def scaling_factor(self) -> float:
        """What the time of batches 2..N is multiplied by to stand for the full dataset."""
        return self._scaling_factor

    @property
    def records(self) -> list[EpochRecord]:
        """Epochs measured so far with this loader's files (train and eval)."""
        return self._log.records

    def __iter__(self) -> ProfileDataLoader:
        self._iterator = super().__iter__()
        self._batches = 0
        return self

    def __next__(self) -> Any:
        log, split = self._log, self._split
        if self._batches == 0:
            log.begin(split)
        else:
            log.monitor.gpus.step_boundary(log.monitor.gpu_indices)
            if self._batches == 1:
                log.first_batch_done(split)
        try:
            batch = next(self._iterator)
        except StopIteration:
            log.end(split, self._scaling_factor)
            raise
        self._batches += 1
        return batch

    @classmethod
    def close_logs(cls) -> None:
        """Stop the power sampling and close every log file (also done at exit)."""
        for log in cls._logs.values():
            log.close()
        cls._logs.clear()


atexit.register(ProfileDataLoader.close_logs)


# -- power-limit windows for `zeus-callbacks profile` -----------------------------------------------------


@dataclass(frozen=True)
class PowerLimitWindow:
    """One measured window of `steps` training steps at a power limit (one Zeus² profile entry)."""

    power_limit_w: int
    time_s: float
    energy_j: float
    steps: int


def profile_batch_size(default: int) -> int:
    """The batch size `zeus-callbacks profile` asks this run for, or `default` outside a profile run."""
    value = os.environ.get(PROFILE_ENV["batch_size"])
    return int(value) if value else default


def _env_int(name: str) -> int | None:
    value = os.environ.get(PROFILE_ENV[name])
    return int(value) if value else None


def profile_power_limits(
    step_fn: Callable[[], Any],
    power_limits: Sequence[int] | None = None,
    warmup_steps: int | None = None,
    steps_per_window: int | None = None,
    *,
    gpu_index: int | None = None,
    pl_step: int | None = None,
    monitor: ZeusMonitor | None = None,
    output: str | os.PathLike[str] | None = None,
) -> list[PowerLimitWindow]:
    """Measure one window of training steps at each power limit, highest first; restore the limit after.

    At each limit `step_fn()` (one training step) runs `warmup_steps` times unmeasured, then
    `steps_per_window` times inside one monitor window. Arguments left `None` come from the environment
    `zeus-callbacks profile` sets (`PROFILE_ENV`), else defaults: every limit of the GPU from the maximum down
    by `pl_step` (25 W), 5 warm-up steps, 10 steps per window, GPU 0. With `output` (or
    `ZEUS_CALLBACKS_PROFILE_OUT`) the windows are written there as JSON for the CLI.

    Raises:
        ValueError: a limit outside the GPU's range, or non-positive step counts.
        GPUNoPermissionError: this process may not change power limits (root or CAP_SYS_ADMIN needed).

    Example::

        model, opt = ...
        batch = make_batch(profile_batch_size(default=64))
        def step():
            opt.zero_grad(); model(batch).sum().backward(); opt.step()
        profile_power_limits(step)    # under `zeus-callbacks profile`, settings come from it
    """
    gpu_index = gpu_index if gpu_index is not None else _env_int("gpu_index") or 0
    warmup_steps = warmup_steps if warmup_steps is not None else _env_int("warmup_steps")
    warmup_steps = 5 if warmup_steps is None else warmup_steps
    steps_per_window = steps_per_window or _env_int("steps_per_window") or 10
    pl_step = pl_step or _env_int("pl_step") or 25
    if warmup_steps < 0 or steps_per_window < 1:
        raise ValueError(
            f"`profile_power_limits(warmup_steps={warmup_steps!r}, steps_per_window={steps_per_window!r})`: "
            "need warmup_steps >= 0 and steps_per_window >= 1."
        )
    monitor = monitor or ZeusMonitor(gpu_indices=[gpu_index])
    gpu = monitor.gpus[gpu_index]
    if power_limits is None and os.environ.get(PROFILE_ENV["power_limits"]):
        power_limits = [int(p) for p in os.environ[PROFILE_ENV["power_limits"]].split(",")]
    lo, hi = (v / 1000 for v in gpu.power_limit_constraints_mw())
    if power_limits is None:
        power_limits = power_limit_grid(lo, hi, pl_step)
    limits = sorted({int(p) for p in power_limits}, reverse=True)
    outside = [p for p in limits if not lo <= p <= hi]
    if outside:
        raise ValueError(f"Power limits {outside} W are outside {gpu.label}'s range [{lo:g}, {hi:g}] W.")
    out_path = output if output is not None else os.environ.get(PROFILE_ENV["out"])
    cuda = _cuda_peak_start(gpu_index) if not gpu.simulated else False
    windows: list[PowerLimitWindow] = []
    boundary = monitor.gpus.step_boundary
    key = "__profile_power_limits"
    try:
        for pl in limits:
            gpu.set_power_limit_mw(pl * 1000)
            for _ in range(warmup_steps):
                step_fn()
                boundary(monitor.gpu_indices)
            monitor.begin_window(key)
            for _ in range(steps_per_window):
                step_fn()
                boundary(monitor.gpu_indices)
            m = monitor.end_window(key)
            windows.append(PowerLimitWindow(pl, m.time, m.gpu_energy[gpu_index], steps_per_window))
            logger.info(
                "%d W: %.4f s, %.2f J per %d steps", pl, m.time, windows[-1].energy_j, steps_per_window
            )
    except Exception as e:
        if out_path is not None and _is_oom(e):
            _write_run(out_path, gpu, windows, warmup_steps, steps_per_window, None, oom=True)
        raise
    finally:
        if key in monitor.open_windows:
            monitor.end_window(key, sync_execution=False, cancel=True)
        guard().restore()
    peak = _cuda_peak_bytes(gpu_index) if cuda else None
    if out_path is not None:
        _write_run(out_path, gpu, windows, warmup_steps, steps_per_window, peak, oom=False)
    return windows


def _cuda_peak_start(gpu_index: int) -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.reset_peak_memory_stats(gpu_index)
    return True


def _cuda_peak_bytes(gpu_index: int) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated(gpu_index))


def _is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _write_run(path, gpu, windows, warmup_steps, steps_per_window, peak, oom: bool) -> None:
    data = {
        "batch_size": _env_int("batch_size"),
        "gpu_model": gpu.name,
        "gpu_index": gpu.index,
        "simulated": gpu.simulated,
        "warmup_steps": warmup_steps,
        "steps_per_window": steps_per_window,
        "memory_peak_bytes": peak,
        "oom": oom,
        "windows": [asdict(w) for w in windows],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))


# -- thin trainer adapters of the epoch log (built on first access, so importing this module imports neither
# transformers nor lightning) ------------------------------------------------------------------------------


def _build_hf_epoch_log() -> type:
    from transformers import TrainerCallback

    class HFEpochLog(TrainerCallback):
        """Log each training epoch's time, energy and power to Zeus's profiler files (see `EpochLog`).

        `on_epoch_begin` -> `EpochLog.begin("train")`, `on_epoch_end` -> `EpochLog.end("train")`,
        `on_evaluate` is not timed (evaluation falls inside the training epoch, as in Zeus),
        `on_train_end` -> `EpochLog.close()`.

        Args:
            monitor: Measures this process's GPU (default: `LOCAL_RANK`'s, or every visible GPU).
            log_prefix: Overrides `ZEUS_LOG_PREFIX`.
        """

        def __init__(self, monitor: ZeusMonitor | None = None, log_prefix: str | None = None) -> None:
            self.log = EpochLog(monitor or monitor_for(None), log_prefix)

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.log.begin("train")

        def on_epoch_end(self, args, state, control, **kwargs):
            self.log.end("train")

        def on_train_end(self, args, state, control, **kwargs):
            self.log.close()

    return HFEpochLog


def _build_lightning_epoch_log() -> type:
    from lightning.pytorch.callbacks import Callback

    class LightningEpochLog(Callback):
        """Log each train and validation epoch's time, energy and power to Zeus's profiler files.

        `on_train_epoch_start/end` -> `EpochLog.begin/end("train")`, `on_validation_epoch_start/end` ->
        `EpochLog.begin/end("eval")` (sanity checks excluded), `on_fit_end` -> `EpochLog.close()`.

        Args:
            monitor: Measures this process's GPU (default: `LOCAL_RANK`'s, or every visible GPU).
            log_prefix: Overrides `ZEUS_LOG_PREFIX`.
        """

        def __init__(self, monitor: ZeusMonitor | None = None, log_prefix: str | None = None) -> None:
            self.log = EpochLog(monitor or monitor_for(None), log_prefix)

        def on_train_epoch_start(self, trainer, pl_module):
            self.log.begin("train")

        def on_train_epoch_end(self, trainer, pl_module):
            self.log.end("train")

        def on_validation_epoch_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.log.begin("eval")

        def on_validation_epoch_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.log.end("eval")

        def on_fit_end(self, trainer, pl_module):
            self.log.close()

    return LightningEpochLog


_LAZY = {"HFEpochLog": _build_hf_epoch_log, "LightningEpochLog": _build_lightning_epoch_log}
__all__ += list(_LAZY)


def __getattr__(name: str) -> Any:
    build = _LAZY.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = build()
    value.__module__ = __name__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
