"""PipelineFrequencyOptimizer: the phase machine that profiles, plans (Perseus) and applies SM clocks per instruction.

The pieces live beside it: `recorder` measures instructions, `clock_sweep` builds the profile clock by
clock, `planning` turns the profile into clocks, `controller` sets them, `profile_file` stores the profile.
"""

from __future__ import annotations

import atexit
import logging
import numbers
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.arguments import bad_argument, positive_number, whole_number
from zeus_callbacks.core.callback import Callback
from zeus_callbacks.core.device.errors import GPUError, InvalidInputError
from zeus_callbacks.core.device.state_guard import guard, job_gpu_overlap
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.clock_sweep import ClockSweep, clock_sweep, stage_clocks
from zeus_callbacks.core.pipeline_frequency.controller import FrequencyController
from zeus_callbacks.core.pipeline_frequency.dag import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    Instruction,
    build_dag,
)
from zeus_callbacks.core.pipeline_frequency.planning import plan_pipeline
from zeus_callbacks.core.pipeline_frequency.profile_file import (
    ProfileRow,
    edge_delays_path,
    read_profile,
    write_edge_delays,
    write_profile,
)
from zeus_callbacks.core.pipeline_frequency.recorder import (
    ClockMeasurements,
    InstructionRecorder,
    instruction_kind,
)

__all__ = ["PipelineFrequencyOptimizer"]

logger = logging.getLogger(__name__)

# Iteration energy is averaged over the recent steps that span this long (20 refreshes of a 100 ms counter).
_ITERATION_WINDOW_S = 2.0

_UNLOCKED = 0  # "clock" of measurements taken at the clock the GPU chose itself (no permission to lock)


_OWNER = "PipelineFrequencyOptimizer"


def _bad(name: str, value: Any, want: str) -> ValueError:
    """The error of a bad constructor argument: names it with its value, says what to pass (one line)."""
    return bad_argument(_OWNER, name, value, want)


def _said(key: str | tuple[str, int]) -> str:
    """An instruction's kind in words, with its virtual stage when there is one."""
    return f"{key[0]} of virtual stage {key[1]}" if isinstance(key, tuple) else key


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_options(schedule: Any, wait: Any, warmup: Any, profile: Any, stride: Any, patience: Any) -> None:
    """The schedule's name and the step counts (`core.arguments`' checks), else a clear error."""
    if schedule is not None and schedule not in SCHEDULES + MULTI_STAGE_SCHEDULES:
        raise _bad("schedule", schedule, f"pass one of {SCHEDULES + MULTI_STAGE_SCHEDULES}, or None (detected)")
    for name, value, low in (
        ("wait_steps", wait, 0),
        ("warmup_steps", warmup, 0),
        ("profile_steps", profile, 1),
        ("frequency_stride_mhz", stride, 1),
        ("patience", patience, 1),
    ):
        whole_number(_OWNER, name, value, low)


# -- phases -----------------------------------------------------------------------------------------
# One object per phase; `name` is what `PipelineFrequencyOptimizer.phase` reports. Every rank of the
# pipeline is in the same phase at the same step, except `fallback`, which a stage enters on its own.
@dataclass
class _Waiting:
    """`waiting`: the first `wait_steps` steps run unchanged (a schedule's first step sets it up).

    Next: `profiling` at the end of the last of them (at the first step when `wait_steps` is 0).
    """

    name: ClassVar[str] = "waiting"
    steps_left: int


@dataclass
class _Profiling:
    """`profiling`: this rank's GPU at one clock of its stage's sweep (its maximum once the stage is done):
    `warmup_left` steps dropped, then `profile_steps` steps measured.

    Next, after the measured steps, when every rank has shared its measurements: `profiling` at the next
    clock while a stage's sweep goes on; `applying` once every stage is done and a plan was found;
    `inactive` when a GPU failed, no plan could be made, or the job may not lock clocks.
    """

    name: ClassVar[str] = "profiling"
    frequency_mhz: int
    warmup_left: int
    steps_done: int = 0
    measurements: ClockMeasurements = field(default_factory=ClockMeasurements)


@dataclass
class _Applying:
    """`applying`: each instruction of a step runs at its planned clock (`frequencies_mhz[i]` for the
    `i`-th, of kind `kinds[i]`: the kind, with its virtual stage where recorded).

    Next: `fallback` when a step's instructions differ from the plan or a clock change fails.
    """

    name: ClassVar[str] = "applying"
    kinds: list[str | tuple[str, int]]
    frequencies_mhz: list[int]
    max_clock_mhz: int | None = None  # while set, every instruction runs at it (`hold_max_clocks`)

    def clock(self, index: int) -> int:
        """The clock of the `index`-th instruction of a step."""
        return self.max_clock_mhz if self.max_clock_mhz is not None else self.frequencies_mhz[index]


