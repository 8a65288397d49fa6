"""PipelineFrequencyOptimizer in one process: the sweep, early stop, planning, fallback, restoring, permissions."""

from __future__ import annotations

import logging
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import burn_cpu
from pipeline_steps import FAST, _kinds, run_steps

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.clock_sweep import clock_sweep, merge_replicas, passed_valley
from zeus_callbacks.core.pipeline_frequency.controller import FrequencyController
from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_schedule
from zeus_callbacks.core.pipeline_frequency.frontier import max_frequency_plan, solve
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.pipeline_frequency.planning import (
    match_schedule,
    options_from_rows,
    plan_pipeline,
    resolve_schedule,
    with_margin,
)
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow, read_profile, write_profile
from zeus_callbacks.core.pipeline_frequency.recorder import (
    StageSample,
    instruction_kind,
    undisturbed_estimate,
)
from zeus_callbacks.sim.system import SimulatedSystem


@pytest.fixture
def node(sim_gpus) -> SimulatedSystem:
    return sim_gpus("a40")


# -- pure pieces -------------------------------------------------------------------------------------
def test_instruction_names():
    assert instruction_kind("forward") == ("forward", None)
    assert instruction_kind("BACKWARD") == ("backward", None)
    assert instruction_kind("backward_input") == ("backward", "input")
    assert instruction_kind("backward_weight") == ("backward", "weight")
    with pytest.raises(ValueError, match="Unknown pipeline instruction 'optimizer'"):
        instruction_kind("optimizer")


def test_clock_sweep_stride_and_floor():
    supported = list(range(1740, 209, -15))
    sweep = clock_sweep(supported, 90)
    assert sweep[0] == 1740 and all(a - b == 90 for a, b in zip(sweep, sweep[1:], strict=False))
    assert set(sweep) <= set(supported)
    assert clock_sweep(supported, 100, min_mhz=1400) == [1740, 1635, 1530, 1425]


def test_passed_valley_uses_effective_energy():
    # (time, energy) from the highest clock down: energy falls, then rises.
    pts = [(1.0, 10.0), (1.1, 8.0), (1.2, 8.5), (1.3, 9.0)]
    assert not passed_valley(pts[:3], p_blk_w=0.0, patience=2)
    assert passed_valley(pts, p_blk_w=0.0, patience=2)
    # With a high blocking power, being slower is worth it: the time would be spent blocked anyway.
    assert not passed_valley(pts, p_blk_w=8.0, patience=2)


def test_merge_replicas_max_time_sum_energy():
    seq = ("forward", "backward")
    a = StageSample(0, 1740, {"forward": (1.0, 10.0, 4), "backward": (2.0, 20.0, 4)}, 2.0, 60.0, seq)
    b = StageSample(0, 1740, {"forward": (1.5, 12.0, 4), "backward": (1.8, 18.0, 4)}, 1.0, 40.0, seq)
    c = StageSample(1, 1740, {"forward": (1.0, 9.0, 4)}, 1.0, 30.0, seq)
    merged = merge_replicas([a, b, c])
    assert merged[0].kinds == {"forward": (1.5, 22.0, 4), "backward": (2.0, 38.0, 4)}
    assert merged[0].blocked_energy_j / merged[0].blocked_time_s == pytest.approx(30.0 + 40.0)
    assert merged[1].kinds == c.kinds
    with pytest.raises(ValueError, match="different instruction sequences"):
        merge_replicas([a, StageSample(0, 1740, a.kinds, 1.0, 1.0, ("forward",))])


def test_match_schedule_detects_1f1b_and_gpipe():
    for kind in ("1f1b", "gpipe"):
        sched = build_schedule(kind, 4, 8)
        seqs = {s: [i.kind for i in order] for s, order in enumerate(sched)}
        assert match_schedule(seqs) == (kind, 8)
    seqs = {s: [i.kind for i in order] for s, order in enumerate(build_schedule("gpipe", 4, 8))}
    with pytest.raises(ValueError, match="not a 1f1b schedule"):
        match_schedule(seqs, preferred="1f1b")


