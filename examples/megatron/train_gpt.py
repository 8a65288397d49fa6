"""Perseus on Megatron-Core: a tiny `GPTModel` in a 4-stage pipeline (1F1B or interleaved), clocks planned.

Runs on 4 CPU processes (gloo), each driving one SIMULATED A40 (`ZEUS_CALLBACKS_SIMULATE=4*a40`, GPU index
= rank). Megatron-Core's own `GPTModel`, `parallel_state` and pipeline schedules run unchanged; on this CPU
host `megatron_cpu.cpu_megatron()` stands in for the few CUDA calls they make (not needed on GPUs). The
model splits as real ones do: every stage holds the same number of transformer layers, and the last one
also the output head (vocabulary projection and loss), so the other stages have slack.

The optimizer measures iterations at the maximum clocks first, profiles every stage's forward and backward
per SM clock, plans the clocks on rank 0 and applies them; the script prints the iteration time and energy
before and after. All figures are SIMULATED.

    python examples/megatron/train_gpt.py                              # 1F1B
    python examples/megatron/train_gpt.py --schedules interleaved      # 2 model chunks per rank
    torchrun --nproc_per_node 4 examples/megatron/train_gpt.py
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
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_cpu import cpu_megatron  # noqa: E402

from zeus_callbacks import PipelineFrequencyOptimizer, ZeusMonitor  # noqa: E402

# Megatron-Core says at import that it falls back to torch without Transformer Engine and Apex: as intended here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|full scope is deprecated).*")

NUM_STAGES = 4
SCHEDULES = {"1f1b": None, "interleaved": 2}  # schedule -> virtual pipeline size (model chunks per rank)
# The interleaved split, in Megatron's `pipeline_model_parallel_layout` notation (one `|`-separated entry per
# virtual stage v = chunk * 4 + rank; E: embedding, t: transformer layer, L: output head and loss): the last
# rank holds 2 layers' worth in each of its chunks (v3: 2 layers; v7: a layer and the head), the others 1.
# The planner profiles a rank's forwards (backwards) over all its chunks, so a rank's chunks weigh the same.
INTERLEAVED_LAYOUT = "Et|t|t|tt|t|t|t|tL"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", default="1f1b", help="comma-separated, run in turn: 1f1b, interleaved")
    p.add_argument("--layers", type=int, default=8, help="transformer layers of 1F1B (split evenly)")
    p.add_argument(
        "--layout", default=INTERLEAVED_LAYOUT, help="the interleaved split (pipeline_model_parallel_layout)"
    )
    p.add_argument("--hidden", type=int, default=32, help="hidden size")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--vocab", type=int, default=384, help="vocabulary; the head costs vocab / (12 hidden) layers"
    )
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument(
        "--kernel-ms",
        type=float,
        default=10.0,
        help="simulated GPU time of one transformer layer's forward per microbatch at the maximum clock "
        "(backward: twice; the head: in proportion to its FLOPs)",
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


def head_layers(args: argparse.Namespace) -> float:
    """The output head's cost in transformer layers: its FLOPs (vocab x hidden) over a layer's (12 hidden^2)."""
    return args.vocab / (12 * args.hidden)


def add_simulated_kernels(chunk: torch.nn.Module, gpu: int, args: argparse.Namespace) -> None:
    """Queue each transformer layer's and the head's GPU time on simulated GPU `gpu` (forward hooks)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from zeus_callbacks.sim import SimulatedKernels

    def after(kernels: SimulatedKernels) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return (kernels(output[0]), *output[1:])
            return kernels(output)

        return hook

    for module in chunk.modules():
        if isinstance(module, TransformerLayer):
            module.register_forward_hook(after(SimulatedKernels(gpu, args.kernel_ms / 1000)))
    head = getattr(chunk, "output_layer", None)
    if head is not None:  # on the head's input: the loss then modifies the logits in place
        kernels = SimulatedKernels(gpu, head_layers(args) * args.kernel_ms / 1000)
        head.register_forward_pre_hook(lambda module, inputs: (kernels(inputs[0]), *inputs[1:]))


def describe(args: argparse.Namespace, schedule: str | None = None) -> str:
    """The model and its split under `schedule` (default: the first of `--schedules`), in one line."""
    chunks = SCHEDULES[schedule or args.schedules.split(",")[0]] or 1
    split = f"layout {args.layout}" if chunks > 1 else f"{args.layers} layers evenly"
    return (
        f"Megatron-Core GPTModel: {split} over {NUM_STAGES} stages ({chunks} chunk(s) per rank), "
        f"head = {head_layers(args):.2f} layers on the last stage, {args.kernel_ms:g} ms simulated kernel per "
        f"layer's forward, {args.microbatches} microbatches"
    )


