"""Perseus on DeepSpeed: a tiny GPT as a 4-stage `PipelineModule` (DeepSpeed's 1F1B `TrainSchedule`).

Runs on 4 CPU processes (gloo), each driving one SIMULATED A40 (`ZEUS_CALLBACKS_SIMULATE=4*a40`, GPU index
= rank). DeepSpeed's `PipelineModule` and `PipelineEngine` run unchanged; on this CPU host
`deepspeed_cpu.skip_shared_memory_op()` keeps `deepspeed.init_distributed` from compiling its shared-memory
op (not needed on GPUs). The model splits as Megatron-DeepSpeed's GPT does (`partition_method="type:Block"`:
the transformer blocks evenly): the first stage also holds the embedding, the last the output head.

The optimizer measures iterations at the maximum clocks first, profiles every stage's forward and backward
per SM clock, plans the clocks on rank 0 and applies them; the script prints the iteration time and energy
before and after. All figures are SIMULATED.

    python examples/deepspeed/train_pipeline_module.py                 # spawns 4 ranks
    torchrun --nproc_per_node 4 examples/deepspeed/train_pipeline_module.py
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deepspeed_cpu.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))  # pipeline_job.py

import pipeline_job as job  # noqa: E402
from deepspeed_cpu import skip_shared_memory_op  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (split evenly over the stages)")
    p.add_argument("--hidden", type=int, default=32, help="hidden size")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--vocab", type=int, default=640, help="vocabulary; the head costs vocab / (12 hidden) blocks"
    )
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument(
        "--kernel-ms",
        type=float,
        default=10.0,
        help="simulated GPU time of one block's forward per microbatch at the maximum clock (backward: "
        "twice; the head: in proportion to its FLOPs)",
    )
    job.add_optimizer_args(p, profile_steps=3, before_after=6)
    return p.parse_args(argv)


def head_blocks(args: argparse.Namespace) -> float:
    """The output head's cost in blocks: its FLOPs (vocab x hidden) over a block's (12 hidden^2)."""
    return args.vocab / (12 * args.hidden)


def describe(args: argparse.Namespace) -> str:
    return (
        f"DeepSpeed PipelineModule GPT: {args.layers} blocks over {job.NUM_STAGES} stages, embedding on the first, "
        f"head = {head_blocks(args):.2f} blocks on the last, {args.kernel_ms:g} ms simulated kernel per block's "
        f"forward, {args.microbatches} microbatches"
    )


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class Block(nn.Module):
    """A transformer block, and its GPU time as simulated kernels on simulated GPU `gpu`."""

    def __init__(self, hidden: int, heads: int, gpu: int, work_s: float) -> None:
        super().__init__()
        from zeus_callbacks.sim import SimulatedKernels

        self.layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True)
        self.kernels = SimulatedKernels(gpu, work_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels(self.layer(x))


class Head(nn.Module):
    """The vocabulary projection, its simulated kernels in proportion to its FLOPs."""

    def __init__(self, vocab: int, hidden: int, gpu: int, work_s: float) -> None:
        super().__init__()
        from zeus_callbacks.sim import SimulatedKernels

        self.kernels = SimulatedKernels(gpu, work_s)
        self.proj = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.kernels(x))


class Pipeline:
    """This rank's `PipelineEngine`: `step()` trains one batch (`train_batch`)."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        work = args.kernel_ms / 1000
        layers = [
            LayerSpec(Embedding, args.vocab, args.hidden),
            *[LayerSpec(Block, args.hidden, args.heads, rank, work) for _ in range(args.layers)],
            LayerSpec(Head, args.vocab, args.hidden, rank, head_blocks(args) * work),
        ]
        vocab = args.vocab

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))

        module = PipelineModule(
            layers=layers, num_stages=job.NUM_STAGES, loss_fn=loss, partition_method="type:Block"
        )
        config = {
            "train_micro_batch_size_per_gpu": args.micro_batch_size,
            "gradient_accumulation_steps": args.microbatches,  # microbatches per batch
            "steps_per_print": 10**9,
        }
        sgd = torch.optim.SGD(module.parameters(), lr=1e-4)
        self.engine, *_ = deepspeed.initialize(model=module, optimizer=sgd, config=config)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_len), generator=g)
        self._batch = (tokens, tokens)

    def _batches(self) -> Any:
        while True:
            yield self._batch

    def step(self) -> None:
        self.engine.train_batch(self._batches())

    def close(self) -> None:
        pass


def train_engine(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Profiled, planned and applied; this rank's history, report and instruction order."""
    from zeus_callbacks.deepspeed import deepspeed_schedule_order, instrument_deepspeed

    pipeline = Pipeline(rank, args)
    # The first step sets the schedule up; then the baseline at the maximum clocks.
    pfo = job.make_optimizer(rank, args, wait_steps=1 + args.before_steps)
    with instrument_deepspeed(pipeline.engine, pfo) as hooks:
        result = job.train(rank, pfo, pipeline.step, args)
    expected = deepspeed_schedule_order(job.NUM_STAGES, args.microbatches)[pipeline.engine.stage_id]
    return {
        "schedule": "1f1b",
        "engine_schedule": hooks.schedule,
        "history": result.history,
        "report": result.report,
        "locked_mhz": result.locked_mhz,
        "ran": [str(i) for i in hooks.last_step],
        "expected": [str(i) for i in expected],
    }


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one "GPU" worth of host work per rank
    torch.manual_seed(rank)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    skip_shared_memory_op()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    result = train_engine(rank, args)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print_summary(gathered, args)
    job.write_results(rank, [result], args)
    dist.destroy_process_group()


def print_summary(ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("\n== Perseus on DeepSpeed PipelineEngine, TrainSchedule (SIMULATED GPUs: 4x A40) ==")
    print(describe(args))
    same = all(r["ran"] == r["expected"] for r in ranks)
    print(
        f"instruction order of every stage {'equals' if same else 'DIFFERS FROM'} DeepSpeed's TrainSchedule"
    )
    job.print_before_after([r["history"] for r in ranks], ranks[0]["report"], args)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    job.launch(run, args, "deepspeed-example")


if __name__ == "__main__":
    main()
