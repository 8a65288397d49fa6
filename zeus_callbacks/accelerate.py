"""Helpers for Accelerate training loops (or plain ones): the power-limit optimizer and heterogeneous plans.

- `PowerLimitOptimizerHelper` / `prepare_power_limit_optimizer`: Zeus's power-limit optimizer in a loop.
- `ZeusMonitorHelper`: the loop's GPU energy, logged to the accelerator's trackers.
- `prepare_accelerate_dataloader`: this rank's share of a heterogeneous plan, prepared by the accelerator.

Accelerate itself is never imported here: the helpers take the user's `Accelerator`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from typing_extensions import Self, Unpack

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.heterogeneous.training import RankPlan, uneven_dataloader, unshard_dataloader
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.session import EnergySession
from zeus_callbacks.core.power_limit.keywords import PowerLimitArguments
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.options import PowerLimitOptions, takes_power_limit_options
from zeus_callbacks.core.power_limit.selectors import OptimumSelector
from zeus_callbacks.core.power_limit.session import PowerLimitSession
from zeus_callbacks.core.wrong_framework import OneFramework

if TYPE_CHECKING:  # pragma: no cover
    from accelerate import Accelerator

__all__ = [
    "PowerLimitOptimizerHelper",
    "ZeusMonitorHelper",
    "LoopHelper",
    "prepare_power_limit_optimizer",
    "local_gpu_index",
    "prepare_accelerate_dataloader",
]


def _refuse_a_monitor(owner: str, accelerator: Any) -> None:
    """The helpers take the run's `Accelerator` (or None), and build the monitor of this process's GPU."""
    if isinstance(accelerator, ZeusMonitor):
        own = ", or the one given as `monitor=`" if owner == "ZeusMonitorHelper" else ""
        raise TypeError(
            f"`{owner}(ZeusMonitor(...))`: its first argument is the run's accelerate.Accelerator (None in a "
            f"plain loop), not a monitor; it measures this process's GPU (`local_gpu_index`){own}. Pass the "
            "accelerator."
        )


def local_gpu_index(accelerator: Accelerator | None = None) -> int:
    """The GPU of this process: the accelerator's CUDA device, else its local process index (which, on CPU
    runs with simulated GPUs, picks one simulated GPU per process), else `local_rank()`."""
    if accelerator is None:
        return dist.local_rank()
    device = accelerator.device
    if device.type == "cuda" and device.index is not None:
        return device.index
    return accelerator.local_process_index


def prepare_power_limit_optimizer(
    accelerator: Accelerator | None,
    optimum_selector: OptimumSelector | None = None,
    **options: Unpack[PowerLimitArguments],
) -> GlobalPowerLimitOptimizer:
    """A `GlobalPowerLimitOptimizer` on this process's GPU, its session registered for the accelerator's
    checkpoints.

    The optimizer measures the GPU given by `local_gpu_index(accelerator)`. Its `PowerLimitSession` is
    registered with `accelerator.register_for_checkpointing`, so `accelerator.save_state()` stores its
    profile (plain numbers) and `accelerator.load_state()` restores it through the session: a resumed run
    applies the chosen limit without profiling again, a corrupted state is refused with one warning. Drive
    it with `on_step_begin`/`on_step_end`/`on_epoch_end`/`on_train_end` yourself, or use
    `PowerLimitOptimizerHelper`, which also logs and reports.

    Args:
        accelerator: The run's `Accelerator`; None for a plain loop (GPU from `local_rank()`, no registration).
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        **options: The other `PowerLimitOptions` (`wait_steps`, ..., `allow_raising_limit`), by keyword.

    Raises:
        ValueError: A bad argument; the message names it.
    """
    _refuse_a_monitor("prepare_power_limit_optimizer", accelerator)
    session = _session("prepare_power_limit_optimizer", accelerator, optimum_selector, options)
    return session.optimizer


def _session(
    owner: str,
    accelerator: Accelerator | None,
    optimum_selector: OptimumSelector | None,
    options: PowerLimitArguments,
) -> PowerLimitSession:
    """The session of this process's GPU, registered for the accelerator's checkpoints."""
    monitor = ZeusMonitor(gpu_indices=[local_gpu_index(accelerator)])
    opts = PowerLimitOptions(owner=owner, optimum_selector=optimum_selector, **options)
    session = PowerLimitSession(owner, monitor, opts)
    if accelerator is not None:
        accelerator.register_for_checkpointing(session)
    return session


class LoopHelper(OneFramework):
    """What both helpers share: a `with` block around training (`start`; leaving it normally → `summary`,
    logged, then `end`; by an exception → `fail`: no collective, no summary), and `step()` around each batch
    (`step_begin`; `step_end` at the micro-batch where `accelerator.sync_gradients`, the one whose backward
    pass feeds the optimizer step under `accelerator.accumulate`; without an accelerator every `step()` is a
    step). Every `log_every_n_steps` optimizer steps `interval_metrics` go to the accelerator's trackers
    (`accelerator.log`, numbers only, the names of `zeus_callbacks.core.monitor.reporting`).

    Raises:
        ValueError: `log_every_n_steps` < 0.
    """

    _session: PowerLimitSession | EnergySession

    def __init__(self, accelerator: Accelerator | None, log_every_n_steps: int) -> None:
        _refuse_a_monitor(type(self).__name__, accelerator)
        if log_every_n_steps < 0:
            raise ValueError(
                f"`{type(self).__name__}(log_every_n_steps={log_every_n_steps!r})`: must be >= 0."
            )
        self._accelerator = accelerator
        self._log_every = log_every_n_steps
        self._done_steps = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one batch (micro-batch under gradient accumulation) of training."""
        self._session.step_begin()
        yield
        synced = self._accelerator is None or self._accelerator.sync_gradients
        if synced and self._session.step_end():
            self._done_steps += 1
            if self._log_every and self._done_steps % self._log_every == 0:
                self._log(self._session.interval_metrics())

    def __enter__(self) -> Self:
        self._session.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None:  # this rank failed: no collective, no summary
            self._session.fail()
            return
        summary = self._session.summary()
        self._session.end()
        self._log(summary)

    def _log(self, values: dict[str, float]) -> None:
        if self._accelerator is not None:
            self._accelerator.log(values, step=self._done_steps)


