"""Zeus's Hugging Face usage (`examples/huggingface`: `HFGlobalPowerLimitOptimizer` in a `Trainer`) with a
tiny GPT-2 built from a config and random tokens; the Zeus part is Zeus's, import changed.

    ZEUS_CALLBACKS_SIMULATE=a40 python examples/zeus/hf_trainer.py
"""

import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

# ZEUS (was: from zeus.monitor import ZeusMonitor; from zeus.optimizer.power_limit import ...)
from zeus_callbacks import HFGlobalPowerLimitOptimizer, ZeusMonitor


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int = 16) -> None:
        self.data = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        num_train_epochs=2,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=50,
    )

    monitor = ZeusMonitor()
    optimizer = HFGlobalPowerLimitOptimizer(monitor)

    # Also works with SFTTrainer.
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(4 * 1200),
        callbacks=[optimizer],  # Add the `HFGlobalPowerLimitOptimizer` callback
    )
    # Not Zeus's: on simulated GPUs each step queues 5 ms of work on the GPU, rather than the host's CPU time
    # standing for it.
    if os.environ.get("ZEUS_CALLBACKS_SIMULATE"):
        from zeus_callbacks.sim import HFSimulatedGPUWork

        trainer.add_callback(HFSimulatedGPUWork(0, 0.005))
    trainer.train()
    print(f"state: {optimizer.optimizer.state}")


if __name__ == "__main__":
    main()
