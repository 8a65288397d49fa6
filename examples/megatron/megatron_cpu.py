"""Run Megatron-Core's pipeline schedules and `GPTModel` on a CPU-only host (gloo): for tests and simulations only.

On GPUs none of this is needed, and `zeus_callbacks.megatron` patches nothing of it. On a host without CUDA,
megatron-core 0.16 touches CUDA in five places, each replaced here for as long as `cpu_megatron()` is active:

- `pipeline_parallel/schedules.py` makes its token counter with `torch.zeros([], ..., device="cuda")`
  (0.12: `torch.tensor(0).cuda()`): the module's `torch` becomes one whose `zeros`/`tensor` put "cuda" on
  the CPU.
- `pipeline_parallel/p2p_communication.py` allocates its receive buffers on `torch.cuda.current_device()`
  and calls `torch.cuda.synchronize()` after batched p2p: that module's `torch.cuda` answers "cpu" and
  synchronises nothing (pass `TransformerConfig(batch_p2p_sync=False)` too).
- `utils.py`'s `GlobalMemoryBuffer` (the local attention's matmul buffer) allocates on
  `torch.cuda.current_device()`: that module's `torch` is the same stand-in.
- `tensor_parallel.random.get_cuda_rng_tracker().fork()` (weight initialisation, dropout) forks the CUDA
  RNG state: the tracker's `fork` becomes a no-op context.

Nothing else is changed (no torch function globally); leaving the context restores every attribute.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cpu_megatron"]


def _on_cpu(device: Any) -> Any:
    return "cpu" if device is not None and str(device).startswith("cuda") else device


def _cpu_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
    if "device" in kwargs:
        kwargs["device"] = _on_cpu(kwargs["device"])
    t = torch.tensor(*args, **kwargs)
    t.cuda = types.MethodType(lambda self, *a, **k: self, t)  # type: ignore[method-assign]
    return t


def _cpu_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
    if "device" in kwargs:
        kwargs["device"] = _on_cpu(kwargs["device"])
    return torch.zeros(*args, **kwargs)


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as seen by p2p_communication.py: the current device is the CPU; nothing to synchronise."""

    def __init__(self) -> None:
        super().__init__("torch.cuda (CPU stand-in)")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


class _CpuTorch(types.ModuleType):
    """`torch` as seen by Megatron's schedules and p2p modules: everything torch's, CUDA allocations on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch (CPU stand-in)")
        self.zeros = _cpu_zeros
        self.tensor = _cpu_tensor
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """While active, Megatron-Core's pipeline schedules and `GPTModel` run on the CPU (see the module docstring)."""
    from megatron.core import utils
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mp_random

    stand_in = _CpuTorch()
    tracker = mp_random.get_cuda_rng_tracker()
    saved = [(module, "torch", module.torch) for module in (schedules, p2p_communication, utils)]
    for module, _, _ in saved:
        module.torch = stand_in
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # instance attribute; the class is untouched
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        tracker.__dict__.pop("fork", None)
