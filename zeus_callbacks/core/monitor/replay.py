"""ReplayZeusMonitor: replay the windows of a monitor's CSV log instead of measuring (Zeus's test double)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor

__all__ = ["ReplayZeusMonitor"]

logger = logging.getLogger(__name__)


class ReplayZeusMonitor(ZeusMonitor):
    """A `ZeusMonitor` whose windows return the rows of a log written by `ZeusMonitor(log_file=...)`
    (or by Zeus's monitor: the same CSV), in order, instead of measuring: training and profiling fast-
    forward exactly as they went when the log was recorded. Zeus's `zeus.utils.testing.ReplayZeusMonitor`.

    Each `end_window` consumes the next row (a cancelled window consumes none, as a cancelled window
    is not logged); with `match_window_name` the row's window name must be the one ended. Nothing is
    read from the GPUs for windows, nor for the one-second power (`one_second_power_w` is None: a power-
    limit optimizer replaying decides on the log's energies alone); `gpus` (for an optimizer that sets
    power limits while replaying) are the process's GPUs, discovered when first asked for.

    Args:
        gpu_indices: GPU indices of the log's columns; default: read from its header.
        approx_instant_energy: Accepted for Zeus compatibility; unused.
        log_file: The CSV log to replay (`start_time,window_name,elapsed_time,gpu<i>_energy,...`).
        ignore_sync_execution: Do not wait for the GPUs at window boundaries.
        match_window_name: Check that each row's window name is the window being ended.

    Raises:
        ValueError: no `log_file`, or its header is not a monitor log's.
        RuntimeError: (when replaying) a window begun twice or ended without being begun, a name that
            does not match the row, a row with the wrong number of values, or no rows left.

    Example::

        monitor = ReplayZeusMonitor(log_file="recorded.csv", ignore_sync_execution=True)
        monitor.begin_window("epoch")
        m = monitor.end_window("epoch")  # the first row's time and energy
    """

    def __init__(
        self,
        gpu_indices: Sequence[int] | None = None,
        approx_instant_energy: bool = False,
        log_file: str | Path | None = None,
        ignore_sync_execution: bool = False,
        match_window_name: bool = True,
    ) -> None:
        if log_file is None:
            raise ValueError("`ReplayZeusMonitor(log_file=None)`: pass the CSV log to replay.")
        self.approx_instant_energy = approx_instant_energy
        self.ignore_sync_execution = ignore_sync_execution
        self.match_window_name = match_window_name
        self.log_path = Path(log_file)
        with self.log_path.open() as f:
            lines = f.read().splitlines()
        header = lines[0].split(",") if lines else []
        if header[:3] != ["start_time", "window_name", "elapsed_time"]:
            raise ValueError(
                f"`ReplayZeusMonitor(log_file={str(log_file)!r})`: not a monitor log (expected the header "
                f"start_time,window_name,elapsed_time,gpu<i>_energy,...; got {lines[0] if lines else 'nothing'!r})."
            )
        columns = [int(c[3:].split("_")[0]) for c in header[3:] if c]
        self.gpu_indices: list[int] = list(columns if gpu_indices is None else gpu_indices)
        self.cpu_indices: list[int] = []
        self._rows = [line for line in lines[1:] if line]
        self._next_row = 0
        self._ongoing: list[str] = []
        self._gpus: Any = None
        self.simulated = False
        logger.info("Replaying %d windows from %s for GPUs %s.", len(self._rows), log_file, self.gpu_indices)

    @property  # type: ignore[override]
    def gpus(self) -> Any:
        """The process's GPUs (for power limits set while replaying); discovered when first asked for."""
        if self._gpus is None:
            from zeus_callbacks.core.device.gpus import get_gpus

            self._gpus = get_gpus()
            self.simulated = self._gpus.simulated
        return self._gpus

    def one_second_power_w(self) -> float | None:
        """None: nothing is read from the GPUs while replaying."""
        return None

    def _sync(self, sync_execution: bool) -> None:
        if sync_execution and not self.ignore_sync_execution:
            self.gpus.synchronize(self.gpu_indices)

    def sync(self) -> None:
        """Wait for the GPUs' queued work, unless `ignore_sync_execution`."""
        self._sync(True)

    def begin_window(self, key: str, sync_execution: bool = True, restart: bool = False) -> None:
        """Open `key` (nothing is measured); with `restart`, an open one of that name begins again."""
        if key in self._ongoing:
            if not restart:
                raise RuntimeError(f"Window {key!r} is already ongoing.")
            self._ongoing.remove(key)
        self._ongoing.append(key)
        self._sync(sync_execution)

    def end_window(self, key: str, sync_execution: bool = True, cancel: bool = False) -> Measurement:
        """Close `key` and return the next row of the log (zeros, and no row consumed, when `cancel`)."""
        try:
            self._ongoing.remove(key)
        except ValueError:
            raise RuntimeError(f"Window {key!r} is not ongoing.") from None
        self._sync(sync_execution)
        if cancel:
            return Measurement(0.0, dict.fromkeys(self.gpu_indices, 0.0))
        if self._next_row >= len(self._rows):
            raise RuntimeError(f"No more rows in {self.log_path} to replay window {key!r}.")
        line = self._rows[self._next_row]
        self._next_row += 1
        _, name, *values = line.split(",")
        if self.match_window_name and name != key:
            raise RuntimeError(f"Was expecting window {name!r} (row {self._next_row}), not {key!r}.")
        if len(values) != len(self.gpu_indices) + 1:
            raise RuntimeError(f"Row {self._next_row} has an unexpected number of values: {line!r}")
        elapsed, *energy = map(float, values)
        return Measurement(elapsed, dict(zip(self.gpu_indices, energy, strict=True)))

    @property
    def open_windows(self) -> list[str]:
        """Names of the windows currently open."""
        return list(self._ongoing)

    @property
    def measurement_states(self) -> dict[str, Any]:
        """Open windows (replayed: nothing was read when they began)."""
        return dict.fromkeys(self._ongoing)

    def reset_windows(self) -> None:
        """Drop every open window."""
        self._ongoing.clear()

    def close(self) -> None:
        """Nothing to stop."""
