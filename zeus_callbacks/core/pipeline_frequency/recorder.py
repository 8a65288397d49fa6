"""The instruction recorder: time and energy of each pipeline instruction of a step, and of the gaps between."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.power import energy_refresh_period_s, instant_power_mw
from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor

__all__ = [
    "FORWARD",
    "BACKWARD",
    "InstructionRecord",
    "InstructionRecorder",
    "ClockMeasurements",
    "StageSample",
    "StepTimeline",
    "instruction_kind",
    "split_trace_key",
    "undisturbed_estimate",
]

logger = logging.getLogger(__name__)

# An instruction shorter than this many refreshes of the energy counter is not measured by its own window
# (it would read 0 J or whole refreshes) but by attribution: see `ClockMeasurements`.
_DIRECT_REFRESHES = 10

FORWARD = "forward"
BACKWARD = "backward"

# Instruction names accepted by the hooks -> (kind, part of a split backward or None). Schedules that split
# the backward (zero-bubble) report its input- and weight-gradient halves; a weight half that directly
# follows an input half is the same backward instruction.
_NAMES: dict[str, tuple[str, str | None]] = {
    "forward": (FORWARD, None),
    "fwd": (FORWARD, None),
    "f": (FORWARD, None),
    "backward": (BACKWARD, None),
    "bwd": (BACKWARD, None),
    "b": (BACKWARD, None),
    "full_backward": (BACKWARD, None),
    "backward_input": (BACKWARD, "input"),
    "bwd_input": (BACKWARD, "input"),
    "i": (BACKWARD, "input"),
    "backward_weight": (BACKWARD, "weight"),
    "bwd_weight": (BACKWARD, "weight"),
    "w": (BACKWARD, "weight"),
}

# Monitor windows of this recorder; the names keep them apart from the user's own windows.
_STEP = "__PipelineFrequencyOptimizer_step"
_INSTRUCTION = "__PipelineFrequencyOptimizer_instruction"
_BLOCKED = "__PipelineFrequencyOptimizer_blocked"

# Ranks on the same host share `time.monotonic()`; ranks on different hosts do not (see `edge_delays`).
_HOST = socket.gethostname()


def instruction_kind(name: str) -> tuple[str, str | None]:
    """`(kind, part)` of an instruction name: kind `"forward"` or `"backward"`, part `"input"`/`"weight"`
    for the halves of a split backward, else None.

    Raises:
        ValueError: an unknown name.
    """
    try:
        return _NAMES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(
            f"Unknown pipeline instruction {name!r}. Expected 'forward' or 'backward' (or, for a split "
            "backward, 'backward_input' and 'backward_weight')."
        ) from None


def split_trace_key(key: str | tuple[str, int]) -> tuple[str, int | None]:
    """`(kind, virtual stage or None)` of an `InstructionRecord.trace_key`."""
    return (key[0], key[1]) if isinstance(key, tuple) else (key, None)


def undisturbed_estimate(values: Sequence[float], quantile: float = 0.1) -> float:
    """An instruction's own time (or energy) from repeated measurements: their `quantile` (linear
    interpolation between order statistics; 0 is the minimum).

    Interference (preemption by other processes, the host scheduling other ranks on shared cores) only
    ever adds time, and idle energy with it, so the median drifts with the load of the moment while a low
    quantile tracks what the instruction itself takes; a quantile above the minimum keeps one lucky
    measurement from deciding.

    Raises:
        ValueError: no values, or a quantile outside [0, 1].
    """
    if not values:
        raise ValueError("undisturbed_estimate() needs at least one measurement.")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"`undisturbed_estimate(quantile={quantile!r})`: must be in [0, 1].")
    ordered = sorted(values)
    position = quantile * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class InstructionRecord:
    """One instruction of a step: its kind, its time and counter energy (both halves of a split backward),
    instantaneous power x time (`power_time_j`, when the recorder reads power), and when it started
    (`start_s`, this host's monotonic clock)."""

    kind: str
    time_s: float = 0.0
    energy_j: float = 0.0
    power_time_j: float = 0.0
    start_s: float = 0.0
    virtual_stage: int | None = None  # the model chunk it ran, with several per rank (interleaved schedules)

    @property
    def trace_key(self) -> str | tuple[str, int]:
        """The kind, with the virtual stage when there is one (as `Instruction.trace_key`)."""
        return self.kind if self.virtual_stage is None else (self.kind, self.virtual_stage)


@dataclass(frozen=True)
class StepTimeline:
    """When one rank's step and each of its instructions started (`time.monotonic()` of its host) and how
    long each took: what `edge_delays` compares across stages to measure the time between instructions."""

    host: str
    step_start_s: float
    step_time_s: float
    starts_s: tuple[float, ...]
    times_s: tuple[float, ...]


@dataclass
class StageSample:
    """What one rank measured at one clock: the per-instruction estimates, the blocking time and energy."""

    stage: int
    frequency_mhz: int
    # trace key (the kind, with the model chunk where there are several) -> (time s, energy J, number of
    # instructions measured), from `undisturbed_estimate`
    kinds: dict[str | tuple[str, int], tuple[float, float, int]]
    blocked_time_s: float
    blocked_energy_j: float
    sequence: tuple[str | tuple[str, int], ...]  # `InstructionRecord.trace_key` of the step's instructions


@dataclass
class ClockMeasurements:
    """The instructions measured over the profiled steps at one clock, and the blocked time and energy.

    Each instruction type (its kind, and its model chunk where a rank holds several: `InstructionRecord.
    trace_key`, as chunks of real splits weigh differently) is summarised by a low quantile of its instances' times and of their energies
    (`undisturbed_estimate`): a host that preempts the job (or simulated GPUs sharing CPU cores) only
    adds time, to many instances when it is busy, and a lower clock must not look free or dear because
    the host happened to be busier at another clock. With 4 simulated ranks on 2 cores, the medians of
    stage 0's forward from 1740 MHz down in 45 MHz steps were 1.00, 1.07, 0.96, 1.13, 0.98, 1.29 of the
    first; the 10% quantiles 1.00, 1.06, 1.09, 1.11, 1.13, 1.17, as the clocks predict.

    Instructions shorter than a few refreshes of the GPU's energy counter (which moves only every 20-100 ms)
    read 0 J or whole refreshes in their own windows. Their energy is then attributed: each instance's
    instantaneous power x time gives the split between instructions, gaps and the rest of the step, and
    the counter's energy over all the profiled steps (long windows, hence exact to within a refresh) gives
    the scale.
    """

    kinds: dict[str | tuple[str, int], tuple[list[float], list[float], list[float]]] = field(
        default_factory=dict
    )  # trace key -> (times, counter energies, power x time)
    blocked_time_s: float = 0.0
    blocked_energy_j: float = 0.0
    blocked_power_time_j: float = 0.0
    step_time_s: float = 0.0
    step_energy_j: float = 0.0
    refresh_s: float | None = None
    timelines: list[StepTimeline] = field(default_factory=list)  # one per step added

    def add_step(self, recorder: InstructionRecorder) -> None:
        """Add the instructions and blocked time of the step `recorder` just recorded."""
        self.timelines.append(recorder.timeline())
        for r in recorder.records:
            times, energies, estimates = self.kinds.setdefault(r.trace_key, ([], [], []))
            times.append(r.time_s)
            energies.append(r.energy_j)
            estimates.append(r.power_time_j)
        self.blocked_time_s += recorder.blocked_time_s
        self.blocked_energy_j += recorder.blocked_energy_j
        self.blocked_power_time_j += recorder.blocked_power_time_j
        self.step_time_s += recorder.step_time_s
        self.step_energy_j += recorder.step_energy_j
        self.refresh_s = recorder.refresh_s

    def attributed(self) -> bool:
        """Whether instructions are too short for their own windows and power was read to attribute them."""
        times = [x for t, _, _ in self.kinds.values() for x in t]
        if not times or self.refresh_s is None:
            return False
        has_power = all(e > 0 for _, _, est in self.kinds.values() for e in est)
        return has_power and undisturbed_estimate(times, 0.5) < _DIRECT_REFRESHES * self.refresh_s

    def _scale(self) -> float:
        """Counter energy of the profiled steps over their power-x-time estimate (the gaps' average power
        standing in for the part of a step outside instructions and gaps); 1 when the profiled steps are too
        short for the counter to measure them either."""
        if self.refresh_s is None or self.step_time_s < _DIRECT_REFRESHES * self.refresh_s:
            return 1.0
        instr_t = sum(sum(t) for t, _, _ in self.kinds.values())
        instr_e = sum(sum(e) for _, _, e in self.kinds.values())
        blocked_w = self.blocked_power_time_j / self.blocked_time_s if self.blocked_time_s > 0 else 0.0
        rest_s = max(0.0, self.step_time_s - instr_t - self.blocked_time_s)
        estimate = instr_e + self.blocked_power_time_j + blocked_w * rest_s
        return self.step_energy_j / estimate if estimate > 0 else 1.0

    def sample(
        self, stage: int, frequency_mhz: int, sequence: tuple[str | tuple[str, int], ...]
    ) -> StageSample:
        """The estimates of every instruction type measured, as this rank's sample of `stage`."""
        if self.attributed():
            scale = self._scale()
            kinds = {
                k: (undisturbed_estimate(t), scale * undisturbed_estimate(e), len(t))
                for k, (t, _, e) in self.kinds.items()
                if t
            }
            blocked_j = scale * self.blocked_power_time_j
        else:
            kinds = {
                k: (undisturbed_estimate(t), undisturbed_estimate(e), len(t))
                for k, (t, e, _) in self.kinds.items()
                if t
            }
            blocked_j = self.blocked_energy_j
        return StageSample(stage, frequency_mhz, kinds, self.blocked_time_s, blocked_j, sequence)


class InstructionRecorder:
    """Measure a training step, each instruction in it, and the gaps between instructions (blocked on peers).

    Three monitor windows: the step (begin to end), the instruction in progress (synchronising the GPU at
    its boundaries), and the gap since the last instruction ended. A GPU error in the monitor is passed
    to `on_error` and the measurement skipped, never raised: the optimizer shares it with its peers at
    the next collective.

    Args:
        monitor: A `ZeusMonitor` of this rank's one GPU.
        on_error: Called with each GPU error the monitor raises.
    """

    def __init__(self, monitor: ZeusMonitor, on_error: Callable[[GPUError], None]) -> None:
        self.monitor = monitor
        self.on_error = on_error
        self.in_step = False
        self.records: list[InstructionRecord] = []
        self.blocked_time_s = 0.0
        self.blocked_energy_j = 0.0
        self.blocked_power_time_j = 0.0
        self.step_time_s = 0.0
        self.step_energy_j = 0.0
        self.step_start_s = 0.0
        # While profiling: read instantaneous power at the end of each instruction and gap (see
        # `ClockMeasurements`), on GPUs whose energy counter refreshes too slowly for short windows.
        self.read_power = False
        self._gpu = monitor.gpus[monitor.gpu_indices[0]]
        self.refresh_s: float | None = None
        # `InstructionRecord.trace_key` of the last complete step's instructions, in order
        self.sequence: tuple[str | tuple[str, int], ...] = ()
        self._in_instruction = False
        self._last_part: str | None = None

    def begin_step(self) -> None:
        """Start recording a step (dropping a step that never ended)."""
        self.records = []
        self.blocked_time_s = self.blocked_energy_j = self.blocked_power_time_j = 0.0
        self.step_time_s = self.step_energy_j = 0.0
        self._last_part = None
        if self.read_power and self.refresh_s is None:
            self.refresh_s = self._guarded(lambda: energy_refresh_period_s(self._gpu))
        self._cancel(_BLOCKED)
        self._cancel(_STEP)
        self._guarded(lambda: self.monitor.begin_window(_STEP))
        self.step_start_s = time.monotonic()
        self.in_step = True

    def begin_instruction(self, kind: str, part: str | None, virtual_stage: int | None = None) -> int | None:
        """End the gap before this instruction (of model chunk `virtual_stage`, if several per rank) and
        start measuring it.

        Returns:
            The index of the new instruction in the step, or None when it continues the previous one
            (the weight half of a split backward right after its input half).
        """
        if _BLOCKED in self.monitor.open_windows:
            power_w = self._power_w()
            m = self._guarded(lambda: self.monitor.end_window(_BLOCKED))
            if m is not None:
                self.blocked_time_s += m.time
                self.blocked_energy_j += m.total_energy
                self.blocked_power_time_j += power_w * m.time
        index = None
        if not (part == "weight" and self._last_part == "input"):
            self.records.append(InstructionRecord(kind, virtual_stage=virtual_stage))
            index = len(self.records) - 1
        self._guarded(lambda: self.monitor.begin_window(_INSTRUCTION))
        if index is not None:
            self.records[index].start_s = time.monotonic()
        self._in_instruction = True
        return index

    def end_instruction(self, part: str | None) -> bool:
        """Record the instruction in progress and start measuring the gap after it.

        Returns:
            False when no instruction was in progress (nothing recorded).
        """
        if not self._in_instruction:
            return False
        self._in_instruction = False
        power_w = self._power_w()  # before the synchronisation, while the instruction's work runs
        # Not open when the GPU failed at the instruction's begin (already reported there).
        m = (
            self._guarded(lambda: self.monitor.end_window(_INSTRUCTION))
            if _INSTRUCTION in self.monitor.open_windows
            else None
        )
        if m is not None and self.records:
            self.records[-1].time_s += m.time
            self.records[-1].energy_j += m.total_energy
            self.records[-1].power_time_j += power_w * m.time
        self._last_part = part
        self._guarded(lambda: self.monitor.begin_window(_BLOCKED, sync_execution=False))
        return True

    def end_step(self) -> Measurement | None:
        """Stop recording the step; its time and energy (None if the monitor failed)."""
        self.in_step = False
        self._cancel(_BLOCKED)
        self._cancel(_INSTRUCTION)
        m = (
            self._guarded(lambda: self.monitor.end_window(_STEP))
            if _STEP in self.monitor.open_windows
            else None
        )
        self.sequence = tuple(r.trace_key for r in self.records)
        if m is not None:
            self.step_time_s, self.step_energy_j = m.time, m.total_energy
        return m

    def timeline(self) -> StepTimeline:
        """When the last recorded step and its instructions started, and how long each took."""
        return StepTimeline(
            _HOST,
            self.step_start_s,
            self.step_time_s,
            tuple(r.start_s for r in self.records),
            tuple(r.time_s for r in self.records),
        )

    def _power_w(self) -> float:
        """Instantaneous power (W) while profiling on a GPU with a slow counter; else 0 (not read)."""
        if not self.read_power or not self.refresh_s:
            return 0.0
        mw = self._guarded(lambda: instant_power_mw(self._gpu))
        return 0.0 if mw is None else mw / 1000.0

    def close(self) -> None:
        """Drop the windows still open; a step in progress is not recorded."""
        self.in_step = self._in_instruction = False
        for key in (_BLOCKED, _INSTRUCTION, _STEP):
            self._cancel(key)

    def _cancel(self, key: str) -> None:
        if key in self.monitor.open_windows:
            self.monitor.end_window(key, sync_execution=False, cancel=True)

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except GPUError as e:
            self.on_error(e)
            return None