def test_match_schedule_detects_multi_stage_schedules_from_virtual_stages():
    for kind in ("interleaved-1f1b", "looped-bfs"):
        order = build_schedule(kind, 4, 8, 2)
        seqs = {s: [i.trace_key for i in o] for s, o in enumerate(order)}
        assert seqs[0][0] == ("forward", 0)
        assert match_schedule(seqs) == (kind, 8)
        assert resolve_schedule(seqs) == (kind, order)
    kinds_only = {s: [i.kind for i in o] for s, o in enumerate(build_schedule("interleaved-1f1b", 4, 8, 2))}
    with pytest.raises(ValueError, match="not a 1f1b or gpipe schedule of 4 stages and 16 microbatches"):
        match_schedule(kinds_only)  # without virtual stages, an interleaved run is not recognised...
    order = build_schedule("interleaved-1f1b", 4, 8, 2)
    assert resolve_schedule(kinds_only, "torch", order) == ("torch", order)  # ...but checked against an order
    seqs = {s: [i.trace_key for i in o] for s, o in enumerate(build_schedule("looped-bfs", 4, 8, 2))}
    with pytest.raises(ValueError, match=r"\{0: 'F0F0.*is not the order of ScheduleInterleaved1F1B"):
        resolve_schedule(seqs, "ScheduleInterleaved1F1B", order)


def test_plan_interleaved_schedule_per_rank_profile():
    """Interleaved 1F1B, 4 ranks x 2 chunks: one profile per rank and kind, a plan per instruction."""
    order = build_schedule("interleaved-1f1b", 4, 8, 2)
    seqs = {s: tuple(i.trace_key for i in o) for s, o in enumerate(order)}
    rows = [
        ProfileRow(stage, kind, f, work * 1740 / f, work * 200 * (f / 1740) ** 2 * 1740 / f)
        for stage, size in enumerate((6, 4, 4, 4))
        for kind, work in (("forward", 0.01 * size), ("backward", 0.02 * size))
        for f in (1740, 1440, 1140)
    ]
    out = plan_pipeline(seqs, rows, dict.fromkeys(range(4), 60.0), "ScheduleInterleaved1F1B", order=order)
    assert out["schedule"] == "ScheduleInterleaved1F1B" and out["num_virtual_stages"] == 8
    assert out["num_stages"] == 4 and out["num_microbatches"] == 8
    assert [k for k, _ in out["stage_plans"][1]] == list(seqs[1])  # keyed as the ranks record them
    pred = out["predicted"]
    assert pred["iteration_time_s"] <= pred["max_clock_iteration_time_s"] * (1 + 1e-9)
    assert pred["energy_saved_pct"] > 0
    assert min(out["plan_frequencies_mhz"][1]) < 1740  # the light ranks wait for rank 0: slowed down


def test_undisturbed_estimate_is_a_low_quantile():
    assert undisturbed_estimate([5.0]) == 5.0
    assert undisturbed_estimate([float(v) for v in range(1, 12)]) == pytest.approx(2.0)
    assert undisturbed_estimate([3.0, 1.0, 2.0], 0) == 1.0
    assert undisturbed_estimate([3.0, 1.0, 2.0], 1) == 3.0
    assert undisturbed_estimate([1.0, 2.0], 0.1) == pytest.approx(1.1)
    # Interference only ever adds time: a few preempted instances do not move the estimate.
    assert undisturbed_estimate([1.0] * 9 + [50.0]) == 1.0
    with pytest.raises(ValueError):
        undisturbed_estimate([])
    with pytest.raises(ValueError):
        undisturbed_estimate([1.0], 1.5)


def test_profile_csv_roundtrip(tmp_path: Path):
    rows = [ProfileRow(0, "forward", 1740, 0.01, 2.5), ProfileRow(0, "backward", 1650, 0.02, 4.25)]
    path = tmp_path / "profile.csv"
    write_profile(path, rows)
    assert path.read_text().splitlines()[0] == "stage,instruction,frequency,time,energy"
    assert read_profile(path) == rows  # forward before backward, as written
    path.write_text("stage,instruction,frequency,time\n0,forward,1740,0.1\n")
    with pytest.raises(ValueError, match="missing column"):
        read_profile(path)


