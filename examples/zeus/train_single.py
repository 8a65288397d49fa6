"""Zeus's `examples/power_limit_optimizer/train_single.py` on synthetic data (CPU); the Zeus part is Zeus's,
import changed.

    ZEUS_CALLBACKS_SIMULATE=a40 python examples/zeus/train_single.py
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# ZEUS (was: from zeus.monitor import ZeusMonitor; from zeus.optimizer.power_limit import ...)
from zeus_callbacks import GlobalPowerLimitOptimizer, MaxSlowdownConstraint, ZeusMonitor


def get_env(name, cast, default):  # Zeus's `zeus.utils.env.get_env`, which is not a zeus_callbacks name
    return cast(os.environ[name]) if name in os.environ else default


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Zeus's single-GPU example on synthetic data")
    parser.add_argument("--epochs", default=8, type=int)
    parser.add_argument("--steps_per_epoch", default=80, type=int)
    parser.add_argument("-b", "--batch_size", default=32, type=int)
    parser.add_argument("--gpu", default=0, type=int, help="GPU id to use (default: 0)")
    return parser.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    # Not Zeus's: on simulated GPUs the step's GPU work (1 ms forward, 2 ms backward) is queued on the GPU,
    # rather than the host's CPU time standing for it.
    if os.environ.get("ZEUS_CALLBACKS_SIMULATE"):
        from zeus_callbacks.sim import SimulatedKernels

        model.append(SimulatedKernels(args.gpu, 0.001))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    data = TensorDataset(
        torch.randn(args.steps_per_epoch * args.batch_size, 64),
        torch.randint(0, 10, (args.steps_per_epoch * args.batch_size,)),
    )
    train_loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)

    ################################## The important part #####################################
    # ZeusMonitor is used to profile the time and energy consumption of the GPU.
    monitor = ZeusMonitor(gpu_indices=[args.gpu])

    # GlobalPowerLimitOptimizer profiles each power limit and selects the best one.
    # This is the power limit optimizer that's in the Zeus paper.
    plo = GlobalPowerLimitOptimizer(
        monitor=monitor,
        optimum_selector=MaxSlowdownConstraint(
            factor=get_env("ZEUS_MAX_SLOWDOWN", float, 1.1),
        ),
        warmup_steps=10,
        profile_steps=40,
        pl_step=25,
    )

    for epoch in range(args.epochs):
        plo.on_epoch_begin()
        train(train_loader, model, criterion, optimizer, epoch, args, plo)
        plo.on_epoch_end()
    ################################## The important part #####################################
    print(f"state: {plo.state}")


def train(train_loader, model, criterion, optimizer, epoch, args, power_limit_optimizer):
    model.train()
    for images, target in train_loader:
        power_limit_optimizer.on_step_begin()  # Mark the beginning of one training step.
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        power_limit_optimizer.on_step_end()  # Mark the end of one training step.
    print(f"Epoch {epoch}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
