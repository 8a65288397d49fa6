"""PipelineFrequencyOptimizer: profile pipeline instructions per SM clock, plan (Perseus), lock the clocks."""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.clock_sweep import (
    ProfileRow,
    StageSample,
    clock_sweep,
    instruction_kind,
    load_profile_csv,
    match_schedule,
    merge_replicas,
    options_from_rows,
    passed_valley,
    save_profile_csv,
    undisturbed_estimate,
)
from zeus_callbacks.core.pipeline_frequency.controller import FrequencyController
from zeus_callbacks.core.pipeline_frequency.dag import SCHEDULES, build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.frontier import (
    FrequencyOption,
    evaluate,
    max_frequency_plan,
    solve,
)

__all__ = ["PipelineFrequencyOptimizer"]


def _with_margin(
    options: dict[tuple[int, str], list[FrequencyOption]], margin: float, p_blk_w: list[float]
) -> dict[tuple[int, str], list[FrequencyOption]]:
    """Every option but the fastest of its type taken `margin` longer, for planning only. The added time is
    charged at the stage's blocking power, so an option's effective energy (`e - P_blk * t`) is unchanged."""
    if margin == 0:
        return options
    out = {}
    for (stage, kind), opts in options.items():
        top = max(o.frequency_mhz for o in opts)
        out[stage, kind] = [
            o
            if o.frequency_mhz == top
            else FrequencyOption(
                o.frequency_mhz, o.time_s * (1 + margin), o.energy_j + p_blk_w[stage] * o.time_s * margin
            )
            for o in opts
        ]
    return out


logger = logging.getLogger(__name__)

_STEP = "__PipelineFrequencyOptimizer_step"
_INSTRUCTION = "__PipelineFrequencyOptimizer_instruction"
_BLOCKED = "__PipelineFrequencyOptimizer_blocked"
_UNLOCKED = 0  # "frequency" of measurements taken at the clock the GPU chose itself


@dataclass
class _Waiting:
    steps_left: int


@dataclass
class _Profiling:
    frequency_mhz: int  # this rank's clock (its stage's sweep clock, or its maximum once the stage is done)
    warmup_left: int
    steps_done: int = 0


@dataclass
class _Applying:
    kinds: list[str]
    frequencies_mhz: list[int]


@dataclass
class _Fallback:
    reason: str


@dataclass
class _Inactive:
    reason: str


_Phase = _Waiting | _Profiling | _Applying | _Fallback | _Inactive


@dataclass
class _Accumulator:
    """The instructions measured over the profiled steps at one clock, and the blocked time and energy.

    Each instruction type is summarised by a low quantile of its instances' times and of their energies
    (`undisturbed_estimate`): a host that preempts the job (or simulated GPUs sharing CPU cores) only
    adds time, to many instances when it is busy, and a lower clock must not look free or dear because
    the host happened to be busier at another clock. With 4 simulated ranks on 2 cores, the medians of
    stage 0's forward from 1740 MHz down in 45 MHz steps were 1.00, 1.07, 0.96, 1.13, 0.98, 1.29 of the
    first; the 10% quantiles 1.00, 1.06, 1.09, 1.11, 1.13, 1.17, as the clocks predict.
    """

    kinds: dict[str, tuple[list[float], list[float]]] = field(
        default_factory=dict
    )  # kind -> (times, energies)
    blocked_time_s: float = 0.0
    blocked_energy_j: float = 0.0

    def add(self, kind: str, time_s: float, energy_j: float) -> None:
        times, energies = self.kinds.setdefault(kind, ([], []))
        times.append(time_s)
        energies.append(energy_j)

    def sample(self, stage: int, frequency_mhz: int, sequence: tuple[str, ...]) -> StageSample:
        kinds = {
            k: (undisturbed_estimate(t), undisturbed_estimate(e), len(t))
            for k, (t, e) in self.kinds.items()
            if t
        }
        return StageSample(stage, frequency_mhz, kinds, self.blocked_time_s, self.blocked_energy_j, sequence)


