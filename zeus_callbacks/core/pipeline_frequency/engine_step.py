"""One training step of a pipeline engine, as its instrumentation reports it to the optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

__all__ = ["EngineStep"]


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
