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
import dataclasses
import inspect
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # megatron_cpu.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))  # pipeline_job.py

import pipeline_job as job  # noqa: E402
from megatron_cpu import cpu_megatron  # noqa: E402

# Megatron-Core says at import that it falls back to torch without Transformer Engine and Apex: as intended here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|full scope is deprecated).*")

SCHEDULES = {"1f1b": None, "interleaved": 2}  # schedule -> virtual pipeline size (model chunks per rank)
# The interleaved split, in Megatron's `pipeline_model_parallel_layout` notation (one `|`-separated entry per
# virtual stage v = chunk * 4 + rank; E: embedding, t: transformer layer, L: output head and loss): the last
# rank holds 2 layers' worth in each of its chunks (v3: 2 layers; v7: a layer and the head), the others 1.
# The optimizer profiles each chunk apart, so a rank's chunks may weigh differently (`--vocab 640`, `--layout`).
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
    job.add_optimizer_args(p, profile_steps=3, before_after=6)
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


def has_layout() -> bool:
    """Whether this megatron-core splits by `pipeline_model_parallel_layout` (0.13+; 0.12 splits evenly)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "pipeline_model_parallel_layout" in {f.name for f in dataclasses.fields(TransformerConfig)}


def describe(args: argparse.Namespace, schedule: str | None = None) -> str:
    """The model and its split under `schedule` (default: the first of `--schedules`), in one line."""
    chunks = SCHEDULES[schedule or args.schedules.split(",")[0]] or 1
    if chunks == 1:
        split = f"{args.layers} layers evenly"
    elif has_layout():
        split = f"layout {args.layout}"
    else:
        split = f"{args.layers} layers evenly over {job.NUM_STAGES * chunks} virtual stages (this megatron-core has no layout)"
    return (
        f"Megatron-Core GPTModel: {split} over {job.NUM_STAGES} stages ({chunks} chunk(s) per rank), "
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
        parallel_state.initialize_model_parallel(1, job.NUM_STAGES, virtual_pipeline_model_parallel_size=vp)
        layout = {"pipeline_model_parallel_layout": args.layout} if vp and has_layout() else {}
        config = TransformerConfig(
            num_layers=args.layout.count("t") if layout else args.layers,
            **layout,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            pipeline_model_parallel_size=job.NUM_STAGES,
            use_cpu_initialization=True,
            pipeline_dtype=torch.float32,
            batch_p2p_sync=False,  # no torch.cuda.synchronize() after p2p (a CPU host)
            virtual_pipeline_model_parallel_size=vp,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        chunks = vp or 1
        with_vp_stage = "vp_stage" in inspect.signature(GPTModel.__init__).parameters  # megatron-core 0.13+
        self.chunks = []
        for c in range(chunks):
            if vp and not with_vp_stage:  # 0.12 reads the chunk being built from parallel_state
                parallel_state.set_virtual_pipeline_model_parallel_rank(c)
            self.chunks.append(
                GPTModel(
                    config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.vocab,
                    max_sequence_length=args.seq_len,
                    pre_process=rank == 0 and c == 0,
                    post_process=rank == job.NUM_STAGES - 1 and c == chunks - 1,
                    share_embeddings_and_output_weights=False,
                    **({"vp_stage": c if vp else None} if with_vp_stage else {}),
                )
            )
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


def train_schedule(rank: int, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """One schedule, profiled, planned and applied; this rank's history, report and instruction order."""
    from zeus_callbacks.megatron import instrument_megatron, megatron_schedule_order

    pipeline = Pipeline(rank, schedule, args)
    # The first step sets the schedule up; then the baseline at the maximum clocks.
    pfo = job.make_optimizer(rank, args, wait_steps=1 + args.before_steps)
    with instrument_megatron(pfo) as hooks:
        result = job.train(rank, pfo, pipeline.step, args)
    expected = megatron_schedule_order(job.NUM_STAGES, args.microbatches, pipeline.vp or 1)[rank]
    pipeline.close()
    return {
        "schedule": schedule,
        "megatron_schedule": hooks.schedule,
        "history": result.history,
        "report": result.report,
        "locked_mhz": result.locked_mhz,
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
            result = train_schedule(rank, schedule, args)
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, result)
            if rank == 0:
                print_summary(gathered, args)
            results.append(result)
    job.write_results(rank, results, args)
    dist.destroy_process_group()


def print_summary(ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = ranks[0]
    print(f"\n== Perseus on Megatron-Core {first['schedule']} (SIMULATED GPUs: 4x A40) ==")
    print(describe(args, first["schedule"]))
    print(f"schedule: {first['megatron_schedule']}")
    same = all(r["ran"] == r["expected"] for r in ranks)
    print(f"instruction order of every rank {'equals' if same else 'DIFFERS FROM'} Megatron's schedule")
    job.print_before_after([r["history"] for r in ranks], first["report"], args)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    unknown = set(args.schedules.split(",")) - set(SCHEDULES)
    if unknown:
        raise SystemExit(f"--schedules: unknown {sorted(unknown)}; pick from {sorted(SCHEDULES)}")
    job.launch(run, args, "megatron-example")


if __name__ == "__main__":
    main()
