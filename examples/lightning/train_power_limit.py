"""Find the best GPU power limit while a Lightning model trains, on simulated GPUs (CPU only, < 1 minute).

    python examples/lightning/train_power_limit.py                # one process, simulated GPU 0
    python examples/lightning/train_power_limit.py --devices 2    # DDP on 2 CPU processes, one GPU each
    torchrun --standalone --nproc_per_node 2 examples/lightning/train_power_limit.py --devices 2
    python examples/lightning/train_power_limit.py --package pytorch_lightning

Every rank measures its own simulated GPU (`ZEUS_CALLBACKS_SIMULATE`, default `2*a40`); the optimizer
sums energy over ranks and applies one limit on all of them at the same step.
"""

from __future__ import annotations

import argparse
import importlib
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from zeus_callbacks import MaxSlowdownConstraint, ZeusMonitor, get_gpus, local_rank


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (DDP when > 1)")
    parser.add_argument("--package", choices=["lightning", "pytorch_lightning"], default="lightning")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--real", action="store_true", help="train on the real GPUs (changes power limits)")
    args = parser.parse_args()
    if not args.real:  # before any GPU is discovered
        os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", "2*a40")

    if args.package == "lightning":
        import lightning.pytorch as L

        from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer, LightningZeusMonitor
    else:
        import pytorch_lightning as L

        from zeus_callbacks.lightning.pl import LightningGlobalPowerLimitOptimizer, LightningZeusMonitor
    loggers = importlib.import_module(f"{L.__name__}.loggers")

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = [torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)]
            if not args.real:  # each step queues 20 ms forward, 40 ms backward on the simulated GPU (no host
                from zeus_callbacks.sim import SimulatedKernels  # CPU: the model's 1-2 ms run beside them)

                # 60 ms a step: a sample is two steps on the A40's 100 ms energy counter, so the profile
                # fits in the default --max-steps (at 30 ms, 120 steps did not: issue 37).
                layers.append(SimulatedKernels(gpu, 0.02))
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(4096, 256)
    data = DataLoader(TensorDataset(x, x[:, :1] * 2 + 1), batch_size=256, shuffle=True)

    # Launched by Lightning (or torchrun), every process but the first has LOCAL_RANK set: its own GPU.
    gpu = local_rank()
    monitor = ZeusMonitor(gpu_indices=[gpu])
    plo = LightningGlobalPowerLimitOptimizer(
        monitor, MaxSlowdownConstraint(1.1), wait_steps=5, warmup_steps=2, profile_steps=8, pl_step=50
    )
    trainer = L.Trainer(
        accelerator="gpu" if args.real else "cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        callbacks=[plo, LightningZeusMonitor(monitor, logging_interval="epoch")],
        logger=loggers.CSVLogger("lightning_logs", name="power_limit"),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), data)

    core = plo.optimizer
    print(
        f"rank {trainer.global_rank} ({'' if args.real else 'simulated '}GPU {gpu}): optimal power limit {core.optimal_power_limit_w} W "
        f"after {core.profiling_steps} profiling steps; "
        f"GPU restored to {get_gpus()[gpu].power_limit_mw() // 1000} W",
        flush=True,
    )
    if trainer.global_rank == 0:
        for row in core.report()["power_limits"]:
            print(
                f"  {row['power_limit_w']:>4} W: {row['time_per_step_s'] * 1000:7.2f} ms/step, "
                f"{row['energy_per_step_j']:7.2f} J/step{'  (pruned)' if row['pruned'] else ''}"
            )
    if torch.distributed.is_initialized():  # Lightning's teardown leaves the DDP group open: end its threads
        torch.distributed.destroy_process_group()  # here, not during the interpreter's teardown


if __name__ == "__main__":
    main()
