"""Report a DeepSpeed `PipelineEngine`'s 1F1B schedule (`TrainSchedule`) to a `PipelineFrequencyOptimizer`.

A `PipelineEngine` runs a batch (`train_batch`) by executing its schedule's instructions, each dispatched
through the class's `_INSTRUCTION_MAP` (instruction type -> method; `_exec_schedule` binds the function it
finds there, so wrapping the methods alone changes nothing). `instrument_deepspeed` gives the one engine its
own copy of the map with `ForwardPass` and `BackwardPass` wrapped, and wraps its `train_batch`; `remove()`
deletes both instance attributes, so the class is never changed. Supported and tested: deepspeed 0.19.8.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction
from zeus_callbacks.core.pipeline_frequency.engine_step import (
    EngineStep,
    check_engine_arguments,
    check_schedule_shape,
)
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

__all__ = ["DeepSpeedInstrumentation", "instrument_deepspeed", "deepspeed_schedule_order"]


def _schedule_module() -> Any:
    try:
        from deepspeed.runtime.pipe import schedule
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "zeus_callbacks.deepspeed needs DeepSpeed: pip install 'zeus-callbacks[deepspeed]'."
        ) from e
    return schedule


def deepspeed_schedule_order(num_stages: int, num_microbatches: int) -> list[list[Instruction]]:
    """Every stage's forwards and backwards in the order DeepSpeed's `TrainSchedule` issues them.

    Read from the schedule itself (`TrainSchedule(micro_batches, stages, stage_id).steps()`), its
    `ForwardPass`/`BackwardPass` instructions numbered in turn: a stage runs the forwards, and the
    backwards, of its microbatches in order (the instructions carry only a buffer id).
    """
    check_schedule_shape("deepspeed_schedule_order", num_stages=num_stages, num_microbatches=num_microbatches)
    schedule = _schedule_module()
    order = []
    for stage in range(num_stages):
        plan = schedule.TrainSchedule(micro_batches=num_microbatches, stages=num_stages, stage_id=stage)
        counts = {"forward": 0, "backward": 0}
        ops = []
        for step in plan.steps():
            for cmd in step:
                kind = _kind(schedule, cmd)
                if kind is not None:
                    ops.append(Instruction(stage, kind, counts[kind]))  # type: ignore[arg-type]
                    counts[kind] += 1
        order.append(ops)
    return order


def _kind(schedule: Any, cmd: Any) -> str | None:
    if isinstance(cmd, schedule.ForwardPass):
        return "forward"
    if isinstance(cmd, schedule.BackwardPass):
        return "backward"
    return None


class DeepSpeedInstrumentation(EngineStep):
    """A `PipelineEngine` reporting to a `PipelineFrequencyOptimizer`; made by `instrument_deepspeed`.

    Hooks: `engine.train_batch(...)` -> `on_step_begin` before and `on_step_end` after (with `mark_steps`);
    at the first one the optimizer is given every stage's `TrainSchedule` order to plan on and to check
    each stage's against. Each `ForwardPass` / `BackwardPass` instruction of a training batch ->
    `on_instruction_begin/end("forward" / "backward")`. `eval_batch` is not reported.

    `last_step` lists what this stage ran in its last training batch, microbatch ids counted in turn.
    Use as a context manager, or call `remove()`.
    """

    def __init__(self, engine: Any, optimizer: PipelineFrequencyOptimizer, mark_steps: bool) -> None:
        super().__init__(optimizer, mark_steps)
        self.engine = engine
        self.schedule: str | None = None
        self._counts = {"forward": 0, "backward": 0}

    def _install(self) -> None:
        schedule = _schedule_module()
        engine = self.engine
        instructions = dict(type(engine)._INSTRUCTION_MAP)
        instructions[schedule.ForwardPass] = self._instruction(instructions[schedule.ForwardPass], "forward")
        instructions[schedule.BackwardPass] = self._instruction(
            instructions[schedule.BackwardPass], "backward"
        )
        engine._INSTRUCTION_MAP = instructions  # this engine's own map: the class's is untouched
        original = engine.train_batch
        engine.train_batch = functools.wraps(original)(self._train_batch(original))

    def remove(self) -> None:
        """Give the engine back its class's map and `train_batch` (idempotent). Clocks are the optimizer's."""
        self.engine.__dict__.pop("_INSTRUCTION_MAP", None)
        self.engine.__dict__.pop("train_batch", None)

    def __enter__(self) -> DeepSpeedInstrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _train_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._training:
                return original(*args, **kwargs)
            engine = self.engine
            if self.schedule is None:
                order = deepspeed_schedule_order(engine.num_stages, engine.micro_batches)
                self.optimizer.use_schedule(order, name="TrainSchedule")
                self.schedule = "TrainSchedule"
            self._counts = {"forward": 0, "backward": 0}
            return self._run_step(original, *args, **kwargs)

        return run

    def _instruction(self, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        # Called as `MethodType(map[type(cmd)], engine)(**cmd.kwargs)` by `PipelineEngine._exec_schedule`.
        @functools.wraps(method)
        def run(engine: Any, **kwargs: Any) -> Any:
            if not self._training:
                return method(engine, **kwargs)
            self.optimizer.on_instruction_begin(kind)
            out = method(engine, **kwargs)
            self.optimizer.on_instruction_end(kind)
            self._running.append(Instruction(engine.stage_id, kind, self._counts[kind]))  # type: ignore[arg-type]
            self._counts[kind] += 1
            return out

        return run


def instrument_deepspeed(
    engine: Any, optimizer: PipelineFrequencyOptimizer, *, mark_steps: bool = True
) -> DeepSpeedInstrumentation:
    """Drive `optimizer` from a DeepSpeed `PipelineEngine` (what `deepspeed.initialize` returns for a
    `PipelineModule`); returns the hooks. Each `engine.train_batch()` is one step, each forward and
    backward of a microbatch one instruction (see `DeepSpeedInstrumentation`).

    Args:
        engine: This rank's `deepspeed.runtime.pipe.engine.PipelineEngine`.
        optimizer: The optimizer to drive; its `pp_rank` is `engine.stage_id`.
        mark_steps: False when something else marks the steps (`on_step_begin/end`).

    Raises:
        TypeError: `engine` is not a `PipelineEngine`, or it is already instrumented.

    Example::

        import deepspeed
        from deepspeed.pipe import PipelineModule
        from zeus_callbacks import PipelineFrequencyOptimizer, ZeusMonitor
        from zeus_callbacks.deepspeed import instrument_deepspeed

        engine, *_ = deepspeed.initialize(model=PipelineModule(layers, num_stages=4, loss_fn=loss), config=cfg)
        pfo = PipelineFrequencyOptimizer(monitor=ZeusMonitor(gpu_indices=[local_rank]), pp_rank=engine.stage_id)
        with instrument_deepspeed(engine, pfo):
            for _ in range(steps):
                engine.train_batch(data_iter)
        pfo.on_train_end()
    """
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, PipelineEngine):
        raise TypeError(
            f"`instrument_deepspeed(engine={type(engine).__name__}(...), ...)`: not a DeepSpeed PipelineEngine; "
            "pass what `deepspeed.initialize(model=PipelineModule(...), ...)` returns first."
        )
    if "_INSTRUCTION_MAP" in engine.__dict__:
        raise TypeError(
            "`instrument_deepspeed(engine, ...)`: this engine is already instrumented; call `.remove()` on the "
            "first instrumentation before instrumenting again."
        )
    check_engine_arguments("instrument_deepspeed", optimizer, mark_steps)
    hooks = DeepSpeedInstrumentation(engine, optimizer, mark_steps)
    hooks._install()
    return hooks