def test_plan_from_simulated_curve_is_valid():
    """4 unequal stages with the A40's clock curve: time within the max-clock time, clocks from the sweep."""
    gpu = SimulatedSystem("a40", state_dir="").gpus[0]
    clocks = clock_sweep(gpu.spec.supported_sm_clocks_mhz(), 90)[:6]
    rows = []
    for stage, size in enumerate((8, 5, 5, 5)):
        for kind, work in (("forward", 0.01 * size), ("backward", 0.02 * size)):
            for f in clocks:
                rel, power = gpu._compute_operating_point(300, (f, f))
                rows.append(ProfileRow(stage, kind, f, work * rel, work * rel * power))
    schedule = build_schedule("1f1b", 4, 8)
    options = options_from_rows(rows)
    ref = max_frequency_plan(schedule, options, 30.0)
    plan = solve(schedule, options, 30.0)
    assert plan.iteration_time_s <= ref.iteration_time_s * (1 + 1e-9)
    assert plan.energy_j < 0.92 * ref.energy_j
    assert {f for fs in plan.stage_frequencies() for f in fs} <= set(clocks)
    at_max = [fs.count(1740) for fs in plan.stage_frequencies()]
    assert at_max[0] > max(at_max[1:])  # the heavy stage is the critical path


@pytest.mark.system
def test_constructor_errors(node):
    with pytest.raises(ValueError, match=r"PipelineFrequencyOptimizer\(schedule='zb'\)"):
        PipelineFrequencyOptimizer(schedule="zb")
    with pytest.raises(ValueError, match=r"PipelineFrequencyOptimizer\(pp_rank=None\).*required"):
        PipelineFrequencyOptimizer(dp_degree=2)
    with pytest.raises(ValueError, match="exactly this rank's GPU"):
        PipelineFrequencyOptimizer(monitor=ZeusMonitor(gpu_indices=[0]), device_id=1)
    # The wording of `core.arguments`, the one validator: what to pass, or what the value must be.
    for kw in ({"target_time_s": math.inf}, {"warmup_steps": True}, {"slack_margin": "0.1"}):
        with pytest.raises(ValueError, match=r"PipelineFrequencyOptimizer\(\w+=.*\)`: (pass|must be) "):
            PipelineFrequencyOptimizer(**kw)


@pytest.mark.system
def test_min_frequency_within_the_gpu_clocks(node):
    """Below the lowest supported clock, or an integral float: accepted; the sweep starts at the maximum."""
    pfo = PipelineFrequencyOptimizer(device_id=0, **{**FAST, "wait_steps": 0}, min_frequency_mhz=10.0)
    pfo.on_step_begin()
    assert pfo.phase == "profiling" and pfo.frequency_mhz == 1740
    pfo.close()


# -- the loop on a simulated GPU ------------------------------------------------------------------------
@pytest.mark.system
def test_sweep_stops_early_and_applies_plan(node, tmp_path: Path):
    gpu = node.gpus[0]
    csv_path = tmp_path / "profile.csv"
    pfo = PipelineFrequencyOptimizer(
        device_id=0, warmup_steps=1, profile_steps=2, frequency_stride_mhz=90, profile_path=csv_path
    )
    kinds = _kinds("1f1b", 4)
    run_steps(pfo, 80, kinds, until="applying")
    assert pfo.phase == "applying"
    sweep = clock_sweep(gpu.spec.supported_sm_clocks_mhz(), 90)
    profiled = sorted({r.frequency_mhz for r in pfo.profile_rows()}, reverse=True)
    assert profiled == sweep[: len(profiled)]  # from the top, in order
    assert 3 <= len(profiled) < len(sweep)  # stopped early, past the energy valley
    # A lower clock saved energy: a forward and a backward together (one kind alone, a few ms long, can
    # come out level with the maximum clock's on the strict counter when the host is busy).
    pair = {f: 0.0 for f in profiled}
    for r in pfo.profile_rows():
        pair[r.frequency_mhz] += r.energy_j
    assert min(pair[f] for f in profiled[1:]) < pair[profiled[0]]
    assert pfo.profiling_steps == len(profiled) * 3  # 1 warm-up + 2 measured steps per clock
    report = pfo.report()
    assert report["simulated"] and report["schedule"] == "1f1b" and report["num_microbatches"] == 4
    assert len(pfo.plan_frequencies_mhz) == len(kinds) and set(pfo.plan_frequencies_mhz) <= set(profiled)
    assert report["predicted"]["iteration_time_s"] <= report["predicted"]["max_clock_iteration_time_s"] * (
        1 + 1e-9
    )
    assert sorted(read_profile(csv_path), key=str) == sorted(pfo.profile_rows(), key=str)
    run_steps(pfo, 2, kinds)
    last = pfo.plan_frequencies_mhz[-1]
    assert pfo._clocks.controller.wait()
    assert gpu.locked_sm_clocks_mhz in {(last, last), (pfo.plan_frequencies_mhz[0],) * 2}
    pfo.on_train_end()
    assert gpu.locked_sm_clocks_mhz is None


