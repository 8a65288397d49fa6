"""The few torch.distributed collectives the core needs, as no-ops when the job is not distributed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["is_distributed", "rank", "world_size", "all_reduce", "broadcast_object", "all_gather_object"]


def is_distributed() -> bool:
    """Whether torch.distributed is initialised with more than one process."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    if not is_distributed():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    if not is_distributed():
        return 1
    import torch.distributed as dist

    return dist.get_world_size()


def _device():
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: Sequence[float], op: str) -> list[float]:
    """Element-wise `sum` or `max` of `values` over every rank (float64). Every rank must call it."""
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce op must be 'sum' or 'max', not {op!r}.")
    if not is_distributed():
        return [float(v) for v in values]
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu().tolist()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank."""
    if not is_distributed():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not is_distributed():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
