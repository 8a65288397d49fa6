"""Zeus's `examples/power_limit_optimizer/train_fsdp.py` (FullyShardedDataParallel, an optimizer on every
rank) on synthetic data, CPU and gloo; the Zeus part is Zeus's, import changed.

    ZEUS_CALLBACKS_SIMULATE=2*a40 torchrun --standalone --nproc_per_node=2 examples/zeus/train_fsdp.py
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# ZEUS (was: from zeus.monitor import ZeusMonitor; from zeus.optimizer.power_limit import ...)
from zeus_callbacks import GlobalPowerLimitOptimizer, ZeusMonitor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 10)

        # Not Zeus's: on simulated GPUs the step's GPU work (1 ms forward, 2 ms backward) is queued on the GPU,
        # rather than the host's CPU time standing for it.
        self.kernels = nn.Identity()
        if os.environ.get("ZEUS_CALLBACKS_SIMULATE"):
            from zeus_callbacks import local_rank, sim

            self.kernels = sim.SimulatedKernels(local_rank(), 0.001)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(self.kernels(x)))), dim=1)


def train(args, model, rank, world_size, train_loader, optimizer, epoch, plo, sampler=None):
    model.train()
    ddp_loss = torch.zeros(2)
    if sampler:
        sampler.set_epoch(epoch)
    for data, target in train_loader:
        plo.on_step_begin()

        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction="sum")
        loss.backward()
        optimizer.step()
        ddp_loss[0] += loss.item()
        ddp_loss[1] += len(data)

        plo.on_step_end()

    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"Train Epoch: {epoch} \tLoss: {ddp_loss[0] / ddp_loss[1]:.6f}")


def fsdp_main(args):
    dist.init_process_group(backend="gloo", init_method="env://")  # Zeus: "nccl" (there is no GPU here)
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = args.local_rank if args.local_rank is not None else rank
    torch.manual_seed(args.seed)
    n = args.steps_per_epoch * args.batch_size * world_size
    dataset1 = TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
    sampler1 = DistributedSampler(dataset1, rank=rank, num_replicas=world_size, shuffle=True)
    train_loader = DataLoader(dataset1, batch_size=args.batch_size, sampler=sampler1)

    model = FSDP(Net(), device_id=torch.device("cpu"))  # Zeus: Net().to(local_rank) on a GPU
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    # Init ZeusMonitor and GPLO
    monitor = ZeusMonitor(gpu_indices=[local_rank])
    plo = GlobalPowerLimitOptimizer(monitor, profile_steps=200)

    for epoch in range(1, args.epochs + 1):
        plo.on_epoch_begin()
        train(args, model, local_rank, world_size, train_loader, optimizer, epoch, plo, sampler=sampler1)
        plo.on_epoch_end()

    print(f"rank {rank} state: {plo.state}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Zeus's FSDP example on synthetic data")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps-per-epoch", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--local-rank", type=int, default=None)
    fsdp_main(parser.parse_args())