class PipelineFrequencyOptimizer:
    """Slow down the pipeline instructions that are off the critical path (Perseus, SOSP'24; Zeus's
    `PipelineFrequencyOptimizer`, without its server: ranks coordinate over torch.distributed).

    Life of a job, every rank in step:

    1. `wait_steps` steps pass unchanged (the first step of a pipeline schedule sets it up).
    2. Profiling: every stage locks its GPU's SM clock to each clock of a sweep from the highest down
       (supported clocks `frequency_stride_mhz` apart), drops `warmup_steps` steps, then measures the time
       and energy of each forward and backward over `profile_steps` steps (synchronising the GPU at every
       instruction boundary), and the power while blocked between instructions. A stage stops once its
       last `patience` clocks saved no effective energy; the sweep ends when every stage stopped.
       Replicas of a stage (same `pp_rank`) are merged: time is the slowest replica's, energy the sum.
    3. Planning: the measurements are gathered on the group's first rank, which finds the schedule (1F1B
       or GPipe) that ran, builds its DAG and picks the least-energy clock of every instruction whose
       iteration time does not exceed the all-maximum-clock one (or `target_time_s`); every rank gets its
       stage's clocks.
    4. Applying: each instruction runs at its planned clock, set by a background thread during the
       communication before it (requests for the clock already in force are skipped). If the order of
       instructions differs from the plan (e.g. a new number of microbatches), the stage warns and goes
       back to its maximum clock.

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
        schedule: `"1f1b"` or `"gpipe"`; default: whichever matches the instructions observed.
        wait_steps: Steps before profiling starts (>= 1 drops a schedule's set-up step).
        warmup_steps: Steps dropped after each clock change.
        profile_steps: Steps measured at each clock.
        frequency_stride_mhz: Minimum gap between profiled clocks.
        min_frequency_mhz: Lowest clock to profile (default: the lowest supported).
        patience: Clocks without an effective-energy gain before a stage stops its sweep.
        target_time_s: Iteration-time target (e.g. a straggler's time); default: the all-max-clock time.
        slack_margin: Planning margin: a lowered clock is planned as if it took this fraction longer than
            profiled, so only instructions with slack to spare are slowed (the DAG has no communication
            time, and a peer waiting on a slowed instruction also waits for its send). Predictions use the
            profiled times.
        profile_path: CSV `stage,instruction,frequency,time,energy`: if it exists, plan from it instead of
            sweeping; otherwise written (by the first rank) once profiling is done.
        process_group: The torch.distributed group of the pipeline's ranks (default: the whole job).

    Raises:
        ValueError: a bad argument; the message names it.

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
        slack_margin: float = 0.1,
    ) -> None:
        def bad(name: str, value: Any, want: str) -> ValueError:
            return ValueError(f"`PipelineFrequencyOptimizer({name}={value!r})`: {want}.")

        if schedule is not None and schedule not in SCHEDULES:
            raise bad("schedule", schedule, f"must be one of {SCHEDULES} or None (detected)")
        for name, value, low in (
            ("wait_steps", wait_steps, 0),
            ("warmup_steps", warmup_steps, 0),
            ("profile_steps", profile_steps, 1),
            ("frequency_stride_mhz", frequency_stride_mhz, 1),
            ("patience", patience, 1),
        ):
            if int(value) != value or value < low:
                raise bad(name, value, f"must be an integer >= {low}")
        if target_time_s is not None and not target_time_s > 0:
            raise bad("target_time_s", target_time_s, "must be a positive number of seconds")
        if rank is not None and dist.is_distributed() and rank != dist.rank():
            raise bad("rank", rank, f"this process is rank {dist.rank()} of torch.distributed")
        if world_size is not None and dist.is_distributed() and world_size != dist.world_size():
            raise bad("world_size", world_size, f"torch.distributed has {dist.world_size()} ranks")
        if pp_rank is None and (dp_degree > 1 or tp_degree > 1):
            raise bad(
                "pp_rank", pp_rank, "is required with data or tensor parallelism (the stage of this rank)"
            )
        if monitor is None:
            if device_id is None:
                device_id = dist.local_rank()
            monitor = ZeusMonitor(gpu_indices=[device_id])
        elif len(monitor.gpu_indices) != 1 or (device_id is not None and monitor.gpu_indices != [device_id]):
            raise bad(
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
        self.wait_steps = int(wait_steps)
        self.warmup_steps = int(warmup_steps)
        self.profile_steps = int(profile_steps)
        self.frequency_stride_mhz = int(frequency_stride_mhz)
        self.min_frequency_mhz = min_frequency_mhz
        self.patience = int(patience)
        self.target_time_s = target_time_s
        if not 0.0 <= slack_margin < 1.0:
            raise bad("slack_margin", slack_margin, "must be in [0, 1)")
        self.slack_margin = slack_margin
        self.profile_path = Path(profile_path) if profile_path is not None else None
        self._group = dist.Group(process_group)
        self._pp_rank = pp_rank
        self.stage: int | None = pp_rank
        self._phase: _Phase = _Waiting(self.wait_steps)
        self._started = False
        self._closed = False
        self._controller: FrequencyController | None = None
        self.may_set = True
        self._replay: list[ProfileRow] | None = None
        # per-step recording
        self._in_step = False
        self._records: list[list[Any]] = []  # [kind, time s, energy J] per instruction of the step
        self._last_part: str | None = None
        self._in_instruction = False
        self._step_blocked = [0.0, 0.0]
        self._acc = _Accumulator()
        self._sequence: tuple[str, ...] = ()
        self._warned_unstarted = False
        # sweep state, identical on every rank
        self._stage_clocks: dict[int, list[int]] = {}
        self._stage_position: dict[int, int] = {}
        self._stage_done: dict[int, bool] = {}
        self._points: dict[int, dict[str, list[tuple[int, float, float]]]] = {}
        self._blocked: dict[int, list[float]] = {}  # stage -> [time s, energy J] over the sweep
        self._sequences: dict[int, tuple[str, ...]] = {}
        self._plan: dict[str, Any] | None = None
        self._failed: str | None = None
        # metrics
        self.iteration_time_s: float | None = None
        self.iteration_energy_j: float | None = None
        self.profiling_steps = 0

    # -- public state ---------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """`waiting`, `profiling`, `applying`, `fallback` or `inactive`."""
        return type(self._phase).__name__.lstrip("_").lower()

    @property
    def frequency_mhz(self) -> int | None:
        """The SM clock this optimizer last locked (None: not locked)."""
        return None if self._controller is None else self._controller.frequency_mhz

    @property
    def plan_frequencies_mhz(self) -> list[int] | None:
        """This stage's planned clock of each instruction, in execution order (None before planning)."""
        return list(self._phase.frequencies_mhz) if isinstance(self._phase, _Applying) else None

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
        return [
            ProfileRow(stage, kind, f, t, e)
            for stage, kinds in sorted(self._points.items())
            for kind, pts in sorted(kinds.items())
            for f, t, e in pts
        ]

    def blocking_power_w(self) -> dict[int, float]:
        """Measured power (W) of each stage while blocked between instructions (replicas summed).

        A blocked GPU draws no more than a computing one: when the gaps are too short for the energy
        counter's millijoule resolution, the figure is capped at the stage's lowest computing power.
        """
        out = {}
        for s, (t, e) in sorted(self._blocked.items()):
            computing = [pe / pt for pts in self._points.get(s, {}).values() for _, pt, pe in pts if pt > 0]
            out[s] = min([e / t if t > 0 else 0.0, *computing])
        return out

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

    # -- hooks ----------------------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Mark the beginning of a training step (one iteration of the pipeline schedule)."""
        if self._closed:
            return
        if not self._started:
            self._start()
        self._records = []
        self._step_blocked = [0.0, 0.0]
        self._last_part = None
        self._close_window(_BLOCKED)
        self._close_window(_STEP)
        self._guarded(lambda: self.monitor.begin_window(_STEP))
        self._in_step = True

    def on_instruction_begin(self, name: str) -> None:
        """Mark the beginning of an instruction: `"forward"` or `"backward"` of one microbatch (or the
        `"backward_input"`/`"backward_weight"` halves of a split backward)."""
        kind, part = instruction_kind(name)
        if not self._in_step:
            self._warn_unstarted()
            return
        continuing = part == "weight" and self._last_part == "input"
        if _BLOCKED in self.monitor.open_windows:
            m = self._guarded(lambda: self.monitor.end_window(_BLOCKED))
            if m is not None:
                self._step_blocked[0] += m.time
                self._step_blocked[1] += m.total_energy
        if not continuing:
            self._records.append([kind, 0.0, 0.0])
            phase = self._phase
            if isinstance(phase, _Applying):
                index = len(self._records) - 1
                if index >= len(phase.kinds) or phase.kinds[index] != kind:
                    self._fall_back(
                        f"instruction {index} of the step is a {kind}, but the plan expects "
                        + (
                            f"a {phase.kinds[index]}"
                            if index < len(phase.kinds)
                            else f"only {len(phase.kinds)}"
                        )
                    )
                else:
                    self._request(phase.frequencies_mhz[index])
        self._guarded(lambda: self.monitor.begin_window(_INSTRUCTION))
        self._in_instruction = True

    def on_instruction_end(self, name: str) -> None:
        """Mark the end of an instruction begun with `on_instruction_begin(name)`."""
        kind, part = instruction_kind(name)
        if not self._in_step or not self._in_instruction:
            return
        self._in_instruction = False
        m = self._guarded(lambda: self.monitor.end_window(_INSTRUCTION))
        if m is not None and self._records:
            self._records[-1][1] += m.time
            self._records[-1][2] += m.total_energy
        self._last_part = part
        phase = self._phase
        if isinstance(phase, _Applying) and part != "input":
            # Set the next instruction's clock while this stage communicates.
            nxt = len(self._records) % len(phase.kinds)
            self._request(phase.frequencies_mhz[nxt])
        self._guarded(lambda: self.monitor.begin_window(_BLOCKED, sync_execution=False))

    def on_step_end(self) -> None:
        """Mark the end of a training step."""
        if not self._in_step:
            return
        self._in_step = False
        self._close_window(_BLOCKED)
        self._close_window(_INSTRUCTION)
        m = self._guarded(lambda: self.monitor.end_window(_STEP))
        if m is not None:
            self.iteration_time_s, self.iteration_energy_j = m.time, m.total_energy
        self._sequence = tuple(r[0] for r in self._records)
        phase = self._phase
        if self._controller is not None and self._controller.error is not None and self._failed is None:
            self._failed = str(self._controller.error)
        if isinstance(phase, _Waiting):
            phase.steps_left -= 1
            if phase.steps_left <= 0:
                self._begin_profiling()
        elif isinstance(phase, _Profiling):
            self.profiling_steps += 1
            if phase.warmup_left > 0:
                phase.warmup_left -= 1
            else:
                for kind, t, e in self._records:
                    self._acc.add(kind, t, e)
                self._acc.blocked_time_s += self._step_blocked[0]
                self._acc.blocked_energy_j += self._step_blocked[1]
                phase.steps_done += 1
                if phase.steps_done >= self.profile_steps:
                    self._finish_clock(phase)
        elif isinstance(phase, _Applying):
            if len(self._records) != len(phase.kinds):
                self._fall_back(
                    f"the step ran {len(self._records)} instructions; the plan has {len(phase.kinds)}"
                )
            elif self._failed is not None:
                self._fall_back(self._failed)
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
        for key in (_BLOCKED, _INSTRUCTION, _STEP):
            if key in self.monitor.open_windows:
                self.monitor.end_window(key, sync_execution=False, cancel=True)
        guard().restore()
        if self._controller is not None:
            self._controller.forget()
        dist.remove_termination_handler(self._on_signal)
        atexit.unregister(self.close)

    # -- start and profiling ----------------------------------------------------------------------
    def _start(self) -> None:
        self._started = True
        if self.stage is None:
            self.stage = self._group.rank()
        may_set = self.gpu.may_change_settings()
        try:
            supported = self.gpu.supported_sm_clocks_mhz()
        except GPUError as e:
            supported, may_set = [], False
            logger.warning("PipelineFrequencyOptimizer: cannot read %s's SM clocks: %s", self.gpu.label, e)
        sweep = clock_sweep(supported, self.frequency_stride_mhz, self.min_frequency_mhz) if supported else []
        infos = self._group.all_gather({"stage": self.stage, "sweep": sweep, "may_set": may_set})
        stages = sorted({i["stage"] for i in infos})
        if stages != list(range(len(stages))):
            raise ValueError(
                f"PipelineFrequencyOptimizer: pipeline stages {stages} are not numbered 0..{len(stages) - 1}."
            )
        if self.pp_degree is not None and self.pp_degree != len(stages):
            raise ValueError(
                f"`PipelineFrequencyOptimizer(pp_degree={self.pp_degree})`: the ranks report {len(stages)} stages."
            )
        self.may_set = all(i["may_set"] and i["sweep"] for i in infos)
        for s in stages:
            common = set.intersection(*(set(i["sweep"]) for i in infos if i["stage"] == s))
            self._stage_clocks[s] = sorted(common, reverse=True)
        if self.profile_path is not None and self.profile_path.exists() and self._group.rank() == 0:
            self._replay = load_profile_csv(self.profile_path)
        self._replay = self._group.broadcast(self._replay)
        if self._replay is not None:
            logger.info("PipelineFrequencyOptimizer: planning from the profile %s.", self.profile_path)
        if not self.may_set:
            logger.warning(
                "PipelineFrequencyOptimizer: this job may not lock GPU clocks (needs root or CAP_SYS_ADMIN on "
                "every rank), so no per-clock profile can be taken and no plan applied. Time and energy are "
                "still measured at the current clock%s.",
                "; the plan from profile_path is reported, not applied" if self._replay else "",
            )
            self._stage_clocks = dict.fromkeys(stages, [_UNLOCKED])
        elif self._replay is not None:
            self._stage_clocks = {s: c[:1] for s, c in self._stage_clocks.items()}
        if any(not c for c in self._stage_clocks.values()):
            raise ValueError("PipelineFrequencyOptimizer: the replicas of a stage share no SM clock.")
        self._stage_position = dict.fromkeys(stages, 0)
        self._stage_done = dict.fromkeys(stages, False)
        self._controller = FrequencyController(self.gpu)
        dist.on_termination(self._on_signal)
        atexit.register(self.close)
        if self.wait_steps == 0:
            self._begin_profiling()

    def _max_clock(self) -> int:
        return self._stage_clocks[self.stage][0]

    def _begin_profiling(self) -> None:
        clock = self._stage_clocks[self.stage][self._stage_position[self.stage]]
        self._set_clock(clock)
        self._acc = _Accumulator()
        self._phase = _Profiling(clock, self.warmup_steps)
        if clock != _UNLOCKED:
            logger.info("Profiling stage %d at %d MHz.", self.stage, clock)

    def _set_clock(self, mhz: int) -> None:
        if mhz == _UNLOCKED or self._controller is None or self._failed is not None:
            return
        try:
            self._controller.set_now(mhz)
        except GPUError as e:
            logger.warning("PipelineFrequencyOptimizer: %s", e)
            self._failed = str(e)

    def _finish_clock(self, phase: _Profiling) -> None:
        done = self._stage_done[self.stage]
        sample = None if done else self._acc.sample(self.stage, phase.frequency_mhz, self._sequence)
        gathered = self._group.all_gather(
            {"sample": sample, "stage": self.stage, "sequence": self._sequence, "failed": self._failed}
        )
        failures = [g["failed"] for g in gathered if g["failed"]]
        if failures:
            self._deactivate(f"a GPU failed during profiling ({failures[0]})")
            return
        for g in gathered:
            self._sequences[g["stage"]] = g["sequence"]
        try:
            merged = merge_replicas(g["sample"] for g in gathered if g["sample"] is not None)
        except ValueError as e:
            self._deactivate(str(e))
            return
        for stage, s in merged.items():
            kinds = self._points.setdefault(stage, {})
            for kind, (t, e, _) in s.kinds.items():
                kinds.setdefault(kind, []).append((s.frequency_mhz, t, e))
            blocked = self._blocked.setdefault(stage, [0.0, 0.0])
            blocked[0] += s.blocked_time_s
            blocked[1] += s.blocked_energy_j
            self._stage_position[stage] += 1
            p_blk = self.blocking_power_w().get(stage, 0.0)
            valley = bool(kinds) and all(
                passed_valley([(t, e) for _, t, e in pts], p_blk, self.patience) for pts in kinds.values()
            )
            if valley or self._stage_position[stage] >= len(self._stage_clocks[stage]):
                self._stage_done[stage] = True
                logger.info("Stage %d: sweep done after %d clocks.", stage, self._stage_position[stage])
        if all(self._stage_done.values()):
            self._make_plan()
            return
        if self._stage_done[self.stage]:
            clock = self._max_clock()
        else:
            clock = self._stage_clocks[self.stage][self._stage_position[self.stage]]
        if clock != phase.frequency_mhz:
            self._set_clock(clock)
        self._acc = _Accumulator()
        # Every rank runs the same number of steps per clock, so that the next gather is reached together.
        self._phase = _Profiling(clock, self.warmup_steps)

    # -- planning and applying ----------------------------------------------------------------------
    def _make_plan(self) -> None:
        result: dict[str, Any] | None = None
        if self._group.rank() == 0:
            result = self._solve()
            if self.profile_path is not None and self._replay is None and self.may_set:
                try:
                    save_profile_csv(self.profile_path, self.profile_rows())
                except OSError as e:
                    logger.warning("PipelineFrequencyOptimizer: cannot write %s: %s", self.profile_path, e)
        result = self._group.broadcast(result)
        assert result is not None
        self._plan = {k: v for k, v in result.items()}
        if "error" in result:
            self._deactivate(result["error"])
            return
        steps = result["stage_plans"][self.stage]
        if not self.may_set:
            self._phase = _Inactive(
                "no permission to lock SM clocks: the plan from profile_path is predicted, not applied"
            )
            return
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
        """On the first rank: the plan, or the reason there is none (plain data, to broadcast)."""
        if self._replay is None and not self.may_set:
            return {
                "error": "no permission to lock SM clocks, so no per-clock profile can be taken; "
                "measurements at the current clock are in report()['profile']"
            }
        try:
            schedule_kind, num_microbatches = match_schedule(self._sequences, self.schedule)
            schedule = build_schedule(schedule_kind, len(self._sequences), num_microbatches)
            dag = build_dag(schedule)
            rows = self._replay if self._replay is not None else self.profile_rows()
            options = options_from_rows(rows)
            missing = sorted({(i.stage, i.kind) for i in dag.instructions} - set(options))
            if missing:
                raise ValueError(f"the profile has no measurements of {missing}")
            p_blk_map = self.blocking_power_w()
            p_blk = [p_blk_map.get(s, 0.0) for s in range(dag.num_stages)]
            reference = max_frequency_plan(dag, options, p_blk)
            plan = evaluate(
                dag,
                options,
                p_blk,
                solve(
                    dag, _with_margin(options, self.slack_margin, p_blk), p_blk, self.target_time_s
                ).frequencies_mhz,
            )
        except ValueError as e:
            return {"error": f"no plan: {e}"}
        kinds = [[i.kind for i in order] for order in schedule]
        stage_plans = {
            s: list(zip(kinds[s], freqs, strict=True)) for s, freqs in enumerate(plan.stage_frequencies())
        }
        return {
            "schedule": schedule_kind,
            "num_stages": dag.num_stages,
            "num_microbatches": num_microbatches,
            "stage_plans": stage_plans,
            "plan_frequencies_mhz": {s: [f for _, f in p] for s, p in stage_plans.items()},
            "predicted": {
                "max_clock_iteration_time_s": reference.iteration_time_s,
                "max_clock_energy_j": reference.energy_j,
                "iteration_time_s": plan.iteration_time_s,
                "energy_j": plan.energy_j,
                "energy_saved_pct": 100 * (1 - plan.energy_j / reference.energy_j),
                "time_change_pct": 100 * (plan.iteration_time_s / reference.iteration_time_s - 1),
            },
        }

    def _request(self, mhz: int) -> None:
        if self._controller is not None:
            self._controller.request(mhz)

    def _fall_back(self, reason: str) -> None:
        logger.warning(
            "PipelineFrequencyOptimizer (stage %s): %s; running at the maximum clock from now on.",
            self.stage,
            reason,
        )
        self._phase = _Fallback(reason)
        self._request(self._max_clock())

    def _deactivate(self, reason: str) -> None:
        logger.warning("PipelineFrequencyOptimizer: %s. Restoring the GPU's clocks and training on.", reason)
        self._phase = _Inactive(reason)
        if self._controller is not None:
            self._controller.close()
        guard().restore()
        if self._controller is not None:
            self._controller.forget()

    # -- measurement helpers ------------------------------------------------------------------------
    def _guarded(self, fn: Any) -> Any:
        """Run a monitor call; a GPU error is remembered (and shared at the next collective), not raised."""
        try:
            return fn()
        except GPUError as e:
            if self._failed is None:
                logger.warning("PipelineFrequencyOptimizer: %s", e)
                self._failed = str(e)
            return None

    def _close_window(self, key: str) -> None:
        if key in self.monitor.open_windows:
            self.monitor.end_window(key, sync_execution=False, cancel=True)

    def _warn_unstarted(self) -> None:
        if not self._warned_unstarted:
            self._warned_unstarted = True
            logger.warning(
                "PipelineFrequencyOptimizer: on_instruction_begin outside a step; call on_step_begin() first "
                "(instructions outside steps are ignored)."
            )

    # -- signals ------------------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> None:
        # Stop the worker thread before restoring, so that no clock is locked again after the restore
        # (the guard's own handler may run before or after this one; restoring twice is harmless).
        if self._controller is not None:
            self._controller.close()
        guard().restore()
