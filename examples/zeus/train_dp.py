"""Zeus's `examples/power_limit_optimizer/train_dp.py` (DistributedDataParallel; the optimizer on rank 0
only, driven through Zeus's `CallbackSet`) on synthetic data, CPU and gloo; the Zeus part is Zeus's,
import changed.

    ZEUS_CALLBACKS_SIMULATE=2*a40 torchrun --standalone --nproc_per_node=2 examples/zeus/train_dp.py
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# ZEUS (was: zeus.monitor, zeus.optimizer.power_limit, zeus.callback)
from zeus_callbacks import (
    Callback,
    CallbackSet,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    ZeusMonitor,
)


def get_env(name, cast, default):  # Zeus's `zeus.utils.env.get_env`, which is not a zeus_callbacks name
    return cast(os.environ[name]) if name in os.environ else default


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Zeus's data-parallel example on synthetic data")
    parser.add_argument("--epochs", default=8, type=int)
    parser.add_argument("--steps_per_epoch", default=80, type=int)
    parser.add_argument("-b", "--batch_size", default=64, type=int, help="global mini-batch size")
    return parser.parse_args()


def main():
    args = parse_args()
    args.gpu = int(os.environ["LOCAL_RANK"])
    args.local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group(backend="gloo")  # Zeus: "nccl" (there is no GPU here)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    # Not Zeus's: on simulated GPUs the step's GPU work (1 ms forward, 2 ms backward) is queued on the GPU,
    # rather than the host's CPU time standing for it.
    if os.environ.get("ZEUS_CALLBACKS_SIMULATE"):
        from zeus_callbacks.sim import SimulatedKernels

        model.append(SimulatedKernels(args.gpu, 0.001))
    args.batch_size = args.batch_size // args.local_world_size
    model = torch.nn.parallel.DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    n = args.steps_per_epoch * args.batch_size * args.local_world_size
    train_dataset = TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

    # The rank 0 process will monitor and optimize the power limit of all GPUs.
    if args.gpu == 0:
        callback_set: list[Callback] = [
            GlobalPowerLimitOptimizer(
                monitor=ZeusMonitor(
                    gpu_indices=args.gpu
                ),  # Since there is only one GPU per process, monitor it (give it local rank).
                optimum_selector=MaxSlowdownConstraint(
                    factor=get_env("ZEUS_MAX_SLOWDOWN", float, 1.1),
                ),
                warmup_steps=10,
                profile_steps=40,
                pl_step=25,
            )
        ]
    else:
        callback_set = []
    callbacks = CallbackSet(callback_set)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)

        callbacks.on_epoch_begin()
        train(train_loader, model, criterion, optimizer, epoch, args, callbacks)
        callbacks.on_epoch_end()

    for cb in callback_set:
        print(f"rank {args.gpu} state: {cb.state}")
    dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, args, callbacks):
    model.train()
    for images, target in train_loader:
        callbacks.on_step_begin()  # Mark the beginning of the training step.
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        callbacks.on_step_end()
    if args.gpu == 0:
        print(f"Epoch {epoch}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