class PowerLimitOptimizerHelper(LoopHelper):
    """Find the best GPU power limit in an Accelerate loop with three calls: a `with` around training,
    `step()` around each batch, `epoch_end()` after each epoch.

    A thin adapter of a `PowerLimitSession` (the adapter contract, in `zeus_callbacks.core.power_limit.session`).
    Which loop event drives which call: entering the `with` block → `start`; entering `step()` →
    `step_begin`; leaving it → `step_end` at the micro-batch where `accelerator.sync_gradients` (the one
    whose backward pass feeds the optimizer step under `accelerator.accumulate`); `epoch_end()` →
    `epoch_end`; leaving the `with` block normally → `summary` (logged), then `end`, which restores the
    GPU's settings; by an exception → `fail`. Without an accelerator every `step()` is a step. The session
    is registered for the accelerator's checkpoints (`save_state` / `load_state`): a resumed run applies the
    chosen limit without profiling again, and a corrupted state is refused with one warning.

    The helper logs to the accelerator's trackers itself (`accelerator.log`, numbers only, the names of
    `zeus_callbacks.core.monitor.reporting` as for HF and Lightning): `interval_metrics` every
    `log_every_n_steps` optimizer steps, and on leaving the `with` block the run's totals (`run_summary`:
    energy, time, average power, profiling cost, the choice and its saving against the maximum limit).

    Args:
        accelerator: The run's `Accelerator`, or None for a plain loop.
        optimum_selector: The objective; default `ZeusCost(eta_knob=0.5)`.
        log_every_n_steps: Optimizer steps between two logs of the optimizer's figures (0: only the
            summary).
        **options: The other `PowerLimitOptions` (`wait_steps`, ..., `report_path`), by keyword.

    Raises:
        ValueError: A bad argument; the message names it.

    Example::

        accelerator = Accelerator(gradient_accumulation_steps=2)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        with PowerLimitOptimizerHelper(accelerator, MaxSlowdownConstraint(1.1)) as plo:
            for epoch in range(epochs):
                for batch in loader:
                    with plo.step(), accelerator.accumulate(model):
                        accelerator.backward(model(batch).loss)
                        opt.step()
                        opt.zero_grad()
                plo.epoch_end()
        chosen_w = plo.optimizer.optimal_power_limit_w
    """

    _what = "the Accelerate and plain-loop helper (a `with` block)"
    _does = "power_limit"

    @takes_power_limit_options(own={"log_every_n_steps": 50})
    def __init__(
        self,
        accelerator: Accelerator | None,
        optimum_selector: OptimumSelector | None = None,
        *,
        log_every_n_steps: int = 50,
        **options: Unpack[PowerLimitArguments],
    ) -> None:
        super().__init__(accelerator, log_every_n_steps)
        self._session: PowerLimitSession = _session(
            type(self).__name__, accelerator, optimum_selector, options
        )

    @property
    def optimizer(self) -> GlobalPowerLimitOptimizer:
        """The core optimizer: `phase`, `optimal_power_limit_w`, `metrics()`, `report()`."""
        return self._session.optimizer

    def epoch_end(self) -> None:
        """Mark the end of an epoch."""
        self._session.epoch_end()


