"""PipelineFrequencyOptimizer across 4 gloo ranks: a real torch.distributed.pipelining Schedule1F1B, replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeus_callbacks.core.pipeline_frequency.profile_file import read_profile

WORLD = 4

# Each rank drives simulated GPU `rank`; results go to OUT/rank<r>.json. Run as a script: mp.spawn.
_WORKER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch import nn
    OUT = sys.argv[1]

    def burn(s):
        c = time.process_time()
        while time.process_time() - c < s:
            pass

    def pipeline(rank, pfo_kw):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
        from zeus_callbacks.core.pipeline_frequency.pipelining import instrument
        layers = [4, 2, 2, 2][rank]
        module = nn.Sequential(*[nn.Linear(256, 256) for _ in range(layers)])
        stage = PipelineStage(module, stage_index=rank, num_stages=4, device=torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
        pfo = PipelineFrequencyOptimizer(device_id=rank, **pfo_kw)
        undo = instrument(stage, schedule, pfo)
        x, y = torch.randn(64, 256), torch.randn(64, 256)
        def step(evaluate=False):
            run = schedule.eval if evaluate else schedule.step
            if rank == 0:
                run(x)
            elif rank == 3:
                run(target=y)
            else:
                run()
        return pfo, step, undo

    def replicas(rank, pfo_kw):
        # 2 stages x 2 data-parallel replicas with a fake 1F1B loop; the collectives use gloo.
        from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
        from zeus_callbacks.core.pipeline_frequency.dag import build_schedule
        stage = rank // 2
        kinds = [i.kind for i in build_schedule("1f1b", 2, 4)[stage]]
        pfo = PipelineFrequencyOptimizer(
            rank=rank, pp_rank=stage, dp_rank=rank % 2, dp_degree=2, pp_degree=2, device_id=rank, **pfo_kw
        )
        work = 0.002 * (1 + stage) * (1 + 0.5 * (rank % 2))  # replica 1 is slower
        def step(evaluate=False):
            pfo.on_step_begin()
            for k in kinds:
                pfo.on_instruction_begin(k)
                burn(work if k == "forward" else 2 * work)
                pfo.on_instruction_end(k)
            pfo.on_step_end()
        return pfo, step, lambda: None

    def run(rank, world):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for mode in ("pipeline", "replicas"):  # one set of processes for both: starting them is the slow part
            out_dir = os.path.join(OUT, mode)
            os.makedirs(out_dir, exist_ok=True)
            kw = dict(wait_steps=1, warmup_steps=0, profile_steps=1, frequency_stride_mhz=300,
                      min_frequency_mhz=1100, patience=1, profile_path=os.path.join(out_dir, "profile.csv"))
            pfo, step, undo = (pipeline if mode == "pipeline" else replicas)(rank, kw)
            out = {"phases": []}
            for n in range(30):
                step()
                out["phases"].append(pfo.phase)
                if pfo.phase == "applying" and out["phases"].count("applying") == 2:
                    step(evaluate=True)  # forward-only steps are not reported to the optimizer
                    step()
                    break
            assert pfo._clocks.controller.wait()
            out.update(phase=pfo.phase, report=pfo.report(), locked=pfo.frequency_mhz,
                       supported=pfo.gpu.supported_sm_clocks_mhz())
            pfo.on_train_end()
            undo()
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(out, f, default=str)
            dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        mp.spawn(run, args=(4,), nprocs=4, join=True)
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Run both scenarios on 4 ranks once; (output directory, simulated node's state directory)."""
    tmp = tmp_path_factory.mktemp("pipelining")
    script = tmp / "worker.py"
    script.write_text(_WORKER)
    out, state = tmp / "out", tmp / "sim-state"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_CALLBACKS_")}
    env.update(ZEUS_CALLBACKS_SIMULATE=f"{WORLD}*a40", ZEUS_CALLBACKS_SIM_STATE_DIR=str(state))
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, state


