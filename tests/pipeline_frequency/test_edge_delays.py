"""Edge delays in the pipeline DAG: the longest path, the solver and the exact reference include them; they
are measured from the instructions' start times and travel beside the profile."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from frontier_options import _options

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.edge_delays import EdgeDelays, measure_edge_delays
from zeus_callbacks.core.pipeline_frequency.frontier import evaluate, frontier, max_frequency_plan, solve
from zeus_callbacks.core.pipeline_frequency.profile_file import (
    edge_delays_path,
    read_edge_delays,
    write_edge_delays,
)
from zeus_callbacks.core.pipeline_frequency.recorder import StepTimeline


def _delay(cross_s: float, host_s: float):
    return lambda u, v: host_s if u.stage == v.stage else cross_s


def test_longest_path_with_edge_delays_hand_computed():
    # 1F1B, 2 stages x 2 microbatches: stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1.
    # Forward 1 s, backward 2 s; 0.5 s between stages, 0.1 s between a stage's own instructions.
    dag = build_dag(build_schedule("1f1b", 2, 2), edge_delay_s=_delay(0.5, 0.1))
    durations = [1.0 if i.kind == "forward" else 2.0 for i in dag.instructions]
    start = dict(zip(dag.instructions, dag.earliest_start(durations), strict=True))
    F = lambda s, m: Instruction(s, "forward", m)  # noqa: E731
    B = lambda s, m: Instruction(s, "backward", m)  # noqa: E731
    expected = {
        F(0, 0): 0.0,
        F(0, 1): 1.1,  # after F(0,0) and the host's 0.1 s
        F(1, 0): 1.5,  # F(0,0) ends at 1, plus 0.5 s to the next stage
        B(1, 0): 2.6,
        F(1, 1): 4.7,  # its stage is busy until 4.6 (B(1,0)); F(0,1)'s data arrived at 2.6
        B(1, 1): 5.8,
        B(0, 0): 5.1,  # B(1,0) ends at 4.6, plus 0.5 s
        B(0, 1): 8.3,  # B(1,1) ends at 7.8, plus 0.5 s
    }
    assert start == pytest.approx(expected)
    assert dag.iteration_time(durations) == pytest.approx(10.3)
    assert build_dag(build_schedule("1f1b", 2, 2)).iteration_time(durations) == pytest.approx(9.0)
    assert dag.edge_delays() == [0.1 if a.stage == b.stage else 0.5 for a, b in _edge_pairs(dag)]


def _edge_pairs(dag):
    return [(dag.instructions[u], dag.instructions[v]) for u, v in dag.edges]


def test_edge_delays_default_to_zero_and_must_be_valid():
    dag = build_dag(build_schedule("gpipe", 2, 3))
    assert dag.edge_delays() == [0.0] * len(dag.edges)
    with pytest.raises(ValueError, match="finite and >= 0"):
        dag.with_edge_delays(lambda u, v: -1.0)


def _brute_force(dag, options, p_blk: float, target: float) -> float:
    """Least energy over every assignment whose iteration time, edge delays included, meets `target`."""
    n = len(dag)
    choices = [options[i.stage, i.kind] for i in dag.instructions]
    idx = np.array(list(itertools.product(*[range(len(c)) for c in choices])), dtype=np.int8)
    width = max(len(c) for c in choices)
    times = np.array([[o.time_s for o in c] + [0.0] * (width - len(c)) for c in choices])
    energies = np.array([[o.energy_j for o in c] + [0.0] * (width - len(c)) for c in choices])
    d = times[np.arange(n), idx]
    start = np.zeros_like(d)
    delays = dag.predecessor_delays()
    for v in range(n):
        for u, x in zip(dag.predecessors(v), delays[v], strict=True):
            np.maximum(start[:, v], start[:, u] + d[:, u] + x, out=start[:, v])
    t_iter = (start + d).max(axis=1)
    energy = energies[np.arange(n), idx].sum(axis=1) + p_blk * (dag.num_stages * t_iter - d.sum(axis=1))
    return float(energy[t_iter <= target * (1 + 1e-9)].min())


@pytest.mark.parametrize("kind,seed", [("1f1b", 3), ("gpipe", 4)])
def test_solver_frontier_and_exact_plan_with_edge_delays(kind, seed):
    options = _options(seed, 2, 3)
    # Delays of the order of an instruction: a plan that ignored them would miss the deadline.
    dag = build_dag(build_schedule(kind, 2, 3), edge_delay_s=_delay(0.4, 0.05))
    ref = max_frequency_plan(dag, options, 80.0)
    zero = max_frequency_plan(build_dag(build_schedule(kind, 2, 3)), options, 80.0)
    assert ref.iteration_time_s > zero.iteration_time_s + 0.4
    plan = solve(dag, options, 80.0)
    assert plan.iteration_time_s <= ref.iteration_time_s * (1 + 1e-9)
    again = evaluate(dag, options, 80.0, plan.frequencies_mhz)
    assert again.iteration_time_s == pytest.approx(plan.iteration_time_s)
    best = _brute_force(dag, options, 80.0, ref.iteration_time_s)
    assert plan.energy_j <= best * (1 + 1e-3)
    chosen = frontier(dag, options, 80.0).choose()
    assert chosen.iteration_time_s <= ref.iteration_time_s * (1 + 1e-9)
    assert chosen.energy_j == pytest.approx(plan.energy_j, rel=1e-9)
    pytest.importorskip("scipy")
    from zeus_callbacks.core.pipeline_frequency.exact import exact_plan

    exact = exact_plan(dag, options, 80.0, ref.iteration_time_s)
    assert exact is not None and exact.energy_j == pytest.approx(best, rel=1e-6)


def _timelines(dag, durations, offsets_s=None, hosts=None, steps=3, jitter=None):
    """Per step, stage -> `StepTimeline` of a pipeline that runs exactly as `dag` says (its edge delays
    included), each stage's clock shifted by `offsets_s[stage]`; `jitter(step, node)` adds to a duration."""
    offsets_s = offsets_s or [0.0] * dag.num_stages
    hosts = hosts or ["node"] * dag.num_stages
    out = []
    for k in range(steps):
        d = [t + (jitter(k, v) if jitter else 0.0) for v, t in enumerate(durations)]
        start = dict(zip(dag.instructions, dag.earliest_start(d), strict=True))
        length = dict(zip(dag.instructions, d, strict=True))
        step = {}
        for s, order in enumerate(dag.schedule):
            base = 100.0 * k + offsets_s[s]
            starts = tuple(base + start[i] for i in order)
            end = starts[-1] + length[order[-1]]
            step[s] = StepTimeline(
                hosts[s],
                starts[0] - 0.01,
                end + 0.02 - starts[0] + 0.01,
                starts,
                tuple(length[i] for i in order),
            )
        out.append(step)
    return out