@pytest.mark.system
def test_straggler_target_slows_instructions(node):
    gpu = node.gpus[0]
    pfo = PipelineFrequencyOptimizer(
        device_id=0, target_time_s=10.0, **FAST
    )  # a far slower pipeline elsewhere
    kinds = _kinds("1f1b", 2)
    run_steps(pfo, 40, kinds, until="applying")
    assert pfo.phase == "applying"
    freqs = pfo.plan_frequencies_mhz
    profiled = {r.frequency_mhz for r in pfo.profile_rows()}
    assert set(freqs) <= profiled and min(freqs) < max(profiled)
    run_steps(pfo, 1, kinds)
    # The clock is set by a worker thread: wait until it applied the step's requests (a loaded host once read it
    # before; the waits below are the same).
    assert pfo._clocks.controller.wait()
    assert gpu.locked_sm_clocks_mhz is not None and gpu.locked_sm_clocks_mhz[0] in freqs
    # A baseline in the same job: every instruction at the maximum clock, then the plan again.
    pfo.hold_max_clocks()
    run_steps(pfo, 1, kinds)
    assert pfo._clocks.controller.wait()
    assert gpu.locked_sm_clocks_mhz == (max(profiled),) * 2 and pfo.phase == "applying"
    assert pfo.plan_frequencies_mhz == freqs
    pfo.hold_max_clocks(False)
    run_steps(pfo, 1, kinds)
    assert pfo._clocks.controller.wait()
    assert gpu.locked_sm_clocks_mhz[0] in {freqs[0], freqs[-1]}
    pfo.close()
    assert gpu.locked_sm_clocks_mhz is None


@pytest.mark.system
@pytest.mark.parametrize(
    ("new_kinds", "when"),
    [(_kinds("1f1b", 3), "the step ran 6 instructions"), (_kinds("gpipe", 4), "instruction 1 of the step")],
)
def test_fallback_to_max_clock_on_sequence_mismatch(node, caplog, new_kinds, when):
    gpu = node.gpus[0]
    pfo = PipelineFrequencyOptimizer(device_id=0, target_time_s=10.0, **FAST)
    run_steps(pfo, 40, _kinds("1f1b", 4), until="applying")
    assert pfo.phase == "applying"
    with caplog.at_level(logging.WARNING):
        run_steps(pfo, 2, new_kinds)  # e.g. the number of microbatches changed
    assert pfo.phase == "fallback" and when in pfo.report()["reason"]
    assert any("maximum clock" in r.message for r in caplog.records)
    max_clock = gpu.spec.max_sm_clock_mhz
    assert pfo.frequency_mhz == max_clock and gpu.locked_sm_clocks_mhz == (max_clock, max_clock)
    pfo.on_train_end()
    assert gpu.locked_sm_clocks_mhz is None


@pytest.mark.system
def test_interleaved_order_planned_applied_and_checked(node, caplog):
    """One rank with 2 model chunks (virtual stages 0 and 1) running torch's interleaved order."""
    gpu = node.gpus[0]
    order = build_schedule("interleaved-1f1b", 1, 4, 2)
    pfo = PipelineFrequencyOptimizer(device_id=0, target_time_s=10.0, **FAST)
    with pytest.raises(InvalidInputError, match="use_schedule.*listed under stage 1"):
        pfo.use_schedule([order[0], order[0]])
    pfo.use_schedule(order, name="ScheduleInterleaved1F1B")
    run_steps(pfo, 40, order[0], until="applying")
    report = pfo.report()
    assert pfo.phase == "applying", report.get("reason")
    assert report["schedule"] == "ScheduleInterleaved1F1B" and report["num_virtual_stages"] == 2
    assert len(pfo.plan_frequencies_mhz) == 16
    assert {r["virtual_stage"] for r in report["profile"]} == {0, 1}  # each chunk profiled on its own
    with pytest.raises(InvalidInputError, match="plan is made"):
        pfo.use_schedule(order)
    swapped = [Instruction(0, i.kind, i.microbatch, 1 - i.virtual_stage) for i in order[0]]
    with caplog.at_level(logging.WARNING):
        run_steps(pfo, 1, swapped)  # the same kinds, but the chunks' order changed
    assert pfo.phase == "fallback"
    assert (
        "is a forward of virtual stage 1, but the plan expects a forward of virtual stage 0"
        in pfo.report()["reason"]
    )
    pfo.on_train_end()
    assert gpu.locked_sm_clocks_mhz is None


