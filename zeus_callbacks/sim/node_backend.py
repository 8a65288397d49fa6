"""What every simulated backend takes from the simulator rather than the vendor library: clock, sync, faults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeus_callbacks.core.device.backend import Backend
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.sim.host import HOST_CLOCK
from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem

__all__ = ["SimulatedNodeBackend", "node_clock"]


def node_clock(system: SimulatedSystem) -> dict[str, Any]:
    """A backend's clock arguments for `system`: its virtual clock, else the wall clock less the host's lag."""
    clock = system.clock
    return {"clock": HOST_CLOCK.now if clock is None else clock.now, "virtual_clock": clock is not None}


class SimulatedNodeBackend(Backend):
    """Put before a vendor's backend class (`class B(SimulatedNodeBackend, NVIDIABackend)`): what the vendor
    library cannot say comes from the simulated node `system`. Synchronising runs the simulator's model of the
    queued work, permission comes from the injected faults, journals live beside the node's persistent state,
    and every step boundary synchronises (standing in for the bounded launch queue that keeps a real host at
    most about a step ahead of its GPU). A subclass sets `system` and says which simulated GPU a device is."""

    simulated = True
    sync_at_step_boundary = True
    system: SimulatedSystem

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.system.spec!r})"

    def gpu(self, device: Device | Any) -> SimulatedGPU:
        """The simulated GPU behind a device (or a handle the simulated library handed out)."""
        raise NotImplementedError(f"{type(self).__name__} must say which simulated GPU a device is")

    @property
    def reachable_from_other_processes(self) -> bool:
        """True for a wall-clock node whose state lives in files and whose settings are exported to the
        environment (`simulate(export_env=True)`, the default): a child process simulates the same node."""
        from zeus_callbacks import sim

        return (
            self.system.clock is None and self.system.state_path() is not None and sim.exported(self.system)
        )

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