class ZeusMonitorHelper(LoopHelper):
    """The GPU energy of an Accelerate (or plain) loop, logged to the accelerator's trackers: `energy/interval_j`,
    ... every `log_every_n_steps` optimizer steps, the run's `energy/total_j`, ... on leaving the `with` block.

    A thin adapter of an `EnergySession` (the adapter contract, in `zeus_callbacks.core.monitor.session`),
    driven as `LoopHelper` says; an exception leaving the block → `fail` (no collective).

    Args:
        accelerator: The run's `Accelerator`, or None for a plain loop.
        monitor: The `ZeusMonitor` to read; default this process's GPU (`local_gpu_index(accelerator)`).
        carbon_intensity: As `HFZeusMonitor`'s: CO2eq figures beside the energy.
        price_per_kwh: As `HFZeusMonitor`'s: cost figures beside the energy.
        report_path: Write the run's HTML report there when the block ends.
        log_every_n_steps: Optimizer steps between two interval logs (0: only the totals).

    Example::

        with ZeusMonitorHelper(accelerator) as energy:
            for batch in loader:
                with energy.step(), accelerator.accumulate(model):
                    ...
        total_j = energy.total_energy_j
    """

    _what = "the Accelerate and plain-loop helper (a `with` block)"
    _does = "energy"

    def __init__(
        self,
        accelerator: Accelerator | None,
        monitor: ZeusMonitor | None = None,
        carbon_intensity: float | str | None = None,
        price_per_kwh: float | str | None = None,
        report_path: str | os.PathLike[str] | None = None,
        *,
        log_every_n_steps: int = 50,
    ) -> None:
        super().__init__(accelerator, log_every_n_steps)
        if monitor is None:
            monitor = ZeusMonitor(gpu_indices=[local_gpu_index(accelerator)])
        self._session = EnergySession(
            type(self).__name__, monitor, carbon_intensity, price_per_kwh, report_path
        )

    @property
    def total_energy_j(self) -> float:
        """GPU energy of the last finished run (J), summed over the job's ranks."""
        assert isinstance(self._session, EnergySession)
        return self._session.total_energy_j


def prepare_accelerate_dataloader(
    accelerator: Accelerator, dataset: Any, rank_plan: RankPlan, **kwargs: Any
) -> tuple[Any, float]:
    """`accelerator.prepare` this rank's uneven loader (`uneven_dataloader`); returns it and the loss scale.

    Accelerate shards every loader it prepares over the processes; this one already holds only this rank's
    samples, so the sharding is switched off after `prepare` (`unshard_dataloader`; device placement and
    `set_epoch` stay). Multiply each step's mean loss by the returned scale before `accelerator.backward`,
    and set the GPU's planned limit once with `apply_power_limit(rank_plan)`.

    Example::

        loader, scale = prepare_accelerate_dataloader(accelerator, train_set, rp)
        for x, y in loader:
            accelerator.backward(loss_fn(model(x), y) * scale)
    """
    loader = accelerator.prepare(uneven_dataloader(dataset, rank_plan, **kwargs))
    return unshard_dataloader(loader), rank_plan.loss_scale