def test_measured_edge_delays_recover_the_pipeline_that_ran():
    truth = _delay(0.03, 0.002)
    dag = build_dag(build_schedule("1f1b", 3, 4))
    durations = [0.1 if i.kind == "forward" else 0.2 for i in dag.instructions]
    ran = dag.with_edge_delays(truth)
    measured = measure_edge_delays(dag, _timelines(ran, durations))
    for (u, v), d in zip(dag.edges, ran.edge_delays(), strict=True):
        a, b = dag.instructions[u], dag.instructions[v]
        if a.stage != b.stage:  # every link carries data that some instruction waits for
            assert measured.delay_s(a, b) == pytest.approx(d)
        else:  # a stage's own gaps: its host time, or longer where it never ran back to back
            assert measured.delay_s(a, b) >= d - 1e-12
    assert measured.step_overhead_s == pytest.approx(0.03)
    predicted = measured.apply(dag).iteration_time(durations) + measured.step_overhead_s
    assert predicted == pytest.approx(ran.iteration_time(durations) + 0.03)
    # The profile file's rows carry it unchanged.
    assert EdgeDelays.from_rows(measured.to_rows()) == measured


def test_a_stage_waiting_for_the_next_stage_keeps_its_slack():
    """Fails if a stage's wait for the next stage's gradient is measured as its own forward -> backward
    delay (the edge nearest its kind's floor taken as tight, not the input that arrived last): the plan
    then finds no slack (DeepSpeed 1F1B saved 3-7% instead of 9-10%)."""
    # The last stage is twice as slow: the others always wait for its gradients, so their forward -> backward
    # gaps are waits (slack), never host time. Those edges get the host time measured on their stage.
    truth = _delay(0.003, 0.001)
    dag = build_dag(build_schedule("1f1b", 3, 6))
    durations = [(0.1 if i.kind == "forward" else 0.2) * (2 if i.stage == 2 else 1) for i in dag.instructions]
    ran = dag.with_edge_delays(truth)
    measured = measure_edge_delays(dag, _timelines(ran, durations))
    for (u, v), d in zip(dag.edges, ran.edge_delays(), strict=True):
        assert measured.delay_s(dag.instructions[u], dag.instructions[v]) == pytest.approx(d)


