"""ReplayZeusMonitor: replay the windows of a monitor's CSV log instead of measuring (Zeus's test double)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core.monitor import checks
from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPUs

__all__ = ["ReplayZeusMonitor"]

logger = logging.getLogger(__name__)

# The window this package's optimizer opens over each training step, and the one Zeus's optimizer opens
# over `profile_steps` steps at one power limit (zeus/optimizer/power_limit.py: `__GlobalPowerLimitOptimizer_
# {limit in W}`), of which a log recorded by Zeus holds one row per limit.
STEP_WINDOW = "__GlobalPowerLimitOptimizer_step"
_ZEUS_LIMIT_WINDOW = re.compile(r"__GlobalPowerLimitOptimizer_(\d+)")


class ReplayZeusMonitor(ZeusMonitor):
    """A `ZeusMonitor` whose windows return the rows of a log written by `ZeusMonitor(log_file=...)`
    (or by Zeus's monitor: the same CSV), in order, instead of measuring: training and profiling fast-
    forward exactly as they went when the log was recorded. Zeus's `zeus.utils.testing.ReplayZeusMonitor`.

    Each `end_window` consumes the next row (a cancelled window consumes none, as a cancelled window
    is not logged); with `match_window_name` the row's window name must be the one ended. A log
    recorded by Zeus's optimizer holds one row per power limit (`__GlobalPowerLimitOptimizer_<W>`, one
    window over `profile_steps` steps) where this package's optimizer opens one window per step: its
    step windows are then served from the row of the power limit the GPUs are at, spread evenly over the
    `steps_per_row` steps the row covered, so that the optimizer takes the decisions the recorded
    measurements call for (a limit the log has no row for is an error that says so). Nothing else is
    read from the GPUs, nor the one-second power (`one_second_power_w` is None: a power-limit optimizer
    replaying decides on the log's energies alone); `gpus` (for an optimizer that sets power limits
    while replaying) are the process's GPUs, discovered when first asked for.

    Args:
        gpu_indices: GPU indices of the log's columns; default: read from its header.
        approx_instant_energy: Accepted for Zeus compatibility; unused.
        log_file: The CSV log to replay (`start_time,window_name,elapsed_time,gpu<i>_energy,...`).
        ignore_sync_execution: Do not wait for the GPUs at window boundaries.
        match_window_name: Check that each row's window name is the window being ended.
        steps_per_row: Steps each of a Zeus log's per-limit rows covered (the recorded run's
            `profile_steps`; default 40, Zeus's default). Only the figures per step depend on it, not
            which limit a selector picks.

    Raises:
        ValueError: no `log_file`, or its header is not a monitor log's.
        RuntimeError: (when replaying) a window begun twice ("already ongoing") or ended without being
            begun ("not ongoing"), a name that does not match the row, a row with the wrong number of
            values, no rows left, or a step at a power limit a Zeus log has no row for.

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
        steps_per_row: int = 40,
    ) -> None:
        if log_file is None:
            raise ValueError("`ReplayZeusMonitor(log_file=None)`: pass the CSV log to replay.")
        if isinstance(steps_per_row, bool) or not isinstance(steps_per_row, int) or steps_per_row < 1:
            raise ValueError(
                f"`ReplayZeusMonitor(steps_per_row={steps_per_row!r})`: expected a whole number of steps of "
                "at least 1 (the recorded run's profile_steps; Zeus's default is 40)."
            )
        self.steps_per_row = steps_per_row
        self.approx_instant_energy = approx_instant_energy
        self.ignore_sync_execution = ignore_sync_execution
        self.match_window_name = match_window_name
        self.log_path = Path(log_file)
        lines = checks.read_log_lines("ReplayZeusMonitor", self.log_path)
        header = lines[0].split(",") if lines else []
        if header[:3] != ["start_time", "window_name", "elapsed_time"]:
            raise ValueError(
                f"`ReplayZeusMonitor(log_file={str(log_file)!r})`: not a monitor log (expected the header "
                f"start_time,window_name,elapsed_time,gpu<i>_energy,...; got {lines[0] if lines else 'nothing'!r})."
            )
        self.gpu_indices: list[int] = checks.log_columns(
            "ReplayZeusMonitor", self.log_path, header, gpu_indices
        )
        self.cpu_indices: list[int] = []
        self._lost: dict[int, str] = {}  # `lost_gpus`: none (a GPU lost when recorded is an empty cell)
        self._live_indices = list(self.gpu_indices)
        self._rows = [line for line in lines[1:] if line]
        for n, line in enumerate(lines[1:], start=2):
            if line:
                checks.log_cells("ReplayZeusMonitor", self.log_path, n, header, line.split(","))
        self._next_row = 0
        # A Zeus log's per-limit rows, by power limit (W): time and energy per step, for the step windows.
        self._per_limit: dict[int, tuple[float, dict[int, float]]] = {}
        for n, line in enumerate(self._rows, start=2):
            _, name, *values = line.split(",")
            match = _ZEUS_LIMIT_WINDOW.fullmatch(name)
            if match and int(match[1]) not in self._per_limit:
                elapsed, energy = self._values(line, values, n - 1)
                per_step = {i: e / steps_per_row for i, e in energy.items()}
                self._per_limit[int(match[1])] = (elapsed / steps_per_row, per_step)
        self._ongoing: list[str] = []
        self._gpus: GPUs | None = None
        self.simulated = False
        logger.info("Replaying %d windows from %s for GPUs %s.", len(self._rows), log_file, self.gpu_indices)

    @property
    def gpus(self) -> GPUs:
        """The process's GPUs (for power limits set while replaying); discovered when first asked for."""
        if self._gpus is None:
            from zeus_callbacks.core.device.gpus import get_gpus

            self._gpus = get_gpus()
            self.simulated = self._gpus.simulated
        return self._gpus

    @gpus.setter
    def gpus(self, gpus: GPUs) -> None:
        # Writable as `ZeusMonitor.gpus` is (the attribute this property overrides).
        self._gpus = gpus

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
        if key == STEP_WINDOW and self._per_limit:
            return self._step_of_zeus_row()
        if self._next_row >= len(self._rows):
            raise RuntimeError(f"No more rows in {self.log_path} to replay window {key!r}.")
        line = self._rows[self._next_row]
        self._next_row += 1
        _, name, *values = line.split(",")
        if self.match_window_name and name != key:
            raise RuntimeError(f"Was expecting window {name!r} (row {self._next_row}), not {key!r}.")
        elapsed, energy = self._values(line, values, self._next_row)
        return Measurement(elapsed, energy)

    def _values(self, line: str, values: list[str], row: int) -> tuple[float, dict[int, float]]:
        """A row's elapsed time and its energy per GPU; an empty cell (a GPU lost) is left out."""
        if len(values) != len(self.gpu_indices) + 1:
            raise RuntimeError(f"Row {row} has an unexpected number of values: {line!r}")
        try:
            elapsed = float(values[0])
            energy = {i: float(v) for i, v in zip(self.gpu_indices, values[1:], strict=True) if v.strip()}
        except ValueError:
            raise RuntimeError(f"Row {row} of {self.log_path} is not numbers: {line!r}") from None
        return elapsed, energy

    def _step_of_zeus_row(self) -> Measurement:
        """One step at the power limit in force, from the Zeus log's row for that limit."""
        limits_w = {math.floor(self.gpus[i].power_limit_mw() / 1000) for i in self.gpu_indices}
        limit_w = max(limits_w)
        if len(limits_w) > 1 or limit_w not in self._per_limit:
            raise RuntimeError(
                f"{self.log_path} was recorded by Zeus's optimizer, with rows for {sorted(self._per_limit)} W; "
                f"this step ran at {sorted(limits_w)} W, which it has no row for. Replay it on GPUs with the "
                "recorded power-limit range and the same `pl_step`."
            )
        elapsed, energy = self._per_limit[limit_w]
        return Measurement(elapsed, dict(energy))

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