@pytest.mark.system
def test_redundant_clock_changes_are_skipped(node):
    gpu = node.gpus[0]
    controller = FrequencyController(gpu)
    controller.set_now(1740)
    for _ in range(5):
        controller.request(1740)
    controller.request(1560)
    controller.request(1560)
    assert controller.wait()
    assert controller.changes == 2 and gpu.locked_sm_clocks_mhz == (1560, 1560)
    controller.close()
    controller.request(1200)  # after close: nothing changes any more
    assert gpu.locked_sm_clocks_mhz == (1560, 1560)

    pfo = PipelineFrequencyOptimizer(device_id=0, **FAST)
    kinds = _kinds("1f1b", 4)
    run_steps(pfo, 40, kinds, until="applying")
    run_steps(pfo, 1, kinds)
    assert pfo._clocks.controller.wait()
    changes = pfo._clocks.controller.changes
    run_steps(pfo, 3, kinds)
    assert pfo._clocks.controller.wait()
    freqs = pfo.plan_frequencies_mhz
    switches = sum(a != b for a, b in zip(freqs, freqs[1:] + freqs[:1], strict=True))
    assert pfo._clocks.controller.changes - changes <= 3 * switches  # only real switches reach NVML
    pfo.close()
    assert gpu.locked_sm_clocks_mhz is None


@pytest.mark.system
def test_split_backward_halves_are_one_instruction(node):
    pfo = PipelineFrequencyOptimizer(device_id=0, **FAST)
    names = ["forward", "backward_input", "backward_weight", "forward", "backward_input", "backward_weight"]
    for _ in range(12):
        pfo.on_step_begin()
        for name in names:
            pfo.on_instruction_begin(name)
            burn_cpu(0.001)
            pfo.on_instruction_end(name)
        pfo.on_step_end()
        if pfo.phase == "applying":
            break
    assert pfo.phase == "applying" and pfo.report()["num_microbatches"] == 2
    assert len(pfo.plan_frequencies_mhz) == 4
    pfo.close()


@pytest.mark.system
def test_no_permission_measures_and_warns_once(sim_gpus, caplog):
    node = sim_gpus("a40", faults="no_permission")
    with caplog.at_level(logging.WARNING):
        pfo = PipelineFrequencyOptimizer(device_id=0, **FAST)
        run_steps(pfo, 6, _kinds("1f1b", 2))
    warnings = [r for r in caplog.records if "no permission to lock SM clocks" in r.message]
    assert len(warnings) == 1
    report = pfo.report()
    assert pfo.phase == "inactive" and "no per-clock profile" in report["reason"]
    assert {r["frequency_mhz"] for r in report["profile"]} == {0}  # measured at the clock in force
    assert all(r["time_s"] > 0 and r["energy_j"] > 0 for r in report["profile"])
    assert pfo.metrics()["iteration_energy_j"] > 0
    assert node.gpus[0].locked_sm_clocks_mhz is None
    pfo.close()


@pytest.mark.system
def test_no_permission_with_profile_reports_plan_without_applying(sim_gpus, tmp_path: Path):
    node = sim_gpus("a40", faults="no_permission")
    path = tmp_path / "profile.csv"
    write_profile(
        path,
        [
            ProfileRow(0, kind, f, t * rel, t * rel * p)
            for kind, t in (("forward", 0.01), ("backward", 0.02))
            for f, rel, p in ((1740, 1.0, 235.0), (1560, 1.115, 172.6))
        ],
    )
    pfo = PipelineFrequencyOptimizer(device_id=0, target_time_s=10.0, profile_path=path, **FAST)
    run_steps(pfo, 6, _kinds("1f1b", 2))
    report = pfo.report()
    assert pfo.phase == "inactive" and report["plan_applied"] is False
    assert report["predicted"]["energy_saved_pct"] > 0
    assert set(report["plan_frequencies_mhz"][0]) == {1560}
    assert node.gpus[0].locked_sm_clocks_mhz is None
    pfo.close()


