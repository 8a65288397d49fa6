"""Wrote the profiles and checkpoint states of this folder with the code of commit 1e9a50b (before
measurement chunks were `Chunk` records): `PYTHONPATH=<that checkout> python make_fixtures.py <this folder>`.
Kept as test data: today's code must read them (tests/power_limit/test_schema.py)."""

import json
import sys
from pathlib import Path

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import MaxSlowdownConstraint, ZeusCost

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
expect = {}


def run(name, steps, spec, work, search="adaptive", selector=None, refresh=None, bursts=False):
    system = sim.simulate(
        spec, virtual_clock=True, noise=0.02, seed=5, energy_refresh_ms=refresh, bursts=bursts
    )
    path = out / f"{name}.profile.json"
    opt = GlobalPowerLimitOptimizer(
        ZeusMonitor(), selector or ZeusCost(0.5), profile_path=path, search=search
    )
    for _ in range(steps):
        opt.on_step_begin()
        system.run_step(work)
        opt.on_step_end()
        if opt.phase in ("done", "inactive"):
            break
    state = opt.state_dict()
    (out / f"{name}.state.json").write_text(json.dumps(state, indent=1))
    expect[name] = {
        "phase": opt.phase,
        "optimal_power_limit_w": opt.optimal_power_limit_w,
        "profiling_steps": opt.profiling_steps,
        "stats": {
            str(pl): {
                "steps": s.steps,
                "samples": s.samples,
                "dropped_steps": s.dropped_steps,
                "mean_time_s": s.mean_time_s,
                "mean_energy_j": s.mean_energy_j,
                "windows": len(s.power_windows_w),
                "visits": s.visits,
                "pruned": s.pruned,
                "rel_vars": list(s.rel_vars()),
            }
            for pl, s in opt.stats.items()
        },
    }
    sim.disable()


# short steps against the counter's refresh: chunks of several steps, settling steps, power windows
run("adaptive_complete", 5000, "a40", 0.02, refresh=100)
run("adaptive_partial", 120, "a40", 0.02, refresh=100)
run("adaptive_bursts", 5000, "a40", 0.1, selector=MaxSlowdownConstraint(1.1), bursts=True)
run("sweep_complete", 5000, "a40", 0.1, search="sweep")
(out / "expected.json").write_text(json.dumps(expect, indent=1))
print({k: (v["phase"], v["optimal_power_limit_w"], len(v["stats"])) for k, v in expect.items()})
