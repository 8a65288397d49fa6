"""Which micro-batches open and close an optimizer step, for trainers whose batch hooks fire per micro-batch."""

from __future__ import annotations

__all__ = ["OptimizerSteps"]


class OptimizerSteps:
    """Turns per-micro-batch hooks into optimizer-step boundaries.

    With gradient accumulation a trainer (Lightning, an Accelerate loop) calls its batch hooks once per
    micro-batch, but a training step for the optimizers and the energy intervals is an optimizer step: it
    begins at the first micro-batch after the previous optimizer step and ends at the micro-batch during which
    the optimizer stepped. So validation or checkpointing between steps is charged to no step.

    Example::

        steps = OptimizerSteps()
        # batch start:
        if steps.begin(trainer.global_step):
            optimizer.on_step_begin()
        # batch end:
        if steps.end(trainer.global_step):
            optimizer.on_step_end()
    """

    def __init__(self) -> None:
        self._begun_at: int | None = None

    def begin(self, optimizer_steps: int = 0) -> bool:
        """At the start of a micro-batch, with the optimizer steps taken so far: whether it opens a step."""
        if self._begun_at is not None:
            return False
        self._begun_at = optimizer_steps
        return True

    def end(self, optimizer_steps: int | None = None) -> bool:
        """At the end of a micro-batch: whether it closes the step.

        Args:
            optimizer_steps: The optimizer steps taken so far (the step closes once it moved since `begin`);
                None when the caller knows the optimizer stepped during this micro-batch.
        """
        if self._begun_at is None or optimizer_steps == self._begun_at:
            return False
        self._begun_at = None
        return True
