"""The training script `zeus-callbacks profile` runs: one window of steps per power limit at one batch size.

    ZEUS_CALLBACKS_SIMULATE=a10g zeus-callbacks profile --gpu-name a10 --batch-sizes 32,64,128 \
        --power-limits 300,200,100 --output a10.json -- python examples/heterogeneous/profile_script.py

The CLI sets the batch size and what to measure through environment variables; `profile_batch_size` and
`profile_power_limits` read them. Run alone, it profiles batch 64 over the GPU's power limits. Replace the
model and data with yours: the only contract is `profile_power_limits(step_fn)` with one training step.
"""

from __future__ import annotations

import argparse
import os

import torch

from zeus_callbacks import profile_batch_size, profile_power_limits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="width of the tiny model")
    args = parser.parse_args()

    batch_size = profile_batch_size(default=64)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    # A tiny CIFAR-100-shaped classifier on synthetic data: the work per step grows with the batch.
    layers = [
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 32 * 32, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 100),
    ]
    if os.environ.get("ZEUS_CALLBACKS_SIMULATE"):
        # On a simulated GPU, 0.1 ms a sample forward (twice that backward) is queued on it: no host CPU, so
        # the host's speed and load do not change the work.
        from zeus_callbacks.sim import SimulatedKernels

        layers.append(SimulatedKernels(0, 1e-4 * batch_size))
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 100, (batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for w in profile_power_limits(step):
        print(
            f"batch {batch_size}: {w.power_limit_w} W  {w.time_s:.4f} s  {w.energy_j:.2f} J per {w.steps} steps"
        )


if __name__ == "__main__":
    main()
