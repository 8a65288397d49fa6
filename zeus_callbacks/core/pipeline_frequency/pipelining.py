"""Report a `torch.distributed.pipelining` stage's forwards and backwards to a `PipelineFrequencyOptimizer`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, InstructionKind
from zeus_callbacks.core.pipeline_frequency.engine_step import EngineStep
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

__all__ = ["instrument", "find_stage", "schedule_order"]

# Stage methods that run one instruction -> the instruction name they report (None: decided per call).
_STAGE_METHODS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": None,
    "backward_weight_one_chunk": "backward_weight",
}

# torch's `_ComputationType` values of the compute actions the planner models.
_MODELLED: dict[str, InstructionKind] = {"F": "forward", "B": "backward"}
# Compute actions it does not model: the halves of a split backward (zero-bubble schedules), and a forward
# overlapped with a backward (DualPipeV).
_SPLIT = {"I", "W", "OVERLAP_F_B"}


def schedule_order(schedule: Any) -> list[list[Instruction]]:
    """Every rank's instructions, in order, from a multi-stage schedule's own `pipeline_order`.

    Reads torch's plan rather than re-deriving it, so the DAG follows whatever order this torch version
    runs: `ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`, or a schedule loaded from a CSV. Each action
    `F`/`B` of `stage_index` `v` and microbatch `m` on rank `r` becomes `Instruction(r, kind, m, v)`; idle
    slots and communication are skipped.

    Raises:
        TypeError: `schedule` has no `pipeline_order` (not a multi-stage schedule).
        ValueError: the order splits backwards into input- and weight-gradient actions (zero-bubble
            schedules: `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`, `ScheduleDualPipeV`).
    """
    actions_by_rank = getattr(schedule, "pipeline_order", None)
    if not isinstance(actions_by_rank, dict) or not actions_by_rank:
        raise TypeError(
            f"`schedule_order({type(schedule).__name__}(...))`: not a multi-stage "
            "torch.distributed.pipelining schedule (no pipeline_order)."
        )
    ranks = sorted(actions_by_rank)
    if ranks != list(range(len(ranks))):
        raise ValueError(
            f"{type(schedule).__name__}.pipeline_order has ranks {ranks}, not 0..{len(ranks) - 1}."
        )
    order: list[list[Instruction]] = []
    for rank in ranks:
        instructions = []
        for action in actions_by_rank[rank]:
            if action is None:
                continue
            kind = getattr(action.computation_type, "value", action.computation_type)
            if kind in _SPLIT:
                raise ValueError(
                    f"{type(schedule).__name__} runs {action} on rank {rank}: a backward split into its "
                    "input- and weight-gradient halves (or overlapped with a forward), run apart to fill "
                    "bubbles. The frequency planner models whole forwards and backwards only: use "
                    "ScheduleInterleaved1F1B, ScheduleLoopedBFS, Schedule1F1B or ScheduleGPipe."
                )
            if kind in _MODELLED:
                instructions.append(
                    Instruction(rank, _MODELLED[kind], action.microbatch_index, action.stage_index)
                )
        order.append(instructions)
    return order


def instrument(
    stage: Any, schedule: Any, optimizer: PipelineFrequencyOptimizer, *, mark_steps: bool = True
) -> Callable[[], None]:
    """Drive `optimizer` from a pipeline stage and its schedule; returns a function that undoes it.

    `schedule.step(...)` becomes one training step (`on_step_begin` before, `on_step_end` after), and each
    call of `stage.forward_one_chunk` / `stage.backward_one_chunk` (and `backward_weight_one_chunk` of
    split-backward schedules) one instruction. Steps run through `schedule.eval(...)` (forward only) are
    not reported, so they do not disturb the plan.

    A multi-stage schedule (`ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`: several model chunks per rank)
    reports every stage it runs on this rank, each instruction with its chunk's `stage_index` as virtual
    stage, and hands the optimizer torch's own order of every rank (`schedule_order`) to plan on.

    Args:
        stage: This rank's `torch.distributed.pipelining` `PipelineStage`; for a multi-stage schedule,
            its list of stages, one of them, or None (the schedule's).
        schedule: The schedule running it (`Schedule1F1B`, `ScheduleGPipe`, `ScheduleInterleaved1F1B`,
            `ScheduleLoopedBFS`), or None when something else (a trainer callback) marks the steps: then
            only instructions are reported.
        optimizer: The optimizer to drive.
        mark_steps: False when something else (a trainer callback) marks the steps of a multi-stage
            `schedule`: its order is still handed over, its `step` is left alone.

    Raises:
        TypeError: `schedule` does not run `stage`.
        ValueError: `schedule` splits backwards (zero-bubble schedules; see `schedule_order`).

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
    multi = schedule is not None and hasattr(schedule, "_stages")
    stages = _stages_run(stage, schedule, multi)
    if multi:
        order = schedule_order(schedule)  # refuses a schedule the planner cannot model, before any change
        optimizer.use_schedule(order, name=type(schedule).__name__)
    patch = _Patch(optimizer, mark_steps, training=schedule is None or not mark_steps)
    if schedule is not None and mark_steps:
        patch.wrap(schedule, "step", functools.partial(patch.step, schedule=schedule))
    for owner in stages:
        virtual_stage = owner.stage_index if multi else None
        for method, name in _STAGE_METHODS.items():
            if hasattr(owner, method):
                make = functools.partial(
                    patch.instruction, owner=owner, fixed=name, virtual_stage=virtual_stage
                )
                patch.wrap(owner, method, make)
    return patch.undo


def _stages_run(stage: Any, schedule: Any, multi: bool) -> list[Any]:
    """The stages `instrument` reports: those of `stage` that a multi-stage `schedule` runs, else `[stage]`.

    Raises:
        TypeError: `schedule` does not run `stage`.
    """
    if multi:
        stages = list(schedule._stages)
        given = stages if stage is None else list(stage) if isinstance(stage, list | tuple) else [stage]
        if not given or any(all(s is not g for s in stages) for g in given):
            raise TypeError(
                f"`instrument(stage, schedule={type(schedule).__name__}(...), ...)`: `stage` is not run by "
                "this schedule; pass its stages, one of them, or None."
            )
        return stages
    if schedule is not None and getattr(schedule, "_stage", stage) is not stage:
        raise TypeError(
            f"`instrument(stage, schedule={type(schedule).__name__}(...), ...)`: the schedule does not "
            "run `stage`; pass the stage it was built with."
        )
    return [stage]


class _Patch(EngineStep):
    """The methods `instrument` replaced (to put back), and the training step they report (`EngineStep`)."""

    def __init__(self, optimizer: PipelineFrequencyOptimizer, mark_steps: bool, training: bool) -> None:
        super().__init__(optimizer, mark_steps)
        self._training = training  # True: every instruction is reported (something else marks the steps)
        self.originals: list[tuple[Any, str]] = []

    def wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace `obj.name` by `make(original)` on the instance, with the original's name and docstring."""
        original = getattr(obj, name)
        wrapped = functools.wraps(original)(make(original))
        setattr(obj, name, wrapped)
        self.originals.append((obj, name))

    def undo(self) -> None:
        """Put every replaced method back."""
        for obj, name in reversed(self.originals):
            obj.__dict__.pop(name, None)
        self.originals.clear()

    def step(self, original: Callable[..., Any], schedule: Any) -> Callable[..., Any]:
        """`schedule.step`, as one training step of the optimizer (not in eval, nor nested in a step)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if not getattr(schedule, "_has_backward", True) or self._training:  # eval, or a nested call
                return original(*args, **kwargs)
            return self._run_step(original, *args, **kwargs)

        return run

    def instruction(
        self, original: Callable[..., Any], owner: Any, fixed: str | None, virtual_stage: int | None
    ) -> Callable[..., Any]:
        """A stage method, as one instruction of the optimizer: `fixed`, else a backward or its input half."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._training or not owner.has_backward:
                return original(*args, **kwargs)
            full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
            name = fixed or ("backward" if full else "backward_input")
            self.optimizer.on_instruction_begin(name, virtual_stage=virtual_stage)
            out = original(*args, **kwargs)
            self.optimizer.on_instruction_end(name, virtual_stage=virtual_stage)
            return out

        return run


def find_stage(obj: Any) -> Any | None:
    """The pipeline stage `obj` is, holds, or whose schedule it holds (as an attribute), else None; for a
    multi-stage schedule (several stages per rank), the schedule itself."""
    try:
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # pragma: no cover - torch without distributed
        return None

    def of(value: Any) -> Any | None:
        if isinstance(value, _PipelineStageBase | PipelineScheduleMulti):
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
