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
import json
import logging
import os
import signal
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepspeed_cpu import skip_shared_memory_op  # noqa: E402

from zeus_callbacks import PipelineFrequencyOptimizer, ZeusMonitor  # noqa: E402

NUM_STAGES = 4


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
    p.add_argument("--before-steps", type=int, default=6, help="steps measured at the maximum clocks")
    p.add_argument("--after-steps", type=int, default=6, help="steps measured with the plan applied")
    p.add_argument("--stride-mhz", type=int, default=45, help="gap between profiled SM clocks")
    p.add_argument("--profile-steps", type=int, default=3, help="measured steps per profiled clock")
    p.add_argument("--min-mhz", type=int, default=None, help="lowest clock to profile")
    p.add_argument("--patience", type=int, default=2, help="clocks without a gain before a stage stops")
    p.add_argument(
        "--slack-margin", type=float, default=0.0, help="extra planning margin of a lowered clock's time"
    )
    p.add_argument("--max-steps", type=int, default=200, help="give up if the plan is not applied by then")
    p.add_argument("--out", default=None, help="write each rank's results here (JSON, for the tests)")
    p.add_argument(
        "--hold", action="store_true", help="after the run, keep training with the plan until signalled"
    )
    p.add_argument("--verbose", action="store_true", help="print every step's phase, time and energy")
    return p.parse_args(argv)


def head_blocks(args: argparse.Namespace) -> float:
    """The output head's cost in blocks: its FLOPs (vocab x hidden) over a block's (12 hidden^2)."""
    return args.vocab / (12 * args.hidden)


def describe(args: argparse.Namespace) -> str:
    return (
        f"DeepSpeed PipelineModule GPT: {args.layers} blocks over {NUM_STAGES} stages, embedding on the first, "
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
            layers=layers, num_stages=NUM_STAGES, loss_fn=loss, partition_method="type:Block"
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


def make_optimizer(rank: int, args: argparse.Namespace, wait_steps: int) -> PipelineFrequencyOptimizer:
    return PipelineFrequencyOptimizer(
        monitor=ZeusMonitor(gpu_indices=[rank]),  # simulated GPU `rank` of the node
        wait_steps=wait_steps,
        warmup_steps=1,
        profile_steps=args.profile_steps,
        frequency_stride_mhz=args.stride_mhz,
        min_frequency_mhz=args.min_mhz,
        patience=args.patience,
        slack_margin=args.slack_margin,
    )


def train(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Profiled, planned and applied; this rank's history, report and instruction order."""
    from zeus_callbacks.deepspeed import deepspeed_schedule_order, instrument_deepspeed

    pipeline = Pipeline(rank, args)
    pfo = make_optimizer(rank, args, wait_steps=1 + args.before_steps)  # the first step sets things up
    history: list[tuple[str, float, float]] = []  # (phase, time s, energy J) of this rank's steps
    after = 0
    with instrument_deepspeed(pipeline.engine, pfo) as hooks:
        try:
            for _ in range(args.max_steps):
                phase = pfo.phase
                pipeline.step()
                m = pfo.metrics()
                history.append((phase, float(m["iteration_time_s"]), float(m["iteration_energy_j"])))
                after += phase == "applying"
                if after >= args.after_steps or pfo.phase in ("inactive", "fallback"):
                    break
            report = pfo.report()
            locked = pfo.frequency_mhz
            if args.hold and pfo.phase == "applying":
                print(f"holding rank {rank} pid {os.getpid()}", flush=True)
                while True:
                    pipeline.step()
        finally:
            pfo.on_train_end()
    expected = deepspeed_schedule_order(NUM_STAGES, args.microbatches)[pipeline.engine.stage_id]
    return {
        "schedule": "1f1b",
        "engine_schedule": hooks.schedule,
        "history": history,
        "report": report,
        "locked_mhz": locked,
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
    result = train(rank, args)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print_summary(gathered, args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps([result], default=str))
    dist.destroy_process_group()


def print_summary(ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    report = ranks[0]["report"]

    def per_step(phase: str, skip: int) -> tuple[float, float, int]:
        rows = [[h for h in r["history"] if h[0] == phase][skip:] for r in ranks]
        n = min(len(r) for r in rows)
        times = [max(r[i][1] for r in rows) for i in range(n)]  # the pipeline is as slow as its slowest stage
        energies = [sum(r[i][2] for r in rows) for i in range(n)]  # every GPU's energy
        return statistics.median(times), statistics.median(energies), n

    if args.verbose:
        for i, steps in enumerate(zip(*(r["history"] for r in ranks), strict=False)):
            print(
                f"step {i:3d} {steps[0][0]:<10} {max(h[1] for h in steps):8.4f} s {sum(h[2] for h in steps):9.2f} J"
            )
    print("\n== Perseus on DeepSpeed PipelineEngine, TrainSchedule (SIMULATED GPUs: 4x A40) ==")
    print(describe(args))
    same = all(r["ran"] == r["expected"] for r in ranks)
    print(
        f"instruction order of every stage {'equals' if same else 'DIFFERS FROM'} DeepSpeed's TrainSchedule"
    )
    if "predicted" not in report:
        print(f"no plan: {report.get('reason')}")
        return
    for stage, freqs in report["plan_frequencies_mhz"].items():
        print(f"  stage {stage} clocks (MHz): {freqs}")
    t0, e0, n0 = per_step("waiting", skip=1)  # the first step sets the schedule up
    t1, e1, n1 = per_step("applying", skip=1)  # the first planned step still ran a profiling clock in part
    pred = report["predicted"]
    print(f"{'':<28}{'iteration time (s)':>20}{'energy (J)':>14}")
    print(f"{'before (all max clocks)':<28}{t0:>20.4f}{e0:>14.2f}   ({n0} steps)")
    print(f"{'after (planned clocks)':<28}{t1:>20.4f}{e1:>14.2f}   ({n1} steps)")
    print(f"measured: energy {100 * (1 - e1 / e0):+.1f}% saved, iteration time {100 * (t1 / t0 - 1):+.2f}%")
    print(
        f"planner's prediction: energy {pred['energy_saved_pct']:+.1f}% saved, iteration time "
        f"{pred['time_change_pct']:+.2f}%"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", f"{NUM_STAGES}*a40")
    if "RANK" in os.environ:  # torchrun (or the deepspeed launcher)
        os.environ.setdefault(
            "ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.gettempdir() + "/zeus_callbacks-deepspeed-example"
        )
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault(
        "ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.mkdtemp(prefix="zeus-callbacks-deepspeed-")
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    mp.spawn(run, args=(NUM_STAGES, args), nprocs=NUM_STAGES, join=True)


if __name__ == "__main__":
    main()
