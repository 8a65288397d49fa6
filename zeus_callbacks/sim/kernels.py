"""`SimulatedKernels`: a layer whose forward and backward queue work on a simulated GPU (no host CPU used).

On simulated GPUs a training step's GPU time is otherwise the host CPU time of its operators, which depends
on the host's speed and load: a toy model's step lasts 2 ms on one machine and 20 ms on another, and so
does every step count that depends on it (a profile's samples span the energy counter's refresh). With this
layer in the model, the step's pace is set by the simulated work, stretched by the power limit and clock in
force, as a real GPU's is. Without a simulation it is the identity and queues nothing.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SimulatedKernels"]


class _SimulatedKernel(torch.autograd.Function):
    """Identity whose forward queues `work_s` and backward twice that on simulated GPU `gpu`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gpu: int, work_s: float) -> torch.Tensor:  # type: ignore[override]
        from zeus_callbacks import sim

        ctx.gpu, ctx.work_s = gpu, work_s
        if not x.is_meta:  # not during a stage's shape inference
            sim.enqueue_if_simulated(gpu, work_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        from zeus_callbacks import sim

        sim.enqueue_if_simulated(ctx.gpu, 2 * ctx.work_s)
        return grad, None, None


class SimulatedKernels(nn.Module):
    """The GPU time of the layers before it, as simulated kernels: `work_s` seconds (at the maximum power
    limit and clock) in the forward pass and twice that in the backward, on simulated GPU `gpu` (its CUDA
    index). The identity where no simulation is active.

    Args:
        gpu: The simulated GPU's CUDA index (`cuda:gpu` under this process's `CUDA_VISIBLE_DEVICES`).
        work_s: Forward work in seconds, >= 0.
    """

    def __init__(self, gpu: int, work_s: float) -> None:
        super().__init__()
        from zeus_callbacks import sim

        self.gpu, self.work_s = int(gpu), sim.work_seconds("SimulatedKernels", work_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SimulatedKernel.apply(x, self.gpu, self.work_s)

    def extra_repr(self) -> str:
        return f"gpu={self.gpu}, work_s={self.work_s}"
