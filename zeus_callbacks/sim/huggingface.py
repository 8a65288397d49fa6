"""Pacing of toy HF `Trainer` steps by simulated GPU work (examples and tests on simulated GPUs); imports
transformers, so `zeus_callbacks.sim` loads it on first use."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from typing_extensions import override

from zeus_callbacks import sim

__all__ = ["HFSimulatedGPUWork"]


class HFSimulatedGPUWork(TrainerCallback):
    """On simulated GPUs, each training step also queues `work_s` seconds of GPU work (at the maximum limit
    and clock, no host CPU: `zeus_callbacks.sim.enqueue_work`), so a toy model's step is paced by the
    simulated GPU, slowed by the limit in force, rather than by the host's speed and load. Nothing happens
    without an active simulation, so a script that uses it runs unchanged on real GPUs.

    Args:
        gpu: The simulated GPU's CUDA index (this process's `local_rank()` under torch.distributed).
        work_s: Seconds of work per step, >= 0.
    """

    def __init__(self, gpu: int = 0, work_s: float = 0.012) -> None:
        self.gpu, self.work_s = int(gpu), sim.work_seconds("HFSimulatedGPUWork", work_s)

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """`on_step_begin` → `sim.enqueue_if_simulated(gpu, work_s)`."""
        sim.enqueue_if_simulated(self.gpu, self.work_s)
