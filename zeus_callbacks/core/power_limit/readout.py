"""What a power-limit optimizer shows: its options, the job, the phase, the measurements, the choice, and
the numbers and report trackers and users read (`PowerLimitReadout`, the base of
`GlobalPowerLimitOptimizer`, which adds the hooks, the phase machine and the I/O)."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from zeus_callbacks.core.callback import Callback
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit import states
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats
from zeus_callbacks.core.power_limit.grid import milliwatts
from zeus_callbacks.core.power_limit.job import Job
from zeus_callbacks.core.power_limit.meter import StepMeter
from zeus_callbacks.core.power_limit.options import PowerLimitOptions, option_names
from zeus_callbacks.core.power_limit.phases import Done, Inactive, Phase, Profiling, Warmup
from zeus_callbacks.core.power_limit.schema import state_dict
from zeus_callbacks.core.power_limit.search import Search, min_measured_steps
from zeus_callbacks.core.wrong_framework import OneFramework

__all__ = ["PowerLimitReadout"]

logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")


class PowerLimitReadout(OneFramework, Callback):
    """The read-only side of `GlobalPowerLimitOptimizer` (see there); the attributes are set by it."""

    _what = "the framework-free power-limit optimizer"
    _does = "power_limit"

    monitor: ZeusMonitor
    power_limit_w: int | None  # the limit in force (None: the GPUs' own)
    options: PowerLimitOptions  # what it was asked to do
    _meter: StepMeter
    _phase: Phase
    _job: Job | None  # set up: the job's size, permissions and grid known
    _search: Search | None  # the search over the grid, once set up (and the GPUs allow one)
    _started: bool  # a run is going on (its first step began)
    _unfinished: str  # what the last run's end said when it cut profiling short

    def __getattr__(self, name: str) -> Any:
        """Each option as the attribute of its name, as in Zeus (`plo.wait_steps`, `plo.profile_path`): the
        `options` record's (`PowerLimitOptions`)."""
        options = self.__dict__.get("options")
        if options is not None and name in option_names():
            return options.path if name == "profile_path" else getattr(options, name)
        return super().__getattr__(name)  # another framework's first hook says so (`OneFramework`)

    @property
    def min_steps(self) -> int:
        """Samples every limit is measured before it may stop (`min_measured_steps` for the adaptive
        search, else `profile_steps`)."""
        return (
            min_measured_steps(self.options.profile_steps)
            if self.options.search == "adaptive"
            else self.options.profile_steps
        )

    @property
    def grid(self) -> list[int]:
        """The power limits profiled (W, highest first; empty until the GPUs' range is known)."""
        return self._search.grid if self._search is not None else []

    @property
    def stats(self) -> dict[int, PowerLimitStats]:
        """The measurements so far, by power limit (W)."""
        return self._search.stats if self._search is not None else {}

    @property
    def num_gpus(self) -> int:
        """GPUs of the job (every rank's)."""
        return self._job.num_gpus if self._job is not None else len(self._meter.gpus)

    @property
    def max_power_w(self) -> float:
        """The job's maximum power: the highest limit profiled (the GPUs' maximum, or the limit in force at
        the start) times its GPUs (0 until known)."""
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
        """The slowest rank's energy-counter refresh period (0: steps are long enough, or the counter is
        always current; None until the first measured step)."""
        return self._meter.refresh_s

    @property
    def phase(self) -> str:
        """`waiting`, `warmup`, `profiling`, `done` or `inactive` (see the `phases` module)."""
        return self._phase.name

    @property
    def state(self) -> states.PowerLimitState:
        """The phase as Zeus's state classes (`Ready`, `Warmup`, `Profiling`, `Done`, and `Inactive`),
        power limits in mW as in Zeus. A snapshot: changing it changes nothing."""
        p = self._phase
        if isinstance(p, Warmup):
            return states.Warmup(current_power_limit=milliwatts(p.power_limit_w), steps=p.steps_left)
        if isinstance(p, Profiling):
            left = max(0, self.options.profile_steps - p.stats.steps)
            return states.Profiling(current_power_limit=milliwatts(p.power_limit_w), steps=left)
        if isinstance(p, Done):
            return states.Done(optimal_power_limit=milliwatts(p.power_limit_w))
        if isinstance(p, Inactive):
            return states.Inactive(p.reason, None if p.power_limit_w is None else milliwatts(p.power_limit_w))
        nxt = self._search.next_power_limit() if self._search is not None else None
        return states.Ready(next_power_limit=None if nxt is None else nxt * 1000, steps=p.steps_left)

    @property
    def optimal_power_limit_w(self) -> int | None:
        """The chosen power limit once profiling is over (also when this process may not apply it)."""
        return self._phase.power_limit_w if isinstance(self._phase, (Done, Inactive)) else None

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
        highest limit profiled (the maximum, or the limit in force at the start; by the measurements; labelled `simulated` when the GPUs are). After a run that
        ended before profiling finished, `phase` is `incomplete` and `incomplete_reason` says how far it
        got and how many steps a run needs (`phase` itself is `waiting`: for the next run)."""
        out: dict[str, Any] = {
            "selector": repr(self.options.selector),
            "search": self.options.search,
            "simulated": self.monitor.simulated,
            "num_gpus": self.num_gpus,
            "phase": "incomplete" if self._unfinished and not self._started else self.phase,
            "power_limits": self._search.rows() if self._search is not None else [],
            "optimal_power_limit_w": self.optimal_power_limit_w,
            "applied": isinstance(self._phase, Done),
            "profiling_steps": self.profiling_steps,
            "profiling_energy_j": self.profiling_energy_j,
        }
        if isinstance(self._phase, Inactive):
            out["inactive_reason"] = self._phase.reason
        if out["phase"] == "incomplete":
            out["incomplete_reason"] = self._unfinished
        if self._search is not None:
            out.update(self._search.saving(self.optimal_power_limit_w))
        return out

    def steps_needed(self) -> int:
        """Training steps a run needs for profiling to finish from the start (`wait_steps` included): a
        sweep's `warmup_steps + profile_steps` per limit; the adaptive search's budget, which grows where
        steps are shorter than the energy counter's refresh (a sample then groups several steps), though
        it usually stops well before it."""
        search, per_sample = self._search, self._meter.steps_per_sample()
        return self.options.wait_steps + (search.steps_needed(per_sample) if search is not None else 0)

    def _say_unfinished(self) -> str:
        measured = sum(1 for s in self.stats.values() if s.steps)
        carry = (
            f"it is saved in {self.options.path}: the next run with the same profile_path carries on"
            if self.options.path is not None
            else "pass `profile_path=...` to carry the profile to the next run (or resume from a checkpoint: "
            "the profile is in the optimizer's state)"
        )
        search, per_sample = self._search, self._meter.steps_per_sample()
        needs = search.steps_needed_text(self.options.wait_steps, per_sample) if search is not None else ""
        said = (
            f"training ended before profiling finished ({measured} of {len(self.grid)} power limits measured "
            f"in {self.profiling_steps} steps): {needs}"
        )
        logger.warning(
            "GlobalPowerLimitOptimizer: %s; no power limit was chosen and the GPUs are back as they were. %s.",
            said,
            carry[0].upper() + carry[1:],
        )
        return said

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers and strings (`schema`): the profile so far and, if any, the choice."""
        return state_dict(
            self.stats, self.optimal_power_limit_w, self.profiling_steps, self.profiling_energy_j
        )

    def refused_state_warning(
        self, source: object, owner: str, error: InvalidInputError, then: str = ""
    ) -> None:
        """Log the one warning for a checkpoint state that `load_state_dict` refused: `source` (the file),
        `owner` (the callback), why, and what profiling goes on from (`then`, else the profile_path profile
        when it exists, else nothing: profiling starts afresh)."""
        if not then:
            profile = self.options.path
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
