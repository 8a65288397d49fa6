"""The pipeline example's saving, measured robustly: the plan and the all-max-clock baseline interleaved.

Runs `examples/pipeline/train_pipeline.py`'s 4-stage Schedule1F1B pipeline (4 gloo ranks on CPU, each driving
one SIMULATED A40 with the strict energy counter). The optimizer profiles and plans as in the example; then
the same processes alternate blocks of iterations with every instruction at its stage's maximum clock
(`PipelineFrequencyOptimizer.hold_max_clocks`) and blocks with the planned clocks, in ABBA order so that a
drift of the host's load falls on both arms alike. Both arms run the same code and the same measurements.

Per arm it prints the median and the 10th/90th percentiles of the iteration time (the slowest rank's step,
every iteration of the arm) and of the energy per iteration (all 4 GPUs; one counter window per block,
divided by its iterations, since a 100 ms counter cannot measure one iteration); then the saving and the
slowdown as ratios of the medians, and the medians of the paired blocks' ratios.

    python benchmarks/pipeline_example.py                    # about 4 minutes on 2 cores
    python benchmarks/pipeline_example.py --blocks 4 --block-steps 3   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pipeline"))

import train_pipeline as example  # noqa: E402

from zeus_callbacks import PipelineFrequencyOptimizer, ZeusMonitor, instrument  # noqa: E402

ARMS = ("max", "plan")
_BLOCK = "pipeline_example_block"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="8,6,6,6", help="Linear layers per stage (as the example)")
    p.add_argument("--width", type=int, default=16, help="hidden size")
    p.add_argument("--kernel-ms", type=float, default=4.0, help="simulated GPU time per layer's forward")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--stride-mhz", type=int, default=45, help="gap between profiled SM clocks")
    p.add_argument("--profile-steps", type=int, default=4, help="measured steps per profiled clock")
    p.add_argument("--blocks", type=int, default=8, help="blocks per arm")
    p.add_argument("--block-steps", type=int, default=5, help="measured iterations per block")
    p.add_argument("--max-steps", type=int, default=300, help="give up if no plan is applied by then")
    return p.parse_args()


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    layers = [int(x) for x in args.layers.split(",")]
    module = example.make_stage_module(layers[rank], args.width, rank, args.kernel_ms)
    stage = PipelineStage(module, stage_index=rank, num_stages=world_size, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss)
    sgd = torch.optim.SGD(module.parameters(), lr=1e-4)
    monitor = ZeusMonitor(gpu_indices=[rank])
    pfo = PipelineFrequencyOptimizer(
        monitor=monitor,
        wait_steps=1,
        warmup_steps=1,
        profile_steps=args.profile_steps,
        frequency_stride_mhz=args.stride_mhz,
    )
    instrument(stage, schedule, pfo)
    batch = args.microbatches * args.microbatch_size
    x, y = torch.randn(batch, args.width), torch.randn(batch, args.width)

    def step() -> float:
        if rank == 0:
            schedule.step(x)
        elif rank == world_size - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        sgd.step()
        sgd.zero_grad()
        return float(pfo.metrics()["iteration_time_s"])

    # arm -> per block (per-step times, block time s, block energy J)
    blocks: dict[str, list[tuple[list[float], float, float]]] = {arm: [] for arm in ARMS}
    try:
        for _ in range(args.max_steps):
            step()
            if pfo.phase != "profiling" and pfo.phase != "waiting":
                break
        if pfo.phase == "applying":
            for b in range(args.blocks):
                for arm in ARMS if b % 2 == 0 else ARMS[::-1]:
                    pfo.hold_max_clocks(arm == "max")
                    step()  # the first step after the switch: clocks change during it
                    monitor.begin_window(_BLOCK)
                    times = [step() for _ in range(args.block_steps)]
                    m = monitor.end_window(_BLOCK)
                    blocks[arm].append((times, m.time, m.total_energy))
        report = pfo.report()
    finally:
        pfo.on_train_end()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, blocks)
    if rank == 0:
        print_summary(gathered, report, args)
    dist.destroy_process_group()


def _spread(values: list[float], digits: int) -> str:
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return f"{p50:.{digits}f} [{p10:.{digits}f}, {p90:.{digits}f}]"


def print_summary(gathered: list, report: dict, args: argparse.Namespace) -> None:
    print("\n== Pipeline example: all-max clocks vs the plan, interleaved (SIMULATED GPUs: 4x A40) ==")
    print(
        f"stages (Linear layers): {args.layers}, width {args.width}, {args.kernel_ms:g} ms simulated kernel "
        f"per layer, {args.microbatches} microbatches, 1F1B; strict energy counter "
        f"(ZEUS_CALLBACKS_SIM_IDEAL={os.environ.get('ZEUS_CALLBACKS_SIM_IDEAL', '0')})"
    )
    if report.get("phase") != "applying" or not gathered[0]["plan"]:
        print(f"no plan applied: {report.get('reason', report.get('phase'))}")
        return
    print(
        f"{args.blocks} blocks per arm x {args.block_steps} iterations, ABBA order, one switch step "
        f"dropped per block; profiling took {report['profiling_steps']} steps"
    )
    per_arm = {}
    for arm in ARMS:
        ranks = [g[arm] for g in gathered]
        times = [max(r[b][0][i] for r in ranks) for b in range(args.blocks) for i in range(args.block_steps)]
        block_time = [max(r[b][1] for r in ranks) / args.block_steps for b in range(args.blocks)]
        block_energy = [sum(r[b][2] for r in ranks) / args.block_steps for b in range(args.blocks)]
        per_arm[arm] = (times, block_time, block_energy)
    print(
        f"{'arm':<18}{'iteration time (s): median [p10, p90]':>40}{'energy/iteration (J): median [p10, p90]':>44}"
    )
    for arm, label in zip(ARMS, ("all max clocks", "planned clocks"), strict=True):
        times, _, energy = per_arm[arm]
        print(f"{label:<18}{_spread(times, 4):>40}{_spread(energy, 1):>44}")
    t0, t1 = (statistics.median(per_arm[a][0]) for a in ARMS)
    e0, e1 = (statistics.median(per_arm[a][2]) for a in ARMS)
    print(
        f"ratio of medians: energy {100 * (1 - e1 / e0):+.1f}% saved, iteration time {100 * (t1 / t0 - 1):+.2f}%"
    )
    paired_e = [100 * (1 - p / m) for m, p in zip(per_arm["max"][2], per_arm["plan"][2], strict=True)]
    paired_t = [100 * (p / m - 1) for m, p in zip(per_arm["max"][1], per_arm["plan"][1], strict=True)]
    print(
        f"paired blocks: energy saved median {statistics.median(paired_e):+.1f}% "
        f"[p10 {np.percentile(paired_e, 10):+.1f}%, p90 {np.percentile(paired_e, 90):+.1f}%], "
        f"block time median {statistics.median(paired_t):+.2f}% "
        f"[p10 {np.percentile(paired_t, 10):+.2f}%, p90 {np.percentile(paired_t, 90):+.2f}%]"
    )
    pred = report["predicted"]
    print(
        f"planner's prediction: {pred['max_clock_iteration_time_s']:.4f} s -> {pred['iteration_time_s']:.4f} s, "
        f"energy {pred['energy_saved_pct']:+.1f}% saved (measured all-max median {t0:.4f} s: "
        f"{100 * (pred['max_clock_iteration_time_s'] / t0 - 1):+.2f}%)"
    )


def main() -> None:
    args = parse_args()
    if len(args.layers.split(",")) != example.NUM_STAGES:
        raise SystemExit(f"--layers needs {example.NUM_STAGES} comma-separated counts, one per stage")
    os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", f"{example.NUM_STAGES}*a40")
    os.environ.setdefault("ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.mkdtemp(prefix="zeus-callbacks-bench-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(example.free_port()))
    mp.spawn(run, args=(example.NUM_STAGES, args), nprocs=example.NUM_STAGES, join=True)


if __name__ == "__main__":
    main()
