"""One training run of the power-limit optimizer, as every framework adapter drives it.

The adapter contract
--------------------
An adapter (HF `Trainer`, Lightning, an Accelerate or plain loop, PyTorch Ignite) builds one
`PowerLimitSession` from the user's `ZeusMonitor` and `PowerLimitOptions` (`options`: the one record of the
options' names and defaults; the adapter's signature comes from it with `takes_power_limit_options`), and
turns its framework's events into these calls, and into nothing else:

=============================  =================================================================
framework event                session call
=============================  =================================================================
training begins                `start()`; on a resumed run first `load_state(saved, source)`
a micro-batch begins / ends    `step_begin(optimizer_steps)` / `step_end(optimizer_steps)`: the session
                               tells the optimizer step's boundaries (`OptimizerSteps`); a framework whose
                               step hooks fire once per optimizer step calls both without arguments
an epoch ends                  `epoch_end()`
a log event                    log `interval_metrics()` with the framework's loggers
training ends                  log `summary()` (the run's totals), then `end()`: the GPUs get their
                               settings back
training raised                `fail()`: no figures and no collective; the GPUs get their settings back
a checkpoint is saved          store `state_dict()` (plain numbers and strings)
=============================  =================================================================

The energy monitor's adapters drive `zeus_callbacks.core.monitor.session.EnergySession` by the same table,
less the optimizer's rows (epochs, checkpoints), and with the same failure rule.

Registration points
-------------------
The contract is executable: `tests/adapters/test_contract.py` drives every adapter class with its real
framework through scripted runs (to the end, raising mid-epoch, resumed from a checkpoint, epochs under
`search="zeus"`) and checks the session calls above. A new adapter is one module here plus one line in that
test's `ADAPTERS` table (the framework, the kind: `"power_limit"` or `"energy"`, and the class); its options
come from `PowerLimitOptions` (`tests/adapters/test_contract.py::test_every_adapter_takes_the_options_record`
reads them from there), and type checkers see them through `**options: Unpack[PowerLimitArguments]`
(`keywords`). The adapters now registered:

- power limit: `HFGlobalPowerLimitOptimizer`, `LightningGlobalPowerLimitOptimizer`,
  `PowerLimitOptimizerHelper` (and `prepare_power_limit_optimizer`, whose session the user drives through
  the optimizer's own hooks), `IgnitePowerLimitOptimizer`;
- energy: `HFZeusMonitor`, `LightningZeusMonitor`, `ZeusMonitorHelper`, `IgniteZeusMonitor`.

Under torch.distributed every rank makes the `interval_metrics` and `summary` calls at the same points: the
energy figures in them are summed over ranks in one collective. Everything else (what a power limit costs,
when to change it, the profile file, the report, the refusal of a corrupted state) is decided here or below,
so that an adapter holds no logic of its own: `duplicates` finds none of it twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zeus_callbacks.core.arguments import require_monitor
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import EnergyReporter, power_limit_metrics, run_summary
from zeus_callbacks.core.monitor.steps import OptimizerSteps
from zeus_callbacks.core.power_limit import readout
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.options import PowerLimitOptions

__all__ = ["PowerLimitOptions", "PowerLimitSession"]


class PowerLimitSession:
    """The power-limit optimizer, its energy reporter and its step boundaries for one adapter (see the
    module's docstring for the contract).

    Args:
        owner: The adapter's name, for messages (`"HFGlobalPowerLimitOptimizer"`).
        monitor: The `ZeusMonitor` of this process's GPU(s).
        options: The optimizer's options.

    Raises:
        InvalidInputError: (a ValueError) a bad monitor or option; the message names it.
    """

    def __init__(self, owner: str, monitor: ZeusMonitor, options: PowerLimitOptions) -> None:
        require_monitor(owner, monitor)
        self.owner = owner
        self.optimizer = GlobalPowerLimitOptimizer(monitor, **options.optimizer_arguments())
        self.reporter = EnergyReporter.for_power_limit_optimizer(monitor, report_path=options.report_path)
        self._steps = OptimizerSteps()

    # -- training -------------------------------------------------------------------------------
    def start(self) -> None:
        """Training begins: the run's energy is measured from here (idempotent)."""
        self.reporter.start()

    def step_begin(self, optimizer_steps: int = 0) -> None:
        """A micro-batch begins, with the optimizer steps taken so far; the first one opens a step."""
        if self._steps.begin(optimizer_steps):
            self.optimizer.on_step_begin()
            self.reporter.step_begin()

    def step_end(self, optimizer_steps: int | None = None) -> bool:
        """A micro-batch ended (None: the optimizer stepped in it); returns whether it closed a step."""
        if not self._steps.end(optimizer_steps):
            return False
        self.reporter.step_end()
        self.optimizer.on_step_end()
        return True

    def epoch_end(self) -> None:
        """An epoch ended."""
        self.optimizer.on_epoch_end()

    def interval_metrics(self, numbers_only: bool = True) -> dict[str, Any]:
        """The figures of a log event: the optimizer's, and the energy since the last log event unless a
        monitor callback of the same `ZeusMonitor` reports it (each figure once). A collective under
        torch.distributed."""
        metrics = power_limit_metrics(self.optimizer.metrics(), numbers_only=numbers_only)
        interval = self.reporter.interval()
        if self.reporter.reported_elsewhere():
            interval = {}
        return {**metrics, **interval}

    def checkpoint(self, step: int | None = None) -> None:
        """A checkpoint was saved at training `step`: this rank's energy ledger line so far, if a ledger is set."""
        self.reporter.checkpoint(step, (self.optimizer,))

    def summary(self, numbers_only: bool = True) -> dict[str, Any]:
        """The end-of-training figures: the optimizer's, and the run's totals (`run_summary`: energy, time,
        average power, profiling cost, the choice and its saving); the report is written. A collective
        while the run is reported (no energy figures once a GPU failed)."""
        totals = self.reporter.stop((self.optimizer,))
        metrics = power_limit_metrics(self.optimizer.metrics(), numbers_only=numbers_only)
        return {**metrics, **run_summary(self.optimizer.report(), totals)}

    def end(self) -> None:
        """Training ended: the GPUs get their settings back (idempotent)."""
        self.reporter.stop((self.optimizer,))
        self.optimizer.on_train_end()

    def fail(self) -> None:
        """Training raised on this rank: the energy windows are closed without figures or a collective,
        the report is marked failed, and the GPUs get their settings back."""
        self.reporter.cancel()
        self.optimizer.on_train_end()

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores: the optimizer's `state_dict()`."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`load_state` from a checkpoint the framework loads (Accelerate's `load_state`)."""
        self.load_state(state, "the checkpoint being resumed")

    def load_state(self, state: Any, source: object, earlier: Iterable[tuple[object, Any]] = ()) -> bool:
        """Load a checkpoint's optimizer state: a chosen limit is applied without profiling again, a partial
        profile carries on. One that is cut short or corrupted is refused with one warning naming `source`,
        and the first of `earlier` ((source, state) pairs, newest first) that loads is used instead, else the
        `profile_path` profile, else none (profiling starts afresh). Returns whether `state` itself loaded."""
        try:
            self.optimizer.load_state_dict(state)
            return True
        except InvalidInputError as e:
            refused = e
        then = ""
        for older_source, older in earlier:
            if older is None:
                continue
            try:
                self.optimizer.load_state_dict(older)
            except InvalidInputError:
                continue
            then = f"profiling resumes from {older_source}, the last complete state"
            break
        readout.refused_state_warning(source, self.owner, refused, self.optimizer.options.path, then)
        return False
