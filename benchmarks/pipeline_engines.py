"""Perseus in the pipeline engines, measured robustly: the plan and all-max clocks interleaved, per engine.

Runs `examples/megatron/train_gpt.py`'s Megatron-Core `GPTModel` pipeline (1F1B and interleaved) and
`examples/deepspeed/train_gpt.py`'s DeepSpeed `PipelineModule` (1F1B) on 4 gloo ranks, each driving one
SIMULATED A40 with the strict energy counter. As `benchmarks/pipeline_example.py` does for
torch.distributed.pipelining: the optimizer profiles and plans; then the same processes alternate blocks of
iterations at every stage's maximum clock (`PipelineFrequencyOptimizer.hold_max_clocks`) with blocks at
the planned clocks, in ABBA order, one switch step dropped per block.

Per engine it prints the median and 10th/90th percentiles of the iteration time (the slowest rank's step)
and of the energy per iteration (all 4 GPUs, one counter window per block), the ratios of the medians and
the medians of the paired blocks' ratios.

    python benchmarks/pipeline_engines.py                          # every engine, several minutes
    python benchmarks/pipeline_engines.py --engines megatron-1f1b --blocks 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Megatron-Core says at import that it falls back to torch without Transformer Engine and Apex: as intended here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|full scope is deprecated).*")

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENGINES = ("megatron-1f1b", "megatron-interleaved", "deepspeed-1f1b")
ARMS = ("max", "plan")
_BLOCK = "pipeline_engines_block"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--blocks", type=int, default=6, help="blocks per arm")
    p.add_argument("--block-steps", type=int, default=4, help="measured iterations per block")
    p.add_argument("--max-steps", type=int, default=300, help="give up if no plan is applied by then")
    p.add_argument(
        "example_args",
        nargs=argparse.REMAINDER,
        help="after `--`: options of the examples (e.g. -- --kernel-ms 8 --stride-mhz 60)",
    )
    return p.parse_args()


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
    extra = [a for a in args.example_args if a != "--"]
    if engine.startswith("megatron"):
        from zeus_callbacks.megatron import instrument_megatron

        example, ex_args, pipeline = _megatron(rank, engine.split("-")[1], extra)
        pfo = example.make_optimizer(rank, ex_args, wait_steps=1)
        hooks = instrument_megatron(pfo)
    else:
        from zeus_callbacks.deepspeed import instrument_deepspeed

        example, ex_args, pipeline = _deepspeed(rank, extra)
        pfo = example.make_optimizer(rank, ex_args, wait_steps=1)
        hooks = instrument_deepspeed(pipeline.engine, pfo)

    def step() -> float:
        pipeline.step()
        return float(pfo.metrics()["iteration_time_s"])

    blocks: dict[str, list[tuple[list[float], float, float]]] = {arm: [] for arm in ARMS}
    try:
        for _ in range(args.max_steps):
            step()
            if pfo.phase not in ("waiting", "profiling"):
                break
        if pfo.phase == "applying":
            for b in range(args.blocks):
                for arm in ARMS if b % 2 == 0 else ARMS[::-1]:
                    pfo.hold_max_clocks(arm == "max")
                    step()  # the first step after the switch: clocks change during it
                    pfo.monitor.begin_window(_BLOCK)
                    times = [step() for _ in range(args.block_steps)]
                    m = pfo.monitor.end_window(_BLOCK)
                    blocks[arm].append((times, m.time, m.total_energy))
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
    engines = args.engines.split(",")
    for engine in engines:
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
            print_summary(engine, gathered, args)
    dist.destroy_process_group()


def _spread(values: list[float], digits: int) -> str:
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return f"{p50:.{digits}f} [{p10:.{digits}f}, {p90:.{digits}f}]"


def print_summary(engine: str, gathered: list[dict[str, Any]], args: argparse.Namespace) -> None:
    report = gathered[0]["report"]
    print(f"\n== {engine}: all-max clocks vs the plan, interleaved (SIMULATED GPUs: 4x A40) ==")
    print(gathered[0]["describe"])
    if report.get("phase") != "applying" or not gathered[0]["blocks"]["plan"]:
        print(f"no plan applied: {report.get('reason', report.get('phase'))}")
        return
    print(
        f"{args.blocks} blocks per arm x {args.block_steps} iterations, ABBA order, one switch step dropped "
        f"per block; profiling took {report['profiling_steps']} steps; schedule {report.get('schedule')}"
    )
    per_arm = {}
    for arm in ARMS:
        ranks = [g["blocks"][arm] for g in gathered]
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
        f"energy {pred['energy_saved_pct']:+.1f}% saved"
    )


def main() -> None:
    args = parse_args()
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        raise SystemExit(f"--engines: unknown {sorted(unknown)}; pick from {', '.join(ENGINES)}")
    os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", "4*a40")
    os.environ.setdefault("ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.mkdtemp(prefix="zeus-callbacks-engines-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    mp.spawn(run, args=(4, args), nprocs=4, join=True)


if __name__ == "__main__":
    main()