class Pipeline:
    """This rank's part of the GPT pipeline under one Megatron schedule: `step()` trains one iteration."""

    def __init__(self, rank: int, schedule: str, args: argparse.Namespace) -> None:
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        vp = SCHEDULES[schedule]
        parallel_state.initialize_model_parallel(1, NUM_STAGES, virtual_pipeline_model_parallel_size=vp)
        config = TransformerConfig(
            num_layers=args.layout.count("t") if vp else args.layers,
            pipeline_model_parallel_layout=args.layout if vp else None,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            pipeline_model_parallel_size=NUM_STAGES,
            use_cpu_initialization=True,
            pipeline_dtype=torch.float32,
            batch_p2p_sync=False,  # no torch.cuda.synchronize() after p2p (a CPU host)
            virtual_pipeline_model_parallel_size=vp,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        chunks = vp or 1
        self.chunks = [
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=args.vocab,
                max_sequence_length=args.seq_len,
                pre_process=rank == 0 and c == 0,
                post_process=rank == NUM_STAGES - 1 and c == chunks - 1,
                share_embeddings_and_output_weights=False,
                vp_stage=c if vp else None,
            )
            for c in range(chunks)
        ]
        for chunk in self.chunks:
            add_simulated_kernels(chunk, rank, args)
        params = [p for c in self.chunks for p in c.parameters()]
        self.sgd = torch.optim.SGD(params, lr=1e-4)
        self.args = args
        self.vp = vp
        g = torch.Generator().manual_seed(0)
        b, s = args.micro_batch_size, args.seq_len
        self.tokens = torch.randint(0, args.vocab, (b, s), generator=g)
        self.position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        self.mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)

    def _batches(self) -> Any:
        while True:
            yield self.tokens

    def _forward_step(self, data_iterator: Any, model: torch.nn.Module) -> Any:
        tokens = next(data_iterator)
        out = model(tokens, self.position_ids, self.mask, labels=tokens)

        def loss(output: torch.Tensor) -> Any:
            value = output.float().mean()
            return value, {"lm loss": value.detach()}

        return out, loss

    def step(self) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iterators = [self._batches() for _ in self.chunks]
        get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iterators if self.vp else iterators[0],
            model=self.chunks if self.vp else self.chunks[0],
            num_microbatches=self.args.microbatches,
            seq_length=self.args.seq_len,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=False,
        )
        self.sgd.step()
        self.sgd.zero_grad()

    def close(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


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


def train(rank: int, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """One schedule, profiled, planned and applied; this rank's history, report and instruction order."""
    from zeus_callbacks.megatron import instrument_megatron, megatron_schedule_order

    pipeline = Pipeline(rank, schedule, args)
    pfo = make_optimizer(rank, args, wait_steps=1 + args.before_steps)  # the first step sets things up
    history: list[tuple[str, float, float]] = []  # (phase, time s, energy J) of this rank's steps
    after = 0
    with instrument_megatron(pfo) as hooks:
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
    expected = megatron_schedule_order(NUM_STAGES, args.microbatches, pipeline.vp or 1)[rank]
    pipeline.close()
    return {
        "schedule": schedule,
        "megatron_schedule": hooks.schedule,
        "history": history,
        "report": report,
        "locked_mhz": locked,
        "ran": [str(i) for i in hooks.last_step],
        "expected": [str(i) for i in expected],
    }


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one "GPU" worth of host work per rank
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = []
    with cpu_megatron():
        for schedule in args.schedules.split(","):
            result = train(rank, schedule, args)
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, result)
            if rank == 0:
                print_summary(gathered, args)
            results.append(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


def print_summary(ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = ranks[0]
    report = first["report"]

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
    print(f"\n== Perseus on Megatron-Core {first['schedule']} (SIMULATED GPUs: 4x A40) ==")
    print(describe(args, first["schedule"]))
    print(f"schedule: {first['megatron_schedule']}")
    same = all(r["ran"] == r["expected"] for r in ranks)
    print(f"instruction order of every rank {'equals' if same else 'DIFFERS FROM'} Megatron's schedule")
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
    unknown = set(args.schedules.split(",")) - set(SCHEDULES)
    if unknown:
        raise SystemExit(f"--schedules: unknown {sorted(unknown)}; pick from {sorted(SCHEDULES)}")
    os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", f"{NUM_STAGES}*a40")
    if "RANK" in os.environ:  # torchrun
        os.environ.setdefault(
            "ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.gettempdir() + "/zeus_callbacks-megatron-example"
        )
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.mkdtemp(prefix="zeus-callbacks-megatron-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    mp.spawn(run, args=(NUM_STAGES, args), nprocs=NUM_STAGES, join=True)


if __name__ == "__main__":
    main()
