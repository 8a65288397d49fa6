"""PyTorch Ignite adapter: the power-limit optimizer on an `ignite.engine.Engine`, built on the session's
contract (`zeus_callbacks.core.power_limit.session`) and nothing else. Ignite is imported at `attach`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import OptimumSelector
from zeus_callbacks.core.power_limit.session import PowerLimitOptions, PowerLimitSession

__all__ = ["IgnitePowerLimitOptimizer"]


class IgnitePowerLimitOptimizer:
    """Find the best GPU power limit while an Ignite `Engine` trains, and keep it.

    `attach(trainer)` adds one handler per event: `STARTED` → `start`, `ITERATION_STARTED` /
    `ITERATION_COMPLETED` → `step_begin` / `step_end` (an Ignite iteration is one optimizer step), every
    `log_every_n_steps` iterations and at `EPOCH_COMPLETED` → `interval_metrics`, at `COMPLETED` →
    `summary`, then `end` (the GPUs get their settings back), `EXCEPTION_RAISED` → `fail`. The figures go
    into `engine.state.metrics`, where Ignite's loggers read them (`OutputHandler(metric_names="all")`,
    attached after this). As an object with `state_dict`/`load_state_dict` it goes in Ignite's
    `Checkpoint(to_save={...})`: a resumed run applies the chosen limit without profiling again.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU.
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        wait_steps: Steps to let pass before profiling starts.
        warmup_steps: Steps run at a power limit before it is measured.
        profile_steps: Steps measured at each power limit (the most, for the adaptive search).
        pl_step: Stride between profiled power limits (W).
        profile_path: JSON profile: loaded if it exists, written (by rank 0) as profiling goes.
        search: `"adaptive"` (default) or `"sweep"` (every limit, as Zeus).
        report_path: Write the run's HTML report there at the end of training; None: no report.
        allow_raising_limit: Let the search go above the limit in force when training started.
        log_every_n_steps: Iterations between two updates of the figures (0: at epoch ends only).

    Example::

        plo = IgnitePowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), MaxSlowdownConstraint(1.1))
        plo.attach(trainer)
        trainer.run(loader, max_epochs=3)
    """

    def __init__(  # Zeus's arguments, in Zeus's order
        self, monitor: ZeusMonitor, optimum_selector: OptimumSelector | None = None, wait_steps: int = 1,
        warmup_steps: int = 10, profile_steps: int = 40, pl_step: int = 25, profile_path: str | Path | None = None,
        search: str = "adaptive", allow_raising_limit: bool = False, report_path: str | Path | None = None, *,
        log_every_n_steps: int = 50,
    ) -> None:  # fmt: skip
        options = PowerLimitOptions(
            optimum_selector,
            wait_steps,
            warmup_steps,
            profile_steps,
            pl_step,
            profile_path,
            search,
            allow_raising_limit,
            report_path,
        )
        self._session = PowerLimitSession(type(self).__name__, monitor, options)
        self._every = log_every_n_steps
        self._handles: list[Any] = []

    @property
    def optimizer(self) -> GlobalPowerLimitOptimizer:
        """The core optimizer: `phase`, `optimal_power_limit_w`, `metrics()`, `report()`."""
        return self._session.optimizer

    def attach(self, engine: Any) -> None:
        """Add the handlers to `engine` (an `ignite.engine.Engine`); `detach()` removes them."""
        from ignite.engine import Events

        s, self._raised = self._session, Events.EXCEPTION_RAISED
        handlers = [
            (Events.STARTED, lambda e: s.start()),
            (Events.ITERATION_STARTED, lambda e: s.step_begin()),
            (Events.ITERATION_COMPLETED, lambda e: s.step_end()),
            (Events.EPOCH_COMPLETED, lambda e: e.state.metrics.update(s.interval_metrics())),
            (Events.COMPLETED, self._completed),
            (Events.EXCEPTION_RAISED, self._failed),
        ]
        if self._every:
            every = Events.ITERATION_COMPLETED(every=self._every)
            handlers.append((every, lambda e: e.state.metrics.update(s.interval_metrics())))
        self._handles = [engine.add_event_handler(event, handler) for event, handler in handlers]

    def detach(self) -> None:
        """Remove the handlers `attach` added."""
        for handle in self._handles:
            handle.remove()

    def _completed(self, engine: Any) -> None:
        engine.state.metrics.update(self._session.summary())
        self._session.end()

    def _failed(self, engine: Any, error: BaseException) -> None:
        self._session.fail()
        # Ignite re-raises only when no EXCEPTION_RAISED handler exists (`Engine._handle_exception`,
        # ignite/engine/engine.py in 0.5.5): this one alone must not swallow the error.
        if len(engine._event_handlers[self._raised]) == 1:
            raise error

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, for Ignite's `Checkpoint`."""
        return self._session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint's state (`PowerLimitSession.load_state`: a corrupted one is refused, said once)."""
        self._session.load_state(state_dict, "the Ignite checkpoint being resumed")
