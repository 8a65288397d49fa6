"""GPUs behind a backend (real or simulated, any vendor): discovery, and the policy over each `Device`.

A `GPU` wraps one `Device` (`gpu.device`, the vendor's readings and raw settings) with what is the same for
every vendor: the CUDA index and label, range checks, and changes recorded by the state guard and made through
this process's route (the vendor's library in this process, or zeusd).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from zeus_callbacks.core.device import power, setters, state_guard
from zeus_callbacks.core.device.backend import Backend, active_backend, reset_backend
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.core.device.errors import SIMULATION_HINT, GPUNoPermissionError, GPUNotSupportedError

__all__ = ["GPU", "GPUs", "get_gpus", "reset", "SIMULATION_HINT"]

logger = logging.getLogger(__name__)


class GPU:
    """One GPU: its `Device` readings and settings in the units the vendors use (mW, mJ, MHz), with this
    package's policy.

    `index` is the CUDA index (what frameworks call GPU i, `cuda:i`); `vendor_index` is the vendor library's
    (NVML's PCI bus order), which differs on mixed nodes. The two are tied by the UUID, never by position.
    `architecture` is the lowercase generation ("volta", "ampere", "cdna3", ...), None where unknown.

    Changes of power limit, clocks and persistence go through the process's `GPUStateGuard`, which
    records the value in force before the first change and restores it at the end.
    """

    def __init__(self, backend: Backend, index: int, device: Device) -> None:
        self.backend = backend
        self.device = device
        self.index = index
        self.uuid = device.uuid
        self.name = device.name
        self.vendor = device.vendor
        self.vendor_index = device.vendor_index
        self.architecture = device.architecture
        self.simulated = backend.simulated
        self.provenance: str | None = backend.provenance(device.uuid)  # e.g. a modelled simulated board
        self.supports_energy_counter = device.supports_energy_counter
        self.supports_power_reading = device.supports_power_reading

    @property
    def nvml_index(self) -> int:
        """`vendor_index` by its name before other vendors (`zeus-callbacks devices` prints it so)."""
        return self.vendor_index

    def __repr__(self) -> str:
        sim = ", simulated" if self.simulated else ""
        return f"GPU(index={self.index}, vendor_index={self.vendor_index}, name={self.name!r}{sim})"

    @property
    def label(self) -> str:
        """A human label: `GPU 0 (NVIDIA A40, simulated)`."""
        return f"GPU {self.index} ({self.name}{', simulated' if self.simulated else ''})"

    # -- measurement --------------------------------------------------------------------------
    def energy_mj(self) -> int:
        """Total energy since the driver loaded (mJ); where `supports_energy_counter`."""
        return self.device.energy_mj()

    def power_mw(self) -> int:
        """The vendor's standard power reading (mW)."""
        return self.device.power_mw()

    def memory_bytes(self) -> int:
        """Total memory (bytes)."""
        return self.device.memory_bytes()

    # -- power limits -------------------------------------------------------------------------
    @property
    def power_limit_scope(self) -> str:
        """Which power limit this GPU's settings act on: "gpu" (nearly every board) or "module" (its module's,
        e.g. a GH200's, where the GPU's own is N/A).

        Raises:
            GPUNotSupportedError: no power limit is settable (e.g. a GeForce GTX 680: N/A).
        """
        return self.device.power_limit_scope

    def power_limit_constraints_mw(self) -> tuple[int, int]:
        """(minimum, maximum) settable power limit (mW), of the `power_limit_scope`."""
        return self.device.power_limit_constraints_mw()

    def default_power_limit_mw(self) -> int:
        """The default power limit (mW), of the `power_limit_scope`."""
        return self.device.default_power_limit_mw()

    def power_limit_mw(self) -> int:
        """The power limit set (mW; nvidia-smi's `Requested Power Limit`): what a change sets and a restore
        puts back."""
        return self.device.power_limit_mw()

    def enforced_power_limit_mw(self) -> int:
        """The power limit in force (mW; nvidia-smi's `Current Power Limit`): the one set, or lower where
        another limiter holds the board below it (a real GH200 runs at 700 W under a 900 W request)."""
        return self.device.enforced_power_limit_mw()

    def starting_power_limit_mw(self) -> int:
        """The limit in force before this process changed it (mW): the one the state guard recorded before
        its first change, else the lower of the one set and the enforced one."""
        recorded = state_guard.guard().recorded(self, "power_limit")
        if recorded is not None:
            return int(recorded)
        return min(self.power_limit_mw(), self.enforced_power_limit_mw())

    def set_power_limit_mw(self, value_mw: int) -> None:
        """Set the power limit (mW) of the `power_limit_scope`, recorded first so that it is restored at
        the end."""
        lo, hi = self.power_limit_constraints_mw()
        if not lo <= value_mw <= hi:
            raise ValueError(
                f"Power limit {value_mw / 1000:g} W is outside {self.label}'s range [{lo / 1000:g}, {hi / 1000:g}] W."
            )
        recorded = state_guard.guard().before_change(self, "power_limit")
        if self.power_limit_mw() != value_mw:
            self._change(recorded, "power_limit", lambda r: r.set_power_limit_mw(self, int(value_mw)))

    def _change(self, recorded: bool, knob: str, change: Callable[[setters.Route], None]) -> None:
        """Make a journaled change through this process's route (NVML or zeusd); a refused first change leaves
        no journal entry behind."""
        try:
            change(setters.route())
        except (GPUNoPermissionError, GPUNotSupportedError):
            if recorded:
                state_guard.guard().discard(self, knob)
            raise

    # -- persistence --------------------------------------------------------------------------
    def persistence_mode(self) -> bool:
        """Whether persistence mode is on."""
        return self.device.persistence_mode()

    def set_persistence_mode(self, enabled: bool) -> None:
        """Turn persistence mode on or off (restored at the end)."""
        recorded = state_guard.guard().before_change(self, "persistence")
        self._change(recorded, "persistence", lambda r: r.set_persistence_mode(self, bool(enabled)))

    # -- clocks -------------------------------------------------------------------------------
    def supported_memory_clocks_mhz(self) -> list[int]:
        """Supported memory clocks (MHz), highest first."""
        return self.device.supported_memory_clocks_mhz()

    def supported_sm_clocks_mhz(self, memory_clock_mhz: int | None = None) -> list[int]:
        """Supported SM (graphics) clocks (MHz) at a memory clock (default: the highest), highest first.

        Empty where the vendor lists none: the clocks cannot be locked.
        """
        return self.device.supported_sm_clocks_mhz(memory_clock_mhz)

    def lock_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into [min_mhz, max_mhz] (reset at the end)."""
        recorded = state_guard.guard().before_change(self, "sm_clocks")
        self._change(recorded, "sm_clocks", lambda r: r.lock_sm_clocks(self, int(min_mhz), int(max_mhz)))

    def reset_sm_clocks(self) -> None:
        """Unlock the SM clock."""
        setters.route().reset_sm_clocks(self)

    # -- permissions and synchronisation --------------------------------------------------------
    def may_change_settings(self) -> bool:
        """Whether this process may change power limits and clocks: in this process, when it holds
        CAP_SYS_ADMIN (a real GPU); through zeusd, always (the daemon changes them; a refusal shows at the first change)."""
        return setters.route().may_change(self)

    def synchronize(self) -> None:
        """Wait for the work queued on this GPU."""
        self.backend.synchronize(self.index, self.device)


class GPUs(Sequence[GPU]):
    """The GPUs this process may use, in CUDA's numbering (`CUDA_DEVICE_ORDER`, `CUDA_VISIBLE_DEVICES`), as the
    backend found them (`Backend.devices`)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.simulated = backend.simulated
        self.clock: Callable[[], float] = backend.clock
        self.virtual_clock = backend.virtual_clock
        self._gpus = [GPU(backend, i, d) for i, d in enumerate(backend.devices())]
        # Settings left by dead processes that discovery put back (`zeus-callbacks restore` reports them).
        self.repaired: list[Any] = []

    def __getitem__(self, index):  # type: ignore[override]
        return self._gpus[index]

    def __len__(self) -> int:
        return len(self._gpus)

    def __iter__(self) -> Iterator[GPU]:
        return iter(self._gpus)

    def synchronize(self, indices: Sequence[int]) -> None:
        """Wait for the work queued on these GPUs."""
        for i in indices:
            self._gpus[i].synchronize()

    def step_boundary(self, indices: Sequence[int]) -> None:
        """Mark the end of a training step.

        A real GPU needs nothing here: its bounded launch queue already stops the host from running more
        than about a step ahead. A backend without one (the simulator) says so with
        `sync_at_step_boundary`, and the GPUs synchronise here instead, so that a slowdown shows in the
        step it happened in.
        """
        if self.backend.sync_at_step_boundary:
            self.synchronize(indices)

    def energy_reader(self, indices: Sequence[int]) -> Callable[[], list[int]]:
        """A function that reads the energy counters (mJ) of these GPUs, in this order, in one call.

        The monitor's hot path (two calls per window): each device's reader is bound once.

        Raises (when called):
            GPUError: a counter could not be read (a lost GPU, or one without an energy counter).
        """
        readers = [self._gpus[i].device.energy_reader() for i in indices]
        if len(readers) == 1:
            (only,) = readers
            return lambda: [only()]
        return lambda: [read() for read in readers]


_lock = threading.Lock()
_gpus: GPUs | None = None


def get_gpus(repair: bool = True) -> GPUs:
    """The process's GPUs (discovered once) through the active backend (see `backend`).

    At the first discovery, settings left changed by processes that died hard are put back, unless
    `repair` is False (read-only callers such as `zeus-callbacks doctor`).

    Raises:
        NVMLUnavailableError: no vendor's library or driver, and no other backend (simulation) selected.
        MIGNotSupportedError: a MIG device or a GPU in MIG mode is visible.
        MixedVendorError: GPUs of two vendors are visible.
    """
    global _gpus
    with _lock:
        if _gpus is None:
            backend = active_backend()
            backend.init()
            _gpus = GPUs(backend)
            if repair:
                _gpus.repaired = state_guard.guard().repair_dead_runs(_gpus)
        return _gpus


def reset() -> None:
    """Forget the discovered GPUs and the backend (after the simulation or `CUDA_VISIBLE_DEVICES` changed).

    What this process changed on the old GPUs is restored first.
    """
    global _gpus
    with _lock:
        _gpus = None
    state_guard.reset()
    setters.forget()
    power.forget_refresh_periods()
    reset_backend()
