"""What a power-limit optimizer shows, as functions of the parts they read: Zeus's state of a phase, the
numbers trackers take, the report, and the warnings at a run's end and for a refused state.

`GlobalPowerLimitOptimizer` owns the parts (its phase, `Search`, `StepMeter`, options) and exposes these as
its `state`, `metrics()` and `report()`; nothing here holds state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.power_limit import states
from zeus_callbacks.core.power_limit.grid import milliwatts
from zeus_callbacks.core.power_limit.meter import StepMeter
from zeus_callbacks.core.power_limit.options import PowerLimitOptions
from zeus_callbacks.core.power_limit.phases import Done, Inactive, Phase, Profiling, Warmup
from zeus_callbacks.core.power_limit.search import Search

__all__ = [
    "PHASE_INDEX",
    "zeus_state",
    "chosen_w",
    "tracker_metrics",
    "report",
    "say_unfinished",
    "refused_state_warning",
]

logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")

PHASE_INDEX: dict[str, int] = {"waiting": 0, "warmup": 1, "profiling": 2, "done": 3, "inactive": 4}
"""The phase as a number for trackers, which take numbers only (MLflow warns at every string)."""


def zeus_state(phase: Phase, search: Search | None, profile_steps: int) -> states.PowerLimitState:
    """`phase` as Zeus's state classes (`Ready`, `Warmup`, `Profiling`, `Done`, and `Inactive`), power
    limits in mW as in Zeus."""
    if isinstance(phase, Warmup):
        return states.Warmup(current_power_limit=milliwatts(phase.power_limit_w), steps=phase.steps_left)
    if isinstance(phase, Profiling):
        left = max(0, profile_steps - phase.stats.steps)
        return states.Profiling(current_power_limit=milliwatts(phase.power_limit_w), steps=left)
    if isinstance(phase, Done):
        return states.Done(optimal_power_limit=milliwatts(phase.power_limit_w))
    if isinstance(phase, Inactive):
        chosen = None if phase.power_limit_w is None else milliwatts(phase.power_limit_w)
        return states.Inactive(phase.reason, chosen)
    nxt = search.next_power_limit() if search is not None else None
    return states.Ready(next_power_limit=None if nxt is None else milliwatts(nxt), steps=phase.steps_left)


def chosen_w(phase: Phase) -> float | None:
    """The chosen power limit once profiling is over (also when it may not be applied), else None."""
    return phase.power_limit_w if isinstance(phase, (Done, Inactive)) else None


def tracker_metrics(
    phase: Phase, power_limit_w: float | None, meter: StepMeter, simulated: bool
) -> dict[str, float]:
    """Numbers for the trainer's loggers: the limit in force, the phase (`PHASE_INDEX`), the profiling cost,
    the choice, and `simulated` (1.0 on simulated GPUs, so every tracker run says so)."""
    out: dict[str, float] = {"phase_index": float(PHASE_INDEX[phase.name]), "simulated": float(simulated)}
    if power_limit_w is not None:
        out["power_limit_w"] = float(power_limit_w)
    chosen = chosen_w(phase)
    if chosen is not None:
        out["optimal_power_limit_w"] = float(chosen)
    out["profiling_steps"] = float(meter.steps)
    out["profiling_energy_j"] = meter.energy_j
    return out


def report(
    options: PowerLimitOptions,
    phase: Phase,
    search: Search | None,
    meter: StepMeter,
    num_gpus: int,
    simulated: bool,
    unfinished: str,
) -> dict[str, Any]:
    """The profile as plain data: one row per profiled limit, the choice, and the saving against the highest
    limit profiled (by the measurements; labelled `simulated` when the GPUs are). `unfinished`: what the last
    run's end said when it cut profiling short, and no run since ("": none); then `phase` is `incomplete` and
    `incomplete_reason` says it."""
    chosen = chosen_w(phase)
    out: dict[str, Any] = {
        "selector": repr(options.selector),
        "search": options.search,
        "simulated": simulated,
        "num_gpus": num_gpus,
        "phase": "incomplete" if unfinished else phase.name,
        "power_limits": search.rows() if search is not None else [],
        "optimal_power_limit_w": chosen,
        "applied": isinstance(phase, Done),
        "profiling_steps": meter.steps,
        "profiling_energy_j": meter.energy_j,
    }
    if isinstance(phase, Inactive):
        out["inactive_reason"] = phase.reason
    if unfinished:
        out["incomplete_reason"] = unfinished
    if search is not None:
        out.update(search.saving(chosen))
    return out


def say_unfinished(options: PowerLimitOptions, search: Search | None, meter: StepMeter) -> str:
    """Warn that training ended before profiling finished (how far it got, how many steps a run needs,
    where the profile is carried); returns the reason `report` gives."""
    stats = search.stats if search is not None else {}
    measured = sum(1 for s in stats.values() if s.steps)
    carry = (
        f"it is saved in {options.path}: the next run with the same profile_path carries on"
        if options.path is not None
        else "pass `profile_path=...` to carry the profile to the next run (or resume from a checkpoint: "
        "the profile is in the optimizer's state)"
    )
    needs = (
        search.steps_needed_text(options.wait_steps, meter.steps_per_sample()) if search is not None else ""
    )
    grid = search.grid if search is not None else []
    said = (
        f"training ended before profiling finished ({measured} of {len(grid)} power limits measured "
        f"in {meter.steps} steps): {needs}"
    )
    logger.warning(
        "GlobalPowerLimitOptimizer: %s; no power limit was chosen and the GPUs are back as they were. %s.",
        said,
        carry[0].upper() + carry[1:],
    )
    return said


def refused_state_warning(
    source: object, owner: str, error: InvalidInputError, profile: Path | None, then: str = ""
) -> None:
    """Log the one warning for a checkpoint state that `load_state_dict` refused: `source` (the file),
    `owner` (the callback), why, and what profiling goes on from (`then`, else the `profile` when it exists,
    else nothing: profiling starts afresh)."""
    if not then:
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
