"""PipelineFrequencyOptimizer: the phase machine that profiles, plans (Perseus) and applies SM clocks per instruction.

The pieces live beside it: `phases` (its states), `readout` (what it shows), `options` (its checks, and its
options and the job's layout as records), `clock_setup` (each stage's clocks), `stage_clocks` (the clocks this
rank sets, and its first GPU error), `recorder` (instructions measured), `clock_sweep` (the profile, clock by
clock), `profiling` (shared by the ranks, planned from: `planning`), `controller`, `profile_file`.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.callback import Callback
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.clock_setup import (
    agree_on_clocks,
    clocks_to_profile,
    default_power_limit,
)
from zeus_callbacks.core.pipeline_frequency.clock_sweep import ClockSweep
from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_dag
from zeus_callbacks.core.pipeline_frequency.options import (
    JobLayout,
    PipelineOptions,
    check_limits,
    check_options,
    check_ranks,
    rank_monitor,
)
from zeus_callbacks.core.pipeline_frequency.phases import (
    UNLOCKED,
    Applying,
    Fallback,
    Inactive,
    Phase,
    Profiling,
    Waiting,
)
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
from zeus_callbacks.core.pipeline_frequency.profiling import (
    read_profile_everywhere,
    save_profile,
    share_clock,
    solve_plan,
)
from zeus_callbacks.core.pipeline_frequency.readout import RecentIterations, pipeline_metrics, pipeline_report
from zeus_callbacks.core.pipeline_frequency.recorder import InstructionRecorder, instruction_kind
from zeus_callbacks.core.pipeline_frequency.stage_clocks import StageClocks

__all__ = ["PipelineFrequencyOptimizer"]

logger = logging.getLogger(__name__)


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
        check_options(schedule, wait_steps, warmup_steps, profile_steps, frequency_stride_mhz, patience)
        check_limits(min_frequency_mhz, target_time_s, slack_margin)
        check_ranks(rank, world_size, pp_rank, dp_degree, tp_degree)
        monitor = rank_monitor(monitor, device_id)
        if server_url is not None:
            logger.info(
                "PipelineFrequencyOptimizer: server_url is not needed (ranks coordinate over torch.distributed)."
            )
        self.monitor = monitor
        self.gpu = monitor.gpus[monitor.gpu_indices[0]]
        self.job = JobLayout(rank, dp_rank, tp_rank, pp_degree, job_metadata)
        self.options = PipelineOptions(
            wait_steps=int(wait_steps),
            warmup_steps=int(warmup_steps),
            profile_steps=int(profile_steps),
            frequency_stride_mhz=int(frequency_stride_mhz),
            min_frequency_mhz=None if min_frequency_mhz is None else int(min_frequency_mhz),
            patience=int(patience),
            target_time_s=None if target_time_s is None else float(target_time_s),
            slack_margin=float(slack_margin),
            profile_path=Path(profile_path) if profile_path is not None else None,
        )
        self.schedule = schedule
        self._order: tuple[tuple[Instruction, ...], ...] | None = None  # `use_schedule`
        self.stage: int | None = pp_rank
        self._iterations = RecentIterations()  # this rank's last iteration, for `metrics`
        self.profiling_steps = 0

        self._group = dist.Group(process_group)
        self._phase: Phase = Waiting(self.options.wait_steps)
        self._clocks = StageClocks()
        self._recorder = InstructionRecorder(monitor, self._clocks.gpu_failed)
        self._sweep: ClockSweep | None = None  # made at the first step, from every rank's clocks
        self._replay: list[ProfileRow] | None = None  # the profile read from `profile_path`
        self._plan: dict[str, Any] | None = None  # plain data, the same on every rank
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

    def hold_max_clocks(self, hold: bool = True) -> None:
        """While applying a plan, run every instruction at the stage's maximum clock instead (`hold=True`), or
        go back to the plan (`hold=False`): a baseline measured in the same job, with the same
        measurements, to compare the plan against. Call it on every rank between steps; it does nothing
        in other phases."""
        if isinstance(self._phase, Applying) and self._sweep is not None and self.stage is not None:
            self._phase.max_clock_mhz = self._sweep.max_clock(self.stage) if hold else None

    # -- what it shows (`readout`) ----------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """`waiting`, `profiling`, `applying`, `fallback` or `inactive` (see the class docstring)."""
        return self._phase.name

    @property
    def frequency_mhz(self) -> int | None:
        """The SM clock this optimizer last locked (None: not locked)."""
        return self._clocks.frequency_mhz

    @property
    def may_set(self) -> bool:
        """Whether every rank may lock SM clocks (known at the first step; True before)."""
        return self._clocks.may_set

    @property
    def plan_frequencies_mhz(self) -> list[int] | None:
        """This stage's planned clock of each instruction, in execution order (None before planning)."""
        return list(self._phase.frequencies_mhz) if isinstance(self._phase, Applying) else None

    @property
    def iteration_time_s(self) -> float | None:
        """This rank's last iteration's time (s; None before the first)."""
        return self._iterations.time_s

    @property
    def iteration_energy_j(self) -> float | None:
        """The mean energy of this rank's recent iterations, over about 2 s (J; None before the first)."""
        return self._iterations.energy_j

    def metrics(self) -> dict[str, float | str]:
        """Numbers for the trainer's loggers (`readout.pipeline_metrics`)."""
        return pipeline_metrics(
            self._phase, self.profiling_steps, self._iterations, self.frequency_mhz, self._plan
        )

    def profile_rows(self) -> list[ProfileRow]:
        """The profile measured so far (every stage, replicas merged), as written to `profile_path`."""
        return [] if self._sweep is None else self._sweep.profile_rows()

    def blocking_power_w(self) -> dict[int, float]:
        """Measured power (W) of each stage while blocked between instructions (replicas summed; capped at
        the stage's lowest computing power when the gaps are too short for the counter)."""
        return {} if self._sweep is None else self._sweep.blocking_power_w()

    def report(self) -> dict[str, Any]:
        """Plain data: phase, profile, blocking power, the plan and its prediction (`readout.pipeline_report`)."""
        facts: dict[str, Any] = {"simulated": self.monitor.simulated, "stage": self.stage}
        facts |= {"may_lock_clocks": self._clocks.may_set, "profiling_steps": self.profiling_steps}
        facts["job_metadata"] = self.job.job_metadata
        return pipeline_report(self._phase, self._sweep, self._plan, facts)

    # -- hooks ----------------------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Mark the beginning of a training step (one iteration of the pipeline schedule)."""
        if self._closed:
            return
        if not self._started:
            self._start()
        self._recorder.read_power = isinstance(self._phase, Profiling)
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
        if index is not None and isinstance(self._phase, Applying):
            self._check_instruction(self._phase, index, self._recorder.records[index].trace_key)

    def on_instruction_end(self, name: str, *, virtual_stage: int | None = None) -> None:
        """Mark the end of an instruction begun with `on_instruction_begin(name, virtual_stage=...)`."""
        _, part = instruction_kind(name)
        if not self._recorder.in_step or not self._recorder.end_instruction(part):
            return
        phase = self._phase
        if isinstance(phase, Applying) and part != "input":
            # Set the next instruction's clock while this stage communicates.
            self._clocks.request(phase.clock(len(self._recorder.records) % len(phase.kinds)))

    def on_step_end(self) -> None:
        """Mark the end of a training step."""
        if not self._recorder.in_step:
            return
        m = self._recorder.end_step()
        if m is not None:
            self._iterations.add(m.time, m.total_energy)
        self._clocks.take_controller_error()
        phase = self._phase
        if isinstance(phase, Waiting):
            phase.steps_left -= 1
            if phase.steps_left <= 0:
                self._begin_profiling()
        elif isinstance(phase, Profiling):
            self.profiling_steps += 1
            if phase.count_step(self._recorder, self.options.profile_steps):
                self._finish_clock(phase)
        elif isinstance(phase, Applying):
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
        self._recorder.close()
        self._clocks.restore()
        dist.remove_termination_handler(self._on_signal)
        atexit.unregister(self.close)

    # -- waiting -> profiling ---------------------------------------------------------------------
    def _start(self) -> None:
        """At the first step: agree with every rank on the stages and their clocks, read the profile."""
        self._started = True
        if self.stage is None:
            self.stage = self._group.rank()
        options = self.options
        job = agree_on_clocks(
            self._group,
            self.gpu,
            self.stage,
            options.frequency_stride_mhz,
            options.min_frequency_mhz,
            self.job.pp_degree,
        )
        self._replay = read_profile_everywhere(self._group, options.profile_path)
        if self._replay is not None:
            logger.info("PipelineFrequencyOptimizer: planning from the profile %s.", options.profile_path)
        self._sweep = ClockSweep(clocks_to_profile(job, self._replay), options.patience)
        self._clocks.start(self.gpu, job.may_set, job.why_not_set)
        dist.on_termination(self._on_signal)
        atexit.register(self.close)
        if options.wait_steps == 0:
            self._begin_profiling()

    def _begin_profiling(self) -> None:
        assert self._sweep is not None and self.stage is not None
        if self._clocks.may_set:
            default_power_limit(self.gpu)
        clock = self._sweep.clock(self.stage)
        self._clocks.set_now(clock)
        self._phase = Profiling(clock, self.options.warmup_steps)
        if clock != UNLOCKED:
            logger.info("Profiling stage %d at %d MHz.", self.stage, clock)

    # -- profiling -> profiling | applying | inactive -----------------------------------------------
    def _finish_clock(self, phase: Profiling) -> None:
        """Share this clock's measurements with every rank; go on to the next clock, or plan."""
        assert self._sweep is not None and self.stage is not None
        why = share_clock(
            self._group, self._sweep, self.stage, phase, self._recorder.sequence, self._clocks.failed
        )
        if why is not None:
            self._deactivate(why)
            return
        if self._sweep.finished:
            self._make_plan()
            return
        clock = self._sweep.clock(self.stage)
        if clock != phase.frequency_mhz:
            self._clocks.set_now(clock)
        # Every rank runs the same number of steps per clock, so that the next gather is reached together.
        self._phase = Profiling(clock, self.options.warmup_steps)

    def _make_plan(self) -> None:
        """Plan on the group's first rank (and write the profile there); every rank takes its stage's part."""
        result: dict[str, Any] | None = None
        options, clocks = self.options, self._clocks
        if self._group.rank() == 0:
            assert self._sweep is not None
            result = solve_plan(
                self._sweep,
                self._replay,
                why_not_set=None if clocks.may_set else clocks.why_not_set,
                schedule=self.schedule,
                target_time_s=options.target_time_s,
                slack_margin=options.slack_margin,
                order=self._order,
            )
            if options.profile_path is not None and self._replay is None and clocks.may_set:
                save_profile(options.profile_path, self.profile_rows(), result)
        result = self._group.broadcast(result)
        assert result is not None and self.stage is not None
        self._plan = dict(result)
        if "error" in result:
            # Without permission the reason was already said once, at the first step.
            self._deactivate(result["error"], already_said=not clocks.may_set and self._replay is None)
            return
        if not clocks.may_set:
            self._phase = Inactive(
                f"{clocks.why_not_set}: the plan from profile_path is predicted, not applied"
            )
            return
        steps = result["stage_plans"][self.stage]
        self._phase = Applying([k for k, _ in steps], [f for _, f in steps])
        self._clocks.request(steps[0][1])
        pred = result["predicted"]
        logger.info(
            "Pipeline frequency plan applied: predicted iteration %.4g s -> %.4g s, energy %.4g J -> %.4g J%s.",
            pred["max_clock_iteration_time_s"],
            pred["iteration_time_s"],
            pred["max_clock_energy_j"],
            pred["energy_j"],
            " (SIMULATED GPUs)" if self.monitor.simulated else "",
        )

    # -- applying -> fallback -------------------------------------------------------------------------
    def _check_instruction(self, phase: Applying, index: int, key: str | tuple[str, int]) -> None:
        """The `index`-th instruction of the step begins: at its planned clock, or off the plan."""
        why = phase.off_plan(index, key)
        if why is None:
            self._clocks.request(phase.clock(index))
        else:
            self._fall_back(why)

    def _applied_step(self, phase: Applying) -> None:
        ran = len(self._recorder.records)
        if ran != len(phase.kinds):
            self._fall_back(f"the step ran {ran} instructions; the plan has {len(phase.kinds)}")
        elif self._clocks.failed is not None:
            self._fall_back(self._clocks.failed)

    def _fall_back(self, reason: str) -> None:
        assert self._sweep is not None and self.stage is not None
        logger.warning(
            "PipelineFrequencyOptimizer (stage %s): %s; running at the maximum clock from now on.",
            self.stage,
            reason,
        )
        self._phase = Fallback(reason)
        self._clocks.request(self._sweep.max_clock(self.stage))

    def _deactivate(self, reason: str, already_said: bool = False) -> None:
        logger.log(
            logging.INFO if already_said else logging.WARNING,
            "PipelineFrequencyOptimizer: %s. Restoring the GPU's clocks and training on.",
            reason.rstrip("."),
        )
        self._phase = Inactive(reason)
        self._clocks.restore()

    # -- errors and signals ------------------------------------------------------------------------------
    def _warn_unstarted(self) -> None:
        if not self._warned_unstarted:
            self._warned_unstarted = True
            logger.warning(
                "PipelineFrequencyOptimizer: on_instruction_begin outside a step; call on_step_begin() first "
                "(instructions outside steps are ignored)."
            )

    def _on_signal(self, signum: int) -> None:
        # The guard's own handler may run before or after this one; restoring twice is harmless.
        self._clocks.restore(forget=False)