def _results(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / mode / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _locked_clocks(state: Path) -> list:
    from zeus_callbacks.sim.system import SimulatedSystem

    return [g.locked_sm_clocks_mhz for g in SimulatedSystem(f"{WORLD}*a40", state_dir=str(state)).gpus]


@pytest.mark.slow
def test_schedule_1f1b_profiles_plans_applies_and_restores(ranks):
    out, state = ranks
    results = _results(out, "pipeline")
    for rank, r in enumerate(results):
        assert r["phase"] == "applying", (rank, r["report"].get("reason"))
        assert "profiling" in r["phases"]
        report = r["report"]
        assert report["simulated"] and report["schedule"] == "1f1b" and report["num_microbatches"] == 4
        freqs = report["plan_frequencies_mhz"][str(rank)]
        assert len(freqs) == 8 and set(freqs) <= set(r["supported"])
        pred = report["predicted"]
        assert pred["iteration_time_s"] <= pred["max_clock_iteration_time_s"] * (1 + 1e-9)
        assert pred["energy_j"] <= pred["max_clock_energy_j"] * (1 + 1e-9)
        assert r["locked"] in freqs  # the plan's clocks were in force
    assert results[0]["phases"] == results[3]["phases"]  # one decision, at the same step, on every rank
    rows = read_profile(out / "pipeline" / "profile.csv")
    assert {r.stage for r in rows} == {0, 1, 2, 3} and {r.instruction for r in rows} == {
        "forward",
        "backward",
    }
    assert max(r.frequency_mhz for r in rows) == 1740 and min(r.frequency_mhz for r in rows) >= 1100
    assert _locked_clocks(state) == [None] * WORLD


@pytest.mark.slow
def test_replicas_of_a_stage_are_merged(ranks):
    out, state = ranks
    results = _results(out, "replicas")
    report = results[0]["report"]
    assert report["num_stages"] == 2
    assert {row["stage"] for row in report["profile"]} == {0, 1}
    plans = report["plan_frequencies_mhz"]
    for rank, r in enumerate(results):
        assert r["phase"] == "applying"
        assert r["report"]["plan_frequencies_mhz"] == plans  # same plan everywhere
        assert r["report"]["stage"] == rank // 2
    # Replicas of a stage count once in time (the slower one) and twice in energy.
    fwd = [row for row in report["profile"] if row["stage"] == 0 and row["instruction"] == "forward"]
    assert fwd and all(row["energy_j"] > 0 for row in fwd)
    assert _locked_clocks(state) == [None] * WORLD


def test_instrument_checks_a_multi_stage_schedule():
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    from zeus_callbacks.core.pipeline_frequency.pipelining import instrument

    class Looped:  # stands in for PipelineScheduleMulti (several stages on this rank)
        _stages = [object(), object()]

    with pytest.raises(TypeError, match="`stage` is not run by this schedule"):
        instrument(object(), Looped(), None)  # type: ignore[arg-type]

    class Chunk:  # just enough of a stage for torch to build the schedule's order
        def __init__(self, index: int) -> None:
            self.stage_index, self.num_stages, self.group_size, self.group_rank = index, 4, 2, 0
            self.submod = None

    zero_bubble = ScheduleInterleavedZeroBubble([Chunk(0), Chunk(2)], 4)
    with pytest.raises(ValueError, match="ScheduleInterleavedZeroBubble runs .* weight-gradient halves"):
        instrument(None, zero_bubble, None)  # type: ignore[arg-type]


@pytest.mark.system
def test_adapters_refuse_a_job_without_pipeline_stage(sim_gpus):
    sim_gpus("a40")
    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from zeus_callbacks.huggingface import HFPipelineFrequencyOptimizer
    from zeus_callbacks.lightning import LightningPipelineFrequencyOptimizer

    model = torch.nn.Linear(2, 2)  # plain data-parallel-style model: no PipelineStage anywhere
    hf = HFPipelineFrequencyOptimizer(device_id=0)
    with pytest.raises(ValueError, match="no pipeline stage.*HFPipelineFrequencyOptimizer\\(stage=...\\)"):
        hf.on_train_begin(
            TrainingArguments("unused", report_to=[]), TrainerState(), TrainerControl(), model=model
        )
    hf.optimizer.close()
    pl = LightningPipelineFrequencyOptimizer(device_id=0)
    with pytest.raises(ValueError, match="no pipeline stage.*LightningGlobalPowerLimitOptimizer"):
        pl.on_train_start(None, model)
    pl.optimizer.close()


@pytest.mark.system
def test_attachment_instruments_a_multi_stage_schedule(sim_gpus):
    """The adapters' path: a model holding an interleaved schedule; the trainer marks the steps."""
    sim_gpus("a40")
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    from zeus_callbacks.core.pipeline_frequency.attach import StageAttachment
    from zeus_callbacks.core.pipeline_frequency.dag import build_schedule
    from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

    class Chunk:  # one rank holding both chunks of a 2-stage model
        def __init__(self, index: int) -> None:
            self.stage_index, self.num_stages, self.group_size, self.group_rank = index, 2, 1, 0
            self.is_first, self.is_last = index == 0, index == 1
            self.submod, self.has_backward = None, True

        def forward_one_chunk(self, mb, *args, **kwargs):
            pass

        def backward_one_chunk(self, mb, *args, **kwargs):
            pass

    class Model:
        def __init__(self) -> None:
            self.schedule = ScheduleInterleaved1F1B([Chunk(0), Chunk(1)], 2)

    model = Model()
    chunks = model.schedule._stages
    pfo = PipelineFrequencyOptimizer(device_id=0)
    attachment = StageAttachment(pfo, adapter="HFPipelineFrequencyOptimizer", alternative="-")
    attachment.attach(model)
    order = build_schedule("interleaved-1f1b", 1, 2, 2)
    assert pfo._order == tuple(tuple(o) for o in order) and pfo.schedule == "ScheduleInterleaved1F1B"
    pfo.on_step_begin()
    for inst in order[0]:
        method = "forward_one_chunk" if inst.kind == "forward" else "backward_one_chunk"
        getattr(chunks[inst.virtual_stage], method)(inst.microbatch)
    pfo.on_step_end()
    assert pfo._recorder.sequence == tuple(i.trace_key for i in order[0])
    attachment.detach()
    assert all("forward_one_chunk" not in c.__dict__ for c in chunks)
