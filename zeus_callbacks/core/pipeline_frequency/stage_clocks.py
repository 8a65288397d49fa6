"""The SM clocks one rank of `PipelineFrequencyOptimizer` sets: whether it may, the controller that sets them,
and the first GPU error, after which it sets none."""

from __future__ import annotations

import logging

from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.gpus import GPU
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.pipeline_frequency.controller import FrequencyController
from zeus_callbacks.core.pipeline_frequency.phases import UNLOCKED

__all__ = ["StageClocks"]

logger = logging.getLogger("zeus_callbacks.core.pipeline_frequency.optimizer")


class StageClocks:
    """This rank's clock changes. Until `start`, nothing is set; `may_set` says whether every rank may lock
    clocks (`why_not_set`, in words, when not). `failed` is this rank's first GPU error (a monitor call or a
    clock change), shared at the next collective; once it is set, `set_now` sets nothing."""

    def __init__(self) -> None:
        self.may_set = True
        self.why_not_set = ""  # why `may_set` is False: no permission is only one of the reasons
        self.controller: FrequencyController | None = None  # made at the first step
        self.failed: str | None = None

    def start(self, gpu: GPU, may_set: bool, why_not_set: str) -> None:
        """At the first step: what every rank agreed on, and the controller of `gpu`'s clock."""
        self.may_set, self.why_not_set = may_set, why_not_set
        self.controller = FrequencyController(gpu)

    @property
    def frequency_mhz(self) -> int | None:
        """The SM clock last locked (None: not locked)."""
        return None if self.controller is None else self.controller.frequency_mhz

    def set_now(self, mhz: int) -> None:
        """Lock `mhz` before returning; a refusal is remembered in `failed` (and logged), not raised."""
        if mhz == UNLOCKED or self.controller is None or self.failed is not None:
            return
        try:
            self.controller.set_now(mhz)
        except GPUError as e:
            logger.warning("PipelineFrequencyOptimizer: %s", e)
            self.failed = str(e)

    def request(self, mhz: int) -> None:
        """Ask the controller's thread for `mhz` (nothing before `start`)."""
        if self.controller is not None:
            self.controller.request(mhz)

    def gpu_failed(self, error: GPUError) -> None:
        """A monitor call failed: remembered (and shared at the next collective), not raised."""
        if self.failed is None:
            logger.warning("PipelineFrequencyOptimizer: %s", error)
            self.failed = str(error)

    def take_controller_error(self) -> None:
        """After a step: a clock change the controller's thread could not make becomes `failed`."""
        if self.controller is not None and self.controller.error is not None and self.failed is None:
            self.failed = str(self.controller.error)

    def restore(self, forget: bool = True) -> None:
        """Stop the worker thread, then restore the GPU's settings (so that no clock is locked again after
        the restore); with `forget`, tell the controller that the clock was reset."""
        if self.controller is not None:
            self.controller.close()
        guard().restore()
        if forget and self.controller is not None:
            self.controller.forget()
