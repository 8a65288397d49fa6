"""Logs recorded by Zeus replayed through this package, and `search="zeus"` beside Zeus 0.16 itself.

Zeus's `tests/optimizer/test_power_limit_optimizer.py` drives its optimizer from the monitor logs of
`tests/profile_data/` (one row per power limit, one window over `profile_steps` steps), with epochs that
interrupt profiling never, once, twice or at every limit. The same logs ship as this package's data
(`zeus_callbacks/sim/data/zeus_profiles/`); the loop here is written from that test's description, and
Zeus's own optimizer and `ReplayZeusMonitor` (the installed `zeus` 0.16) run beside ours on the same
simulated GPUs, step by step. No Zeus code is copied.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from zeus_callbacks import (
    Done,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    ReplayZeusMonitor,
    Time,
    ZeusCost,
    sim,
    zeus_cost,
)

DATA = Path(sim.__file__).parent / "data" / "zeus_profiles"
LOGS = sorted(p.name for p in DATA.glob("*.csv"))
STEP_S = 0.01  # the simulated work of a step; the replayed figures are the log's
# Steps per epoch and epochs for Zeus's four interrupt patterns, given the number of limits `n`.
PATTERNS = {
    "never": lambda n: (50 * n + 10, 3),
    "in warm-up": lambda n: (50 * (n // 2) + 5, 4),
    "in profiling": lambda n: (50 * (n // 3) + 15, 5),
    "at every limit": lambda n: (100, n + 2),  # on the last profiled step of every second limit
}


def _rows(name: str) -> list[tuple[int, float, float]]:
    """(power limit W, time s, energy J summed over GPUs) of each row of a log Zeus recorded."""
    with open(DATA / name, newline="") as f:
        return [
            (
                int(r["window_name"].rsplit("_", 1)[1]),
                float(r["elapsed_time"]),
                sum(float(v) for k, v in r.items() if k.endswith("_energy")),
            )
            for r in csv.DictReader(f)
        ]


def _gpus(name: str) -> str:
    """The simulated node a log was recorded on: `A40+resnet18+gpu0,1,2,3.csv` -> `4*a40`."""
    kind, _, gpus = name.removesuffix(".csv").split("+")
    return f"{len(gpus.split(','))}*{kind.lower()}"


def _recorded_choice(name: str, eta_knob: float) -> int:
    """The limit with the least `zeus_cost` among the log's rows: the recorded run's decision."""
    rows = _rows(name)
    num_gpus = int(_gpus(name).split("*")[0])
    max_power = max(pl for pl, _, _ in rows) * num_gpus
    costs = [zeus_cost(e, t, eta_knob, max_power) for _, t, e in rows]
    return rows[costs.index(min(costs))][0]


def _loop(plo, system, steps_per_epoch: int, epochs: int) -> list[int]:
    """Zeus's test loop; the power limit (W) each step ran at."""
    trace = []
    for _ in range(epochs):
        plo.on_epoch_begin()
        for _ in range(steps_per_epoch):
            plo.on_step_begin()
            trace.append(system.gpus[0].power_limit_mw // 1000)
            system.run_step(STEP_S)
            plo.on_step_end()
        plo.on_epoch_end()
    return trace


def _ours(name: str, selector, pattern: str, search: str, **kw) -> tuple[GlobalPowerLimitOptimizer, list]:
    system = sim.simulate(_gpus(name), virtual_clock=True)
    monitor = ReplayZeusMonitor(log_file=DATA / name, ignore_sync_execution=True, match_window_name=False)
    plo = GlobalPowerLimitOptimizer(monitor, selector, search=search, **kw)
    trace = _loop(plo, system, *PATTERNS[pattern](len(_rows(name))))
    return plo, trace


@pytest.mark.parametrize("name", LOGS)
def test_a_log_recorded_by_zeus_drives_the_optimizer_to_the_recorded_decision(name: str):
    """Issue 24: every case used to stop with "No more rows ... to replay window
    '__GlobalPowerLimitOptimizer_step'". Each step is now served from the row of the limit it ran at:
    the default search, and Zeus's own (interrupted at every limit), take the recorded run's decision."""
    num_gpus = int(_gpus(name).split("*")[0])
    cases = [(eta, "never", "adaptive") for eta in (0.0, 0.25, 0.5, 0.75, 1.0)]
    cases += [
        (0.5, "at every limit", "adaptive"),
        (0.5, "at every limit", "zeus"),
        (0.25, "in warm-up", "sweep"),
    ]
    for eta_knob, pattern, search in cases:
        plo, _ = _ours(name, ZeusCost(eta_knob, world_size=num_gpus), pattern, search)
        want = Done(optimal_power_limit=_recorded_choice(name, eta_knob) * 1000)
        assert plo.state == want, (eta_knob, pattern, search, plo.report())
        sim.disable()


def test_replayed_zeus_rows_are_spread_over_the_steps_they_covered(tmp_path: Path):
    name = "A40+resnet50+gpu0.csv"
    plo, _ = _ours(name, Energy(), "never", "sweep", profile_steps=40)
    for pl, time_s, energy_j in _rows(name):
        assert plo.stats[pl].mean_time_s == pytest.approx(time_s / 40)
        assert plo.stats[pl].mean_energy_j == pytest.approx(energy_j / 40)
    # Reused from the profile this run wrote, each selector answers as from the log (Zeus's second half).
    sim.disable()
    path = tmp_path / "profile.json"
    plo, _ = _ours(name, ZeusCost(0.5), "never", "sweep", profile_path=path)
    rows = _rows(name)
    fastest = min(rows, key=lambda r: r[1])
    assert GlobalPowerLimitOptimizer(plo.monitor, Time(), search="sweep", profile_path=path).state == Done(
        fastest[0] * 1000
    )
    least = min(rows, key=lambda r: r[2])
    assert GlobalPowerLimitOptimizer(plo.monitor, Energy(), search="sweep", profile_path=path).state == Done(
        least[0] * 1000
    )
    within = [r for r in rows if r[1] <= rows[0][1] * 1.1]
    lowest = MaxSlowdownConstraint(1.1, prefer="lowest_power_limit")
    assert GlobalPowerLimitOptimizer(plo.monitor, lowest, search="sweep", profile_path=path).state == Done(
        min(r[0] for r in within) * 1000
    )


def test_a_step_at_a_limit_the_zeus_log_lacks_is_a_clear_error():
    sim.simulate("a40", virtual_clock=True)
    monitor = ReplayZeusMonitor(log_file=DATA / "V100+resnet50+gpu0.csv")  # 100-250 W; the A40 is at 300
    monitor.begin_window("__GlobalPowerLimitOptimizer_step")
    with pytest.raises(RuntimeError, match=r"recorded by Zeus's optimizer.*300\] W, which it has no row for"):
        monitor.end_window("__GlobalPowerLimitOptimizer_step")
    with pytest.raises(ValueError, match=r"steps_per_row=0"):
        ReplayZeusMonitor(log_file=DATA / "V100+resnet50+gpu0.csv", steps_per_row=0)


# -- search="zeus" beside Zeus 0.16 ------------------------------------------------------------------
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("name", ["A40+resnet18+gpu0.csv", "V100+bert-base-uncased+gpu0.csv"])
def test_search_zeus_takes_zeus_016s_limits_at_the_same_steps(monkeypatch, name: str, pattern: str):
    """Issue 24: with every epoch interrupting profiling, later limits used to finish one step early
    (at the end of their last step, where Zeus counts it at the next step's beginning), so an epoch's end
    on that step interrupted Zeus's limit but not ours, and the two sequences parted."""
    zeus_gpu = pytest.importorskip("zeus.device.gpu")
    zeus_pl = pytest.importorskip("zeus.optimizer.power_limit")
    zeus_testing = pytest.importorskip("zeus.utils.testing")
    # Zeus's optimizer registers a hook that sets the maximum limit at exit, when no simulation is left
    # to answer it (Zeus's own test removes it the same way); Zeus discovers GPUs once per process.
    monkeypatch.setattr(zeus_pl, "atexit", SimpleNamespace(register=lambda *a, **k: None))
    monkeypatch.setattr(zeus_gpu, "_gpus", None)
    steps, epochs = PATTERNS[pattern](len(_rows(name)))
    system = sim.simulate(_gpus(name), virtual_clock=True)
    monitor = zeus_testing.ReplayZeusMonitor(
        log_file=str(DATA / name), ignore_sync_execution=True, match_window_name=False
    )
    theirs = zeus_pl.GlobalPowerLimitOptimizer(monitor, zeus_pl.ZeusCost(0.5))
    zeus_trace = _loop(theirs, system, steps, epochs)
    sim.disable()
    ours, trace = _ours(name, ZeusCost(0.5), pattern, "zeus")
    assert isinstance(theirs.state, zeus_pl.Done)
    assert ours.state == Done(theirs.state.optimal_power_limit)
    parted = next((i for i, (a, b) in enumerate(zip(zeus_trace, trace, strict=True)) if a != b), None)
    assert parted is None, (parted, zeus_trace[parted - 3 : parted + 3], trace[parted - 3 : parted + 3])


def test_an_epoch_ending_on_a_limits_last_step_restarts_it_with_search_zeus():
    """The smallest case: warm-up 2 + 3 measured steps, epochs of 5 steps after the first. Zeus counts a
    limit's last step at the next step's beginning, so every epoch's end lands on that step and
    interrupts the limit; only the first epoch (a wait step, then 6 steps) measures one."""
    system = sim.simulate("a40", virtual_clock=True)
    from zeus_callbacks import ZeusMonitor

    plo = GlobalPowerLimitOptimizer(
        ZeusMonitor(), Energy(), wait_steps=0, warmup_steps=2, profile_steps=3, search="zeus"
    )
    for epoch in range(6):
        plo.on_epoch_begin()
        for _ in range(6 if epoch == 0 else 5):
            plo.on_step_begin()
            system.run_step(0.2)
            plo.on_step_end()
        plo.on_epoch_end()
    assert sorted(plo.stats) == [300]  # before: 275 W too, and a limit more every epoch


def test_report_says_incomplete_after_a_run_that_ended_mid_profiling(caplog):
    """Issue 24: `report()["phase"]` said `waiting`; the end-of-training message says how many steps a
    run needs (issue 24: Zeus's run_clm.py with 600 steps measured 1 of 9 limits, and nothing said why)."""
    from zeus_callbacks import ZeusMonitor

    for search, step_s, needed in (
        ("sweep", 0.2, 1 + 9 * 50),
        ("adaptive", 0.02, 1 + 9 * (10 + 40 * 5) * 3 // 4),
    ):
        system = sim.simulate("a40", virtual_clock=True)
        plo = GlobalPowerLimitOptimizer(ZeusMonitor(), search=search)
        plo.on_train_begin()
        with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
            for _ in range(150):
                plo.on_step_begin()
                system.run_step(step_s)
                plo.on_step_end()
            plo.on_train_end()
        report = plo.report()
        assert report["phase"] == "incomplete" and plo.phase == "waiting"  # waiting for the next run
        # The adaptive budget with 20 ms steps against the A40's 100 ms refresh: ~5 steps per sample.
        assert plo.steps_needed() == pytest.approx(needed, abs=5)
        needed = plo.steps_needed()
        said = [r.getMessage() for r in caplog.records if "before profiling finished" in r.getMessage()]
        assert (
            len(said) == 1
            and f"profiling needs {'at most ' * (search == 'adaptive')}{needed} steps" in said[0]
        )
        assert "of 9 power limits measured in 149 steps" in report["incomplete_reason"]
        # The next run carries on: its report says what that run is doing.
        plo.on_step_begin()
        assert plo.report()["phase"] != "incomplete"
        plo.on_train_end()
        caplog.clear()
        sim.disable()
