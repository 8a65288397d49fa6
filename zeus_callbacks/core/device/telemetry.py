"""Read-only GPU readings for exporters: temperature and the clocks in force, as the GPU's `Device` reports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zeus_callbacks.core.device.power import instant_power_mw

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = ["GPUReading", "read_gpu", "temperature_c", "clocks_mhz"]


@dataclass(frozen=True, slots=True)
class GPUReading:
    """One GPU's readings at one moment; a field is None where this GPU or its library does not offer it.

    Attributes:
        energy_j: The energy counter (J since the driver loaded; Volta and newer).
        power_w: Instantaneous power draw (W).
        temperature_c: Core temperature (°C).
        power_limit_w: The power limit in force (W).
        sm_clock_mhz: The SM (graphics) clock now (MHz).
        memory_clock_mhz: The memory clock now (MHz).
    """

    energy_j: float | None
    power_w: float | None
    temperature_c: float | None
    power_limit_w: float | None
    sm_clock_mhz: float | None
    memory_clock_mhz: float | None


def temperature_c(gpu: GPU) -> int:
    """The GPU core temperature (°C)."""
    return gpu.device.temperature_c()


def clocks_mhz(gpu: GPU) -> tuple[int, int]:
    """(SM, memory) clocks in force now (MHz)."""
    return gpu.device.clocks_mhz()


def read_gpu(gpu: GPU) -> GPUReading:
    """Every reading of `gpu` that answers; one that raises (not supported, a lost GPU) is None.

    For exporters, which must report what they can rather than fail a scrape.
    """

    def attempt(fn):
        try:
            return fn()
        except Exception:  # each reading stands alone: a GPU without a sensor still reports its power
            return None

    energy = attempt(gpu.energy_mj) if gpu.supports_energy_counter else None
    power = attempt(lambda: instant_power_mw(gpu))
    limit = attempt(gpu.power_limit_mw)
    clocks = attempt(lambda: clocks_mhz(gpu))
    return GPUReading(
        energy_j=None if energy is None else energy / 1000,
        power_w=None if power is None else power / 1000,
        temperature_c=attempt(lambda: temperature_c(gpu)),
        power_limit_w=None if limit is None else limit / 1000,
        sm_clock_mhz=None if clocks is None else clocks[0],
        memory_clock_mhz=None if clocks is None else clocks[1],
    )
