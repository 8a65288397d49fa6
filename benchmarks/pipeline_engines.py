"""Perseus in the pipeline engines, measured robustly: the plan and all-max clocks interleaved, per engine.

Runs `examples/megatron/train_gpt.py`'s Megatron-Core `GPTModel` pipeline (1F1B and interleaved) and
`examples/deepspeed/train_pipeline_module.py`'s DeepSpeed `PipelineModule` (1F1B) on 4 gloo ranks, each driving one
SIMULATED A40 with the strict energy counter. As `benchmarks/pipeline_example.py` does for
torch.distributed.pipelining: the optimizer profiles and plans; then the same processes alternate blocks of
iterations at every stage's maximum clock with blocks at the planned clocks, in ABBA order
(`pipeline_blocks.py`).

Per engine it prints the median and 10th/90th percentiles of the iteration time (the slowest rank's step)
and of the energy per iteration (all 4 GPUs, one counter window per block), the ratios of the medians and
the medians of the paired blocks' ratios.

Without options after `--`, the examples run at the sizes of a real model rather than their quick defaults:
20 ms of simulated kernel per layer's forward (a GPT-3 2.7B layer on 4 x 2048 tokens at half of an A40's
dense FP16 peak) and an output head of 1.67 layers (`--vocab 640`: GPT-3 2.7B's 50257 / (12 x 2560)).

    python benchmarks/pipeline_engines.py                          # every engine, about 15 minutes
    python benchmarks/pipeline_engines.py --engines megatron-1f1b --blocks 4
    python benchmarks/pipeline_engines.py -- --kernel-ms 10        # options after `--` replace those sizes
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(_EXAMPLES / "pipeline"))

import pipeline_job  # noqa: E402
from pipeline_blocks import add_block_args, example_args, measure_blocks, print_comparison  # noqa: E402

# Megatron-Core says at import that it falls back to torch without Transformer Engine and Apex: as intended here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|full scope is deprecated).*")

ENGINES = ("megatron-1f1b", "megatron-interleaved", "deepspeed-1f1b")
# The examples' options when none are given after `--`: a real model's sizes (module docstring).
REAL_MODEL_SIZES = ["--kernel-ms", "20", "--vocab", "640"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    add_block_args(p, blocks=6, block_steps=4, example="the examples (e.g. -- --kernel-ms 8)")
    args = p.parse_args()
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"--engines: unknown {sorted(unknown)}; pick from {', '.join(ENGINES)}")
    return args


def _megatron(rank: int, schedule: str, extra: list[str]) -> tuple[Any, Any, Any]:
    """(example module, its args, its pipeline) of Megatron-Core under `schedule`."""
    sys.path.insert(0, str(_EXAMPLES / "megatron"))
    import train_gpt as example  # examples/megatron/train_gpt.py

    args = example.parse_args(["--schedules", schedule, *extra])
    return example, args, example.Pipeline(rank, schedule, args)


def _deepspeed(rank: int, extra: list[str]) -> tuple[Any, Any, Any]:
    """(example module, its args, its pipeline) of a DeepSpeed PipelineEngine."""
    sys.path.insert(0, str(_EXAMPLES / "deepspeed"))
    import train_pipeline_module as example  # examples/deepspeed/train_pipeline_module.py

    example.skip_shared_memory_op()  # deepspeed.initialize would compile it on this CPU host
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's view of the process group made by run()
    args = example.parse_args(extra)
    return example, args, example.Pipeline(rank, args)


def measure(rank: int, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """Profile and plan, then the ABBA blocks; this rank's blocks and the optimizer's report."""
    extra = example_args(args) or REAL_MODEL_SIZES
    if engine.startswith("megatron"):
        from zeus_callbacks.megatron import instrument_megatron

        example, ex_args, pipeline = _megatron(rank, engine.split("-")[1], extra)
        pfo = pipeline_job.make_optimizer(rank, ex_args, wait_steps=1)
        hooks = instrument_megatron(pfo)
    else:
        from zeus_callbacks.deepspeed import instrument_deepspeed

        example, ex_args, pipeline = _deepspeed(rank, extra)
        pfo = pipeline_job.make_optimizer(rank, ex_args, wait_steps=1)
        hooks = instrument_deepspeed(pipeline.engine, pfo)
    try:
        blocks = measure_blocks(pfo, pipeline.step, args.blocks, args.block_steps, args.max_steps)
        report = pfo.report()
    finally:
        pfo.on_train_end()
        hooks.remove()
        pipeline.close()
    return {"blocks": blocks, "report": report, "describe": example.describe(ex_args)}


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))  # for DeepSpeed
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for engine in args.engines.split(","):
        if engine.startswith("megatron"):
            sys.path.insert(0, str(_EXAMPLES / "megatron"))
            from megatron_cpu import cpu_megatron

            with cpu_megatron():
                result = measure(rank, engine, args)
        else:
            result = measure(rank, engine, args)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            print(f"\n== {engine}: all-max clocks vs the plan, interleaved (SIMULATED GPUs: 4x A40) ==")
            print(gathered[0]["describe"])
            print_comparison([g["blocks"] for g in gathered], gathered[0]["report"])
    dist.destroy_process_group()


if __name__ == "__main__":
    pipeline_job.launch(run, parse_args(), "bench-engines")
