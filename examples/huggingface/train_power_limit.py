"""Train a tiny causal LM with HF Trainer while HFGlobalPowerLimitOptimizer picks the GPU power limit.

Runs on the CPU in under a minute against simulated GPUs (the default; nothing on this machine changes):

    python examples/huggingface/train_power_limit.py
    torchrun --nproc_per_node 2 examples/huggingface/train_power_limit.py

Each process measures and caps its own (simulated) GPU, `gpu_indices=[local_rank]`; under torchrun the ranks
sum their energy, take the slowest time, and so choose the same power limit at the same step.
"""

from __future__ import annotations

import argparse
import os
import random

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from zeus_callbacks import (
    HFGlobalPowerLimitOptimizer,
    HFZeusMonitor,
    MaxSlowdownConstraint,
    ZeusMonitor,
    local_rank,
    saving_text,
)

SEQ_LEN = 64


class ToyCorpus(torch.utils.data.Dataset):
    """Byte-level blocks of generated sentences (nothing downloaded)."""

    def __init__(self, num_blocks: int = 2048, seed: int = 0) -> None:
        words = "the gpu trains a tiny model while its power limit goes down and up again".split()
        rng = random.Random(seed)
        text = "\n".join(" ".join(rng.choices(words, k=rng.randint(4, 12))) for _ in range(num_blocks * 8))
        data = torch.tensor(list(text.encode()), dtype=torch.long)
        self.blocks = data[: num_blocks * SEQ_LEN].view(num_blocks, SEQ_LEN)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--real", action="store_true", help="use the real GPUs (changes power limits; needs root)"
    )
    parser.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    parser.add_argument(
        "--output-dir", default="/tmp/zeus-callbacks-example", help="Trainer output directory"
    )
    args = parser.parse_args()

    rank = local_rank()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if not args.real:
        # Select simulated GPUs explicitly: one per process, at least two so that torchrun works as is.
        os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", f"{max(2, world_size)}*a40")
        if rank == 0:
            print(f"SIMULATED GPUs: ZEUS_CALLBACKS_SIMULATE={os.environ['ZEUS_CALLBACKS_SIMULATE']}")
        torch.set_num_threads(1)  # the toy model's host work stays short beside its simulated GPU work

    monitor = ZeusMonitor(gpu_indices=[rank])
    plo = HFGlobalPowerLimitOptimizer(
        monitor, MaxSlowdownConstraint(1.1), wait_steps=5, warmup_steps=2, profile_steps=8, pl_step=50
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=not args.real,  # CPU training: torchrun's processes talk over gloo
        logging_steps=20,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=32,
            n_head=2,
            vocab_size=256,
            n_positions=SEQ_LEN,
            bos_token_id=10,
            eos_token_id=10,
        )
    )
    callbacks = [HFZeusMonitor(monitor), plo]
    if not args.real:
        # Each step queues 60 ms of work on its simulated GPU (no host CPU: the toy model's few ms of host
        # work run beside it), so the GPU's pace, not the host's load, sets the step's time.
        from zeus_callbacks.sim import HFSimulatedGPUWork

        callbacks.append(HFSimulatedGPUWork(local_rank(), 0.06))
    trainer = Trainer(model=model, args=training_args, train_dataset=ToyCorpus(), callbacks=callbacks)
    trainer.train()

    report = plo.optimizer.report()
    sim = " (SIMULATED)" if report["simulated"] else ""
    print(
        f"rank {trainer.args.process_index}: chose {report['optimal_power_limit_w']} W{sim} after profiling "
        f"{[r['power_limit_w'] for r in report['power_limits']]} W: {saving_text(report)}; "
        f"run energy {trainer.state.log_history[-1]['energy/total_j']:.0f} J{sim}",
        flush=True,
    )
    if torch.distributed.is_initialized():  # the group Trainer opened under torchrun: its threads end here,
        torch.distributed.destroy_process_group()  # not during the interpreter's teardown


if __name__ == "__main__":
    main()
