"""One training step of a pipeline engine, as its instrumentation reports it to the optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

__all__ = ["EngineStep", "check_engine_arguments", "check_schedule_shape"]


def check_engine_arguments(call: str, optimizer: Any, mark_steps: Any) -> None:
    """`optimizer` must be a `PipelineFrequencyOptimizer` and `mark_steps` a bool, else one clear line."""
    if not isinstance(optimizer, PipelineFrequencyOptimizer):
        raise TypeError(
            f"`{call}(optimizer={optimizer!r:.60})`: a {type(optimizer).__name__} is not a "
            "PipelineFrequencyOptimizer; pass `PipelineFrequencyOptimizer(monitor=..., pp_rank=...)` (the power-"
            "limit optimizer needs no engine hooks: call its on_step_begin/on_step_end)."
        )
    if not isinstance(mark_steps, bool):
        raise TypeError(f"`{call}(mark_steps={mark_steps!r})`: pass True or False.")


def check_schedule_shape(call: str, **sizes: Any) -> None:
    """Each of `sizes` (None: its default) must be a whole number >= 1, else one clear line."""
    from zeus_callbacks.core.arguments import whole_number

    for name, value in sizes.items():
        if value is not None:
            whole_number(call, name, value, 1)


class EngineStep:
    """What every engine's instrumentation keeps of a training step (Megatron-Core's schedule call,
    DeepSpeed's `train_batch`): whether one is running, the instructions it ran, and the step marks.

    Attributes:
        optimizer: The optimizer the step is reported to.
        mark_steps: Whether the step's start and end are `on_step_begin` / `on_step_end`.
        last_step: What this rank ran in its last complete training step.
    """

    def __init__(self, optimizer: PipelineFrequencyOptimizer, mark_steps: bool) -> None:
        self.optimizer = optimizer
        self.mark_steps = mark_steps
        self.last_step: list[Instruction] = []
        self._training = False
        self._running: list[Instruction] = []

    def _run_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the engine's training step `original(*args, **kwargs)` between the step marks."""
        self._running = []
        if self.mark_steps:
            self.optimizer.on_step_begin()
        self._training = True
        try:
            out = original(*args, **kwargs)
        finally:
            self._training = False
        self.last_step, self._running = self._running, []
        if self.mark_steps:
            self.optimizer.on_step_end()
        return out
