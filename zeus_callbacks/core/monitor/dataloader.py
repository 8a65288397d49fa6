"""Zeus's `ProfileDataLoader`: a `DataLoader` that logs each epoch's time, energy and power in Zeus's files.

Time and energy come from `ZeusMonitor` windows in this process (`EpochLog`) instead of Zeus's monitor binary;
with a subset of the data, an epoch is scaled to the full dataset as Zeus does.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Literal

from torch.utils.data import DataLoader, Subset

from zeus_callbacks.core.arguments import whole_number
from zeus_callbacks.core.monitor import checks
from zeus_callbacks.core.monitor.epoch_log import (
    LOG_PREFIX_ENV,
    EpochLog,
    EpochRecord,
    subset_indices,
    subset_scaling_factor,
)
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

__all__ = ["ProfileDataLoader"]


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
        monitor: The monitor to measure with; default one of this process's GPU (`local_rank()`) under
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
        checks.require_zeus_monitor("ProfileDataLoader", monitor)
        batch_size = whole_number("ProfileDataLoader", "batch_size", batch_size, 1)
        number = isinstance(subset_proportion, (int, float)) and not isinstance(subset_proportion, bool)
        if not number or not 0.0 < subset_proportion <= 1.0:
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
        if not eat_batch_size:
            kwargs["batch_size"] = batch_size
        super().__init__(*args, **kwargs)
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
            log = cls._logs[prefix] = EpochLog(monitor=monitor, log_prefix=prefix or None)
        return log

    @property
    def scaling_factor(self) -> float:
        """What the time of batches 2..N is multiplied by to stand for the full dataset."""
        return self._scaling_factor

    @property
    def records(self) -> list[EpochRecord]:
        """Epochs measured so far with this loader's files (train and eval)."""
        return self._log.records

    # Zeus's API: the loader is its own iterator (`DataLoader.__iter__` returns a separate one), so the
    # override narrows nothing and the type checker rightly flags it; kept for Zeus's users.
    def __iter__(self) -> ProfileDataLoader:  # type: ignore[override]
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
