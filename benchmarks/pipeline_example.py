"""The pipeline example's saving, measured robustly: the plan and the all-max-clock baseline interleaved.

Runs `examples/pipeline/train_pipeline.py`'s 4-stage Schedule1F1B pipeline (4 gloo ranks on CPU, each driving
one SIMULATED A40 with the strict energy counter). The optimizer profiles and plans as in the example; then
the same processes alternate blocks of iterations at every stage's maximum clock with blocks at the planned
clocks, in ABBA order (`pipeline_blocks.py`).

Per arm it prints the median and the 10th/90th percentiles of the iteration time (the slowest rank's step,
every iteration of the arm) and of the energy per iteration (all 4 GPUs; one counter window per block,
divided by its iterations, since a 100 ms counter cannot measure one iteration); then the saving and the
slowdown as ratios of the medians, and the medians of the paired blocks' ratios.

    python benchmarks/pipeline_example.py                    # about 4 minutes on 2 cores
    python benchmarks/pipeline_example.py --blocks 4 --block-steps 3   # a quick look
    python benchmarks/pipeline_example.py -- --kernel-ms 8   # options of the example after `--`
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pipeline"))

import pipeline_job  # noqa: E402
import train_pipeline as example  # noqa: E402
from pipeline_blocks import add_block_args, example_args, measure_blocks, print_comparison  # noqa: E402

from zeus_callbacks import instrument  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_block_args(p, blocks=8, block_steps=5, example="the example (e.g. -- --width 32)")
    args = p.parse_args()
    args.example = example.parse_args(example_args(args))
    return args


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    pipeline = example.Pipeline(rank, world_size, args.example)
    pfo = pipeline_job.make_optimizer(rank, args.example, wait_steps=1)
    instrument(pipeline.stage, pipeline.schedule, pfo)
    try:
        blocks = measure_blocks(pfo, pipeline.step, args.blocks, args.block_steps, args.max_steps)
        report = pfo.report()
    finally:
        pfo.on_train_end()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, blocks)
    if rank == 0:
        print("\n== Pipeline example: all-max clocks vs the plan, interleaved (SIMULATED GPUs: 4x A40) ==")
        print(
            f"{example.describe(args.example)}, width {args.example.width}, {args.example.kernel_ms:g} ms "
            f"simulated kernel per layer; strict energy counter "
            f"(ZEUS_CALLBACKS_SIM_IDEAL={os.environ.get('ZEUS_CALLBACKS_SIM_IDEAL', '0')})"
        )
        print_comparison(gathered, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    pipeline_job.launch(run, parse_args(), "bench-pipeline")
