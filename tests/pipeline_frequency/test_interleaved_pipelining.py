"""Interleaved 1F1B on 4 gloo ranks: torch's real execution against our order and DAG, then the optimizer end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.profile_file import read_profile

WORLD, CHUNKS, MICROBATCHES = 4, 2, 8

# Each rank holds CHUNKS model chunks (virtual stages rank, rank + 4) on simulated GPU `rank`. Step 0 runs
# torch alone and records each compute call's time span; then the optimizer profiles, plans and applies.
_WORKER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch import nn
    OUT, WORLD, CHUNKS, M = sys.argv[1], 4, 2, 8

    def record(stage, calls):
        # Our own wrappers under the optimizer's: each compute call's (kind, virtual stage, microbatch, span).
        for method, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
            original = getattr(stage, method)
            def run(mb, *args, _original=original, _kind=kind, **kwargs):
                begin = time.monotonic()
                out = _original(mb, *args, **kwargs)
                calls.append((_kind, stage.stage_index, mb, begin, time.monotonic()))
                return out
            setattr(stage, method, run)

    def run(rank, world):
        torch.set_num_threads(1)
        torch.manual_seed(rank)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
        from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
        from zeus_callbacks.core.pipeline_frequency.pipelining import instrument, schedule_order
        calls = []
        stages = []
        for chunk in range(CHUNKS):
            index = chunk * WORLD + rank
            module = nn.Sequential(*[nn.Linear(256, 256) for _ in range(2)])
            stage = PipelineStage(module, stage_index=index, num_stages=WORLD * CHUNKS, device=torch.device("cpu"))
            record(stage, calls)
            stages.append(stage)
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=nn.functional.mse_loss)
        x, y = torch.randn(8 * M, 256), torch.randn(8 * M, 256)
        def step():
            if rank == 0:
                schedule.step(x)
            elif rank == WORLD - 1:
                schedule.step(target=y)
            else:
                schedule.step()
        step()  # torch alone; sets the stages up
        calls.clear()
        step()
        out = {"torch_calls": list(calls), "order": [[list(i.__dict__.values()) for i in o] for o in schedule_order(schedule)]}
        pfo = PipelineFrequencyOptimizer(device_id=rank, wait_steps=1, warmup_steps=0, profile_steps=1,
            frequency_stride_mhz=300, min_frequency_mhz=1100, patience=1, profile_path=os.path.join(OUT, "profile.csv"))
        undo = instrument(stages, schedule, pfo)
        out["phases"] = []
        for n in range(30):
            calls.clear()
            step()
            out["phases"].append(pfo.phase)
            if out["phases"].count("applying") == 2:
                break
        out["applied_calls"] = list(calls)
        assert pfo._clocks.controller.wait()
        out.update(phase=pfo.phase, report=pfo.report(), locked=pfo.frequency_mhz,
                   supported=pfo.gpu.supported_sm_clocks_mhz())
        pfo.on_train_end()
        undo()
        with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
            json.dump(out, f, default=str)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        mp.spawn(run, args=(WORLD,), nprocs=WORLD, join=True)
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path, Path]:
    """Run the 4 ranks once: (each rank's results, output directory, simulated node's state directory)."""
    tmp = tmp_path_factory.mktemp("interleaved")
    script = tmp / "worker.py"
    script.write_text(_WORKER)
    out, state = tmp / "out", tmp / "sim-state"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_CALLBACKS_")}
    env.update(ZEUS_CALLBACKS_SIMULATE=f"{WORLD}*a40", ZEUS_CALLBACKS_SIM_STATE_DIR=str(state))
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return results, out, state


def _per_rank(results: list[dict], key: str) -> list[list[Instruction]]:
    return [
        [Instruction(rank, kind, mb, v) for kind, v, mb, _, _ in r[key]] for rank, r in enumerate(results)
    ]


@pytest.mark.slow
def test_torch_runs_our_order_and_respects_every_dag_edge(ranks):
    results, _, _ = ranks
    torch_order = [[Instruction(*fields) for fields in o] for o in results[0]["order"]]
    ours = build_schedule("interleaved-1f1b", WORLD, MICROBATCHES, CHUNKS)
    assert torch_order == ours  # torch's pipeline_order, read at run time, is what our builder derives
    for key in ("torch_calls", "applied_calls"):  # torch alone, and with the plan's clocks applied
        executed = _per_rank(results, key)
        assert executed == ours, key  # each rank ran exactly that order
        span = {
            Instruction(rank, kind, mb, v): (begin, end)
            for rank, r in enumerate(results)
            for kind, v, mb, begin, end in r[key]
        }
        dag = build_dag(ours)
        cross_rank = 0
        for u, v in dag.edges:
            a, b = dag.instructions[u], dag.instructions[v]
            assert span[b][0] >= span[a][1], (key, str(a), str(b))  # b began after a ended, across processes
            cross_rank += a.stage != b.stage
        # Data edges between ranks: 8 virtual stages x 8 microbatches, forward (7 hops) and backward (7 hops).
        assert cross_rank == 2 * 7 * MICROBATCHES


@pytest.mark.slow
def test_optimizer_profiles_plans_and_applies_interleaved_1f1b(ranks):
    results, out, state = ranks
    for rank, r in enumerate(results):
        assert r["phase"] == "applying", (rank, r["report"].get("reason"))
        assert "profiling" in r["phases"]
        report = r["report"]
        assert report["simulated"] and report["schedule"] == "ScheduleInterleaved1F1B"
        assert report["num_stages"] == WORLD and report["num_virtual_stages"] == WORLD * CHUNKS
        assert report["num_microbatches"] == MICROBATCHES
        freqs = report["plan_frequencies_mhz"][str(rank)]
        assert len(freqs) == 2 * CHUNKS * MICROBATCHES and set(freqs) <= set(r["supported"])
        pred = report["predicted"]
        assert pred["iteration_time_s"] <= pred["max_clock_iteration_time_s"] * (1 + 1e-9)
        assert pred["energy_j"] <= pred["max_clock_energy_j"] * (1 + 1e-9)
        assert r["locked"] in freqs  # the plan's clocks were in force
    assert all(r["phases"] == results[0]["phases"] for r in results)  # one decision, same step everywhere
    rows = read_profile(out / "profile.csv")
    assert {r.stage for r in rows} == set(range(WORLD))
    assert {r.instruction for r in rows} == {"forward", "backward"}
    from zeus_callbacks.sim.system import SimulatedSystem

    gpus = SimulatedSystem(f"{WORLD}*a40", state_dir=str(state)).gpus
    assert [g.locked_sm_clocks_mhz for g in gpus] == [None] * WORLD  # clocks restored at the end