@dataclass
class _Fallback:
    """`fallback`: this stage runs at its maximum clock until training ends; `reason` says why. Final."""

    name: ClassVar[str] = "fallback"
    reason: str


@dataclass
class _Inactive:
    """`inactive`: the GPU's clocks are as they were found; time and energy are still measured. Final."""

    name: ClassVar[str] = "inactive"
    reason: str


_Phase = _Waiting | _Profiling | _Applying | _Fallback | _Inactive


class PipelineFrequencyOptimizer(Callback):
    """Slow down the pipeline instructions that are off the critical path (Perseus, SOSP'24; Zeus's
    `PipelineFrequencyOptimizer`, without its server: ranks coordinate over torch.distributed).

    Phases (`phase`), every rank in step:

    1. `waiting`: `wait_steps` steps pass unchanged (the first step of a pipeline schedule sets it up).
    2. `profiling`: every stage locks its GPU's SM clock to each clock of a sweep from the highest down
       (supported clocks `frequency_stride_mhz` apart), drops `warmup_steps` steps, then measures the time
       and energy of each forward and backward over `profile_steps` steps (synchronising the GPU at every
       instruction boundary), the power while blocked between instructions, and when each instruction
       started (the time between instructions, communication included, becomes the DAG's edge delays:
       `edge_delays`). A stage stops once its
       last `patience` clocks saved no effective energy; the sweep ends when every stage stopped.
       Replicas of a stage (same `pp_rank`) are merged: time is the slowest replica's, energy the sum.
       Then planning: the measurements are gathered on the group's first rank, which finds the schedule
       that ran (1F1B or GPipe; an interleaved one, with several model chunks per rank, from torch's own
       order: see `use_schedule`), builds its DAG and picks the least-energy clock of every instruction
       whose iteration time does not exceed the all-maximum-clock one (or `target_time_s`), each
       instruction type's times read off one curve across its clocks (`planning.fit_clock_times`, so
       that measurement noise does not pass for a free clock); every rank gets its stage's clocks.
    3. `applying`: each instruction runs at its planned clock, set by a background thread during the
       communication before it (requests for the clock already in force are skipped).
       `hold_max_clocks()` runs the maximum clocks instead for a while, to measure the plan against them.
    4. `fallback`: the order of instructions differs from the plan (e.g. a new number of microbatches),
       or a clock change failed: the stage warns and goes back to its maximum clock.
    5. `inactive`: no plan (a GPU failed, no known schedule ran, no permission to lock clocks): the
       clocks are restored and training goes on.

    Without permission to lock clocks, time and energy are still measured at the clock in force and
    reported; with a `profile_path` that exists, the plan and its predicted savings are reported, not
    applied. Every clock change is undone at `on_train_end`, at exit, on exceptions and on SIGINT/SIGTERM.

    The positional arguments are those of Zeus's class; `server_url` is accepted and not used.

    Args:
        rank: Global rank (checked against torch.distributed when given).
        dp_rank: Data-parallel rank (accepted for compatibility).
        pp_rank: Pipeline stage of this rank. Default: the rank in `process_group` (pure pipeline).
        tp_rank: Tensor-parallel rank (accepted for compatibility).
        device_id: Index of this rank's GPU. Default: the GPU of `monitor`, else `LOCAL_RANK`, else 0.
        dp_degree: Data-parallel degree; with `tp_degree`, tells whether `pp_rank` is required.
        pp_degree: Number of pipeline stages (checked when given).
        tp_degree: Tensor-parallel degree.
        world_size: Number of ranks (checked when given).
        server_url: Zeus's Perseus server; not needed here (ignored).
        job_metadata: Free text, shown in `report()`.
        monitor: A `ZeusMonitor` of this rank's one GPU. Default: one on `device_id`.
        schedule: `"1f1b"`, `"gpipe"`, `"interleaved-1f1b"` or `"looped-bfs"`; default: whichever matches
            the instructions observed (`pipelining.instrument` passes torch's own order instead).
        wait_steps: Steps before profiling starts (>= 1 drops a schedule's set-up step).
        warmup_steps: Steps dropped after each clock change.
        profile_steps: Steps measured at each clock.
        frequency_stride_mhz: Minimum gap between profiled clocks.
        min_frequency_mhz: Lowest clock to profile (default: the lowest supported).
        patience: Clocks without an effective-energy gain before a stage stops its sweep.
        target_time_s: Iteration-time target (e.g. a straggler's time); default: the all-max-clock time.
        slack_margin: Extra planning margin: a lowered clock is planned as if it took this fraction longer
            than profiled. Not needed by default: the time between instructions (communication between
            stages, the host's time within one) is measured while profiling and is part of the plan's DAG.
            Predictions use the profiled times.
        profile_path: CSV `stage,instruction,frequency,time,energy`: if it exists, plan from it instead of
            sweeping; otherwise written (by the first rank) once profiling is done, with the measured edge
            delays beside it (`profile.edges.csv`). Replaying, the delays are measured again in the job.
        process_group: The torch.distributed group of the pipeline's ranks (default: the whole job).

    Raises:
        ValueError: a bad argument; the message names it and says what to pass. A `min_frequency_mhz`
            above a rank's GPU clocks is found at the first `on_step_begin` (raised on every rank).

    Example::

        monitor = ZeusMonitor(gpu_indices=[local_rank])
        pfo = PipelineFrequencyOptimizer(monitor=monitor)
        for batch in loader:
            pfo.on_step_begin()
            for name, fn in my_schedule(batch):      # or zeus_callbacks.core.pipeline_frequency.pipelining.instrument(stage, schedule, pfo)
                pfo.on_instruction_begin(name)       # "forward" or "backward"
                fn()
                pfo.on_instruction_end(name)
            pfo.on_step_end()
        pfo.on_train_end()
    """

    def __init__(
        self,
        rank: int | None = None,
        dp_rank: int = 0,
        pp_rank: int | None = None,
        tp_rank: int = 0,
        device_id: int | None = None,
        dp_degree: int = 1,
        pp_degree: int | None = None,
        tp_degree: int = 1,
        world_size: int | None = None,
        server_url: str | None = None,
        job_metadata: str | None = None,
        *,
        monitor: ZeusMonitor | None = None,
        schedule: str | None = None,
        wait_steps: int = 1,
        warmup_steps: int = 2,
        profile_steps: int = 3,
        frequency_stride_mhz: int = 90,
        min_frequency_mhz: int | None = None,
        patience: int = 2,
        target_time_s: float | None = None,
        profile_path: str | Path | None = None,
        process_group: Any = None,
        slack_margin: float = 0.0,
    ) -> None:
        _check_options(schedule, wait_steps, warmup_steps, profile_steps, frequency_stride_mhz, patience)
        if min_frequency_mhz is not None:
            whole_number(_OWNER, "min_frequency_mhz", min_frequency_mhz, 1)
        if target_time_s is not None:
            positive_number(_OWNER, "target_time_s", target_time_s)
        if not (_is_number(slack_margin) and 0.0 <= slack_margin < 1.0):
            raise _bad("slack_margin", slack_margin, "pass a number in [0, 1), e.g. 0 (the default)")
        if rank is not None and dist.is_distributed() and rank != dist.rank():
            raise _bad("rank", rank, f"this process is rank {dist.rank()} of torch.distributed")
        if world_size is not None and dist.is_distributed() and world_size != dist.world_size():
            raise _bad("world_size", world_size, f"torch.distributed has {dist.world_size()} ranks")
        if pp_rank is None and (dp_degree > 1 or tp_degree > 1):
            raise _bad(
                "pp_rank", pp_rank, "is required with data or tensor parallelism (the stage of this rank)"
            )
        if monitor is None:
            if device_id is None:
                device_id = dist.local_rank()
            monitor = ZeusMonitor(gpu_indices=[device_id])
        elif len(monitor.gpu_indices) != 1 or (device_id is not None and monitor.gpu_indices != [device_id]):
            raise _bad(
                "monitor",
                f"ZeusMonitor(gpu_indices={monitor.gpu_indices})",
                "must measure exactly this rank's GPU"
                + (f" (device_id={device_id})" if device_id is not None else ""),
            )
        if server_url is not None:
            logger.info(
                "PipelineFrequencyOptimizer: server_url is not needed (ranks coordinate over torch.distributed)."
            )
        self.monitor = monitor
        self.gpu = monitor.gpus[monitor.gpu_indices[0]]
        self.rank, self.dp_rank, self.tp_rank = rank, dp_rank, tp_rank
        self.pp_degree, self.job_metadata = pp_degree, job_metadata
        self.schedule = schedule
        self._order: tuple[tuple[Instruction, ...], ...] | None = None  # `use_schedule`
        self.wait_steps = int(wait_steps)
        self.warmup_steps = int(warmup_steps)
        self.profile_steps = int(profile_steps)
        self.frequency_stride_mhz = int(frequency_stride_mhz)
        self.min_frequency_mhz = None if min_frequency_mhz is None else int(min_frequency_mhz)
        self.patience = int(patience)
        self.target_time_s = None if target_time_s is None else float(target_time_s)
        self.slack_margin = float(slack_margin)
        self.profile_path = Path(profile_path) if profile_path is not None else None
        self.stage: int | None = pp_rank
        self.may_set = True
        self._why_not_set = ""  # why `may_set` is False, in words: no permission is only one of the reasons
        # metrics
        self.iteration_time_s: float | None = None
        self.iteration_energy_j: float | None = None
        # Recent steps (time, counter energy): an iteration's energy is their mean, over enough steps for a
        # counter that moves only every 20-100 ms (a single short step reads 0 J or a whole refresh).
        self._recent_steps: deque[tuple[float, float]] = deque()
        self.profiling_steps = 0

        self._group = dist.Group(process_group)
        self._phase: _Phase = _Waiting(self.wait_steps)
        self._recorder = InstructionRecorder(monitor, self._gpu_failed)
        self._sweep: ClockSweep | None = None  # made at the first step, from every rank's clocks
        self._controller: FrequencyController | None = None
        self._replay: list[ProfileRow] | None = None  # the profile read from `profile_path`
        self._plan: dict[str, Any] | None = None  # plain data, the same on every rank
        self._failed: str | None = None  # this rank's first GPU error, shared at the next collective
        self._started = False
        self._closed = False
        self._warned_unstarted = False

    def use_schedule(self, order: Sequence[Sequence[Instruction]], name: str = "custom") -> None:
        """Plan on this order of every stage's instructions instead of matching a named schedule.

        `pipelining.instrument` passes a multi-stage schedule's own `pipeline_order` here
        (`pipelining.schedule_order`). At planning the order each stage ran is checked against it; with
        several model chunks per rank, each instruction must be reported with its `virtual_stage`.

        Args:
            order: One list per stage (`Instruction.stage` = list index), in execution order.
            name: What `report()["schedule"]` calls it, e.g. torch's class name.

        Raises:
            InvalidInputError: after planning began, or an order that is not a schedule (the reason).
        """
        if self._plan is not None:
            raise InvalidInputError(
                "`PipelineFrequencyOptimizer.use_schedule(...)`: the plan is made; call it before training."
            )
        try:
            build_dag(order)
        except ValueError as e:
            raise InvalidInputError(f"`PipelineFrequencyOptimizer.use_schedule(order)`: {e}") from None
        self._order = tuple(tuple(o) for o in order)
        self.schedule = name

    # -- public state ---------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """`waiting`, `profiling`, `applying`, `fallback` or `inactive` (see the class docstring)."""
        return self._phase.name

    @property
    def frequency_mhz(self) -> int | None:
        """The SM clock this optimizer last locked (None: not locked)."""
        return None if self._controller is None else self._controller.frequency_mhz

    @property
    def plan_frequencies_mhz(self) -> list[int] | None:
        """This stage's planned clock of each instruction, in execution order (None before planning)."""
        return list(self._phase.frequencies_mhz) if isinstance(self._phase, _Applying) else None

    def hold_max_clocks(self, hold: bool = True) -> None:
        """While applying a plan, run every instruction at the stage's maximum clock instead (`hold=True`), or
        go back to the plan (`hold=False`): a baseline measured in the same job, with the same
        measurements, to compare the plan against. Call it on every rank between steps; it does nothing
        in other phases."""
        if isinstance(self._phase, _Applying) and self._sweep is not None and self.stage is not None:
            self._phase.max_clock_mhz = self._sweep.max_clock(self.stage) if hold else None

    def metrics(self) -> dict[str, float | str]:
        """Numbers for the trainer's loggers: phase, this rank's last iteration, the plan's prediction."""
        out: dict[str, float | str] = {"phase": self.phase, "profiling_steps": float(self.profiling_steps)}
        if self.iteration_time_s is not None and self.iteration_energy_j is not None:
            out["iteration_time_s"] = self.iteration_time_s
            out["iteration_energy_j"] = self.iteration_energy_j
        if self.frequency_mhz is not None:
            out["frequency_mhz"] = float(self.frequency_mhz)
        if self._plan and "predicted" in self._plan:
            for k, v in self._plan["predicted"].items():
                out[f"plan_{k}"] = float(v)
        return out

    def profile_rows(self) -> list[ProfileRow]:
        """The profile measured so far (every stage, replicas merged), as written to `profile_path`."""
        return [] if self._sweep is None else self._sweep.profile_rows()

    def blocking_power_w(self) -> dict[int, float]:
        """Measured power (W) of each stage while blocked between instructions (replicas summed).

        A blocked GPU draws no more than a computing one: when the gaps are too short for the energy
        counter's millijoule resolution, the figure is capped at the stage's lowest computing power.
        """
        return {} if self._sweep is None else self._sweep.blocking_power_w()

    def report(self) -> dict[str, Any]:
        """Plain data: phase, the profile, blocking power, the plan and its predicted time and energy
        against all maximum clocks (labelled `simulated` when the GPUs are)."""
        out: dict[str, Any] = {
            "phase": self.phase,
            "simulated": self.monitor.simulated,
            "stage": self.stage,
            "may_lock_clocks": self.may_set,
            "profile": [r.__dict__ for r in self.profile_rows()],
            "blocking_power_w": self.blocking_power_w(),
            "profiling_steps": self.profiling_steps,
        }
        if self.job_metadata is not None:
            out["job_metadata"] = self.job_metadata
        if isinstance(self._phase, (_Inactive, _Fallback)):
            out["reason"] = self._phase.reason
        if self._plan is not None:
            out.update({k: v for k, v in self._plan.items() if k != "stage_plans"})
            out["plan_applied"] = isinstance(self._phase, _Applying)
        return out

    def _record_iteration(self, time_s: float, energy_j: float) -> None:
        """The last iteration's time, and the mean energy of the recent iterations spanning ~2 s."""
        recent = self._recent_steps
        recent.append((time_s, energy_j))
        while len(recent) > 1 and sum(t for t, _ in recent) - recent[0][0] >= _ITERATION_WINDOW_S:
            recent.popleft()
        self.iteration_time_s = time_s
        self.iteration_energy_j = sum(e for _, e in recent) / len(recent)

    # -- hooks ----------------------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Mark the beginning of a training step (one iteration of the pipeline schedule)."""
        if self._closed:
            return
        if not self._started:
            self._start()
        self._recorder.read_power = isinstance(self._phase, _Profiling)
        self._recorder.begin_step()

    def on_instruction_begin(self, name: str, *, virtual_stage: int | None = None) -> None:
        """Mark the beginning of an instruction: `"forward"` or `"backward"` of one microbatch (or the
        `"backward_input"`/`"backward_weight"` halves of a split backward); with several model chunks per
        rank (interleaved schedules), `virtual_stage` is the chunk's stage index in the model."""
        kind, part = instruction_kind(name)
        if not self._recorder.in_step:
            self._warn_unstarted()
            return
        index = self._recorder.begin_instruction(kind, part, virtual_stage)
        if index is not None and isinstance(self._phase, _Applying):
            self._check_instruction(self._phase, index, self._recorder.records[index].trace_key)

    def on_instruction_end(self, name: str, *, virtual_stage: int | None = None) -> None:
        """Mark the end of an instruction begun with `on_instruction_begin(name, virtual_stage=...)`."""
        _, part = instruction_kind(name)
        if not self._recorder.in_step or not self._recorder.end_instruction(part):
            return
        phase = self._phase
        if isinstance(phase, _Applying) and part != "input":
            # Set the next instruction's clock while this stage communicates.
            self._request(phase.clock(len(self._recorder.records) % len(phase.kinds)))

    def on_step_end(self) -> None:
        """Mark the end of a training step."""
        if not self._recorder.in_step:
            return
        m = self._recorder.end_step()
        if m is not None:
            self._record_iteration(m.time, m.total_energy)
        if self._controller is not None and self._controller.error is not None and self._failed is None:
            self._failed = str(self._controller.error)
        phase = self._phase
        if isinstance(phase, _Waiting):
            phase.steps_left -= 1
            if phase.steps_left <= 0:
                self._begin_profiling()
        elif isinstance(phase, _Profiling):
            self._profiled_step(phase)
        elif isinstance(phase, _Applying):
            self._applied_step(phase)
        self.monitor.gpus.step_boundary(self.monitor.gpu_indices)

    def on_train_end(self) -> None:
        """Stop changing clocks and restore the GPU's settings as they were before training."""
        self.close()

    def close(self) -> None:
        """Stop the background thread, close open windows and reset the clocks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._controller is not None:
            self._controller.close()
        self._recorder.close()
        guard().restore()
        if self._controller is not None:
            self._controller.forget()
        dist.remove_termination_handler(self._on_signal)
        atexit.unregister(self.close)

    # -- waiting -> profiling ---------------------------------------------------------------------
    def _start(self) -> None:
        """At the first step: agree with every rank on the stages and their clocks, read the profile."""
        self._started = True
        if self.stage is None:
            self.stage = self._group.rank()
        sweep, may_set = self._own_sweep()
        infos = self._group.all_gather(
            {"stage": self.stage, "sweep": sweep, "may_set": may_set, "bad": self._check_clock_range()}
        )
        bad = next((i["bad"] for i in infos if i["bad"]), None)
        if bad is not None:  # raised on every rank, so that none waits for the others at a collective
            raise ValueError(bad)
        clocks = stage_clocks((i["stage"], i["sweep"]) for i in infos)
        if self.pp_degree is not None and self.pp_degree != len(clocks):
            raise ValueError(
                f"`PipelineFrequencyOptimizer(pp_degree={self.pp_degree})`: the ranks report {len(clocks)} stages."
            )
        self.may_set = all(i["may_set"] and i["sweep"] for i in infos)
        if not all(i["sweep"] for i in infos):
            self._why_not_set = "SM clocks cannot be locked: a rank's GPU or driver does not support it"
        elif not self.may_set:
            self._why_not_set = "no permission to lock SM clocks (needs root or CAP_SYS_ADMIN on every rank)"
        overlap = job_gpu_overlap([self.gpu])  # before any change, on every rank
        if overlap is not None:
            logger.warning("PipelineFrequencyOptimizer: %s", overlap)
            self.may_set, self._why_not_set = False, "ranks share a GPU"
        self._replay = self._read_profile_everywhere()
        if self._replay is not None:
            logger.info("PipelineFrequencyOptimizer: planning from the profile %s.", self.profile_path)
        self._sweep = ClockSweep(self._clocks_to_profile(clocks), self.patience)
        self._controller = FrequencyController(self.gpu)
        dist.on_termination(self._on_signal)
        atexit.register(self.close)
        if self.wait_steps == 0:
            self._begin_profiling()

    def _read_profile_everywhere(self) -> list[ProfileRow] | None:
        """The rows of `profile_path` if it exists (read by the group's first rank, sent to every rank); a
        bad file raises on every rank, so that none waits for the others at a collective."""
        read: tuple[list[ProfileRow] | None, str | None] = (None, None)
        if self.profile_path is not None and self.profile_path.exists() and self._group.rank() == 0:
            try:
                read = (read_profile(self.profile_path), None)
            except (OSError, ValueError) as e:
                read = (None, f"`PipelineFrequencyOptimizer(profile_path={str(self.profile_path)!r})`: {e}")
        rows, error = self._group.broadcast(read)
        if error is not None:
            raise InvalidInputError(error + " Fix or remove the file (it is written again after profiling).")
        return rows

    def _check_clock_range(self) -> str | None:
        """Why `min_frequency_mhz` does not fit this rank's GPU (above its highest SM clock), or None."""
        if self.min_frequency_mhz is None:
            return None
        try:
            supported = self.gpu.supported_sm_clocks_mhz()
        except GPUError:
            return None  # reported by `_own_sweep`
        if not supported or self.min_frequency_mhz <= max(supported):
            return None
        return str(
            _bad(
                "min_frequency_mhz",
                self.min_frequency_mhz,
                f"above the highest SM clock, {max(supported)} MHz, of {self.gpu.label}; pass a clock in "
                f"{min(supported)}..{max(supported)} MHz, or None (its lowest)",
            )
        )

    def _own_sweep(self) -> tuple[list[int], bool]:
        """The clocks this rank's GPU would profile, and whether it may lock them."""
        may_set = self.gpu.may_change_settings()
        try:
            supported = self.gpu.supported_sm_clocks_mhz()
        except GPUError as e:
            logger.warning("PipelineFrequencyOptimizer: cannot read %s's SM clocks: %s", self.gpu.label, e)
            return [], False
        if not supported:
            logger.warning(
                "PipelineFrequencyOptimizer: %s lists no supported SM clocks (NVML answered an empty list of "
                "memory or SM clocks), so clock locking is not supported on it.",
                self.gpu.label,
            )
            return [], False
        return clock_sweep(supported, self.frequency_stride_mhz, self.min_frequency_mhz), may_set

    def _clocks_to_profile(self, clocks: dict[int, list[int]]) -> dict[int, list[int]]:
        """Each stage's sweep: in full, only its maximum (replaying a profile), or the clock in force."""
        if not self.may_set:
            logger.warning(
                "PipelineFrequencyOptimizer: %s, so no per-clock profile can be taken and no plan applied. "
                "Time and energy are still measured at the current clock%s.",
                self._why_not_set,
                "; the plan from profile_path is reported, not applied" if self._replay else "",
            )
            return dict.fromkeys(clocks, [_UNLOCKED])
        if self._replay is not None:
            clocks = {s: c[:1] for s, c in clocks.items()}
        if any(not c for c in clocks.values()):
            raise ValueError("PipelineFrequencyOptimizer: the replicas of a stage share no SM clock.")
        return clocks

    def _default_power_limit(self) -> None:
        """Put the GPU's power limit at its default before profiling clocks, as Zeus does: a low limit left
        by someone else would cap every clock and make the profile wrong (journaled, restored at the end)."""
        try:
            default = self.gpu.default_power_limit_mw()
            if self.gpu.power_limit_mw() != default:
                logger.info(
                    "PipelineFrequencyOptimizer: %s's power limit set to its default %g W for the clock profile.",
                    self.gpu.label,
                    default / 1000,
                )
                self.gpu.set_power_limit_mw(default)
        except GPUError as e:
            logger.warning("PipelineFrequencyOptimizer: the power limit stays as it is (%s).", e)

    def _begin_profiling(self) -> None:
        assert self._sweep is not None and self.stage is not None
        if self.may_set:
            self._default_power_limit()
        clock = self._sweep.clock(self.stage)
        self._set_clock(clock)
        self._phase = _Profiling(clock, self.warmup_steps)
        if clock != _UNLOCKED:
            logger.info("Profiling stage %d at %d MHz.", self.stage, clock)

    # -- profiling -> profiling | applying | inactive -----------------------------------------------
    def _profiled_step(self, phase: _Profiling) -> None:
        self.profiling_steps += 1
        if phase.warmup_left > 0:
            phase.warmup_left -= 1
            return
        phase.measurements.add_step(self._recorder)
        phase.steps_done += 1
        if phase.steps_done >= self.profile_steps:
            self._finish_clock(phase)

    def _finish_clock(self, phase: _Profiling) -> None:
        """Share this clock's measurements with every rank; go on to the next clock, or plan."""
        assert self._sweep is not None and self.stage is not None
        sequence = self._recorder.sequence
        sample = (
            None
            if self._sweep.done(self.stage)
            else phase.measurements.sample(self.stage, phase.frequency_mhz, sequence)
        )
        gathered = self._group.all_gather(
            {
                "sample": sample,
                "stage": self.stage,
                "sequence": sequence,
                "failed": self._failed,
                "timelines": phase.measurements.timelines,
            }
        )
        failures = [g["failed"] for g in gathered if g["failed"]]
        if failures:
            self._deactivate(f"a GPU failed during profiling ({failures[0]})")
            return
        try:
            timelines: dict[int, Any] = {}
            for g in gathered:  # one replica of each stage: the first rank that runs it
                timelines.setdefault(g["stage"], g["timelines"])
            self._sweep.add(
                (g["sample"] for g in gathered if g["sample"] is not None),
                {g["stage"]: g["sequence"] for g in gathered},
                timelines,
            )
        except ValueError as e:
            self._deactivate(str(e))
            return
        if self._sweep.finished:
            self._make_plan()
            return
        clock = self._sweep.clock(self.stage)
        if clock != phase.frequency_mhz:
            self._set_clock(clock)
        # Every rank runs the same number of steps per clock, so that the next gather is reached together.
        self._phase = _Profiling(clock, self.warmup_steps)

    def _make_plan(self) -> None:
        """Plan on the group's first rank (and write the profile there); every rank takes its stage's part."""
        result: dict[str, Any] | None = None
        if self._group.rank() == 0:
            result = self._solve()
            self._save_profile(result)
        result = self._group.broadcast(result)
        assert result is not None and self.stage is not None
        self._plan = dict(result)
        if "error" in result:
            # Without permission the reason was already said once, at the first step.
            self._deactivate(result["error"], already_said=not self.may_set and self._replay is None)
            return
        if not self.may_set:
            self._phase = _Inactive(
                f"{self._why_not_set}: the plan from profile_path is predicted, not applied"
            )
            return
        steps = result["stage_plans"][self.stage]
        self._phase = _Applying([k for k, _ in steps], [f for _, f in steps])
        self._request(steps[0][1])
        pred = result["predicted"]
        logger.info(
            "Pipeline frequency plan applied: predicted iteration %.4g s -> %.4g s, energy %.4g J -> %.4g J%s.",
            pred["max_clock_iteration_time_s"],
            pred["iteration_time_s"],
            pred["max_clock_energy_j"],
            pred["energy_j"],
            " (SIMULATED GPUs)" if self.monitor.simulated else "",
        )

    def _solve(self) -> dict[str, Any]:
        """The plan, or `{"error": why}` when there is none (plain data, to broadcast)."""
        assert self._sweep is not None
        if self._replay is None and not self.may_set:
            return {
                "error": f"{self._why_not_set}, so no per-clock profile can be taken; "
                "measurements at the current clock are in report()['profile']"
            }
        rows = self._replay if self._replay is not None else self._sweep.profile_rows()
        try:
            return plan_pipeline(
                self._sweep.sequences,
                rows,
                self._sweep.blocking_power_w(),
                self.schedule,
                self.target_time_s,
                self.slack_margin,
                self._order,
                timelines=self._sweep.timelines,
                fit_times=self._replay is None,  # its own sweep: times read off one curve per type
            )
        except ValueError as e:
            return {"error": f"no plan: {e}"}

    def _save_profile(self, plan: dict[str, Any]) -> None:
        if self.profile_path is None or self._replay is not None or not self.may_set:
            return
        try:
            write_profile(self.profile_path, self.profile_rows())
            if "edge_delays" in plan:
                write_edge_delays(edge_delays_path(self.profile_path), plan["edge_delays"])
        except OSError as e:
            logger.warning("PipelineFrequencyOptimizer: cannot write %s: %s", self.profile_path, e)

    # -- applying -> fallback -------------------------------------------------------------------------
    def _check_instruction(self, phase: _Applying, index: int, key: str | tuple[str, int]) -> None:
        """The `index`-th instruction of the step begins: at its planned clock, or off the plan."""
        if index < len(phase.kinds) and phase.kinds[index] == key:
            self._request(phase.clock(index))
            return
        expected = (
            f"a {_said(phase.kinds[index])}" if index < len(phase.kinds) else f"only {len(phase.kinds)}"
        )
        self._fall_back(f"instruction {index} of the step is a {_said(key)}, but the plan expects {expected}")

    def _applied_step(self, phase: _Applying) -> None:
        ran = len(self._recorder.records)
        if ran != len(phase.kinds):
            self._fall_back(f"the step ran {ran} instructions; the plan has {len(phase.kinds)}")
        elif self._failed is not None:
            self._fall_back(self._failed)

    def _fall_back(self, reason: str) -> None:
        assert self._sweep is not None and self.stage is not None
        logger.warning(
            "PipelineFrequencyOptimizer (stage %s): %s; running at the maximum clock from now on.",
            self.stage,
            reason,
        )
        self._phase = _Fallback(reason)
        self._request(self._sweep.max_clock(self.stage))

    def _deactivate(self, reason: str, already_said: bool = False) -> None:
        logger.log(
            logging.INFO if already_said else logging.WARNING,
            "PipelineFrequencyOptimizer: %s. Restoring the GPU's clocks and training on.",
            reason.rstrip("."),
        )
        self._phase = _Inactive(reason)
        if self._controller is not None:
            self._controller.close()
        guard().restore()
        if self._controller is not None:
            self._controller.forget()

    # -- clocks and errors ------------------------------------------------------------------------------
    def _set_clock(self, mhz: int) -> None:
        if mhz == _UNLOCKED or self._controller is None or self._failed is not None:
            return
        try:
            self._controller.set_now(mhz)
        except GPUError as e:
            logger.warning("PipelineFrequencyOptimizer: %s", e)
            self._failed = str(e)

    def _request(self, mhz: int) -> None:
        if self._controller is not None:
            self._controller.request(mhz)

    def _gpu_failed(self, error: GPUError) -> None:
        """A monitor call failed: remembered (and shared at the next collective), not raised."""
        if self._failed is None:
            logger.warning("PipelineFrequencyOptimizer: %s", error)
            self._failed = str(error)

    def _warn_unstarted(self) -> None:
        if not self._warned_unstarted:
            self._warned_unstarted = True
            logger.warning(
                "PipelineFrequencyOptimizer: on_instruction_begin outside a step; call on_step_begin() first "
                "(instructions outside steps are ignored)."
            )

    def _on_signal(self, signum: int) -> None:
        # Stop the worker thread before restoring, so that no clock is locked again after the restore
        # (the guard's own handler may run before or after this one; restoring twice is harmless).
        if self._controller is not None:
            self._controller.close()
        guard().restore()