# -- restoring the clocks --------------------------------------------------------------------------------
_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = {paths!r}  # this file's folder and tests/ (helpers)
    from pipeline_steps import FAST, _kinds, run_steps
    from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
    pfo = PipelineFrequencyOptimizer(device_id=0, target_time_s=10.0, **FAST)
    kinds = _kinds("1f1b", 2)
    run_steps(pfo, 40, kinds, until="applying", work_s=0.01)  # long enough to rank clocks
    run_steps(pfo, 1, kinds)
    assert pfo._clocks.controller.wait()
    print("locked", pfo.frequency_mhz, flush=True)
    if {mode!r} == "raise":
        raise RuntimeError("boom")
    while True:
        run_steps(pfo, 1, kinds)
    """
)


def _child(mode: str) -> str:
    here = Path(__file__).parent
    return _CHILD.format(paths=[str(here), str(here.parent)], mode=mode)


@pytest.mark.slow
def test_clocks_restored_after_exception(node, run_python):
    out = run_python(_child("raise"), timeout=90)
    assert "locked" in out.stdout and "RuntimeError: boom" in out.stderr
    assert int(out.stdout.split()[1]) < node.gpus[0].spec.max_sm_clock_mhz
    assert node.gpus[0].locked_sm_clocks_mhz is None


@pytest.mark.slow
def test_clocks_restored_after_sigterm(node):
    proc = subprocess.Popen(
        [sys.executable, "-c", _child("loop")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("locked"), proc.stderr.read()
        assert node.gpus[0].locked_sm_clocks_mhz is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
    assert node.gpus[0].locked_sm_clocks_mhz is None


@pytest.mark.system
def test_slack_margin_plans_lowered_clocks_longer_at_the_same_effective_energy(node):
    from zeus_callbacks.core.pipeline_frequency.frontier import FrequencyOption

    options = {(0, "forward"): [FrequencyOption(1740, 1.0, 200.0), FrequencyOption(1500, 1.2, 180.0)]}
    padded = with_margin(options, 0.1, [50.0])[0, "forward"]
    assert padded[0] == options[0, "forward"][0]  # the fastest option is untouched
    assert padded[1].time_s == pytest.approx(1.32)
    assert padded[1].energy_j - 50.0 * padded[1].time_s == pytest.approx(180.0 - 50.0 * 1.2)
    assert with_margin(options, 0.0, [50.0]) is options
    with pytest.raises(ValueError, match="slack_margin"):
        PipelineFrequencyOptimizer(slack_margin=1.5)


@pytest.mark.system
def test_close_in_the_middle_of_a_step(node):
    pfo = PipelineFrequencyOptimizer(device_id=0, **FAST)
    pfo.on_step_begin()
    pfo.on_instruction_begin("forward")
    pfo.close()
    pfo.on_instruction_end("forward")
    pfo.on_step_end()  # nothing left to record, nothing raised
    assert pfo.phase == "waiting" and not pfo.monitor.open_windows


@pytest.mark.system
def test_empty_clock_list_is_not_supported_not_a_crash(sim_gpus, caplog):
    node = sim_gpus("a40", faults="empty_clocks")
    pfo = PipelineFrequencyOptimizer(device_id=0, **FAST)
    with caplog.at_level(logging.WARNING):
        run_steps(pfo, 3, _kinds("1f1b", 2))
    text = caplog.text
    assert "lists no supported SM clocks" in text and "does not support it" in text
    assert "CAP_SYS_ADMIN" not in text  # not reported as a permission problem
    assert pfo.metrics()["iteration_time_s"] > 0  # still measuring
    pfo.close()
    assert node.gpus[0].locked_sm_clocks_mhz is None


@pytest.mark.system
def test_profiling_starts_from_the_default_power_limit(node):
    gpu = node.gpus[0]
    gpu.set_power_limit_mw(150_000)  # left low by someone else: it would cap every clock
    pfo = PipelineFrequencyOptimizer(device_id=0, target_time_s=10.0, **FAST)
    run_steps(pfo, 3, _kinds("1f1b", 2))
    assert pfo.phase == "profiling"
    assert gpu.power_limit_mw == 300_000  # the default, through the guard
    pfo.close()
    assert gpu.power_limit_mw == 150_000  # put back as it was found


@pytest.mark.system
def test_bad_profile_path_file_is_named_at_the_first_step(node, tmp_path):
    path = tmp_path / "profile.csv"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    pfo = PipelineFrequencyOptimizer(device_id=0, **FAST, profile_path=path)
    with pytest.raises(ValueError, match=r"PipelineFrequencyOptimizer\(profile_path=.*not a text file"):
        pfo.on_step_begin()
    pfo.close()
