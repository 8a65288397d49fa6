"""Process-level helpers the core shares: torch.distributed collectives (no-ops when the job is not
distributed), one `Group` for collectives over a process group, `local_rank()`, and the one chain of
SIGINT/SIGTERM handlers that every part of the core registers its clean-up with."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, TypeVar

__all__ = [
    "is_distributed",
    "rank",
    "world_size",
    "local_rank",
    "all_reduce",
    "reduce_by",
    "all_reduce_record",
    "broadcast_object",
    "all_gather_object",
    "Group",
    "on_termination",
    "remove_termination_handler",
]

logger = logging.getLogger(__name__)


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


def local_rank() -> int:
    """This process's rank on its node: `LOCAL_RANK` (torchrun, accelerate, Lightning), else `SLURM_LOCALID`
    (a task started by `srun`), else 0."""
    name = "LOCAL_RANK" if os.environ.get("LOCAL_RANK") else "SLURM_LOCALID"
    value = os.environ.get(name, "")
    try:
        return int(value) if value else 0
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not an integer; unset it or set the rank on this node."
        ) from None


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


_Record = TypeVar("_Record")


def reduce_by(op: str) -> Mapping[str, str]:
    """The metadata of a field of an `all_reduce_record` record: reduced by `op` ("sum", "max" or "min")."""
    if op not in ("sum", "max", "min"):
        raise ValueError(f"reduce_by op must be 'sum', 'max' or 'min', not {op!r}.")
    return {"reduce": op}


def all_reduce_record(record: _Record) -> _Record:
    """The dataclass `record` with each field reduced over every rank by the op its metadata names
    (`field(metadata=reduce_by(op))`), back in the field's type (bool, int or float). One collective for
    the sums and one for the maxima and minima (a minimum is the maximum of the negated values). Every
    rank must call it; not distributed: `record` itself."""
    if not is_distributed():
        return record
    ops = {f.name: f.metadata["reduce"] for f in fields(record)}  # type: ignore[arg-type]
    # Back in the declared type: a bool or an int field (its name, under postponed annotations), else float.
    kinds = {
        f.name: {"bool": bool, "int": int}.get(str(getattr(f.type, "__name__", f.type)), float)
        for f in fields(record)  # type: ignore[arg-type]
    }
    out: dict[str, Any] = {}
    for kind in ("sum", "max"):
        names = [n for n, o in ops.items() if (o == "sum") == (kind == "sum")]
        if not names:
            continue
        signs = [-1.0 if ops[n] == "min" else 1.0 for n in names]
        values = [sign * float(getattr(record, n)) for sign, n in zip(signs, names, strict=True)]
        for name, sign, value in zip(names, signs, all_reduce(values, kind), strict=True):
            out[name] = kinds[name](sign * value)
    return replace(record, **out)  # type: ignore[type-var]


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


class Group:
    """The collectives of one process group (the default group when None); no-ops outside torch.distributed."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def rank(self) -> int:
        """This process's rank in the group."""
        if not is_distributed():
            return 0
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every group member's `obj`, in group-rank order."""
        if not is_distributed():
            return [obj]
        if self.group is None:
            return all_gather_object(obj)
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """`obj` from the group's first rank."""
        if not is_distributed():
            return obj
        if self.group is None:
            return broadcast_object(obj, src=0)
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


# -- the one signal chain -------------------------------------------------------------------------------
_TERMINATION_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_handlers: list[Callable[[int], None]] = []
_previous: dict[int, Any] = {}
_chain_lock = threading.Lock()
_installed_by: int | None = None  # the pid whose handlers these are: a forked child passes signals on


def on_termination(handler: Callable[[int], None]) -> bool:
    """Call `handler(signum)` on SIGINT/SIGTERM, newest first, before the handler that was in place.

    The first registration installs this module's handler (main thread only); the signal then goes on to
    the handler that was there before (the user's or the framework's), or kills the process as it would
    have without us. Returns False when not on the main thread (the handler then only runs at exit, through
    the caller's own `atexit`).
    """
    global _installed_by
    if threading.current_thread() is not threading.main_thread():
        return False
    with _chain_lock:
        if _installed_by != os.getpid():  # first registration in this process (or a forked child's)
            _handlers.clear()
            _installed_by = os.getpid()
        if handler not in _handlers:
            _handlers.append(handler)
        for signum in _TERMINATION_SIGNALS:
            if signal.getsignal(signum) is not _on_signal:
                _previous[signum] = signal.getsignal(signum)
                signal.signal(signum, _on_signal)
    return True


def remove_termination_handler(handler: Callable[[int], None]) -> None:
    """Forget `handler`; with no handler left, put back the signal handlers found at the first registration."""
    with _chain_lock:
        if handler in _handlers:
            _handlers.remove(handler)
        if _handlers or threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in _previous.items():
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, previous)
        _previous.clear()


def _on_signal(signum: int, frame: Any) -> None:
    # A forked child (a DataLoader worker) inherits this handler but none of the changes it would undo:
    # only the process that registered the clean-ups runs them.
    handlers = list(_handlers) if os.getpid() == _installed_by else []
    if handlers:
        logger.warning("Received %s: restoring GPU settings.", signal.Signals(signum).name)
    for handler in reversed(handlers):
        try:
            handler(signum)
        except Exception:  # one failing clean-up must not stop the others nor the signal
            logger.exception("A clean-up handler failed on %s.", signal.Signals(signum).name)
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL or unknown: die from the signal as the process would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
