"""GlobalPowerLimitOptimizer: profile GPU power limits during real training, pick the best, keep it."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.arguments import bad_argument, require_monitor, whole_number
from zeus_callbacks.core.callback import Callback
from zeus_callbacks.core.device.errors import GPUError, GPULostError, InvalidInputError
from zeus_callbacks.core.device.power import MAX_REFRESH_PERIOD_S, energy_refresh_period_s
from zeus_callbacks.core.device.state_guard import guard, job_gpu_overlap
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.profile_file import (
    ProfileContext,
    SavedProfile,
    load_profile,
    measurement_problem,
    save_profile,
)
from zeus_callbacks.core.power_limit.ranks import JobMembership
from zeus_callbacks.core.power_limit.search import (
    MAX_VISITS,
    SEARCHES,
    PowerLimitStats,
    adaptive_budget_steps,
    burst_lookback,
    choose_power_limit,
    chunk_steps,
    measurement_verdict,
    min_measured_steps,
    next_power_limit,
    power_limit_grid,
    settle_steps,
    slower_above,
    spent_steps,
    visit_bursts,
)
from zeus_callbacks.core.power_limit.selectors import OptimumSelector, ZeusCost
from zeus_callbacks.core.power_limit.states import Done, Inactive, PowerLimitState, Profiling, Ready, Warmup

__all__ = ["GlobalPowerLimitOptimizer"]

logger = logging.getLogger(__name__)

_WINDOW = "__GlobalPowerLimitOptimizer_step"
# A sample (chunk of contiguous steps) spans at least this many refreshes of the energy counter, so that
# the counter's rounding (up to one refresh's energy at either end) is a small part of it.
CHUNK_REFRESHES = 1
# Bursts (another job on the node, throttling, a slow stretch of input) slow every step for a while. One
# that lasts past the end of a visit runs on into the next: that visit goes on until the burst is seen to
# end, up to this many steps, so that it keeps samples from after it. One seen to end early in a visit
# that did not expect it began before: the visits of up to this many steps before are set aside.
BURST_STEPS = 20
_NOT_CLOSED = object()  # `_record_step`: the step's window is still open


# -- phases -----------------------------------------------------------------------------------------
# One object per phase; `name` is what `GlobalPowerLimitOptimizer.phase` reports. Under torch.distributed
# every rank is in the same phase at the same step.
@dataclass
class _Waiting:
    """`waiting`: `wait_steps` steps pass at the GPU's own power limit (again when a later run starts after
    `on_train_end` interrupted profiling; none after an epoch's end interrupted it with `search="zeus"`).

    Next: `warmup` (or `profiling` when `warmup_steps` is 0) at the next limit to profile, at the end of the
    last waiting step (at the next step's beginning when none is left); `done` when a complete profile
    (from `profile_path` or a checkpoint) leaves nothing to profile; `inactive` when the job may not change
    power limits or a GPU fails.
    """

    name: ClassVar[str] = "waiting"
    steps_left: int


@dataclass
class _Warmup:
    """`warmup`: `steps_left` more steps at `power_limit_w` before it is measured (they count as profiling
    cost, not as samples).

    Next: `profiling` at the same limit after the last of them; `inactive` when a GPU fails; `waiting`
    when an epoch ends first with `search="zeus"`.
    """

    name: ClassVar[str] = "warmup"
    power_limit_w: int
    steps_left: int
    stats: PowerLimitStats  # what the measurement adds to: empty, or the samples of earlier visits
    settling: bool = False  # a later visit's settling steps: their times help see a burst begin


@dataclass
class _Profiling:
    """`profiling`: each step at `power_limit_w` is measured (energy summed, time maxed over ranks) until
    the search has seen enough of this limit.

    Next: `warmup`/`profiling` at the next limit the search picks (a new one, or a near-tie revisited);
    `done` when the search is over and the chosen limit is applied; `inactive` when a GPU fails, no limit
    could be measured, or the choice may not be applied; `waiting` when an epoch ends first with
    `search="zeus"` (this visit's samples are dropped and the limit is profiled again).
    """

    name: ClassVar[str] = "profiling"
    power_limit_w: int
    stats: PowerLimitStats
    samples_done: int = 0  # chunks closed, valid or not
    chunk_steps: int = 0  # the chunk being measured: its steps so far,
    chunk_time_s: float = 0.0  # their time (each step's maxed over ranks),
    chunk_energy_j: float = 0.0  # and this rank's energy
    chunk_own_s: float = 0.0  # this rank's own time in the chunk
    # `search="zeus"`: the limit's last step, measured, is counted at the next step's beginning, as Zeus
    # closes its window there (an epoch's end before that interrupts the limit). A 1-tuple once held.
    held: tuple[Any] | None = None


@dataclass
class _Done:
    """`done`: the chosen `power_limit_w` is in force for the rest of training (applied again when the
    optimizer drives a later run). Final."""

    name: ClassVar[str] = "done"
    power_limit_w: int


@dataclass
class _Inactive:
    """`inactive`: the GPUs are left as they were found; energy is still measured; `reason` says why.
    Final."""

    name: ClassVar[str] = "inactive"
    reason: str
    power_limit_w: int | None = None  # the choice it would apply, when a complete profile gave one


_Phase = _Waiting | _Warmup | _Profiling | _Done | _Inactive


class GlobalPowerLimitOptimizer(Callback):
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
        wait_steps: Steps to let pass before profiling starts.
        warmup_steps: Steps run at a power limit before it is measured (0 allowed): at each limit for
            the sweeps, at the run's first limit for the adaptive search (later ones settle for one
            sample's worth of steps, at most this many).
        profile_steps: Steps measured at each power limit (the most, for the adaptive search).
        pl_step: Stride between profiled power limits (W); the minimum limit is always profiled.
        profile_path: JSON file of the profile: loaded if it exists (a complete one is applied at once, a
            partial one resumes), written (by rank 0) as profiling goes.
        search: "adaptive" (default: each limit measured only as long as needed, the near-ties
            measured again), "sweep" (every limit for `profile_steps`, as Zeus) or "zeus" (the sweep,
            and the end of an epoch interrupts the limit being profiled: back to the maximum limit, that
            limit profiled again from its warm-up in the next epoch, exactly as Zeus).

    Raises:
        ValueError: a bad argument, or a `profile_path` that is unreadable or was measured on other
            GPUs; the message names it.

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

    def __init__(
        self,
        monitor: ZeusMonitor,
        optimum_selector: OptimumSelector | None = None,
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step: int = 25,
        profile_path: str | Path | None = None,
        search: str = "adaptive",
    ) -> None:
        owner = "GlobalPowerLimitOptimizer"

        def bad(name: str, value: Any, want: str) -> ValueError:
            return bad_argument(owner, name, value, want)

        require_monitor(owner, monitor)
        wait_steps = whole_number(owner, "wait_steps", wait_steps, 0)
        warmup_steps = whole_number(owner, "warmup_steps", warmup_steps, 0)
        profile_steps = whole_number(owner, "profile_steps", profile_steps, 1)
        pl_step = whole_number(owner, "pl_step", pl_step, 1)
        if search not in SEARCHES:
            raise bad("search", search, f"must be one of {SEARCHES}")
        if optimum_selector is not None and not isinstance(optimum_selector, OptimumSelector):
            raise bad(
                "optimum_selector", optimum_selector, "must be an OptimumSelector (Time(), Energy(), ...)"
            )
        if profile_path is not None and not isinstance(profile_path, (str, os.PathLike)):
            raise bad("profile_path", profile_path, "must be a path (str or pathlib.Path) or None")
        self.monitor = monitor
        self.optimum_selector = optimum_selector or ZeusCost(eta_knob=0.5)
        self.wait_steps = wait_steps
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.min_steps = min_measured_steps(profile_steps) if search == "adaptive" else profile_steps
        self.pl_step = int(pl_step)
        self.profile_path = Path(profile_path) if profile_path is not None else None
        self.search = search
        self._gpus = [monitor.gpus[i] for i in monitor.gpu_indices]
        self._phase: _Phase = _Waiting(wait_steps)
        self._started = False
        self._ready = False  # grid, job size and permissions known (at construction, or the first step)
        self._collective = False  # every rank runs an optimizer: decide together
        self._pending_state: _SavedState | None = None
        self.stats: dict[int, PowerLimitStats] = {}
        self._spent_before = 0  # steps of a reused profile that do not count against the search's budget
        self.grid: list[int] = []
        self.num_gpus = len(self._gpus)
        self.max_power_w = 0.0
        self.may_set = True
        self.profiling_steps = 0
        self.profiling_energy_j = 0.0
        self.power_limit_w: int | None = None
        self._failed = False
        self._unfinished = ""  # what the last run's end said when it cut profiling short
        self._warmed_up = False  # this run's first limit had its full warm-up (later ones settle)
        self._burst_open = False  # the last visit ended inside a burst
        self._visit_in_burst = False  # the current visit began inside one
        self._timeline: list[tuple[int, int]] = []  # (limit, visit) of this run's finished visits, in order
        # The slowest rank's energy-counter refresh period (0: steps are long enough, or the counter is
        # always current); learned at the first measured step.
        self.energy_refresh_s: float | None = None
        # Under torch.distributed the setup waits for the end of the first step, when every rank that runs
        # an optimizer has registered, however late it started (`ranks`: no clock decides who takes part).
        # Under torchrun the process group may not exist yet (transformers creates it later), nor under
        # Lightning's launcher, whose first process builds its callbacks before it becomes rank 0.
        self._membership = JobMembership()
        if dist.is_distributed():
            self._membership.register()
        elif int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
            self._setup()

    # -- public state ---------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """`waiting`, `warmup`, `profiling`, `done` or `inactive` (see the phase classes of this module)."""
        return self._phase.name

    @property
    def state(self) -> PowerLimitState:
        """The phase as Zeus's state classes (`Ready`, `Warmup`, `Profiling`, `Done`, and `Inactive`),
        power limits in mW as in Zeus. A snapshot: changing it changes nothing."""
        p = self._phase
        if isinstance(p, _Warmup):
            return Warmup(current_power_limit=p.power_limit_w * 1000, steps=p.steps_left)
        if isinstance(p, _Profiling):
            return Profiling(
                current_power_limit=p.power_limit_w * 1000, steps=max(0, self.profile_steps - p.stats.steps)
            )
        if isinstance(p, _Done):
            return Done(optimal_power_limit=p.power_limit_w * 1000)
        if isinstance(p, _Inactive):
            return Inactive(p.reason, None if p.power_limit_w is None else p.power_limit_w * 1000)
        nxt = self._next_power_limit() if self._ready else None
        return Ready(next_power_limit=None if nxt is None else nxt * 1000, steps=p.steps_left)

    @property
    def optimal_power_limit_w(self) -> int | None:
        """The chosen power limit once profiling is over (also when this process may not apply it)."""
        return self._phase.power_limit_w if isinstance(self._phase, (_Done, _Inactive)) else None

    # The phase as a number for trackers, which take numbers only (MLflow warns at every string).
    PHASE_INDEX: ClassVar[dict[str, int]] = {
        "waiting": 0,
        "warmup": 1,
        "profiling": 2,
        "done": 3,
        "inactive": 4,
    }

    def metrics(self) -> dict[str, float]:
        """Numbers for the trainer's loggers: current limit, phase (`PHASE_INDEX`), profiling cost, the
        choice, and `simulated` (1.0 when the GPUs are simulated, so every tracker run says so)."""
        out: dict[str, float] = {
            "phase_index": float(self.PHASE_INDEX[self.phase]),
            "simulated": float(self.monitor.simulated),
        }
        if self.power_limit_w is not None:
            out["power_limit_w"] = float(self.power_limit_w)
        if self.optimal_power_limit_w is not None:
            out["optimal_power_limit_w"] = float(self.optimal_power_limit_w)
        out["profiling_steps"] = float(self.profiling_steps)
        out["profiling_energy_j"] = self.profiling_energy_j
        return out

    def report(self) -> dict[str, Any]:
        """The profile as plain data: one row per profiled limit, the choice, and the saving against the
        maximum limit (by the measurements; labelled `simulated` when the GPUs are). After a run that
        ended before profiling finished, `phase` is `incomplete` and `incomplete_reason` says how far it
        got and how many steps a run needs (`phase` itself is `waiting`: for the next run)."""
        rows = []
        ref = self.stats.get(self.grid[0]) if self.grid else None
        ref_time = ref.mean_time_s if ref is not None and ref.steps else float("nan")
        for pl in sorted(self.stats, reverse=True):
            s = self.stats[pl]
            if not s.steps:
                continue
            m = s.measurement(self.profile_steps)
            cost = (
                float(
                    self.optimum_selector.score(
                        np.array([m.time]),
                        np.array([m.energy]),
                        self.max_power_w,
                        ref_time * self.profile_steps,
                    )[0]
                )
                if self.optimum_selector.has_score()
                else float("nan")
            )
            rows.append(
                {
                    "power_limit_w": pl,
                    "time_per_step_s": s.mean_time_s,
                    "energy_per_step_j": s.mean_energy_j,
                    "cost": cost,
                    "steps": s.steps,
                    "pruned": s.pruned,
                }
            )
        out: dict[str, Any] = {
            "selector": repr(self.optimum_selector),
            "search": self.search,
            "simulated": self.monitor.simulated,
            "num_gpus": self.num_gpus,
            "phase": "incomplete" if self._unfinished and not self._started else self.phase,
            "power_limits": rows,
            "optimal_power_limit_w": self.optimal_power_limit_w,
            "applied": isinstance(self._phase, _Done),
            "profiling_steps": self.profiling_steps,
            "profiling_energy_j": self.profiling_energy_j,
        }
        if isinstance(self._phase, _Inactive):
            out["inactive_reason"] = self._phase.reason
        if out["phase"] == "incomplete":
            out["incomplete_reason"] = self._unfinished
        best = self.stats.get(self.optimal_power_limit_w or -1)
        if ref is not None and ref.steps and best is not None and best.steps:
            out["energy_saved_pct"] = 100 * (1 - best.mean_energy_j / ref.mean_energy_j)
            out["time_lost_pct"] = 100 * (best.mean_time_s / ref.mean_time_s - 1)
        return out

    # -- hooks ----------------------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Mark the beginning of a training step."""
        if not self._started:
            if dist.is_distributed():  # the first step: the job's membership settles at its end
                self._membership.register()
                if self._ready:  # set up before this process knew it was a rank (Lightning's launcher)
                    self._ready, self.stats, self._spent_before = False, {}, 0
                    self._phase = _Waiting(self.wait_steps)
                return
            self._start()
        if isinstance(self._phase, _Profiling) and self._phase.held is not None:
            phase, (m,) = self._phase, self._phase.held
            phase.held = None
            self._record_step(phase, m)
        if isinstance(self._phase, _Waiting) and self._phase.steps_left <= 0:
            self._begin_next()  # after an epoch's end interrupted a limit (`search="zeus"`)
        if isinstance(self._phase, (_Warmup, _Profiling)) and not self._failed:
            try:
                if _WINDOW in self.monitor.open_windows:
                    self.monitor.end_window(_WINDOW, cancel=True)
                self.monitor.begin_window(_WINDOW)
            except GPUError as e:
                self._gpu_failed(e)

    def on_step_end(self) -> None:
        """Mark the end of a training step."""
        if not self._started:
            if not dist.is_distributed():
                return
            self._start()  # after a step every rank synchronised on: every optimizer has registered
            if isinstance(self._phase, (_Warmup, _Profiling)):  # begun now (`wait_steps=0`): nothing to count
                self.monitor.gpus.step_boundary(self.monitor.gpu_indices)
                return
        phase = self._phase
        if isinstance(phase, _Waiting):
            phase.steps_left -= 1
            if phase.steps_left <= 0:
                self._begin_next()
        elif isinstance(phase, _Warmup):
            own_s = self._record_step(None)
            if phase.settling and self._phase is phase:
                # The limit is in force already: the step's time (not its energy: the counter lags) is
                # one more look at whether a burst begins.
                # Its end time as every rank sees it (the latest rank clock), like a sample's.
                clock = self.monitor.gpus.clock()
                top = self._all_reduce(
                    [own_s if own_s is not None else 0.0, float(own_s is None), clock], op="max"
                )
                if top[1] == 0 and top[0] > 0:
                    phase.stats.add_settling(top[0], top[2])
            phase.steps_left -= 1
            if phase.steps_left <= 0 and self._phase is phase:
                self._warmed_up = True
                self._phase = _Profiling(phase.power_limit_w, phase.stats)
        elif isinstance(phase, _Profiling):
            if (
                self.search == "zeus"
                and phase.stats.spent_steps + phase.chunk_steps + 1 >= self.profile_steps
            ):
                phase.held = (self._close_step(),)
            else:
                self._record_step(phase)
        self.monitor.gpus.step_boundary(self.monitor.gpu_indices)

    def on_epoch_begin(self) -> None:
        """Mark the beginning of an epoch (nothing to do: Zeus's loop calls it)."""

    def on_epoch_end(self) -> None:
        """Mark the end of an epoch. Profiling carries on across epochs, except with `search="zeus"`:
        then the limit being warmed up or profiled is dropped, the GPU goes back to the maximum limit,
        and that limit is profiled again from its warm-up at the next step, as Zeus does (also when the
        epoch ends right after the limit's last step: Zeus counts that step at the next one's beginning)."""
        phase = self._phase
        if self.search != "zeus" or not self._started or not isinstance(phase, (_Warmup, _Profiling)):
            return
        logger.info(
            "%s at %d W interrupted by the end of an epoch; it is profiled again from its warm-up.",
            "Warm-up" if isinstance(phase, _Warmup) else "Profiling",
            phase.power_limit_w,
        )
        if _WINDOW in self.monitor.open_windows:
            self.monitor.end_window(_WINDOW, cancel=True)
        self._phase = _Waiting(0)
        self._set_power_limit(self.grid[0])

    def on_train_end(self) -> None:
        """Restore the GPUs' settings as they were before training.

        The optimizer can drive another training run afterwards: a finished choice is applied again at
        its first step, and a limit whose profiling was interrupted is profiled again from its warm-up.
        """
        if _WINDOW in self.monitor.open_windows:
            self.monitor.end_window(_WINDOW, cancel=True)
        guard().restore()
        self.power_limit_w = None
        if self._started and isinstance(self._phase, (_Waiting, _Warmup, _Profiling)):
            self._unfinished = self._say_unfinished()
        self._started = False
        self._warmed_up = False
        self._burst_open = False
        self._timeline = []
        if isinstance(self._phase, (_Warmup, _Profiling)):
            self._phase = _Waiting(self.wait_steps)

    def steps_needed(self) -> int:
        """Training steps a run needs for profiling to finish from the start (`wait_steps` included): a
        sweep's `warmup_steps + profile_steps` per limit; the adaptive search's budget, which grows where
        steps are shorter than the energy counter's refresh (a sample then groups several steps), though
        it usually stops well before it."""
        per_limit = self.warmup_steps + self.profile_steps
        if self._by_steps():
            return self.wait_steps + len(self.grid) * per_limit
        per_sample = chunk_steps(self.stats)
        return self.wait_steps + adaptive_budget_steps(
            len(self.grid), self.warmup_steps, self.profile_steps, per_sample
        )

    def _steps_needed_text(self) -> str:
        limits, per_sample = len(self.grid), chunk_steps(self.stats)
        if self._by_steps():
            return (
                f"profiling needs {self.steps_needed()} steps in one run ({self.wait_steps} wait + {limits} "
                f"limits x ({self.warmup_steps} warm-up + {self.profile_steps} measured)"
                + (
                    ", and epochs longer than warmup_steps + profile_steps, as an epoch's end restarts a limit"
                    if self.search == "zeus"
                    else ""
                )
                + ")"
            )
        grouped = (
            f"; {per_sample:.1f} steps per sample, as these steps are shorter than the energy counter's "
            "refresh"
            if per_sample > 1
            else ""
        )
        return (
            f"profiling needs at most {self.steps_needed()} steps in one run ({self.wait_steps} wait + 3/4 of "
            f"{limits} limits x ({self.warmup_steps} warm-up + {self.profile_steps} samples){grouped}), "
            "usually far fewer"
        )

    def _say_unfinished(self) -> str:
        measured = sum(1 for s in self.stats.values() if s.steps)
        carry = (
            f"it is saved in {self.profile_path}: the next run with the same profile_path carries on"
            if self.profile_path is not None
            else "pass `profile_path=...` to carry the profile to the next run (or resume from a checkpoint: "
            "the profile is in the optimizer's state)"
        )
        said = (
            f"training ended before profiling finished ({measured} of {len(self.grid)} power limits measured "
            f"in {self.profiling_steps} steps): {self._steps_needed_text()}"
        )
        logger.warning(
            "GlobalPowerLimitOptimizer: %s; no power limit was chosen and the GPUs are back as they were. %s.",
            said,
            carry[0].upper() + carry[1:],
        )
        return said

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain numbers and strings: the finished profile and, if any, the choice."""
        return {
            "version": 1,
            "optimal_power_limit_w": self.optimal_power_limit_w,
            "stats": [s.to_dict() for s in self.stats.values()],
            "profiling_steps": self.profiling_steps,
            "profiling_energy_j": self.profiling_energy_j,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`: a finished profile is applied without profiling again; a partial
        one resumes at the next power limit (the limit being profiled at the checkpoint starts over).

        Raises:
            CorruptedStateError: `state` is not a whole `state_dict()` (a checkpoint cut short or edited);
                nothing is loaded (an `InvalidInputError`).
        """
        self._pending_state = _parse_state(state)
        if self._started:
            self._apply_state()

    def refused_state_warning(
        self, source: object, owner: str, error: InvalidInputError, then: str = ""
    ) -> None:
        """Log the one warning for a checkpoint state that `load_state_dict` refused: `source` (the file),
        `owner` (the callback), why, and what profiling goes on from (`then`, else the profile_path profile
        when it exists, else nothing: profiling starts afresh)."""
        if not then:
            profile = self.profile_path
            then = (
                f"profiling carries on from the profile {profile}"
                if profile is not None and profile.exists()
                else "no earlier state: profiling starts afresh"
            )
        problem = getattr(error, "problem", error)
        logger.warning(
            "%s: the %s state is incomplete or corrupted (%s), so it is not used; %s.",
            source,
            owner,
            problem,
            then,
        )

    # -- internals ------------------------------------------------------------------------------
    def _context(self) -> ProfileContext:
        from zeus_callbacks import __version__

        lo, hi = self.grid[-1], self.grid[0]
        return ProfileContext(
            self._gpus[0].name, (lo, hi), self.pl_step, self.num_gpus, self.monitor.simulated, __version__
        )

    def _setup(self) -> None:
        """Learn the grid, the job's size and permissions (collectives when every rank takes part), and
        load a saved profile: a complete one is applied now."""
        self._ready = True
        self._collective = dist.is_distributed() and self._membership.settle()
        try:
            constraints = {g.power_limit_constraints_mw() for g in self._gpus}
        except GPUError as e:  # e.g. no power-limit control on this GPU: every rank stands down below
            logger.warning(
                "GlobalPowerLimitOptimizer: %s Training on without it; energy is still measured.", e
            )
            constraints = {(0, 0)}
        lo, hi = min(c[0] for c in constraints), max(c[1] for c in constraints)
        # Every rank must profile the same grid: refuse mixed GPU models rather than guess.
        lows = self._all_reduce([-lo, hi, float(len(constraints) > 1), float(hi == 0)], op="max")
        if lows[3]:
            self._phase = _Inactive("a GPU does not support power-limit control")
            return
        if self._collective or not dist.is_distributed():
            overlap = job_gpu_overlap(self._gpus)  # before any change, on every rank
            if overlap is not None:
                logger.warning("GlobalPowerLimitOptimizer: %s", overlap)
                self._phase = _Inactive("GPUs shared between ranks")
                return
        if len(constraints) > 1 or -lows[0] != lo or lows[1] != hi or lows[2]:
            raise ValueError(
                "GlobalPowerLimitOptimizer needs GPUs with the same power-limit range on every rank; this job mixes "
                "GPU models. Plan per-GPU limits with `zeus-callbacks plan` (the heterogeneous planner) instead."
            )
        self.grid = power_limit_grid(lo / 1000, hi / 1000, self.pl_step)
        self.num_gpus = int(self._all_reduce([len(self._gpus)], op="sum")[0])
        self.max_power_w = self.grid[0] * self.num_gpus
        denied = self._all_reduce([float(not all(g.may_change_settings() for g in self._gpus))], op="sum")[0]
        self.may_set = denied == 0
        if self.profile_path is not None and self.profile_path.exists():
            self._use_profile(load_profile(self.profile_path, self._context(), self.profile_steps))

    def _use_profile(self, saved: SavedProfile) -> None:
        """Take a saved profile: apply its answer when it holds one for this selector, else keep its
        measurements and profile what this selector still needs first."""
        stats = saved.stats
        if saved.written_by_zeus:
            logger.warning(
                "%s is a profile written by Zeus: it does not say which GPU it was measured on, so that could "
                "not be checked against this job's %s. Using it.",
                self.profile_path,
                self._context().describe(),
            )
            self.stats = stats
            self._finish(save=False)
            return
        same = saved.selector == repr(self.optimum_selector) and saved.search == self.search
        if not same:
            # What the first search pruned is only worse for *its* selector: measure again what ours needs.
            for s in stats.values():
                s.pruned = False
            if self.search != "adaptive" or not self.optimum_selector.has_score():
                stats = {pl: s for pl, s in stats.items() if s.spent_steps >= self.profile_steps}
            self._spent_before = spent_steps(stats, self.warmup_steps)
        self.stats = stats
        if same and saved.complete or self._next_power_limit() is None and stats:
            logger.info("Loaded the power-limit profile %s.", self.profile_path)
            self._finish(save=not same)
            return
        logger.info(
            "Loaded %s power-limit profile from %s%s; profiling what is missing.",
            "the" if saved.complete else "a partial",
            self.profile_path,
            ""
            if same
            else f" (searched for {saved.selector or 'another selector'}, not {self.optimum_selector!r})",
        )

    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        """A collective over the ranks when every rank takes part; this rank's values otherwise."""
        return dist.all_reduce(values, op=op) if self._collective else list(values)

    def _next_power_limit(self) -> int | None:
        return next_power_limit(
            self.grid,
            self.stats,
            self.optimum_selector,
            self.max_power_w,
            self.num_gpus,
            self.search,
            self.warmup_steps,
            self.profile_steps,
            self._spent_before,
        )

    def _start(self) -> None:
        self._started = True
        self._unfinished = ""
        if not self._ready:
            self._setup()
        if isinstance(self._phase, _Done):  # a profile applied at construction, or a later run
            self._settle(self._phase.power_limit_w)
            return
        if isinstance(self._phase, _Inactive):
            return
        if self._pending_state is not None:
            self._apply_state()
            if not isinstance(self._phase, _Waiting):
                return
        if not self.may_set:
            self._phase = _Inactive("no permission to change power limits")
            logger.warning(
                "GlobalPowerLimitOptimizer: this process may not change GPU power limits (needs root or "
                "CAP_SYS_ADMIN), so it cannot profile them. Energy is still measured; with a complete "
                "profile_path it reports the limit it would apply."
            )
            return
        if isinstance(self._phase, _Waiting) and self._phase.steps_left <= 0:
            self._begin_next()

    def _apply_state(self) -> None:
        state, self._pending_state = self._pending_state, None
        assert state is not None
        lo, hi = self.grid[-1], self.grid[0]
        outside = sorted(
            pl for pl in (*state.stats, state.optimal_power_limit_w) if pl is not None and not lo <= pl <= hi
        )
        if outside:
            logger.warning(
                "GlobalPowerLimitOptimizer: the saved state holds power limits %s W outside this job's range "
                "%d-%d W (saved on other GPUs); it is not used and profiling starts afresh.",
                outside,
                lo,
                hi,
            )
            return
        self.stats = state.stats
        if state.profiling_steps is not None:
            self.profiling_steps, self.profiling_energy_j = state.profiling_steps, state.profiling_energy_j
        if state.optimal_power_limit_w is not None:
            self._settle(state.optimal_power_limit_w)
            logger.info(
                "Resumed with the optimal power limit %d W without profiling again.",
                self._phase.power_limit_w,
            )

    def _begin_next(self) -> None:
        pl = self._next_power_limit()
        if pl is None:
            self._finish()
            return
        if not self._set_power_limit(pl):
            return
        earlier = self.stats.get(pl)
        # A revisit (the adaptive search's refinement) adds to the samples of the earlier visits.
        if earlier is None:
            stats = PowerLimitStats(pl, refresh_s=self.energy_refresh_s or 0.0)
        else:
            chunks = [list(c) for c in earlier.chunks]
            stats = replace(earlier, visits=earlier.visits + 1, chunks=chunks)
        logger.info("Profiling power limit %d W%s.", pl, "" if earlier is None else " again")
        warmup = self.warmup_steps
        if self._warmed_up and not self._by_steps():
            warmup = settle_steps(self.warmup_steps, chunk_steps(self.stats))
        stats.warmed_steps = max(0, stats.warmed_steps) + warmup
        self._visit_in_burst = self._burst_open
        if warmup > 0:
            self._phase = _Warmup(pl, warmup, stats, settling=warmup < self.warmup_steps)
        else:
            self._warmed_up = True
            self._phase = _Profiling(pl, stats)

    def _close_step(self) -> Any:
        """Close the step's window and add it to the profiling cost: its `Measurement`, or None when a
        GPU failed (said, and the optimizer stands down)."""
        self.profiling_steps += 1
        m = None
        if not self._failed:
            try:
                m = self.monitor.end_window(_WINDOW)
                lost = getattr(self.monitor, "lost_gpus", None)  # the monitor measures on without them
                if lost:
                    raise GPULostError(next(iter(lost.values())))
                self.profiling_energy_j += m.total_energy
            except (GPUError, ValueError) as e:
                self._gpu_failed(e)
        return m

    def _record_step(self, phase: _Profiling | None, m: Any = _NOT_CLOSED) -> float | None:
        """Close the step's window (unless `m`, its measurement, was taken already) and add it to the
        profiling cost; when measuring, add the job's step (time maxed over ranks) to the chunk being
        measured; once the chunk spans `CHUNK_REFRESHES` refreshes of the energy counter, add it (energy
        summed over ranks) to the limit's samples and decide whether to go on."""
        if m is _NOT_CLOSED:
            m = self._close_step()
        if phase is None or (self._phase is not phase and not self._collective):
            return m.time if m is not None else None
        t, e = (m.time, m.total_energy) if m is not None else (0.0, 0.0)
        # One collective per measured step and one per chunk, on every rank, whatever happened to its GPU.
        phase.chunk_own_s += t
        # The chunk closes once every rank's own windows span the refreshes (ranks' steps may differ).
        moved = float(self._limit_moved())
        # The step's end: the latest of the ranks' clocks, so that every rank dates a chunk the same and
        # finds the same one-second power windows (and decides the same).
        clock = self.monitor.gpus.clock()
        top = self._all_reduce(
            [t, float(self._failed), -phase.chunk_own_s, self._own_refresh_s(t), moved, clock], op="max"
        )
        if top[1] > 0:
            self._deactivate("a GPU failed during profiling")
            return
        if top[4] > 0:
            # E.g. SIGTERM: the guard restored the GPUs while the framework finishes its step. That step
            # (and the chunk it ends) ran at another limit: it is not a measurement of this one.
            logger.warning(
                "GlobalPowerLimitOptimizer: the power limit was changed outside the optimizer during "
                "profiling at %d W (restored on a signal?); that step is not counted and profiling stops.",
                phase.power_limit_w,
            )
            self._deactivate("the power limit was changed outside the optimizer (restored on a signal?)")
            return
        if self.energy_refresh_s is None:
            self.energy_refresh_s = top[3]
            phase.stats.refresh_s = top[3]
        phase.chunk_steps += 1
        phase.chunk_time_s += top[0]
        phase.chunk_energy_j += e
        if -top[2] < CHUNK_REFRESHES * self.energy_refresh_s and not self._last_fixed_step(phase):
            return
        # A counter that did not move is not a sample, unless it moves by refreshes: then 0 J is its
        # rounding (a refresh fell between steps), which the next chunk's reading makes up for.
        stuck = phase.chunk_energy_j <= 0 and not self.energy_refresh_s
        power_w, missing = self._one_second_power_w()
        total = self._all_reduce([phase.chunk_energy_j, float(stuck), power_w, missing], op="sum")
        if total[1] == 0 and phase.chunk_time_s > 0:
            power_w = total[2] if total[3] == 0 else math.nan
            phase.stats.add(phase.chunk_time_s, total[0], phase.chunk_steps, power_w, top[5])
        phase.chunk_steps, phase.chunk_time_s, phase.chunk_energy_j, phase.chunk_own_s = 0, 0.0, 0.0, 0.0
        phase.samples_done += 1
        self._decide(phase)

    def _one_second_power_w(self) -> tuple[float, float]:
        """(this rank's GPUs' power averaged over the last second in W, 1.0 if a GPU does not report it,
        or the monitor replays a log). Read only where the energy counter's rounding matters."""
        if not self.energy_refresh_s or self._failed:
            return 0.0, 1.0
        try:
            power_w = self.monitor.one_second_power_w()
        except GPUError:
            return 0.0, 1.0
        return (0.0, 1.0) if power_w is None else (power_w, 0.0)

    def _limit_moved(self) -> bool:
        """Whether a GPU's power limit is no longer the one being profiled (restored on a signal, or
        changed by another process)."""
        if self.power_limit_w is None or self._failed:
            return False
        try:
            return any(g.power_limit_mw() != self.power_limit_w * 1000 for g in self._gpus)
        except GPUError:
            return False

    def _own_refresh_s(self, step_s: float) -> float:
        """This rank's energy-counter refresh period, learned (once per GPU: polling up to 1.5 s) at the
        first measured step when that step is short enough for the counter's rounding to matter."""
        if self.energy_refresh_s is not None:
            return self.energy_refresh_s
        if self.monitor.approx_instant_energy or step_s >= 4 * MAX_REFRESH_PERIOD_S:
            return 0.0
        try:
            return max((energy_refresh_period_s(g) or 0.0 for g in self._gpus), default=0.0)
        except GPUError:
            return 0.0

    def _by_steps(self) -> bool:
        """Whether each limit is measured for `profile_steps` steps (the sweeps, or a selector without a
        score), rather than for as long as the adaptive search needs."""
        return self.search != "adaptive" or not self.optimum_selector.has_score()

    def _last_fixed_step(self, phase: _Profiling) -> bool:
        return self._by_steps() and phase.stats.spent_steps + phase.chunk_steps >= self.profile_steps

    def _decide(self, phase: _Profiling) -> None:
        s = phase.stats
        if self._by_steps():
            verdict = "measured" if s.spent_steps >= self.profile_steps else "more"
        else:
            # The budget is a hard cap on the whole search, whatever the noise: what is left of it, less
            # the least the limits not yet visited need.
            left = self._budget_left_steps(s) - self._unvisited_need_steps(s)
            if left > 0 and self._burst_open and not self._burst_seen_ending(s):
                verdict = "more"
            else:
                verdict = measurement_verdict(
                    s,
                    self.stats,
                    self.optimum_selector,
                    self.max_power_w,
                    self.stats.get(self.grid[0], s),
                    self.min_steps,
                    self.profile_steps,
                    left,
                )
        if verdict == "more" and phase.samples_done >= 4 * self.profile_steps:
            verdict = "measured"  # the counter barely moves: settle for what was measured
        if verdict == "more":
            return
        if not s.steps:
            logger.warning(
                "No valid measurement at %d W in %d samples (%s); skipping it.",
                s.power_limit_w,
                phase.samples_done,
                "every sample set aside as slowed by a burst, and the search's budget is spent"
                if s.spent_steps
                else "energy counter not moving",
            )
        s.pruned = verdict == "pruned" or not s.steps
        self.stats[s.power_limit_w] = s
        if not self._by_steps():
            self._track_bursts(s)
        self._after_limit()

    def _burst_seen_ending(self, s: PowerLimitStats) -> bool:
        """While a visit that began inside a burst waits for it to end: whether it has (or waited long
        enough: it ended with the last visit)."""
        _, began_before, _ = visit_bursts(s.chunks, s.visits)
        taken = sum(c[0] for c in s.chunks if len(c) > 3 and c[3] == s.visits)
        if began_before or taken >= BURST_STEPS:
            self._burst_open = False
        return not self._burst_open

    def _track_bursts(self, s: PowerLimitStats) -> None:
        """At a visit's end: note a burst still going on, or set aside the earlier visits that ran inside
        one that this visit saw end (`burst_lookback`); a limit that loses every sample is measured again."""
        inside, began_before, goes_on = visit_bursts(s.chunks, s.visits)
        if began_before and not self._visit_in_burst:
            own = [c for c in s.chunks if len(c) > 3 and c[3] == s.visits]
            lead = next((k for k, i in enumerate(inside) if i != k), len(inside))  # the visit's first run
            before = sum(own[i][0] for i in inside[:lead])  # the burst's steps in this visit
            for pl, visit in burst_lookback(self._timeline, self.stats, BURST_STEPS - before):
                if not self._may_measure_again(pl, s):
                    continue
                logger.info("Samples at %d W (visit %d) set aside: they ran inside a burst.", pl, visit)
                self.stats[pl].set_aside_visit(visit)
                self.stats[pl].pruned = False
        for pl, visit in slower_above(self.stats, s) if s.steps else []:
            if not self._may_measure_again(pl, s):
                continue
            logger.info(
                "Samples at %d W (visit %d) set aside: slower than at %d W.", pl, visit, s.power_limit_w
            )
            self.stats[pl].set_aside_visit(visit)
            self.stats[pl].pruned = False
        self._burst_open = goes_on
        self._visit_in_burst = False
        self._timeline.append((s.power_limit_w, s.visits))

    def _may_measure_again(self, power_limit_w: int, current: PowerLimitStats) -> bool:
        """Whether a limit's visit may still be set aside and measured again: not once the limit has had
        `MAX_VISITS` visits or the search's budget is spent (noise that keeps looking like bursts, e.g. the
        host's own on ms-long steps, must not keep profiling going for ever)."""
        return self.stats[power_limit_w].visits < MAX_VISITS and self._budget_left_steps(current) > 0

    def _unvisited_need_steps(self, current: PowerLimitStats) -> float:
        """Steps the limits not visited yet (`current` aside) need at least: a settling and
        `min_measured_steps` samples each."""
        unvisited = sum(1 for pl in self.grid if pl not in self.stats and pl != current.power_limit_w)
        per = chunk_steps({**self.stats, current.power_limit_w: current})
        return unvisited * (settle_steps(self.warmup_steps, per) + self.min_steps * per)

    def _budget_left_steps(self, current: PowerLimitStats) -> int:
        """Steps the adaptive search may still spend (`adaptive_budget_steps`), `current` counted."""
        stats = {**self.stats, current.power_limit_w: current}
        budget = adaptive_budget_steps(
            len(self.grid), self.warmup_steps, self.profile_steps, chunk_steps(stats)
        )
        spent = spent_steps(stats, self.warmup_steps)
        return budget - (spent - self._spent_before)

    def _after_limit(self) -> None:
        self._save(complete=False)
        self._begin_next()

    def _finish(self, save: bool = True) -> None:
        try:
            pl = choose_power_limit(self.stats, self.optimum_selector, self.max_power_w, self.profile_steps)
        except ValueError:
            logger.warning(
                "GlobalPowerLimitOptimizer: no power limit could be measured; leaving the GPU as it was."
            )
            self._deactivate("no power limit could be measured")
            return
        if save:
            self._save(complete=True)
        self._settle(pl)
        # Applied: at WARNING, the level the frameworks' default logging shows (not applied: said above).
        logger.log(
            logging.WARNING if isinstance(self._phase, _Done) else logging.INFO,
            "GlobalPowerLimitOptimizer chose the power limit %d W (%s, %d limits profiled%s).",
            pl,
            self.optimum_selector,
            len(self.stats),
            ", SIMULATED GPUs" if self.monitor.simulated else "",
        )

    def _settle(self, pl: int) -> None:
        """Apply the choice, or, without permission, only report it."""
        if self.may_set:
            self._phase = _Done(pl)
            self._set_power_limit(pl)
            return
        self._phase = _Inactive("no permission to change power limits", pl)
        logger.warning(
            "GlobalPowerLimitOptimizer: this process may not change GPU power limits (needs root or CAP_SYS_ADMIN); "
            "it would apply %d W. Energy is still measured.",
            pl,
        )

    def _save(self, complete: bool) -> None:
        if self.profile_path is not None and dist.rank() == 0:
            save_profile(
                self.profile_path,
                self._context(),
                self.stats,
                complete,
                repr(self.optimum_selector),
                self.search,
            )

    def _set_power_limit(self, pl: int) -> bool:
        try:
            for g in self._gpus:
                g.set_power_limit_mw(pl * 1000)
        except GPUError as e:
            self._gpu_failed(e)
            # Under torch.distributed the other ranks carry on until the next decision, which deactivates
            # every rank together; this rank's limit is not in force, so it reports none.
            self.power_limit_w = None
            return self._collective
        self.power_limit_w = pl
        return True

    def _gpu_failed(self, error: Exception) -> None:
        logger.warning(  # the device layer's messages are sentences already: no second period
            "GlobalPowerLimitOptimizer: %s. Restoring the GPU and training on without it.",
            str(error).rstrip("."),
        )
        self._failed = True
        if not self._collective:
            self._deactivate(str(error))

    def _deactivate(self, reason: str) -> None:
        self._phase = _Inactive(reason)
        if _WINDOW in self.monitor.open_windows:
            self.monitor.end_window(_WINDOW, sync_execution=False, cancel=True)
        guard().restore()
        self.power_limit_w = None


class CorruptedStateError(InvalidInputError):
    """A checkpoint state that is not a whole `state_dict()` (cut short or edited); `problem` says why."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"The GlobalPowerLimitOptimizer state is incomplete or corrupted: {problem}. It is not loaded."
        )
        self.problem = problem


@dataclass(frozen=True)
class _SavedState:
    """A checked `state_dict()`."""

    stats: dict[int, PowerLimitStats]
    optimal_power_limit_w: int | None
    profiling_steps: int | None  # None: a state saved before the counters were (keep the current ones)
    profiling_energy_j: float


def _parse_state(state: Any) -> _SavedState:
    """`state_dict()` read back and checked whole, or `CorruptedStateError` saying what is wrong with it."""
    if not isinstance(state, dict):
        raise CorruptedStateError(f"expected a dict, got {type(state).__name__}")
    if state.get("version") != 1:
        raise CorruptedStateError(f"unknown version {state.get('version')!r}")
    missing = [k for k in ("optimal_power_limit_w", "stats") if k not in state]
    if missing:
        raise CorruptedStateError(f"no {', '.join(missing)}")
    if not isinstance(state["stats"], list):
        raise CorruptedStateError(f"stats is {type(state['stats']).__name__}, not a list")
    stats: dict[int, PowerLimitStats] = {}
    for i, entry in enumerate(state["stats"]):
        try:
            s = PowerLimitStats(**entry)
        except TypeError as e:
            raise CorruptedStateError(f"stats entry {i}: {e}") from None
        problem = measurement_problem(s, None, entry)
        if problem is not None:
            raise CorruptedStateError(f"stats entry {i}: {problem}")
        stats[s.power_limit_w] = s
    optimal = state["optimal_power_limit_w"]
    if optimal is not None and (not isinstance(optimal, int) or isinstance(optimal, bool) or optimal <= 0):
        raise CorruptedStateError(f"optimal_power_limit_w={optimal!r} is not a power limit in watts")
    steps, energy = state.get("profiling_steps"), state.get("profiling_energy_j", 0.0)
    if steps is None:
        return _SavedState(stats, optimal, None, 0.0)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise CorruptedStateError(f"profiling_steps={steps!r} is not a count of steps")
    if (
        isinstance(energy, bool)
        or not isinstance(energy, (int, float))
        or not np.isfinite(energy)
        or energy < 0
    ):
        raise CorruptedStateError(f"profiling_energy_j={energy!r} is not a finite, non-negative number")
    return _SavedState(stats, optimal, steps, float(energy))
