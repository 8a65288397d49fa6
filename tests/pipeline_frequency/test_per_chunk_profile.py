"""Interleaved schedules profiled per model chunk: the recorder's keys, the sweep's rows, the CSV, the plan.

A rank of an interleaved schedule holds several model chunks, and real splits do not weigh them alike (the
embedding on the first virtual stage, the output head on the last). Priced at its rank's cost, a heavy chunk
is planned too short and the plan slows the iteration; priced per chunk, it is not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.clock_sweep import ClockSweep
from zeus_callbacks.core.pipeline_frequency.dag import build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.energy_model import evaluate
from zeus_callbacks.core.pipeline_frequency.planning import options_from_rows, plan_pipeline
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow, read_profile, write_profile
from zeus_callbacks.core.pipeline_frequency.recorder import (
    ClockMeasurements,
    InstructionRecord,
    InstructionRecorder,
)

CLOCKS = (1740, 1590, 1440, 1290, 1140, 990)
STAGES, CHUNKS, MICROBATCHES = 4, 2, 8
# Layers of each virtual stage v (on rank v % 4), as examples/megatron's interleaved layout with a 1.67-layer
# head: the last rank holds 2 layers in one chunk and a layer and the head in the other.
LAYERS = (1, 1, 1, 2, 1, 1, 1, 2.67)


def _rows(stage: int, layers: float, virtual_stage: int | None) -> list[ProfileRow]:
    """One chunk's forward and backward at every clock: a curve like an A40's (time stretches as 1/f on
    70% of it; power from 60 W idle to 300 W at 1740 MHz, cubic in f)."""
    rows = []
    for kind, per_layer_s in (("forward", 0.01), ("backward", 0.02)):
        for f in CLOCKS:
            time_s = layers * per_layer_s * (0.3 + 0.7 * 1740 / f)
            power_w = 60 + 240 * (f / 1740) ** 3
            rows.append(ProfileRow(stage, kind, f, time_s, power_w * time_s, virtual_stage))
    return rows


def _per_chunk_rows() -> list[ProfileRow]:
    return [r for v, layers in enumerate(LAYERS) for r in _rows(v % STAGES, layers, v)]


def _per_rank_rows() -> list[ProfileRow]:
    """What a profile over all of a rank's chunks gives: a low quantile of their times, i.e. the lighter
    chunk's (`recorder.undisturbed_estimate`)."""
    return [
        r
        for s in range(STAGES)
        for r in _rows(s, min(LAYERS[v] for v in range(s, len(LAYERS), STAGES)), None)
    ]


def _planned(rows: list[ProfileRow]) -> tuple[dict, dict]:
    order = build_schedule("interleaved-1f1b", STAGES, MICROBATCHES, CHUNKS)
    sequences = {s: tuple(i.trace_key for i in o) for s, o in enumerate(order)}
    p_blk = dict.fromkeys(range(STAGES), 60.0)
    out = plan_pipeline(sequences, rows, p_blk, "interleaved-1f1b", order=order)
    frequencies = {
        inst: f
        for o, fs in zip(order, out["plan_frequencies_mhz"].values(), strict=True)
        for inst, f in zip(o, fs, strict=True)
    }
    true_options = options_from_rows(_per_chunk_rows())
    dag = build_dag(order)
    truth = {
        "planned": evaluate(dag, true_options, list(p_blk.values()), frequencies),
        "max": evaluate(dag, true_options, list(p_blk.values()), dict.fromkeys(frequencies, max(CLOCKS))),
    }
    return out, truth


def test_a_plan_from_a_per_chunk_profile_predicts_what_it_does():
    """Fails if the planner prices a chunk at its rank's cost when the profile has the chunk's own rows."""
    out, truth = _planned(_per_chunk_rows())
    assert out["predicted"]["iteration_time_s"] == pytest.approx(truth["planned"].iteration_time_s)
    assert out["predicted"]["energy_j"] == pytest.approx(truth["planned"].energy_j)
    assert truth["planned"].iteration_time_s <= truth["max"].iteration_time_s * (1 + 1e-9)
    assert truth["planned"].energy_j < 0.9 * truth["max"].energy_j  # the light ranks are slowed
    heavy = [f for (kind, v), f in out["stage_plans"][3] if v == 7]
    assert max(heavy) == max(CLOCKS)  # the head's chunk is on the critical path