def test_clock_offsets_between_hosts_cancel():
    dag = build_dag(build_schedule("1f1b", 2, 4))
    durations = [0.1 if i.kind == "forward" else 0.2 for i in dag.instructions]
    ran = dag.with_edge_delays(_delay(0.03, 0.0))
    # Stage 1 on another host whose clock is 5 s ahead: one direction reads 5.03 s, the other -4.97 s.
    steps = _timelines(ran, durations, offsets_s=[0.0, 5.0], hosts=["a", "b"])
    measured = measure_edge_delays(dag, steps)
    F = lambda s, m: Instruction(s, "forward", m)  # noqa: E731
    B = lambda s, m: Instruction(s, "backward", m)  # noqa: E731
    assert measured.delay_s(F(0, 0), F(1, 0)) == pytest.approx(0.03)
    assert measured.delay_s(B(1, 0), B(0, 0)) == pytest.approx(0.03)


def test_steps_that_do_not_match_the_schedule_are_skipped():
    dag = build_dag(build_schedule("1f1b", 2, 2))
    other = build_dag(build_schedule("1f1b", 2, 3))
    steps = _timelines(other, [0.1] * len(other))
    assert measure_edge_delays(dag, steps) == EdgeDelays()
    assert measure_edge_delays(dag, []).apply(dag) is dag


def test_edge_delays_file_beside_the_profile(tmp_path):
    profile = tmp_path / "profile.csv"
    assert edge_delays_path(profile) == tmp_path / "profile.edges.csv"
    assert read_edge_delays(edge_delays_path(profile)) == []  # an old profile: no delays
    delays = EdgeDelays({(0, "forward", 1, "forward"): 0.001, (1, "backward", 1, "forward"): 2e-4}, 0.003)
    write_edge_delays(edge_delays_path(profile), delays.to_rows())
    assert EdgeDelays.from_rows(read_edge_delays(edge_delays_path(profile))) == delays
    edge_delays_path(profile).write_text(
        "from_stage,from_instruction,to_stage,to_instruction,delay\n0,f,1,b,x\n"
    )
    with pytest.raises(InvalidInputError, match=r"profile.edges.csv:2"):
        read_edge_delays(edge_delays_path(profile))


def test_cli_pipeline_plan_reads_the_edge_delays_beside_the_profile(tmp_path, capsys):
    from profile_rows import _profile

    from zeus_callbacks.cli import main
    from zeus_callbacks.core.pipeline_frequency.profile_file import write_profile

    path = tmp_path / "profile.csv"
    write_profile(path, _profile(2))
    argv = ["pipeline-plan", "--profile", str(path), "--p-blk", "80", "--microbatches", "4", "--json"]

    def planned() -> dict:
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    without = planned()
    links = {(0, "forward", 1, "forward"): 0.005, (1, "backward", 0, "backward"): 0.005}
    write_edge_delays(edge_delays_path(path), EdgeDelays(links).to_rows())
    with_delays = planned()
    # The critical path crosses the link in both directions at least once: 10 ms or more.
    slower = with_delays["max_frequency"]["iteration_time_s"] - without["max_frequency"]["iteration_time_s"]
    assert slower >= 0.01 - 1e-9
    assert with_delays["plan"]["iteration_time_s"] <= with_delays["max_frequency"]["iteration_time_s"] * (
        1 + 1e-9
    )
