"""The Perseus solver against brute force on tiny pipelines, and its energy model and frontier."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from frontier_options import _options

import zeus_callbacks.core.pipeline_frequency.frontier as frontier_module
from zeus_callbacks.cli import main
from zeus_callbacks.core.pipeline_frequency.dag import build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.frontier import (
    FrequencyOption,
    evaluate,
    frontier,
    max_frequency_plan,
    pareto_options,
    solve,
)
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow, write_profile


def _brute_force(dag, options, p_blk: float, target: float) -> float:
    """Least energy over every assignment of profiled options whose iteration time meets `target`."""
    n = len(dag)
    choices = [options[i.stage, i.kind] for i in dag.instructions]
    idx = np.array(list(itertools.product(*[range(len(c)) for c in choices])), dtype=np.int8)
    width = max(len(c) for c in choices)
    times = np.array([[o.time_s for o in c] + [0.0] * (width - len(c)) for c in choices])
    energies = np.array([[o.energy_j for o in c] + [0.0] * (width - len(c)) for c in choices])
    d = times[np.arange(n), idx]
    start = np.zeros_like(d)
    for v in range(n):
        for u in dag.predecessors(v):
            np.maximum(start[:, v], start[:, u] + d[:, u], out=start[:, v])
    t_iter = (start + d).max(axis=1)
    energy = energies[np.arange(n), idx].sum(axis=1) + p_blk * (dag.num_stages * t_iter - d.sum(axis=1))
    return float(energy[t_iter <= target * (1 + 1e-9)].min())


CASES = [
    # (schedule, stages, microbatches, frequencies, seed)
    ("1f1b", 2, 2, 3, 0),
    ("1f1b", 2, 3, 3, 1),
    ("gpipe", 2, 3, 3, 2),
    ("1f1b", 3, 3, 2, 3),
    ("gpipe", 3, 3, 2, 4),
    ("1f1b", 2, 4, 2, 5),
]


@pytest.mark.parametrize("kind,stages,microbatches,freqs,seed", CASES)
def test_matches_brute_force_at_max_frequency_time(kind, stages, microbatches, freqs, seed):
    dag = build_dag(build_schedule(kind, stages, microbatches))
    options = _options(seed, stages, freqs)
    p_blk = 60 + 10 * seed
    ref = max_frequency_plan(dag, options, p_blk)
    plan = solve(dag, options, p_blk)
    assert plan.iteration_time_s <= ref.iteration_time_s * (1 + 1e-9)
    best = _brute_force(dag, options, p_blk, ref.iteration_time_s)
    assert plan.energy_j == pytest.approx(best, rel=1e-9)
    assert plan.energy_j < ref.energy_j


@pytest.mark.parametrize("kind,stages,microbatches,freqs,seed", CASES[:4])
def test_near_brute_force_with_looser_target(kind, stages, microbatches, freqs, seed):
    dag = build_dag(build_schedule(kind, stages, microbatches))
    options = _options(seed, stages, freqs)
    target = 1.1 * max_frequency_plan(dag, options, 80.0).iteration_time_s
    plan = solve(dag, options, 80.0, target_time_s=target)
    assert plan.iteration_time_s <= target * (1 + 1e-9)
    best = _brute_force(dag, options, 80.0, target)
    assert best * (1 - 1e-9) <= plan.energy_j <= best * 1.001


@pytest.mark.parametrize("kind,stages,microbatches,freqs,seed", CASES[:4])
def test_without_scipy_the_heuristic_plans_alone(monkeypatch, kind, stages, microbatches, freqs, seed):
    monkeypatch.setattr(frontier_module, "_REFINE", [False])
    dag = build_dag(build_schedule(kind, stages, microbatches))
    options = _options(seed, stages, freqs)
    ref = max_frequency_plan(dag, options, 80.0)
    plan = solve(dag, options, 80.0)
    best = _brute_force(dag, options, 80.0, ref.iteration_time_s)
    assert best * (1 - 1e-9) <= plan.energy_j <= best * 1.015
    front = frontier(dag, options, 80.0, num_points=6)
    assert front.choose().energy_j <= plan.energy_j * (1 + 1e-9)


def test_energy_model_counts_blocking_power_per_stage():
    schedule = build_schedule("1f1b", 2, 2)
    options = {
        (0, "forward"): [FrequencyOption(1500, 1.0, 100.0)],
        (0, "backward"): [FrequencyOption(1500, 2.0, 200.0)],
        (1, "forward"): [FrequencyOption(1500, 1.0, 100.0)],
        (1, "backward"): [FrequencyOption(1500, 2.0, 200.0)],
    }
    plan = evaluate(schedule, options, [10.0, 20.0], {i: 1500 for order in schedule for i in order})
    # Stage 1 runs F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; stage 0 runs B0 [4,6] and B1 [7,9].
    assert plan.iteration_time_s == pytest.approx(9.0)
    # 4 x (100 + 200) J of compute, and each stage is busy 6 s of 9 s: 3 s blocking at 10 W and at 20 W.
    assert plan.energy_j == pytest.approx(1200.0 + 10.0 * 3 + 20.0 * 3)
    assert plan.stage_frequencies() == [[1500] * 4, [1500] * 4]


def test_blocking_power_makes_slow_options_useless():
    opts = [
        FrequencyOption(1740, 1.0, 200.0),
        FrequencyOption(1200, 1.5, 170.0),
        FrequencyOption(900, 2.0, 160.0),
    ]
    # Effective energy e - P t: 0 W keeps all three; 80 W: 120, 50, 0 keeps all; 150 W: 50, -55, -140.
    assert [o.frequency_mhz for o in pareto_options(opts, 0.0)] == [1740, 1200, 900]
    # A slower, costlier option is dropped; so is a duplicate time with more energy.
    extra = opts + [FrequencyOption(1000, 2.5, 300.0), FrequencyOption(1710, 1.0, 210.0)]
    assert [o.frequency_mhz for o in pareto_options(extra, 50.0)] == [1740, 1200, 900]
    # With P_blk = 0 the slowest option wins on an off-critical instruction; with a huge P_blk nothing
    # off the critical path is worth slowing (blocking there costs as much as computing).
    assert [o.frequency_mhz for o in pareto_options(opts, 100.0)] == [1740, 1200, 900]
    assert [o.frequency_mhz for o in pareto_options([opts[0], FrequencyOption(900, 2.0, 420.0)], 200.0)] == [
        1740
    ]


def test_slack_goes_to_the_off_critical_stage_only():
    # Stage 1 is twice as slow as stage 0, so stage 0's instructions can slow down for free.
    options = {}
    for s, scale in ((0, 1.0), (1, 2.0)):
        for kind, mult in (("forward", 1.0), ("backward", 2.0)):
            options[s, kind] = [
                FrequencyOption(1740, scale * mult, scale * mult * 300),
                FrequencyOption(1300, scale * mult * 1.3, scale * mult * 1.3 * 150),
            ]
    schedule = build_schedule("1f1b", 2, 4)
    ref = max_frequency_plan(schedule, options, 50.0)
    plan = solve(schedule, options, 50.0)
    assert plan.iteration_time_s <= ref.iteration_time_s * (1 + 1e-9)
    assert all(f == 1740 for f in plan.stage_frequencies()[1])
    assert any(f == 1300 for f in plan.stage_frequencies()[0])
    assert plan.energy_j < ref.energy_j


def test_target_time_is_respected_and_infeasible_target_raises():
    schedule = build_schedule("1f1b", 3, 6)
    options = _options(7, 3, 4)
    ref = max_frequency_plan(schedule, options, 80.0)
    for factor in (1.0, 1.05, 1.2, 1.5):
        plan = solve(schedule, options, 80.0, target_time_s=factor * ref.iteration_time_s)
        assert plan.iteration_time_s <= factor * ref.iteration_time_s * (1 + 1e-9)
    with pytest.raises(ValueError, match="infeasible"):
        solve(schedule, options, 80.0, target_time_s=0.5 * ref.iteration_time_s)
    with pytest.raises(ValueError, match="No profiled options"):
        solve(schedule, {k: v for k, v in options.items() if k != (2, "backward")}, 80.0)
    with pytest.raises(ValueError, match="3 stages"):
        solve(schedule, options, [80.0, 80.0])


@pytest.mark.slow
def test_frontier_is_pareto_and_choose_meets_target():
    schedule = build_schedule("1f1b", 4, 8)
    options = _options(11, 4, 8)
    front = frontier(schedule, options, [85.0, 90.0, 95.0, 100.0], num_points=12)
    times = [p.iteration_time_s for p in front.plans]
    energies = [p.energy_j for p in front.plans]
    assert times == sorted(times) and all(a > b for a, b in zip(energies, energies[1:], strict=False))
    chosen = front.choose()
    assert chosen.iteration_time_s <= front.max_frequency.iteration_time_s * (1 + 1e-9)
    assert chosen.energy_j < front.max_frequency.energy_j
    assert front.choose(times[-1] * 2) is front.plans[-1]
    with pytest.raises(ValueError, match="No plan meets"):
        front.choose(times[0] * 0.5)
    # solve() refines one target at least as well as the frontier's point for it.
    assert solve(schedule, options, [85.0, 90.0, 95.0, 100.0]).energy_j <= chosen.energy_j * (1 + 1e-12)


def _noisy_profile(path, seed: int, num_stages: int, num_freqs: int) -> None:
    """A profile CSV of `_options`' kind, noisy enough that branch and bound runs out of nodes on some points."""
    options = _options(seed, num_stages, num_freqs)
    write_profile(
        path,
        [
            ProfileRow(s, k, o.frequency_mhz, o.time_s, o.energy_j)
            for (s, k), opts in options.items()
            for o in opts
        ],
    )


