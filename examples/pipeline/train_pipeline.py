"""Perseus in one job: a 4-stage Schedule1F1B pipeline whose off-critical-path instructions get lower clocks.

Runs on 4 CPU processes (gloo), each driving one simulated A40 (`ZEUS_CALLBACKS_SIMULATE=4*a40`, GPU index =
rank). The stages are deliberately unequal, so the lighter ones have slack. The optimizer measures the
iterations at the maximum clocks first, then profiles every stage's forward and backward per SM clock,
plans the clocks on rank 0 and applies them; the script prints the iteration time and energy before and
after. All figures are SIMULATED.

    python examples/pipeline/train_pipeline.py                 # spawns 4 ranks
    torchrun --nproc_per_node 4 examples/pipeline/train_pipeline.py
"""

from __future__ import annotations

import argparse
import logging

import pipeline_job as job
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from zeus_callbacks import instrument
from zeus_callbacks.sim import SimulatedKernels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="8,6,6,6", help="Linear layers per stage (unequal on purpose)")
    p.add_argument("--width", type=int, default=16, help="hidden size")
    p.add_argument(
        "--kernel-ms",
        type=float,
        default=4.0,
        help="simulated GPU time of one layer's forward per microbatch at the maximum clock (backward: twice), "
        "queued on the simulated GPU: no host CPU counts as GPU work",
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    job.add_optimizer_args(p, profile_steps=4, before_after=10)
    args = p.parse_args(argv)
    if len(args.layers.split(",")) != job.NUM_STAGES:
        p.error(f"--layers needs {job.NUM_STAGES} comma-separated counts, one per stage")
    if not args.kernel_ms > 0:
        p.error(f"--kernel-ms {args.kernel_ms:g}: must be > 0 (the stages' GPU work; the host's CPU is not)")
    return args


def make_stage_module(layers: int, width: int, gpu: int, kernel_ms: float) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    blocks.append(SimulatedKernels(gpu, layers * kernel_ms / 1000))
    return nn.Sequential(*blocks)


class Pipeline:
    """This rank's stage of the Schedule1F1B pipeline: `step()` trains one iteration."""

    def __init__(self, rank: int, world_size: int, args: argparse.Namespace) -> None:
        layers = [int(x) for x in args.layers.split(",")]
        module = make_stage_module(layers[rank], args.width, rank, args.kernel_ms)
        self.stage = PipelineStage(
            module, stage_index=rank, num_stages=world_size, device=torch.device("cpu")
        )
        self.schedule = Schedule1F1B(
            self.stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss
        )
        self.sgd = torch.optim.SGD(module.parameters(), lr=1e-4)
        self.rank, self.last = rank, rank == world_size - 1
        batch = args.microbatches * args.microbatch_size
        self.x, self.y = torch.randn(batch, args.width), torch.randn(batch, args.width)

    def step(self) -> None:
        if self.rank == 0:
            self.schedule.step(self.x)
        elif self.last:
            self.schedule.step(target=self.y)
        else:
            self.schedule.step()
        self.sgd.step()
        self.sgd.zero_grad()

    def close(self) -> None:
        pass


def describe(args: argparse.Namespace) -> str:
    return f"stages (Linear layers): {args.layers}, microbatches: {args.microbatches}, schedule: 1F1B"


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one "GPU" worth of host work per rank
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    pipeline = Pipeline(rank, world_size, args)
    # The first step sets the schedule up; then the baseline at the maximum clocks.
    pfo = job.make_optimizer(rank, args, wait_steps=1 + args.before_steps)
    instrument(pipeline.stage, pipeline.schedule, pfo)
    result = job.train(rank, pfo, pipeline.step, args)
    job.write_results(rank, [{"history": result.history, "report": result.report}], args)
    histories = [None] * world_size
    dist.all_gather_object(histories, result.history)
    if rank == 0:
        print("\n== Perseus pipeline frequency plan (SIMULATED GPUs: 4x A40) ==")
        print(describe(args))
        job.print_before_after(histories, result.report, args)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    job.launch(run, args, "pipeline-example")


if __name__ == "__main__":
    main()