def test_a_per_rank_profile_of_uneven_chunks_mispredicts_the_plan():
    """What per-chunk profiling fixes: priced at its rank's (lighter) cost, the head's chunk makes the
    planner promise a saving the plan does not give (fails if this split had no chunk heavier than its
    rank's cost)."""
    out, truth = _planned(_per_rank_rows())
    true_saving = 100 * (1 - truth["planned"].energy_j / truth["max"].energy_j)
    assert out["predicted"]["energy_saved_pct"] > true_saving + 1


def test_a_per_chunk_profile_missing_a_chunk_is_named():
    rows = [r for r in _per_chunk_rows() if not (r.virtual_stage == 6 and r.instruction == "backward")]
    with pytest.raises(ValueError, match="No profiled options for stage 2 backward of virtual stage 6"):
        _planned(rows)


def test_the_csv_keeps_the_chunk_and_a_perseus_file_stays_as_it_was(tmp_path: Path):
    """Fails if the `virtual_stage` column is lost on a round trip, or written into a per-rank profile."""
    per_chunk, per_rank = tmp_path / "chunks.csv", tmp_path / "ranks.csv"
    write_profile(per_chunk, _per_chunk_rows())
    write_profile(per_rank, _per_rank_rows())
    assert per_chunk.read_text().splitlines()[0] == "stage,instruction,frequency,time,energy,virtual_stage"
    assert per_rank.read_text().splitlines()[0] == "stage,instruction,frequency,time,energy"
    assert sorted(read_profile(per_chunk, num_stages=STAGES), key=repr) == sorted(_per_chunk_rows(), key=repr)
    assert sorted(read_profile(per_rank), key=repr) == sorted(_per_rank_rows(), key=repr)


@pytest.mark.parametrize(
    "line,match",
    [
        ("0,forward,1740,0.1,5,0\n0,forward,1740,0.2,5,0\n", "of virtual stage 0 at 1740 MHz appears twice"),
        ("0,forward,1740,0.1,5,-1\n", "virtual_stage must be >= 0"),
        ("0,forward,1740,0.1,5,x\n", "cannot parse virtual_stage"),
    ],
)
def test_bad_chunk_rows_are_named(tmp_path: Path, line: str, match: str):
    path = tmp_path / "p.csv"
    path.write_text(
        "stage,instruction,frequency,time,energy,virtual_stage\n" + line + "0,backward,1740,0.1,5,\n"
    )
    with pytest.raises(ValueError, match=match):
        read_profile(path)


def test_measurements_and_sweep_rows_are_per_chunk(sim_gpus):
    """Fails if the recorder merges a rank's chunks into one estimate per kind (as it did)."""
    sim_gpus("a40", virtual_clock=True)
    recorder = InstructionRecorder(ZeusMonitor(gpu_indices=[0]), on_error=lambda e: None)
    measured = ClockMeasurements()
    for _ in range(3):
        recorder.records = [
            InstructionRecord("forward", time_s=0.01, energy_j=2.0, virtual_stage=3),
            InstructionRecord("forward", time_s=0.03, energy_j=6.0, virtual_stage=7),
            InstructionRecord("backward", time_s=0.06, energy_j=12.0, virtual_stage=7),
            InstructionRecord("backward", time_s=0.02, energy_j=4.0, virtual_stage=3),
        ]
        measured.add_step(recorder)
    sequence = tuple(r.trace_key for r in recorder.records)
    sample = measured.sample(3, 1740, sequence)
    assert sample.kinds == {
        ("forward", 3): (0.01, 2.0, 3),
        ("forward", 7): (0.03, 6.0, 3),
        ("backward", 7): (0.06, 12.0, 3),
        ("backward", 3): (0.02, 4.0, 3),
    }
    sweep = ClockSweep({3: [1740, 1440]}, patience=1)
    sweep.add([sample], {3: sequence})
    assert [(r.virtual_stage, r.instruction, r.time_s) for r in sweep.profile_rows()] == [
        (3, "backward", 0.02),
        (3, "forward", 0.01),
        (7, "backward", 0.06),
        (7, "forward", 0.03),
    ]
