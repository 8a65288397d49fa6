"""The simulator as an NVML backend of the device layer (registered by the package root)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from zeus_callbacks import sim
from zeus_callbacks.core.device.backend import NVMLBackend
from zeus_callbacks.sim import fake_nvml
from zeus_callbacks.sim.system import SimulatedSystem

__all__ = ["SimulatedBackend", "simulated_backend"]


class SimulatedBackend(NVMLBackend):
    """Simulated GPUs of one `SimulatedSystem`, reached through `fake_nvml`.

    Differs from the real driver where NVML cannot say: synchronising runs the simulator's model of the
    queued work, CUDA's numbering comes from the simulator's model of it (torch stands in for it on real
    GPUs), permission comes from the injected faults, the clock is the node's (virtual or wall),
    journals live beside the node's persistent state, and every step boundary synchronises (standing in
    for the bounded launch queue that keeps a real host at most about a step ahead of its GPU).
    """

    simulated = True
    sync_at_step_boundary = True

    def __init__(self, system: SimulatedSystem) -> None:
        clock = system.clock
        super().__init__(
            fake_nvml, clock=time.time if clock is None else clock.now, virtual_clock=clock is not None
        )
        self.system = system

    def __repr__(self) -> str:
        return f"SimulatedBackend(spec={self.system.spec!r})"

    # `handle` is a `SimulatedGPU`: this backend's NVML hands out no other.
    def synchronize(self, index: int, handle: Any) -> None:
        """Wait for the simulated work queued on the GPU (no-op on a virtual clock)."""
        handle.synchronize()

    def settle(self, handle: Any) -> None:
        """Account the work so far at the settings in force, before zeusd (another process) changes them."""
        handle.settle()

    def may_change_settings(self, handle: Any) -> bool:
        """False only where the `no_permission` or `no_cap_sys_admin` fault is injected."""
        return not (handle.faults.no_permission or handle.faults.no_cap_sys_admin)

    def cuda_uuids(self) -> list[str]:
        """From the simulator's model of CUDA's numbering (see `SimulatedSystem.cuda_gpus`)."""
        return [g.uuid for g in self.system.cuda_gpus()]

    def known_energy_refresh_s(self, handle: Any) -> float | None:
        """On a virtual clock polling cannot see the counter move, so the model's period is told; on the
        wall clock it is measured by polling, exactly as on a real GPU."""
        return handle.energy_refresh_s if self.virtual_clock else None

    def journal_dir(self) -> Path | None:
        """Beside the node's state, so that the journal outlives the process exactly as long as the state."""
        path = self.system.state_path()
        return None if path is None else path / "journal"


def simulated_backend() -> SimulatedBackend | None:
    """The backend factory: simulated GPUs when selected (`simulate()` or `ZEUS_CALLBACKS_SIMULATE`), else None."""
    system = sim.active()
    return None if system is None else SimulatedBackend(system)
