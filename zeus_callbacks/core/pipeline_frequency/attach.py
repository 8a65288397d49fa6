"""A `PipelineFrequencyOptimizer` attached to one training run's pipeline stage: what every adapter does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.pipeline_frequency.pipelining import find_stage, instrument

__all__ = ["StageAttachment"]


class StageAttachment:
    """Instrument this rank's pipeline stage at train start; reset the clocks and undo it at train end.

    The adapters' training step is one pipeline iteration, which the trainer's step hooks mark, so the
    stage is instrumented without its schedule: only its instructions are reported.

    Args:
        optimizer: The optimizer the stage's forwards and backwards are reported to.
        stage: This rank's `PipelineStage`, or its schedule (single- or multi-stage), or an object holding
            one as an attribute; None to find it on what `attach` is given.
        adapter: The adapter's class name, for the error message.
        alternative: The adapter to use without pipeline parallelism, for the error message.
    """

    def __init__(
        self, optimizer: PipelineFrequencyOptimizer, stage: Any = None, *, adapter: str, alternative: str
    ) -> None:
        self.optimizer = optimizer
        self.stage = stage
        self._adapter = adapter
        self._alternative = alternative
        self._undo: Callable[[], None] | None = None

    def attach(self, model: Any) -> None:
        """Find the stage (`stage`, else on `model`) and instrument it, once per run.

        Raises:
            ValueError: the job has no pipeline stage to instrument.
        """
        stage = find_stage(self.stage if self.stage is not None else model)
        if stage is None:
            raise ValueError(
                f"{self._adapter} is attached to a job with no pipeline stage: pass "
                f"`{self._adapter}(stage=...)` with this rank's torch.distributed.pipelining PipelineStage "
                f"(or keep it, or its schedule, as an attribute of the model). For training without pipeline "
                f"parallelism, use {self._alternative}."
            )
        if self._undo is None:
            if hasattr(stage, "_stages"):  # a multi-stage schedule: its stages, and its order to plan on
                self._undo = instrument(None, stage, self.optimizer, mark_steps=False)
            else:
                self._undo = instrument(stage, None, self.optimizer)

    def detach(self) -> None:
        """`PipelineFrequencyOptimizer.on_train_end` (clocks reset), then remove the instrumentation."""
        self.optimizer.on_train_end()
        if self._undo is not None:
            self._undo()
            self._undo = None
