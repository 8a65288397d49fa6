"""GlobalPowerLimitOptimizer: profile GPU power limits during real training, pick the best, keep it.

The optimizer is the phase machine (`phases`), the hooks, what it shows (`readout`'s functions of its parts)
and the I/O (GPUs, profile file, checkpoints); what to profile and for how long is the `Search`'s, how a
step is measured the `StepMeter`'s, what it learns of its job at set-up `job`'s.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, ClassVar

from typing_extensions import Unpack

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.arguments import require_monitor
from zeus_callbacks.core.callback import Callback
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.files import warn_write_failed
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit import power_budget, readout, states
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats
from zeus_callbacks.core.power_limit.grid import milliwatts
from zeus_callbacks.core.power_limit.job import Job, find_job, profile_context
from zeus_callbacks.core.power_limit.keywords import OptimizerArguments
from zeus_callbacks.core.power_limit.meter import StepMeter
from zeus_callbacks.core.power_limit.options import PowerLimitOptions, option_names, takes_power_limit_options
from zeus_callbacks.core.power_limit.phases import Done, Inactive, Phase, Profiling, Waiting, Warmup
from zeus_callbacks.core.power_limit.profile_file import (
    ProfileContext,
    load_profile,
    reuse_profile,
    save_profile,
)
from zeus_callbacks.core.power_limit.ranks import JobMembership
from zeus_callbacks.core.power_limit.schema import CorruptedStateError, SavedState, parse_state, state_dict
from zeus_callbacks.core.power_limit.search import Search, min_measured_steps
from zeus_callbacks.core.power_limit.selectors import OptimumSelector
from zeus_callbacks.core.wrong_framework import OneFramework

__all__ = ["GlobalPowerLimitOptimizer", "CorruptedStateError"]

logger = logging.getLogger(__name__)


class GlobalPowerLimitOptimizer(OneFramework, Callback):
    """Find the best GPU power limit during training and keep it (Zeus's `GlobalPowerLimitOptimizer`).

    Each power limit is profiled over whole training steps (step begin to step end, so evaluation,
    logging and checkpointing between steps are not charged to it), after `warmup_steps` steps at that
    limit (the adaptive search: at the first limit of a run; a later limit, in force within
    milliseconds, settles for a step or two). The adaptive search measures each limit only until it is
    clearly worse than the best so far or cannot beat it by more than 1% (at least
    `profile_steps // 8` steps), then revisits the few limits still within 1% of the best (up to
    `profile_steps` steps in all); samples taken inside a burst of slow steps are set aside, a limit left
    without any or whose time stands out against the others' is measured again, and the whole search
    stays within 3/4 of a sweep's steps, whatever the noise; see
    `zeus_callbacks.core.power_limit.search`. Profiling carries on across epochs
    (`search="zeus"`: an epoch's end interrupts it as in Zeus). Under torch.distributed every rank
    measures its own GPU; each measured step's energy is summed and its time maxed over ranks, so every
    rank reaches the same decision at the same step. Every change goes through the process's GPU-state
    guard and is undone at `on_train_end`, at exit, on exceptions and on signals.

    Unlike Zeus, which profiles from each GPU's maximum limit down, the search never goes above the limit in
    force when the job started (a site's cap: real H100 NVL boards run at 310 W of 400 W, a GH200 at 700 W of
    900 W) unless `allow_raising_limit=True` or `ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT=1`: the grid's top
    is the lowest limit in force over the job's GPUs, which is also the reference a slowdown bound is judged
    against. Boards of one model whose ranges differ (a real V100 node: 150 W minimums beside 100 W ones)
    share the range every one of them accepts, said in one log line; Zeus refuses them as mixed models. A GPU
    without a settable power limit leaves the optimizer inactive (one log line says why).

    A complete profile at `profile_path` is applied at construction, as Zeus does: by `state`, `Done`
    at once. It answers the selector it was searched for; reused with another selector, the limits
    that selector still needs are profiled first (a profile written by Zeus, which measured every
    limit fully, answers any selector; its GPU cannot be checked, which is logged).

    Phases (`phase`, and Zeus's `state` classes): `waiting` (`Ready`), then `warmup` (`Warmup`) and
    `profiling` (`Profiling`) at each limit the search picks, then `done` (`Done`: the choice applied)
    or `inactive` (`Inactive`: GPUs left as found); each phase class says what moves it on.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s).
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        wait_steps, warmup_steps, profile_steps, pl_step, profile_path: Zeus's, positional as in Zeus.
        search, allow_raising_limit: by keyword. Every option is documented, named and defaulted once, in
            `PowerLimitOptions` (`options`), which checks it.

    Raises:
        ValueError: a bad argument, or a `profile_path` that is unreadable or was measured on other
            GPUs; the message names it. At set-up (construction, or the first step under
            torch.distributed): GPUs of different models, or whose power-limit ranges do not overlap.

    Example::

        monitor = ZeusMonitor(gpu_indices=[local_rank])
        plo = GlobalPowerLimitOptimizer(monitor, MaxSlowdownConstraint(1.1))
        for epoch in range(epochs):
            plo.on_epoch_begin()
            for batch in loader:
                plo.on_step_begin()
                train_step(batch)
                plo.on_step_end()
            plo.on_epoch_end()
        plo.on_train_end()
    """

    _what = "the framework-free power-limit optimizer"
    _does = "power_limit"
    PHASE_INDEX: ClassVar[dict[str, int]] = readout.PHASE_INDEX

    @takes_power_limit_options(zeus_positional=True, exclude=("report_path",))
    def __init__(
        self,
        monitor: ZeusMonitor,
        optimum_selector: OptimumSelector | None = None,
        **options: Unpack[OptimizerArguments],
    ) -> None:
        require_monitor("GlobalPowerLimitOptimizer", monitor)
        self.options = PowerLimitOptions(optimum_selector=optimum_selector, **options)
        self.monitor = monitor
        self._meter = StepMeter(monitor, [monitor.gpus[i] for i in monitor.gpu_indices], self._gpu_failed)
        self._phase: Phase = Waiting(self.options.wait_steps)
        self._started = False
        self._job: Job | None = None
        self._search: Search | None = None
        self._pending_state: SavedState | None = None  # a checkpoint's, loaded at the next run's start
        self.power_limit_w: float | None = None  # the limit in force (W; a fractional grid's 137.5 too)
        self._unfinished = ""
        self._restored_on: str | None = None  # the signal on which the guard put the GPUs back, if any
        # Under torch.distributed the setup waits for the end of the first step, when every rank that runs
        # an optimizer has registered, however late it started (`ranks`: no clock decides who takes part).
        # Under torchrun the process group may not exist yet (transformers creates it later), nor under
        # Lightning's launcher, whose first process builds its callbacks before it becomes rank 0.
        self._membership = JobMembership()
        if dist.is_distributed():
            self._membership.register()
        elif int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
            self._setup()

    # -- what it shows (`readout`) ------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Each option as the attribute of its name, as in Zeus (`plo.wait_steps`, `plo.profile_path`)."""
        options = self.__dict__.get("options")
        if options is not None and name in option_names():
            return options.path if name == "profile_path" else getattr(options, name)
        return super().__getattr__(name)  # another framework's first hook says so (`OneFramework`)

    @property
    def min_steps(self) -> int:
        """Samples every limit is measured before it may stop (adaptive search), else `profile_steps`."""
        steps = self.options.profile_steps
        return min_measured_steps(steps) if self.options.search == "adaptive" else steps

    @property
    def grid(self) -> list[float]:
        """The power limits profiled (W, highest first; empty until the GPUs' range is known)."""
        return self._search.grid if self._search is not None else []

    @property
    def stats(self) -> dict[float, PowerLimitStats]:
        """The measurements so far, by power limit (W)."""
        return self._search.stats if self._search is not None else {}

    @property
    def num_gpus(self) -> int:
        """GPUs of the job (every rank's)."""
        return self._job.num_gpus if self._job is not None else len(self._meter.gpus)

    @property
    def max_power_w(self) -> float:
        """The highest limit profiled times the job's GPUs (0 until known)."""
        return self._job.max_power_w if self._job is not None else 0.0

    @property
    def may_set(self) -> bool:
        """Whether every rank may change its GPUs' power limits."""
        return self._job.may_set if self._job is not None else True

    @property
    def profiling_steps(self) -> int:
        """Steps run at a limit being profiled (warm-ups included): the profiling cost."""
        return self._meter.steps

    @property
    def profiling_energy_j(self) -> float:
        """Energy of those steps (J, this rank's GPUs)."""
        return self._meter.energy_j

    @property
    def energy_refresh_s(self) -> float | None:
        """The slowest rank's energy-counter refresh (0: always current; None until a step is measured)."""
        return self._meter.refresh_s

    @property
    def phase(self) -> str:
        """`waiting`, `warmup`, `profiling`, `done` or `inactive` (see the `phases` module)."""
        return self._phase.name

    @property
    def state(self) -> states.PowerLimitState:
        """The phase as Zeus's state classes, limits in mW (`readout.zeus_state`); a snapshot."""
        return readout.zeus_state(self._phase, self._search, self.options.profile_steps)

    @property
    def optimal_power_limit_w(self) -> float | None:
        """The chosen power limit once profiling is over (also when this process may not apply it)."""
        return readout.chosen_w(self._phase)

    def metrics(self) -> dict[str, float]:
        """Numbers for the trainer's loggers (`readout.tracker_metrics`)."""
        return readout.tracker_metrics(self._phase, self.power_limit_w, self._meter, self.monitor.simulated)

    def report(self) -> dict[str, Any]:
        """The profile as plain data, the choice and its saving (`readout.report`); after a run that ended
        before profiling finished, `phase` is `incomplete` (`phase` itself is `waiting`: for the next run)."""
        unfinished = "" if self._started else self._unfinished
        return readout.report(
            self.options,
            self._phase,
            self._search,
            self._meter,
            self.num_gpus,
            self.monitor.simulated,
            unfinished,
        )

    def steps_needed(self) -> int:
        """Training steps a run needs for profiling to finish from the start (`wait_steps` included): a
        sweep's `warmup_steps + profile_steps` per limit; the adaptive search's budget, which grows where
        steps are shorter than the energy counter's refresh, though it usually stops well before it."""
        search, per_sample = self._search, self._meter.steps_per_sample()
        return self.options.wait_steps + (search.steps_needed(per_sample) if search is not None else 0)

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers and strings (`schema`): the profile so far and, if any, the choice."""
        return state_dict(
            self.stats, self.optimal_power_limit_w, self.profiling_steps, self.profiling_energy_j
        )

    # -- hooks ----------------------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Mark the beginning of a training step."""
        if not self._started:
            if dist.is_distributed():  # the first step: the job's membership settles at its end
                self._membership.register()
                # Set up before this process knew it was a rank (Lightning's launcher): again, as a rank.
                if self._job is not None:
                    self._job, self._search = None, None
                    self._phase = Waiting(self.options.wait_steps)
                return
            self._start()
        if isinstance(self._phase, Profiling) and self._phase.held is not None:
            phase, (m,) = self._phase, self._phase.held
            phase.held = None
            self._measure(phase, m)
        if isinstance(self._phase, Waiting) and self._phase.steps_left <= 0:
            self._begin_next()  # after an epoch's end interrupted a limit (`search="zeus"`)
        if isinstance(self._phase, (Warmup, Profiling)):
            self._meter.open_step()

    def on_step_end(self) -> None:
        """Mark the end of a training step."""
        if not self._started:
            if not dist.is_distributed():
                return
            self._start()  # after a step every rank synchronised on: every optimizer has registered
            if isinstance(self._phase, (Warmup, Profiling)):  # begun now (`wait_steps=0`): nothing to count
                self.monitor.gpus.step_boundary(self.monitor.gpu_indices)
                return
        phase = self._phase
        if isinstance(phase, Waiting):
            phase.steps_left -= 1
            if phase.steps_left <= 0:
                self._begin_next()
        elif isinstance(phase, Warmup):
            self._end_warmup_step(phase)
        elif isinstance(phase, Profiling):
            search = self._search
            assert search is not None
            if (
                self.options.search == "zeus"
                and phase.stats.spent_steps + phase.chunk.steps + 1 >= self.options.profile_steps
            ):
                phase.held = (self._meter.close_step(),)
            else:
                self._measure(phase, self._meter.close_step())
        self.monitor.gpus.step_boundary(self.monitor.gpu_indices)

    def on_epoch_begin(self) -> None:
        """Mark the beginning of an epoch (nothing to do: Zeus's loop calls it)."""

    def on_epoch_end(self) -> None:
        """Mark the end of an epoch. Profiling carries on across epochs, except with `search="zeus"`:
        then the limit being warmed up or profiled is dropped, the GPU goes back to the highest limit
        profiled, and that limit is profiled again from its warm-up at the next step, as Zeus does (also when the
        epoch ends right after the limit's last step: Zeus counts that step at the next one's beginning)."""
        phase = self._phase
        if self.options.search != "zeus" or not self._started or not isinstance(phase, (Warmup, Profiling)):
            return
        logger.info(
            "%s at %g W interrupted by the end of an epoch; it is profiled again from its warm-up.",
            "Warm-up" if isinstance(phase, Warmup) else "Profiling",
            phase.power_limit_w,
        )
        self._meter.cancel()
        self._phase = Waiting(0)
        self._set_power_limit(self.grid[0])

    def on_train_end(self) -> None:
        """Restore the GPUs' settings as they were before training.

        The optimizer can drive another training run afterwards: a finished choice is applied again at
        its first step, and a limit whose profiling was interrupted is profiled again from its warm-up.
        """
        self._meter.cancel()
        guard().restore()
        dist.remove_termination_handler(self._on_signal)
        self.power_limit_w = None
        if self._started and isinstance(self._phase, (Waiting, Warmup, Profiling)):
            self._unfinished = readout.say_unfinished(self.options, self._search, self._meter)
        self._started = False
        if self._search is not None:
            self._search.new_run()
        if isinstance(self._phase, (Warmup, Profiling)):
            self._phase = Waiting(self.options.wait_steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`: a finished profile is applied without profiling again; a partial one
        resumes at the next power limit (the limit being profiled at the checkpoint starts over).

        Raises:
            CorruptedStateError: `state` is not a whole `state_dict()` of this schema version (a checkpoint
                cut short or edited, or written by a development version); nothing is loaded (an
                `InvalidInputError`).
        """
        self._pending_state = parse_state(state)
        if self._started:
            self._apply_state()

    # -- set-up ---------------------------------------------------------------------------------
    def _setup(self) -> None:
        """Learn the job (`find_job`) and start the search over its grid; load a saved profile: a
        complete one is applied now."""
        o = self.options
        self._job = job = find_job(
            self._meter,
            self._membership,
            o.pl_step,
            o.allow_raising_limit,
            budget_w=lambda num_gpus: power_budget.per_gpu_cap_w(o.selector, num_gpus),
        )
        if job.inactive:
            self._phase = Inactive(job.inactive)
            return
        selector = power_budget.for_job(o.selector, job.num_gpus)
        self._search = Search(job.grid, selector, job.max_power_w, o.search, o.warmup_steps, o.profile_steps)
        if o.path is not None and o.path.exists():
            context = self._context()
            saved = load_profile(o.path, context, o.profile_steps)
            save = reuse_profile(saved, self._search, repr(o.selector), o.search, o.path, context)
            if save is not None:  # it answers: the choice is applied now
                self._finish(save=save)

    def _context(self) -> ProfileContext:
        assert self._job is not None
        return profile_context(self._job, self._meter, self.options.pl_step)

    def _start(self) -> None:
        self._started = True
        self._unfinished = ""
        if self._job is None:
            self._setup()
        if isinstance(self._phase, Done):  # a profile applied at construction, or a later run
            self._settle(self._phase.power_limit_w)
            return
        if isinstance(self._phase, Inactive):
            if self._restored_on is not None and self._phase.power_limit_w is not None:
                self._restored_on = None  # put back on a signal the process survived: applied again
                self._settle(self._phase.power_limit_w)
            return
        if self._pending_state is not None:
            self._apply_state()
            if not isinstance(self._phase, Waiting):
                return
        if not self.may_set:
            self._phase = Inactive("no permission to change power limits")
            logger.warning(
                "GlobalPowerLimitOptimizer: this process may not change GPU power limits (needs root or "
                "CAP_SYS_ADMIN), so it cannot profile them. Energy is still measured; with a complete "
                "profile_path it reports the limit it would apply."
            )
            return
        if self._job is not None and self._job.within_budget and isinstance(self._phase, Waiting):
            self._set_power_limit(self.grid[0])  # within the budget before the first step, waiting included
        if isinstance(self._phase, Waiting) and self._phase.steps_left <= 0:
            self._begin_next()

    def _apply_state(self) -> None:
        state, self._pending_state = self._pending_state, None
        assert state is not None and self._search is not None
        lo, hi = self.grid[-1], self.grid[0]
        outside = sorted(
            pl for pl in (*state.stats, state.optimal_power_limit_w) if pl is not None and not lo <= pl <= hi
        )
        if outside:
            logger.warning(
                "GlobalPowerLimitOptimizer: the saved state holds power limits %s W outside this job's range "
                "%g-%g W (saved on other GPUs); it is not used and profiling starts afresh.",
                outside,
                lo,
                hi,
            )
            return
        self._search.stats = state.stats
        if state.profiling_steps is not None:
            self._meter.steps, self._meter.energy_j = state.profiling_steps, state.profiling_energy_j
        if state.optimal_power_limit_w is not None:
            self._settle(state.optimal_power_limit_w)
            logger.info(
                "Resumed with the optimal power limit %g W without profiling again.",
                state.optimal_power_limit_w,
            )

    # -- the phase machine ------------------------------------------------------------------------
    def _begin_next(self) -> None:
        search = self._search
        assert search is not None
        pl = search.next_power_limit()
        if pl is None:
            self._finish()
            return
        if not self._set_power_limit(pl):
            return
        logger.info("Profiling power limit %g W%s.", pl, " again" if pl in search.stats else "")
        # A revisit (the adaptive search's refinement) adds to the samples of the earlier visits.
        stats, warmup = search.begin_visit(pl, self.energy_refresh_s or 0.0)
        if warmup > 0:
            self._phase = Warmup(pl, warmup, stats, settling=warmup < self.options.warmup_steps)
        else:
            self._phase = Profiling(pl, stats)

    def _end_warmup_step(self, phase: Warmup) -> None:
        m = self._meter.close_step()
        if phase.settling and self._phase is phase:
            self._meter.settling_step(phase.stats, m.time if m is not None else None)
        phase.steps_left -= 1
        if phase.steps_left <= 0 and self._phase is phase:
            assert self._search is not None
            self._search.warmed_up = True
            self._phase = Profiling(phase.power_limit_w, phase.stats)

    def _measure(self, phase: Profiling, m: Any) -> None:
        """Add a closed step (its measurement `m`, None if a GPU failed) to the limit being profiled, and
        decide whether to go on once a chunk closes."""
        if self._phase is not phase and not self._meter.collective:
            return  # this rank's GPU failed and it stood down alone
        search = self._search
        assert search is not None
        outcome = self._meter.measure(phase, m, self.power_limit_w, search)
        if outcome == "failed":
            self._deactivate("a GPU failed during profiling")
        elif outcome == "moved":
            # E.g. SIGTERM: the guard restored the GPUs while the framework finishes its step. That step
            # (and the chunk it ends) ran at another limit: it is not a measurement of this one.
            logger.warning(
                "GlobalPowerLimitOptimizer: the power limit was changed outside the optimizer during "
                "profiling at %g W (restored on a signal?); that step is not counted and profiling stops.",
                phase.power_limit_w,
            )
            self._deactivate("the power limit was changed outside the optimizer (restored on a signal?)")
        elif outcome == "closed":
            verdict = search.verdict(phase.stats, phase.samples_done)
            if verdict != "more":
                search.end_visit(phase.stats, verdict, phase.samples_done)
                self._save(complete=False)
                self._begin_next()

    def _finish(self, save: bool = True) -> None:
        assert self._search is not None
        try:
            # A Zeus-style selector answers whole watts: the profiled limit it means, a board's fractional
            # end included (137 -> 137.5).
            chosen = self._search.choose()
            pl = min(self.grid, key=lambda g: abs(g - chosen))
        except ValueError:
            logger.warning(
                "GlobalPowerLimitOptimizer: no power limit could be measured; leaving the GPU as it was."
            )
            self._deactivate("no power limit could be measured")
            return
        if save:
            self._save(complete=True)
        self._settle(pl)
        # At INFO: a choice is news, not a warning (`zeus-callbacks demo` shows the package's INFO lines;
        # `report()` and the adapters' logs carry it too). Not applied: said at WARNING above.
        logger.info(
            "GlobalPowerLimitOptimizer chose the power limit %g W (%s, %d limits profiled%s).",
            pl,
            self.options.selector,
            len(self.stats),
            ", SIMULATED GPUs" if self.monitor.simulated else "",
        )

    def _settle(self, pl: float) -> None:
        """Apply the choice, or, without permission, only report it."""
        if self.may_set:
            self._phase = Done(pl)
            if self._set_power_limit(pl):
                dist.on_termination(self._on_signal)  # runs before the guard's restore, which it reports
            return
        self._phase = Inactive("no permission to change power limits", pl)
        logger.warning(
            "GlobalPowerLimitOptimizer: this process may not change GPU power limits (needs root or CAP_SYS_ADMIN); "
            "it would apply %g W. Energy is still measured.",
            pl,
        )

    # -- I/O ------------------------------------------------------------------------------------
    def _save(self, complete: bool) -> None:
        if self.options.path is None or dist.rank() != 0:
            return
        try:
            save_profile(
                self.options.path,
                self._context(),
                self.stats,
                complete,
                repr(self.options.selector),
                self.options.search,
            )
        except OSError as e:  # a full disk, a quota, `ulimit -f`: training goes on
            warn_write_failed(logger, "power-limit profile", self.options.path, e)

    def _set_power_limit(self, pl: float) -> bool:
        try:
            for g in self._meter.gpus:
                g.set_power_limit_mw(milliwatts(pl))
        except GPUError as e:
            self._gpu_failed(e)
            # Under torch.distributed the other ranks carry on until the next decision, which deactivates
            # every rank together; this rank's limit is not in force, so it reports none.
            self.power_limit_w = None
            return self._meter.collective
        self.power_limit_w = pl
        return True

    def _gpu_failed(self, error: Exception) -> None:
        logger.warning(  # the device layer's messages are sentences already: no second period
            "GlobalPowerLimitOptimizer: %s. Restoring the GPU and training on without it.",
            str(error).rstrip("."),
        )
        self._meter.failed = True
        if not self._meter.collective:
            self._deactivate(str(error))

    def _deactivate(self, reason: str) -> None:
        self._phase = Inactive(reason)
        self._meter.cancel(sync=False)
        guard().restore()
        dist.remove_termination_handler(self._on_signal)
        self.power_limit_w = None

    def _on_signal(self, signum: int) -> None:
        """SIGINT/SIGTERM with the choice in force: the GPU-state guard puts the GPUs back next. A process that
        survives the signal (a framework's handler that checkpoints first) then runs at the GPUs' own limits,
        so the choice is reported as not applied (`inactive`, with the reason) until a later run applies it
        again. Profiling needs no such note: the next measured step sees the limit moved, on every rank."""
        if not isinstance(self._phase, Done):
            return
        self._restored_on = signal.Signals(signum).name
        self._phase = Inactive(
            f"the GPUs' settings were put back on {self._restored_on}; the choice "
            f"{self._phase.power_limit_w:g} W is applied again at the next run's first step",
            self._phase.power_limit_w,
        )
        self.power_limit_w = None
