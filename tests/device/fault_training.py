"""A short training run with an energy optimizer, for the fault tests (run as a script, also under torchrun).

Usage: `python fault_training.py FRAMEWORK` with FRAMEWORK in plain, hf, lightning, pipeline; the simulated
node and its faults come from the environment (`ZEUS_CALLBACKS_SIMULATE`, `ZEUS_CALLBACKS_SIM_FAULTS`).
`FULL_JOURNAL_DISK=1` makes every write into the journal directory fail with ENOSPC. Prints one JSON line
`RESULT {...}`: the power limits and SM locks seen on this rank's GPU during training, and the steps run.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import torch

from zeus_callbacks import sim
from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.state_guard import journal_dir
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

STEPS = 40
PLO_KW = {"wait_steps": 1, "warmup_steps": 1, "profile_steps": 2, "pl_step": 100}
seen: set[str] = set()
steps_run = 0


def _full_disk() -> None:
    """Writes into the journal directory fail as on a full disk (at fsync, where a real one reports it)."""
    directory = os.path.realpath(str(journal_dir()))
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    os.fsync = fsync


def _rank() -> int:
    """This rank's GPU index (every rank GPU 0 with `SAME_GPU=1`: a misconfigured job)."""
    return 0 if os.environ.get("SAME_GPU") else int(os.environ.get("RANK", "0"))


def _observe() -> None:
    global steps_run
    steps_run += 1
    gpu = sim.active().gpus[_rank()]  # the simulator's own view: never lost, never counted
    seen.add(f"{gpu.power_limit_mw // 1000}W")
    if gpu.locked_sm_clocks_mhz is not None:
        seen.add("locked")


def _gpu_work() -> None:
    """A step's GPU work (simulated, no host CPU): the step's pace is the GPU's, not the host's, so the
    optimizer reaches its second limit within the same few steps on a fast host and on a slow one."""
    sim.enqueue_work(_rank(), 0.012)


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def plain() -> None:
    from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer

    plo = GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[_rank()]), **PLO_KW)
    for _ in range(STEPS):
        plo.on_step_begin()
        _burn(0.002)
        _gpu_work()
        dist.all_reduce([1.0], op="sum")
        plo.on_step_end()
        _observe()
    plo.on_train_end()


def pipeline() -> None:
    from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

    pfo = PipelineFrequencyOptimizer(
        rank=0, pp_rank=0, pp_degree=1, world_size=1, wait_steps=1, warmup_steps=0, profile_steps=1,
        frequency_stride_mhz=180,
    )  # fmt: skip
    kinds = ["forward", "forward", "backward", "backward"]
    for _ in range(STEPS):
        pfo.on_step_begin()
        for kind in kinds:
            pfo.on_instruction_begin(kind)
            _burn(0.002)
            pfo.on_instruction_end(kind)
        pfo.on_step_end()
        _observe()
    pfo.on_train_end()


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        return {"loss": (self.layer(x).squeeze(-1) - labels).pow(2).mean()}


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randn((), generator=g)}


def hf() -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer

    class Observe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _gpu_work()

        def on_step_end(self, args, state, control, **kwargs):
            _burn(0.002)
            _observe()

    args = TrainingArguments(
        output_dir=os.environ["OUT_DIR"], max_steps=STEPS, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=10,
    )  # fmt: skip
    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), **PLO_KW)
    Trainer(model=_Tiny(), args=args, train_dataset=_Data(), callbacks=[plo, Observe()]).train()


def lightning() -> None:
    import lightning.pytorch as pl

    from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            _burn(0.002)
            _gpu_work()
            return self.layer(batch["x"]).pow(2).mean()

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            _observe()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    plo = LightningGlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), **PLO_KW)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[plo], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(_Data(), batch_size=4))


def main() -> None:
    torch.set_num_threads(1)
    if os.environ.get("FULL_JOURNAL_DISK"):
        _full_disk()
    if "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group("gloo")
    {"plain": plain, "pipeline": pipeline, "hf": hf, "lightning": lightning}[sys.argv[1]]()
    result = {"rank": int(os.environ.get("RANK", "0")), "seen": sorted(seen), "steps": steps_run}
    # One write per line: the ranks under torchrun share stdout, and print() may split a line in two writes.
    sys.stdout.flush()
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())
    if "WORLD_SIZE" in os.environ:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