@pytest.mark.slow
def test_pipeline_plan_is_bounded_by_work_and_identical_on_a_loaded_host(tmp_path, monkeypatch, capsys):
    """Issue 24: the proof search stopped at a wall-clock limit, so plans depended on the host's speed."""
    pytest.importorskip("scipy.optimize")
    from zeus_callbacks.core.pipeline_frequency import exact
    from zeus_callbacks.core.pipeline_frequency.highs import MipStatus

    path = tmp_path / "profile.csv"
    _noisy_profile(path, 0, 2, 12)
    argv = ["pipeline-plan", "--profile", str(path), "--p-blk", "80", "--microbatches", "5", "--points", "4"]
    real, calls = exact.branch_and_bound, []

    def recording(*args):
        result = real(*args)
        calls.append((args[-1], result.status))
        return result

    monkeypatch.setattr(exact, "branch_and_bound", recording)
    assert main(argv) == 0
    idle = capsys.readouterr().out
    assert calls, "branch and bound never ran: the case does not exercise the proof search"
    assert all(options.time_limit_s is None and (options.node_limit or 0) > 0 for options, _ in calls)
    # HiGHS stopped by its node limit on some point: the case is one a limit decides.
    assert any(status is MipStatus.LIMIT for _, status in calls), calls
    monkeypatch.setattr(exact, "branch_and_bound", real)
    assert main(argv) == 0
    assert capsys.readouterr().out == idle
    # The same command in a fresh process while every core spins.
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(max(2, os.cpu_count() or 1))
    ]
    try:
        loaded = subprocess.run(
            [sys.executable, "-m", "zeus_callbacks.cli", *argv], capture_output=True, text=True, check=True
        ).stdout
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert loaded == idle


def test_pipeline_plan_prints_the_proven_gap_of_every_plan(tmp_path, monkeypatch, capsys):
    pytest.importorskip("scipy.optimize")
    path = tmp_path / "profile.csv"
    _noisy_profile(path, 1, 2, 4)
    argv = ["pipeline-plan", "--profile", str(path), "--p-blk", "80", "--microbatches", "3", "--points", "4"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("proven gap to optimum")
    rows = lines[2 : lines.index(next(line for line in lines if line.startswith("all at max")))]
    assert rows and all(float(row.split()[-1].rstrip("%")) <= 0.1 for row in rows), rows
    chosen = next(line for line in lines if line.startswith("chosen plan"))
    assert "proven within" in chosen and chosen.endswith("% of the optimum")
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(0 <= p["proven_gap"] <= 0.001 for p in [*out["frontier"], out["plan"]])
    assert out["max_frequency"]["proven_gap"] is None
    monkeypatch.setattr(frontier_module, "_REFINE", [False])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "proven within unproven (no scipy) of the optimum" in text
