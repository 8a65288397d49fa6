"""Builders of run records for the report's tests: a simulated run on a virtual clock, and a pipeline plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.dag import build_schedule
from zeus_callbacks.core.pipeline_frequency.planning import plan_pipeline
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
from zeus_callbacks.core.report.records import (
    GPUInfo,
    PowerLimitRow,
    PowerLimitSummary,
    PowerSample,
    RankRecord,
    StepSpan,
)
from zeus_callbacks.core.report.run_record import RunRecorder

WORK_S = 0.1


def simulated_run(
    run_dir: Path, spec: str = "2*a40", steps_after_choice: int = 100, **recorder_kw: Any
) -> tuple[RunRecorder, Any, int]:
    """Train on a virtual clock until the power-limit optimizer chose, then `steps_after_choice` more steps;
    the recorder finished. Deterministic (seeded noise, virtual clock)."""
    from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
    from zeus_callbacks.core.power_limit.selectors import ZeusCost

    system = sim.simulate(spec, virtual_clock=True, noise=0.02, seed=1)
    monitor = ZeusMonitor()
    opt = GlobalPowerLimitOptimizer(monitor, ZeusCost(0.5))
    rec = RunRecorder.start(run_dir, monitor, **recorder_kw)
    steps, left = 0, steps_after_choice
    while left > 0:
        opt.on_step_begin()
        rec.on_step_begin()
        system.run_step(WORK_S)
        opt.on_step_end()
        rec.on_step_end()
        steps += 1
        if opt.phase == "done":
            left -= 1
        assert steps < 5000
    rec.finish(optimizers=[opt])
    return rec, opt, steps


def pipeline_report(num_stages: int = 4, num_microbatches: int = 6) -> dict[str, Any]:
    """A `PipelineFrequencyOptimizer.report()` as it reads once a plan is applied (1F1B, a slower stage 1)."""
    order = build_schedule("1f1b", num_stages, num_microbatches)
    sequences = {s: [i.kind for i in o] for s, o in enumerate(order)}
    rows = []
    for s in range(num_stages):
        for kind, base in (("forward", 0.010), ("backward", 0.020)):
            base *= 1.3 if s == 1 else 1.0
            for f in (1740, 1500, 1200, 900):
                t = base * (1740 / f) ** 0.7
                rows.append(ProfileRow(s, kind, f, t, t * (150 * (f / 1740) ** 2 + 60)))
    plan = plan_pipeline(sequences, rows, {s: 60.0 for s in range(num_stages)})
    return {
        "phase": "applying",
        "simulated": True,
        "stage": 0,
        "may_lock_clocks": True,
        "profile": [r.__dict__ for r in rows],
        "blocking_power_w": {s: 60.0 for s in range(num_stages)},
        "profiling_steps": 40,
        **{k: v for k, v in plan.items() if k != "stage_plans"},
        "plan_applied": True,
    }


class FakePipelineOptimizer:
    """Stands for a PipelineFrequencyOptimizer in `RunRecorder.finish`: only `report()` is read."""

    def __init__(self, report: dict[str, Any]) -> None:
        self._report = report

    def report(self) -> dict[str, Any]:
        return self._report


def synthetic_record(
    simulated: bool = True,
    num_gpus: int = 2,
    carbon: float | None = 400.0,
    price: float | None = 0.2,
    rank: int = 0,
    title: str = "NVIDIA A40",
) -> RankRecord:
    """A record with round numbers: 100 steps of 0.1 s; 300 W for 50 steps, then 250 W; each GPU draws
    200 W (20 J per step) at 300 W and 150 W (15 J) at 250 W."""
    steps, samples = [], []
    for n in range(1, 101):
        pl = 300.0 if n <= 50 else 250.0
        e = 20.0 if n <= 50 else 15.0
        steps.append(StepSpan(n, n, round(0.1 * n, 4), 0.1, (e,) * num_gpus, (pl,) * num_gpus))
    for k in range(21):
        t = 0.5 * k
        pl = 300.0 if t <= 5.0 else 250.0
        samples.append(PowerSample(t, (200.0 if pl == 300 else 150.0,) * num_gpus, (pl,) * num_gpus))
    rows = (
        PowerLimitRow(300, 0.1, 20.0, 2.0, 40, False),
        PowerLimitRow(275, 0.102, 17.0, 1.8, 20, True),
        PowerLimitRow(250, 0.105, 15.0, 1.6, 40, False),
    )
    summary = PowerLimitSummary(
        "ZeusCost(eta_knob=0.5)", "adaptive", "done", rows, 250, True, 50, 1000.0, 25.0, 5.0
    )
    return RankRecord(
        rank=rank,
        simulated=simulated,
        title=title,
        started_unix_s=1_700_000_000.0,
        duration_s=10.0,
        gpus=[GPUInfo(i, f"GPU-{rank}-{i}", "NVIDIA A40", 100.0, 300.0) for i in range(num_gpus)],
        samples=samples,
        steps=steps,
        total_energy_j=[1750.0] * num_gpus,
        carbon_intensity_gco2_per_kwh=carbon,
        price_per_kwh=price,
        power_limit=summary,
        finished=True,
    )
