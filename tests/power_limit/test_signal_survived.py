"""A SIGINT/SIGTERM the process survives (issue 38 item 5): the GPU-state guard puts the GPUs back, and the
optimizer says so instead of reporting its choice as in force (virtual clock)."""

from __future__ import annotations

import os
import signal

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit import states
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import Time

WORK_S = 0.1


def _until_done(opt: GlobalPowerLimitOptimizer, system: sim.SimulatedSystem) -> None:
    for _ in range(2000):
        opt.on_step_begin()
        system.run_step(WORK_S)
        opt.on_step_end()
        if opt.phase == "done":
            return
    raise AssertionError(f"still {opt.phase}")


def test_a_survived_sigterm_reports_the_choice_as_no_longer_in_force():
    """The choice in force, then SIGTERM with a framework handler that lets training go on (a checkpoint
    first): the GPU is back at its own 300 W, and `phase`, `state`, `metrics()` and `report()` say the choice
    is not applied and why. A later run applies it again. On the parent commit the optimizer still said
    `done` with its limit in force."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # the framework's
    try:
        system = sim.simulate("a40", virtual_clock=True, noise=0.02, seed=1)
        opt = GlobalPowerLimitOptimizer(ZeusMonitor(), Time(), warmup_steps=1, profile_steps=8)
        _until_done(opt, system)
        chosen = opt.optimal_power_limit_w
        assert chosen is not None and chosen < 300 and system.gpus[0].power_limit_mw == chosen * 1000

        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM] and system.gpus[0].power_limit_mw == 300_000  # put back
        opt.on_step_begin()  # training goes on after the handler
        system.run_step(WORK_S)
        opt.on_step_end()

        assert opt.phase == "inactive" and opt.power_limit_w is None
        assert opt.optimal_power_limit_w == chosen  # the choice is still known
        state = opt.state
        assert isinstance(state, states.Inactive) and state.optimal_power_limit == chosen * 1000
        assert "SIGTERM" in state.reason
        report = opt.report()
        assert report["applied"] is False and "SIGTERM" in report["inactive_reason"]
        assert "power_limit_w" not in opt.metrics()
        assert opt.metrics()["phase_index"] == GlobalPowerLimitOptimizer.PHASE_INDEX["inactive"]

        opt.on_train_end()
        opt.on_step_begin()  # a later run: the choice is applied again
        assert opt.phase == "done" and opt.power_limit_w == chosen
        assert system.gpus[0].power_limit_mw == chosen * 1000
        opt.on_train_end()
        assert system.gpus[0].power_limit_mw == 300_000
    finally:
        signal.signal(signal.SIGTERM, previous)
        sim.disable()
