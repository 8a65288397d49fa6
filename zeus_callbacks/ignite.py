"""PyTorch Ignite adapters: the power-limit optimizer and the energy monitor on an `ignite.engine.Engine`, each
built on its session's contract (`zeus_callbacks.core.power_limit.session`, `zeus_callbacks.core.monitor.session`)
and nothing else. Ignite is imported at `attach`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from typing_extensions import Unpack

from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.session import EnergySession
from zeus_callbacks.core.power_limit.keywords import PowerLimitArguments
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.options import PowerLimitOptions, takes_power_limit_options
from zeus_callbacks.core.power_limit.selectors import OptimumSelector
from zeus_callbacks.core.power_limit.session import PowerLimitSession
from zeus_callbacks.core.wrong_framework import OneFramework

__all__ = ["IgnitePowerLimitOptimizer", "IgniteZeusMonitor"]

Handler = Callable[..., object]  # Ignite calls it as (engine, *event_args) and ignores what it returns


class IgniteAdapter(OneFramework):
    """What both Ignite adapters share: one handler per event, added by `attach` and removed by `detach`,
    the figures put in `engine.state.metrics` (where Ignite's loggers read them), and the session's `fail`
    on `EXCEPTION_RAISED` without swallowing the error. A subclass sets `_session` and `_every`, and says
    which handlers it adds (`_handlers`)."""

    _session: PowerLimitSession | EnergySession
    _every: int

    def _handlers(self, events: Any) -> list[tuple[Any, Handler]]:
        """(event, handler) pairs beyond the shared ones."""
        return []

    def attach(self, engine: Any) -> None:
        """Add the handlers to `engine` (an `ignite.engine.Engine`); `detach()` removes them."""
        from ignite.engine import Events

        s, self._raised = self._session, Events.EXCEPTION_RAISED
        handlers: list[tuple[Any, Handler]] = [
            (Events.STARTED, self._started),
            (Events.ITERATION_STARTED, lambda e: s.step_begin()),
            (Events.ITERATION_COMPLETED, lambda e: s.step_end()),
            *self._handlers(Events),
            (Events.EPOCH_COMPLETED, self._log),
            (Events.COMPLETED, self._completed),
            (Events.EXCEPTION_RAISED, self._failed),
        ]
        if self._every:
            handlers.append((Events.ITERATION_COMPLETED(every=self._every), self._log))
        self._handles = [engine.add_event_handler(event, handler) for event, handler in handlers]

    def detach(self) -> None:
        """Remove the handlers `attach` added."""
        for handle in getattr(self, "_handles", ()):
            handle.remove()

    def _started(self, engine: Any) -> None:
        self._running = True
        self._session.start()

    def _log(self, engine: Any) -> None:
        engine.state.metrics.update(self._session.interval_metrics())

    def _completed(self, engine: Any) -> None:
        engine.state.metrics.update(self._session.summary())
        self._session.end()

    def _failed(self, engine: Any, error: BaseException) -> None:
        # Ignite fires EXCEPTION_RAISED twice for an error in a step (the epoch's run, then the engine's):
        # the session fails once.
        if getattr(self, "_running", False):
            self._running = False
            self._session.fail()
        # Ignite re-raises only when no EXCEPTION_RAISED handler exists (`Engine._handle_exception`,
        # ignite/engine/engine.py in 0.5.5): this one alone must not swallow the error.
        if len(engine._event_handlers[self._raised]) == 1:
            raise error


class IgnitePowerLimitOptimizer(IgniteAdapter):
    """Find the best GPU power limit while an Ignite `Engine` trains, and keep it.

    `attach(trainer)` adds one handler per event: `STARTED` → `start`, `ITERATION_STARTED` /
    `ITERATION_COMPLETED` → `step_begin` / `step_end` (an Ignite iteration is one optimizer step),
    `EPOCH_COMPLETED` → `epoch_end`, then `interval_metrics`, also every `log_every_n_steps` iterations, at
    `COMPLETED` → `summary`, then `end` (the GPUs get their settings back), `EXCEPTION_RAISED` → `fail`. The
    figures go into `engine.state.metrics`, where Ignite's loggers read them (`OutputHandler(metric_names=
    "all")`, attached after this). As an object with `state_dict`/`load_state_dict` it goes in Ignite's
    `Checkpoint(to_save={...})`: a resumed run applies the chosen limit without profiling again.

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU.
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        **options: The other `PowerLimitOptions` (`wait_steps`, ..., `report_path`), by keyword.
        log_every_n_steps: Iterations between two updates of the figures (0: at epoch ends only).

    Example::

        plo = IgnitePowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), MaxSlowdownConstraint(1.1))
        plo.attach(trainer)
        trainer.run(loader, max_epochs=3)
    """

    _what = "a PyTorch Ignite handler (`attach` it to an Engine)"
    _does = "power_limit"
    _session: PowerLimitSession

    @takes_power_limit_options(own={"log_every_n_steps": 50})
    def __init__(
        self,
        monitor: ZeusMonitor,
        optimum_selector: OptimumSelector | None = None,
        *,
        log_every_n_steps: int = 50,
        **options: Unpack[PowerLimitArguments],
    ) -> None:
        name = type(self).__name__
        opts = PowerLimitOptions(owner=name, optimum_selector=optimum_selector, **options)
        self._session = PowerLimitSession(name, monitor, opts)
        self._every = log_every_n_steps

    @property
    def optimizer(self) -> GlobalPowerLimitOptimizer:
        """The core optimizer: `phase`, `optimal_power_limit_w`, `metrics()`, `report()`."""
        return self._session.optimizer

    def _handlers(self, events: Any) -> list[tuple[Any, Handler]]:
        session = self._session
        return [(events.EPOCH_COMPLETED, lambda e: session.epoch_end())]

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, for Ignite's `Checkpoint`."""
        return self._session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint's state (`PowerLimitSession.load_state`: a corrupted one is refused, said once)."""
        self._session.load_state(state_dict, "the Ignite checkpoint being resumed")


class IgniteZeusMonitor(IgniteAdapter):
    """The GPUs' energy while an Ignite `Engine` trains, in `engine.state.metrics` (`energy/interval_j`, ...,
    and at `COMPLETED` the run's `energy/total_j`, ...; the names of `EnergyReporter`).

    `attach(trainer)`: `STARTED` → `start`, `ITERATION_STARTED` / `ITERATION_COMPLETED` → `step_begin` /
    `step_end`, `EPOCH_COMPLETED` (and every `log_every_n_steps` iterations) → `interval_metrics`,
    `COMPLETED` → `summary`, then `end`, `EXCEPTION_RAISED` → `fail` (no collective).

    Args:
        monitor: The `ZeusMonitor` measuring this process's GPU(s).
        carbon_intensity: As `HFZeusMonitor`'s: CO2eq figures beside the energy.
        price_per_kwh: As `HFZeusMonitor`'s: cost figures beside the energy.
        report_path: Write the run's HTML report there at the end of training.
        log_every_n_steps: Iterations between two interval figures (0: at epoch ends only).

    Raises:
        TypeError: `monitor` is not a `ZeusMonitor`.

    Example::

        energy = IgniteZeusMonitor(ZeusMonitor(gpu_indices=[0]))
        energy.attach(trainer)
        trainer.run(loader, max_epochs=3)
        total_j = trainer.state.metrics["energy/total_j"]
    """

    _what = "a PyTorch Ignite handler (`attach` it to an Engine)"
    _does = "energy"
    _session: EnergySession

    def __init__(
        self,
        monitor: ZeusMonitor,
        carbon_intensity: float | str | None = None,
        price_per_kwh: float | str | None = None,
        report_path: str | os.PathLike[str] | None = None,
        *,
        log_every_n_steps: int = 50,
    ) -> None:
        self._session = EnergySession(
            type(self).__name__, monitor, carbon_intensity, price_per_kwh, report_path
        )
        self._every = log_every_n_steps
