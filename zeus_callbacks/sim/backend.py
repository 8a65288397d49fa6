"""The simulator as a backend of the device layer (registered by the package root): simulated NVIDIA GPUs beneath
nvidia-ml-py, through the real NVIDIA backend (`core/device/nvidia.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml

from zeus_callbacks import sim
from zeus_callbacks.core.device.backend import Backend
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.core.device.nvidia import NVIDIABackend, NVIDIADevice
from zeus_callbacks.sim import nvml_library
from zeus_callbacks.sim.host import HOST_CLOCK
from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem

__all__ = ["SimulatedBackend", "simulated_backend"]


class SimulatedBackend(NVIDIABackend):
    """Simulated GPUs of one `SimulatedSystem`, reached through the real `pynvml` (nvidia-ml-py), beneath
    which the node answers as the NVML library (`zeus_callbacks.sim.nvml_library`); handles are pynvml's.

    Differs from the real driver where NVML cannot say: synchronising runs the simulator's model of the
    queued work, CUDA's numbering comes from the simulator's model of it (torch stands in for it on real
    GPUs), permission comes from the injected faults, the clock is the node's (virtual, or the wall clock
    less the host's lag: `sim.host.HostClock`), journals live beside the node's persistent state, and every
    step boundary synchronises (standing in for the bounded launch queue that keeps a real host at most
    about a step ahead of its GPU).
    """

    simulated = True
    sync_at_step_boundary = True

    def __init__(self, system: SimulatedSystem) -> None:
        clock = system.clock
        nvml_library.ensure(system)
        super().__init__(
            pynvml, clock=HOST_CLOCK.now if clock is None else clock.now, virtual_clock=clock is not None
        )
        self.system = system

    def __repr__(self) -> str:
        return f"SimulatedBackend(spec={self.system.spec!r})"

    @property
    def reachable_from_other_processes(self) -> bool:
        """True for a wall-clock node whose state lives in files and whose settings are exported to the
        environment (`simulate(export_env=True)`, the default): a child process simulates the same node."""
        return (
            self.system.clock is None and self.system.state_path() is not None and sim.exported(self.system)
        )

    def gpu(self, device: Device | Any) -> SimulatedGPU:
        """The simulated GPU behind a device (an `NVIDIADevice`; or a pynvml handle the simulated library
        handed out)."""
        return nvml_library.simulated_gpu(device.handle if isinstance(device, NVIDIADevice) else device)

    def synchronize(self, index: int, device: Device) -> None:
        """Wait for the simulated work queued on the GPU (no-op on a virtual clock)."""
        self.gpu(device).synchronize()

    def settle(self, device: Device) -> None:
        """Account the work so far at the settings in force, before zeusd (another process) changes them."""
        self.gpu(device).settle()

    def may_change_settings(self, device: Device) -> bool:
        """False only where the `no_permission` or `no_cap_sys_admin` fault is injected."""
        faults = self.gpu(device).faults
        return not (faults.no_permission or faults.no_cap_sys_admin)

    def cuda_uuids(self) -> list[str]:
        """From the simulator's model of CUDA's numbering (see `SimulatedSystem.cuda_gpus`)."""
        return [g.uuid for g in self.system.cuda_gpus()]

    def known_energy_refresh_s(self, device: Device) -> float | None:
        """On a virtual clock polling cannot see the counter move, so the model's period is told; on the
        wall clock it is measured by polling, exactly as on a real GPU."""
        return self.gpu(device).energy_refresh_s if self.virtual_clock else None

    def provenance(self, uuid: str) -> str | None:
        """A modelled board's label, e.g. "modelled A100, scaled from the A40 traces" (`traces.provenance`)."""
        return next((g.provenance for g in self.system.gpus if g.uuid == uuid), None)

    def journal_dir(self) -> Path | None:
        """Beside the node's state, so that the journal outlives the process exactly as long as the state."""
        path = self.system.state_path()
        return None if path is None else path / "journal"


def simulated_backend() -> Backend | None:
    """The backend factory: simulated GPUs when selected (`simulate()` or `ZEUS_CALLBACKS_SIMULATE`), else None;
    an AMD node's are reached through amdsmi (`sim/amd_backend.py`)."""
    system = sim.active()
    if system is not None and system.vendor == "amd":
        from zeus_callbacks.sim.amd_backend import SimulatedAMDBackend

        return SimulatedAMDBackend(system)
    return None if system is None else SimulatedBackend(system)
