"""The simulator as a backend of the device layer (registered by the package root): simulated NVIDIA GPUs beneath
nvidia-ml-py, through the real NVIDIA backend (`core/device/nvidia.py`)."""

from __future__ import annotations

from typing import Any

import pynvml

from zeus_callbacks import sim
from zeus_callbacks.core.device.backend import Backend
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.core.device.nvidia import NVIDIABackend, NVIDIADevice
from zeus_callbacks.sim import nvml_library
from zeus_callbacks.sim.node_backend import SimulatedNodeBackend, node_clock
from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem

__all__ = ["SimulatedBackend", "simulated_backend"]


class SimulatedBackend(SimulatedNodeBackend, NVIDIABackend):
    """Simulated GPUs of one `SimulatedSystem`, reached through the real `pynvml` (nvidia-ml-py), beneath
    which the node answers as the NVML library (`zeus_callbacks.sim.nvml_library`); handles are pynvml's.

    Differs from the real driver where NVML cannot say (`SimulatedNodeBackend`), and in CUDA's numbering, which
    comes from the simulator's model of it (torch stands in for it on real GPUs).
    """

    def __init__(self, system: SimulatedSystem) -> None:
        nvml_library.ensure(system)
        super().__init__(pynvml, **node_clock(system))
        self.system = system

    def gpu(self, device: Device | Any) -> SimulatedGPU:
        """The simulated GPU behind a device (an `NVIDIADevice`; or a pynvml handle the simulated library
        handed out)."""
        return nvml_library.simulated_gpu(device.handle if isinstance(device, NVIDIADevice) else device)

    def cuda_uuids(self) -> list[str]:
        """From the simulator's model of CUDA's numbering (see `SimulatedSystem.cuda_gpus`)."""
        return [g.uuid for g in self.system.cuda_gpus()]


def simulated_backend() -> Backend | None:
    """The backend factory: simulated GPUs when selected (`simulate()` or `ZEUS_CALLBACKS_SIMULATE`), else None;
    an AMD node's are reached through amdsmi (`sim/amd_backend.py`)."""
    system = sim.active()
    if system is not None and system.vendor == "amd":
        from zeus_callbacks.sim.amd_backend import SimulatedAMDBackend

        return SimulatedAMDBackend(system)
    return None if system is None else SimulatedBackend(system)
