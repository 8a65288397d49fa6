"""Report a `torch.distributed.pipelining` stage's forwards and backwards to a `PipelineFrequencyOptimizer`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

__all__ = ["instrument", "find_stage"]

# Stage methods that run one instruction -> the instruction name they report (None: decided per call).
_STAGE_METHODS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": None,
    "backward_weight_one_chunk": "backward_weight",
}


def instrument(stage: Any, schedule: Any, optimizer: PipelineFrequencyOptimizer) -> Callable[[], None]:
    """Drive `optimizer` from a pipeline stage and its schedule; returns a function that undoes it.

    `schedule.step(...)` becomes one training step (`on_step_begin` before, `on_step_end` after), and each
    call of `stage.forward_one_chunk` / `stage.backward_one_chunk` (and `backward_weight_one_chunk` of
    split-backward schedules) one instruction. Steps run through `schedule.eval(...)` (forward only) are
    not reported, so they do not disturb the plan.

    Args:
        stage: This rank's `torch.distributed.pipelining` `PipelineStage` (one stage per rank).
        schedule: The single-stage schedule running it (`Schedule1F1B`, `ScheduleGPipe`), or None when
            something else (a trainer callback) marks the steps: then only instructions are reported.
        optimizer: The optimizer to drive.

    Raises:
        TypeError: `schedule` runs several stages on this rank, or not `stage`.

    Example::

        stage = PipelineStage(module, stage_index=rank, num_stages=world_size, device=device)
        schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
        pfo = PipelineFrequencyOptimizer(monitor=ZeusMonitor(gpu_indices=[local_rank]))
        instrument(stage, schedule, pfo)
        for x, y in loader:
            schedule.step(x, target=y)  # or schedule.step() on the middle stages
            optimizer.step(); optimizer.zero_grad()
        pfo.on_train_end()
    """
    if schedule is not None and (
        hasattr(schedule, "_stages") or getattr(schedule, "_stage", stage) is not stage
    ):
        raise TypeError(
            f"`instrument(stage, schedule={type(schedule).__name__}(...), ...)`: the optimizer handles one "
            "pipeline stage per rank, run by a single-stage schedule (Schedule1F1B or ScheduleGPipe) of that stage."
        )
    state = {"training": schedule is None}
    originals: list[tuple[Any, str]] = []

    def wrap(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(obj, name)
        wrapped = functools.wraps(original)(make(original))
        setattr(obj, name, wrapped)
        originals.append((obj, name))

    def step(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not getattr(schedule, "_has_backward", True) or state["training"]:  # eval, or a nested call
                return original(*args, **kwargs)
            optimizer.on_step_begin()
            state["training"] = True
            try:
                out = original(*args, **kwargs)
            finally:
                state["training"] = False
            optimizer.on_step_end()
            return out

        return run

    def instruction(original: Callable[..., Any], fixed: str | None) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not state["training"] or not stage.has_backward:
                return original(*args, **kwargs)
            full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
            name = fixed or ("backward" if full else "backward_input")
            optimizer.on_instruction_begin(name)
            out = original(*args, **kwargs)
            optimizer.on_instruction_end(name)
            return out

        return run

    if schedule is not None:
        wrap(schedule, "step", step)
    for method, name in _STAGE_METHODS.items():
        if hasattr(stage, method):
            wrap(stage, method, functools.partial(instruction, fixed=name))

    def undo() -> None:
        for obj, name in reversed(originals):
            obj.__dict__.pop(name, None)
        originals.clear()

    return undo


def find_stage(obj: Any) -> Any | None:
    """The pipeline stage `obj` is, holds, or whose schedule it holds (as an attribute), else None."""
    try:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # pragma: no cover - torch without distributed
        return None

    def of(value: Any) -> Any | None:
        if isinstance(value, _PipelineStageBase):
            return value
        if isinstance(value, PipelineScheduleSingle):
            return value._stage
        return None

    found = of(obj)
    if found is None:
        for value in getattr(obj, "__dict__", {}).values():
            found = of(value)
            if found is not None:
                break
    return found
