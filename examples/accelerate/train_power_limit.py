"""Find the best GPU power limit in an Accelerate training loop, on simulated GPUs (CPU only, < 1 minute).

    python examples/accelerate/train_power_limit.py
    accelerate launch --cpu --num_processes 2 examples/accelerate/train_power_limit.py
    torchrun --standalone --nproc_per_node 2 examples/accelerate/train_power_limit.py

Every process measures its own simulated GPU (`ZEUS_CALLBACKS_SIMULATE`, default `2*a40`); the optimizer
sums energy over processes and applies one limit on all of them at the same step. With `--state DIR`,
the run ends with `accelerator.save_state(DIR)`, and a run that finds DIR resumes from it at the chosen
power limit without profiling again.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from zeus_callbacks import MaxSlowdownConstraint, get_gpus
from zeus_callbacks.accelerate import PowerLimitOptimizerHelper, local_gpu_index


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--state", type=Path, help="directory for accelerator.save_state / load_state")
    parser.add_argument("--real", action="store_true", help="train on the real GPUs (changes power limits)")
    args = parser.parse_args()
    if not args.real:  # before any GPU is discovered
        os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", "2*a40")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=not args.real, gradient_accumulation_steps=args.gradient_accumulation_steps)
    gpu = local_gpu_index(accelerator)
    layers = [torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)]
    if not args.real:  # each step queues 10 ms forward, 20 ms backward on the simulated GPU (no host CPU:
        from zeus_callbacks.sim import SimulatedKernels  # the model's 1-2 ms on the host run beside them)

        layers.append(SimulatedKernels(gpu, 0.01))
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4096, 256)
    loader = DataLoader(TensorDataset(x, x[:, :1] * 2 + 1), batch_size=256, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    with PowerLimitOptimizerHelper(
        accelerator, MaxSlowdownConstraint(1.1), wait_steps=5, warmup_steps=2, profile_steps=8
    ) as plo:
        if args.state is not None and args.state.exists():
            accelerator.load_state(args.state)  # restores the profile: no profiling again
        for _ in range(args.epochs):
            for inputs, targets in loader:
                with plo.step(), accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(inputs), targets)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            plo.epoch_end()
        if args.state is not None:
            accelerator.save_state(args.state)
        core = plo.optimizer
        chosen = core.optimal_power_limit_w
        in_force = core.power_limit_w

    # One write per line, so that the lines of several processes sharing a pipe do not interleave.
    sys.stdout.write(
        f"process {accelerator.process_index} ({'' if args.real else 'simulated '}GPU {gpu}): optimal power limit {chosen} W "
        f"(in force at the end: {in_force} W) after {core.profiling_steps} profiling steps; "
        f"GPU restored to {get_gpus()[gpu].power_limit_mw() // 1000} W\n"
    )
    sys.stdout.flush()
    if accelerator.is_main_process:
        for row in core.report()["power_limits"]:
            print(
                f"  {row['power_limit_w']:>4} W: {row['time_per_step_s'] * 1000:7.2f} ms/step, "
                f"{row['energy_per_step_j']:7.2f} J/step{'  (pruned)' if row['pruned'] else ''}"
            )
    accelerator.end_training()  # ends the process group `accelerate launch` opened, before the interpreter's teardown


if __name__ == "__main__":
    main()
