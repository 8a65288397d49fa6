"""The vendor-neutral Device boundary: one GPU as its vendor's library sees it, in this package's units.

Every vendor module (`nvidia.py` over nvidia-ml-py, `amd.py` over amdsmi) implements `Device`; everything
above it (the `GPU` policy in `gpus.py`, monitors, optimizers, the zeusd client, `doctor`) calls only this.
Units everywhere: mW, mJ, MHz, bytes, °C. Every method raises this package's errors (`errors.py`: GPUError,
GPUNotSupportedError, GPUNoPermissionError, GPULostError, ...) with the GPU's label and a remedy, never a
vendor exception.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

__all__ = ["Device", "VENDORS"]

VENDORS = ("nvidia", "amd")


class Device(ABC):
    """One GPU as its vendor's library sees it: readings and raw settings, no policy (no state guard, no
    journal, no routes, no range checks; `gpus.GPU` adds those).

    Attributes:
        vendor: "nvidia" or "amd".
        name: The board's name as its vendor prints it ("NVIDIA A40", "AMD Instinct MI300X").
        uuid: The id CUDA/HIP tie the device to (NVIDIA "GPU-..."; AMD: amdsmi's UUID).
        vendor_index: The vendor library's own index (NVML index; amdsmi's processor order).
        architecture: Lowercase generation ("volta", "ampere", "hopper", "cdna3", ...); None if unknown.
        supports_energy_counter: Whether `energy_mj` reads a hardware counter.
        supports_power_reading: Whether `power_mw` answers (without either, a monitor gives time only).
        label: A human label, "GPU 0 (NVIDIA A40, simulated)", set from the CUDA index at discovery.
    """

    vendor: str
    name: str
    uuid: str
    vendor_index: int
    architecture: str | None
    supports_energy_counter: bool
    supports_power_reading: bool
    label: str
    power_usage_domain: str | None = None
    """The power domain `power_mw` reads ("device_average" or "device_instant"); None where unknown."""

    # -- identity -----------------------------------------------------------------------------
    @abstractmethod
    def pci_bus_id(self) -> str:
        """The PCI bus id as the vendor prints it ("00000000:3B:00.0"-style)."""

    @abstractmethod
    def mig_enabled(self) -> bool:
        """Whether the GPU is partitioned (NVIDIA MIG; AMD: see `amd.py`), which this package refuses."""

    # -- measurement --------------------------------------------------------------------------
    @abstractmethod
    def energy_mj(self) -> int:
        """The energy counter (mJ since the driver loaded)."""

    @abstractmethod
    def energy_reader(self) -> Callable[[], int]:
        """A function reading `energy_mj` (mJ) bound once: the monitor's hot path, no lookups per call."""

    @abstractmethod
    def power_mw(self) -> int:
        """The vendor's standard power reading (mW)."""

    @abstractmethod
    def average_power_mw(self) -> int:
        """Power averaged as the vendor averages it (mW)."""

    @abstractmethod
    def instant_power_mw(self) -> int:
        """The instantaneous power draw (mW), or the standard reading where the vendor has none."""

    @abstractmethod
    def one_second_power_mw(self) -> int | None:
        """Power averaged over the last second (mW); None where the vendor has no such reading."""

    def power_domains_mw(self, domains: Sequence[str]) -> list[int | None] | None:
        """Readings (mW) of the named power domains ("device_instant", "device_average", "memory_average"), in
        one call where the vendor can; None for a domain not offered, or None when none is offered at all.

        The default reads `instant_power_mw` and `one_second_power_mw` one by one.
        """
        read = {"device_instant": self.instant_power_mw, "device_average": self.one_second_power_mw}
        return [read[d]() if d in read else None for d in domains]

    @abstractmethod
    def memory_bytes(self) -> int:
        """Total memory (bytes)."""

    @abstractmethod
    def temperature_c(self) -> int:
        """The core temperature (°C)."""

    @abstractmethod
    def clocks_mhz(self) -> tuple[int, int]:
        """(SM/graphics clock, memory clock) in force now (MHz)."""

    # -- power limits ("cap" on AMD) ----------------------------------------------------------
    @property
    @abstractmethod
    def power_limit_scope(self) -> str:
        """Which power limit the settings act on: "gpu" or "module".

        Raises:
            GPUNotSupportedError: no power limit is settable.
        """

    @abstractmethod
    def power_limit_constraints_mw(self) -> tuple[int, int]:
        """(minimum, maximum) settable power limit (mW)."""

    @abstractmethod
    def default_power_limit_mw(self) -> int:
        """The default power limit (mW)."""

    @abstractmethod
    def power_limit_mw(self) -> int:
        """The power limit set (requested, mW): what a change sets and a restore puts back."""

    @abstractmethod
    def enforced_power_limit_mw(self) -> int:
        """The power limit in force (mW): the one set, or lower where another limiter holds the board."""

    @abstractmethod
    def set_power_limit_mw(self, value_mw: int) -> None:
        """Set the power limit (mW): a raw set, no guard, no range check."""

    # -- persistence --------------------------------------------------------------------------
    @abstractmethod
    def persistence_mode(self) -> bool:
        """Whether persistence mode is on (GPUNotSupportedError where the vendor has no such mode)."""

    @abstractmethod
    def set_persistence_mode(self, enabled: bool) -> None:
        """Turn persistence mode on or off (raw)."""

    # -- clocks (the pipeline optimizer's knob) -----------------------------------------------
    @abstractmethod
    def supported_memory_clocks_mhz(self) -> list[int]:
        """Supported memory clocks (MHz), highest first."""

    @abstractmethod
    def supported_sm_clocks_mhz(self, memory_clock_mhz: int | None = None) -> list[int]:
        """Supported SM (graphics) clocks (MHz) at a memory clock (default: the highest), highest first;
        empty where none can be locked."""

    @abstractmethod
    def lock_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into [min_mhz, max_mhz] (raw)."""

    @abstractmethod
    def reset_sm_clocks(self) -> None:
        """Unlock the SM clock (raw)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vendor_index={self.vendor_index}, name={self.name!r})"
