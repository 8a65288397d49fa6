"""Simulated GPUs: a fake NVML backed by traces measured on real GPUs, offered as an NVML backend.

The device layer reaches them like real GPUs, through the backend in `zeus_callbacks.sim.backend` (which
the package root registers); nothing outside the simulator touches its objects.

Select them explicitly, never silently: `ZEUS_CALLBACKS_SIMULATE=a40` (or `simulate("a40")` in Python).
Spec: comma-separated `[COUNT*]KIND[:WORKLOAD][@TRACE_FILE]` groups, KIND in a40, v100, a10g (a10), t4;
e.g. `4*a40:imagenet/resnet50/256`, `a10g,t4`, `a40:mydata/mynet/64@/path/profile.csv`.
Options (environment variables, or arguments of `simulate`):
- `ZEUS_CALLBACKS_SIM_NOISE`: relative run-to-run noise of time and power (e.g. 0.02), seeded by
  `ZEUS_CALLBACKS_SIM_SEED`;
- `ZEUS_CALLBACKS_SIM_FAULTS`: injected faults, e.g. `no_permission;lost_after=200@1` (see `parse_faults`);
- `ZEUS_CALLBACKS_SIM_STATE_DIR`: where the GPUs' state (power limit, clocks, energy) persists across
  processes (default: a per-user directory under the temp dir).
Everything the simulator reports is a simulation, and the package labels it so.
"""

from __future__ import annotations

import os

from zeus_callbacks.core.device import gpus as devices
from zeus_callbacks.sim import fake_nvml
from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem, VirtualClock, parse_faults, parse_spec
from zeus_callbacks.sim.traces import DATA_FORMATS_HELP, Trace, load_trace, shipped_trace, shipped_workloads

__all__ = [
    "SIMULATE_ENV",
    "simulate",
    "active",
    "enqueue_work",
    "disable",
    "SimulatedSystem",
    "SimulatedGPU",
    "VirtualClock",
    "Trace",
    "load_trace",
    "shipped_trace",
    "shipped_workloads",
    "parse_spec",
    "parse_faults",
    "DATA_FORMATS_HELP",
]

SIMULATE_ENV = "ZEUS_CALLBACKS_SIMULATE"
_NOISE_ENV = "ZEUS_CALLBACKS_SIM_NOISE"
_SEED_ENV = "ZEUS_CALLBACKS_SIM_SEED"
_FAULTS_ENV = "ZEUS_CALLBACKS_SIM_FAULTS"
_STATE_ENV = "ZEUS_CALLBACKS_SIM_STATE_DIR"


def simulate(
    spec: str,
    *,
    noise: float = 0.0,
    seed: int = 0,
    faults: str = "",
    state_dir: str | None = None,
    virtual_clock: bool = False,
    export_env: bool = True,
) -> SimulatedSystem:
    """Use simulated GPUs in this process (and, with `export_env`, in processes it starts).

    Virtual-clock systems keep their state in memory and are never exported.
    """
    if virtual_clock and state_dir is None:
        state_dir = ""
    system = SimulatedSystem(spec, noise, seed, faults, state_dir, virtual_clock)
    devices.reset()  # restores what this process changed on the previous node first
    fake_nvml.attach(system)
    if export_env and not virtual_clock:
        os.environ[SIMULATE_ENV] = spec
        os.environ[_NOISE_ENV] = str(noise)
        os.environ[_SEED_ENV] = str(seed)
        os.environ[_FAULTS_ENV] = faults
        if state_dir is not None:
            os.environ[_STATE_ENV] = state_dir
    return system


def active() -> SimulatedSystem | None:
    """The simulated node of this process: the one set by `simulate`, else one built from the environment."""
    if fake_nvml.system() is None and os.environ.get(SIMULATE_ENV):
        fake_nvml.attach(
            SimulatedSystem(
                os.environ[SIMULATE_ENV],
                float(os.environ.get(_NOISE_ENV) or 0.0),
                int(os.environ.get(_SEED_ENV) or 0),
                os.environ.get(_FAULTS_ENV, ""),
                os.environ.get(_STATE_ENV) or None,
            )
        )
    return fake_nvml.system()


def enqueue_work(gpu_index: int, work_s: float) -> None:
    """Queue work on simulated GPU `gpu_index` (its NVML index) that uses no host CPU: a stand-in for a
    kernel that takes `work_s` seconds at the maximum power limit and clock. The GPU's next synchronisation
    waits for it, stretched by the slowdown of the limit and clock in force. Lets examples and tests run
    many ranks on few CPU cores without the host's contention deciding the GPU's pace.

    Raises:
        RuntimeError: no simulation is selected.
    """
    system = active()
    if system is None:
        raise RuntimeError(
            "enqueue_work needs simulated GPUs: set ZEUS_CALLBACKS_SIMULATE (see zeus_callbacks.sim)."
        )
    system.gpus[gpu_index].enqueue(work_s)


def disable() -> None:
    """Stop simulating in this process and forget the exported environment variables."""
    devices.reset()  # restores what this process changed first
    fake_nvml.attach(None)
    for name in (SIMULATE_ENV, _NOISE_ENV, _SEED_ENV, _FAULTS_ENV, _STATE_ENV):
        os.environ.pop(name, None)
