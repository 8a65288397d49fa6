"""Simulated GPUs: trace-driven GPUs answering at NVML's C boundary beneath the real nvidia-ml-py.

While a simulation is active, `pynvml` (nvidia-ml-py) calls the simulated node as its NVML library
(`zeus_callbacks.sim.nvml_library`): the device layer, through the backend in `zeus_callbacks.sim.backend`
(which the package root registers), and any other NVML user in the process (Zeus, for instance) run
nvidia-ml-py's own functions, structures and error classes. `disable()` gives pynvml back the real driver.

Select them explicitly, never silently: `ZEUS_CALLBACKS_SIMULATE=a40` (or `simulate("a40")` in Python).
Spec: comma-separated `[COUNT*]KIND[:WORKLOAD][@TRACE_FILE]` groups, KIND in a40, v100, a10g (a10), t4
(traced) or a100, h100, h200 (modelled: the A40's traces scaled, labelled so; see `sim/specs.py`), or AMD's
mi300x (modelled likewise; amdsmi answers for it, `sim/amdsmi_library.py`); e.g. `4*a40:imagenet/resnet50/256`, `a10g,t4`, `a40:mydata/mynet/64@/path/profile.csv`.
Or a whole node from a saved `nvidia-smi -q` (`-a`) output: `nvidia-smi:FILE[:WORKLOAD]`, FILE a path or the
name of a shipped dump (`shipped_dumps()`: A10, A100SXMx4, A40x10, GH200, GTX680, H100NVLx2, H100SXMx8, H200,
L40S, RTX2000Ada, RTX3070, RTX3090, RTX4060Ti, RTX4090, RTX5090, RTX6000Ada_x8, RTX_A6000_x9, V100_x8; real
nodes, from thamada/gls), e.g. `nvidia-smi:V100_x8`, `nvidia-smi:/path/node.txt:imagenet/resnet50/128`. NVML
answers the dump board by board: count, names, UUIDs, PCI bus ids, each board's own power-limit range, default,
requested (`nvmlDeviceGetPowerManagementLimit`) and enforced limit (`nvmlDeviceGetEnforcedPowerLimit`: the
GH200's 700 W under 900 W requested), module-scope limits and draw (`NVML_POWER_SCOPE_MODULE`: field values and
`nvmlDeviceSetPowerManagementLimit_v2`), maximum clocks, memory, persistence and MIG mode, architecture, driver
version; what the dump says is N/A answers NOT_SUPPORTED (GTX680's power calls). Its time and power under limits
are the nearest traced generation's (A40 for Ampere and newer, V100 up to Volta, T4 for Turing) scaled to the
model's range, labelled e.g. "NVIDIA GeForce RTX 3070 from an nvidia-smi dump; timing modelled from A40 traces"
(`sim/dump_node.py`). Its state keys on the dump's text, so two dumps never share one.
Options (environment variables, or arguments of `simulate`):
- `ZEUS_CALLBACKS_SIM_NOISE`: relative run-to-run noise of time and power (e.g. 0.02), seeded by
  `ZEUS_CALLBACKS_SIM_SEED`;
- `ZEUS_CALLBACKS_SIM_FAULTS`: injected faults, e.g. `no_permission;lost_after=200@1` (see `parse_faults`):
  `no_permission`, `no_cap_sys_admin` (root in a container without CAP_SYS_ADMIN: setters raise
  NO_PERMISSION), `hidden` (NVML counts the GPU, opening it raises NO_PERMISSION, CUDA does not see it),
  `empty_clocks`, `empty_memory_clocks`, `default_limit_w=W` (GeForce-like default limit below the maximum),
  `not_supported=power|clocks|persistence|power_draw|clock_info`, `missing=FUNCTION` (FUNCTION_NOT_FOUND, as from an old driver's library),
  `unknown=FUNCTION` (the whole call answers UNKNOWN), `lost_after=N` (NVML calls), `lost_after_changes=N`,
  `no_energy_counter`, `mig`; `@I` targets NVML index I;
- `ZEUS_CALLBACKS_SIM_STATE_DIR`: where the GPUs' state (power limit, clocks, energy) persists across
  processes (default: a per-user directory under the temp dir);
- `ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS`: the energy counter's refresh period for every GPU (default: each
  model's own, see below);
- `ZEUS_CALLBACKS_SIM_IDEAL`: comma-separated hardware behaviours to switch off (below), for tests that
  need the ideal case, e.g. `energy_counter,power_average`.

The simulated GPUs answer as real ones do, by default (each name is what `ZEUS_CALLBACKS_SIM_IDEAL` takes):
- `energy_counter`: `nvmlDeviceGetTotalEnergyConsumption` returns integer mJ that move only when the
  driver refreshes the counter, once per power update: every 20 ms on V100, 100 ms on the others; between
  refreshes it returns the last value, so a window shorter than the period reads 0 J or a whole period.
- `power_average`: `nvmlDeviceGetPowerUsage` is a 1-second moving average on Ampere (except GA100) and newer
  boards (A40, A10G, H100, H200) and the instant reading on V100, T4 and A100; `nvmlDeviceGetFieldValues`
  answers `NVML_FI_DEV_POWER_INSTANT` and, on the averaging boards only, `NVML_FI_DEV_POWER_AVERAGE` (mW in
  `value.uiVal`; other fields NOT_SUPPORTED in their own `nvmlReturn`).
- `power_window`: on a virtual clock the instant reading updates once per period, averaged over a window at
  its end (20 ms over 10 ms on V100; 100 over 100 on T4, A40, A10G; 100 over 25 on A100, H100, H200), so a
  burst between windows is unseen by it (the energy counter counts it).
- `device_order`: NVML numbers GPUs by PCI bus, with the slower models on the lower buses; CUDA numbers them
  fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so on `a10g,t4` NVML index 0 is the T4 and `cuda:0`
  the A10G. `CUDA_VISIBLE_DEVICES` indices are CUDA's. Ideal: both orders are the spec's.
- `interruptible_sync`: a synchronisation waits in "native code": Python signal handlers (SIGINT,
  SIGTERM, ...) run only after it returns, as with `torch.cuda.synchronize()`.
- `sensor_gain`: each board's power sensor reads its true power times a gain of its own, within 1 +/- 5%
  (the steady-state error against an external meter, `specs.SENSOR_GAIN_ERROR`), seeded from its UUID: the
  energy counter and every power reading. `SimulatedGPU.true_energy_mj()` is the truth. Ideal: a gain of 1.
Everything the simulator reports is a simulation, and the package labels it so.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from zeus_callbacks.core.device import gpus as devices
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.sim import (
    _bindings,  # noqa: F401  (first: refuses the unofficial pynvml)
    fake_nvml,
    nvml_library,
)
from zeus_callbacks.sim.dump_node import shipped_dumps
from zeus_callbacks.sim.system import (
    IDEAL_BEHAVIOURS,
    SimulatedGPU,
    SimulatedSystem,
    VirtualClock,
    parse_faults,
    parse_ideal,
    parse_spec,
)
from zeus_callbacks.sim.traces import DATA_FORMATS_HELP, Trace, load_trace, shipped_trace, shipped_workloads

__all__ = [
    "SIMULATE_ENV",
    "simulate",
    "active",
    "simulated_gpu",
    "exported",
    "enqueue_work",
    "enqueue_if_simulated",
    "work_seconds",
    "disable",
    "SimulatedSystem",
    "SimulatedGPU",
    "VirtualClock",
    "Trace",
    "load_trace",
    "shipped_trace",
    "shipped_workloads",
    "shipped_dumps",
    "parse_spec",
    "parse_faults",
    "parse_ideal",
    "IDEAL_BEHAVIOURS",
    "DATA_FORMATS_HELP",
    "SimulatedKernels",
]

SIMULATE_ENV = "ZEUS_CALLBACKS_SIMULATE"
_NOISE_ENV = "ZEUS_CALLBACKS_SIM_NOISE"
_SEED_ENV = "ZEUS_CALLBACKS_SIM_SEED"
_FAULTS_ENV = "ZEUS_CALLBACKS_SIM_FAULTS"
_STATE_ENV = "ZEUS_CALLBACKS_SIM_STATE_DIR"
_IDEAL_ENV = "ZEUS_CALLBACKS_SIM_IDEAL"
_REFRESH_ENV = "ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS"


def __getattr__(name: str) -> Any:
    """`SimulatedKernels` (an `nn.Module`) and `HFSimulatedGPUWork` (a `Trainer` callback) are imported on
    first use, so the simulator loads without torch or transformers."""
    if name == "SimulatedKernels":
        from zeus_callbacks.sim.kernels import SimulatedKernels

        return SimulatedKernels
    if name == "HFSimulatedGPUWork":  # imports transformers
        from zeus_callbacks.sim.huggingface import HFSimulatedGPUWork

        return HFSimulatedGPUWork
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def simulate(
    spec: str,
    *,
    noise: float = 0.0,
    seed: int = 0,
    faults: str = "",
    state_dir: str | None = None,
    virtual_clock: bool = False,
    export_env: bool = True,
    ideal: str = "",
    energy_refresh_ms: float | None = None,
    bursts: bool = False,
) -> SimulatedSystem:
    """Use simulated GPUs in this process (and, with `export_env`, in processes it starts).

    `ideal` switches hardware behaviours off (comma-separated `IDEAL_BEHAVIOURS`, see the module's
    docstring); `energy_refresh_ms` sets the energy counter's refresh period of every GPU (default: each
    model's); `bursts` adds heavy-tailed step times on a virtual clock: stalls (2% of steps idle for
    0.5-3x the step) and bursts (from 1% of steps, 5-20 steps 10-50% slower), seeded. Virtual-clock
    systems keep their state in memory and are never exported.
    """
    if virtual_clock and state_dir is None:
        state_dir = ""
    system = SimulatedSystem(
        spec, noise, seed, faults, state_dir, virtual_clock, ideal, energy_refresh_ms, bursts=bursts
    )
    devices.reset()  # restores what this process changed on the previous node first
    _attach(system)
    if export_env and not virtual_clock:
        os.environ[SIMULATE_ENV] = system.spec  # a dump's path made absolute: children may start elsewhere
        os.environ[_NOISE_ENV] = str(noise)
        os.environ[_SEED_ENV] = str(seed)
        os.environ[_FAULTS_ENV] = faults
        os.environ[_IDEAL_ENV] = ideal
        if energy_refresh_ms is None:
            os.environ.pop(_REFRESH_ENV, None)
        else:
            os.environ[_REFRESH_ENV] = str(energy_refresh_ms)
        if state_dir is not None:
            os.environ[_STATE_ENV] = state_dir
    return system


def active() -> SimulatedSystem | None:
    """The simulated node of this process: the one set by `simulate`, else one built from the environment.

    Raises:
        InvalidInputError: a `ZEUS_CALLBACKS_SIM*` variable holds a value the simulator cannot use.
    """
    system = _attached()
    if system is None and os.environ.get(SIMULATE_ENV):
        system = SimulatedSystem(
            os.environ[SIMULATE_ENV],
            _env_number(_NOISE_ENV, float, "a relative noise from 0 to 0.5, e.g. 0.02") or 0.0,
            _env_number(_SEED_ENV, int, "a whole number, e.g. 0") or 0,
            os.environ.get(_FAULTS_ENV, ""),
            os.environ.get(_STATE_ENV) or None,
            ideal=os.environ.get(_IDEAL_ENV, ""),
            energy_refresh_ms=_env_number(_REFRESH_ENV, float, "a period in ms from 0 to 10000, e.g. 100"),
        )
    if system is not None and system.vendor == "amd":
        _amd().ensure(system)  # the node answers beneath amdsmi
    elif system is not None:
        nvml_library.ensure(system)  # the node answers beneath pynvml
    return system


def _amd() -> Any:
    """`sim/amd_backend.py`, imported only for an AMD node (it imports amdsmi, bound to the simulated library)."""
    from zeus_callbacks.sim import amd_backend

    return amd_backend


def _attach(system: SimulatedSystem | None) -> None:
    """Put `system` beneath its vendor's library (NVML's or amdsmi's) and take any node from the other's."""
    amd = system is not None and system.vendor == "amd"
    nvml_library.attach(None if amd else system)
    if amd or "zeus_callbacks.sim.amd_backend" in sys.modules:
        _amd().attach(system if amd else None)


def _attached() -> SimulatedSystem | None:
    """The node attached beneath NVML or amdsmi, if any."""
    system = fake_nvml.system()
    if system is None and "zeus_callbacks.sim.amd_backend" in sys.modules:
        library = _amd().installed()
        system = None if library is None else library.system
    return system


def exported(system: SimulatedSystem) -> bool:
    """Whether a process started now, with this environment, would simulate `system`'s node (same spec,
    state directory and faults)."""
    env = os.environ
    return (
        env.get(SIMULATE_ENV) == system.spec
        and (env.get(_STATE_ENV) or None) == (system.state_dir or None)
        and env.get(_FAULTS_ENV, "") == system.faults
    )


def simulated_gpu(handle: Any) -> SimulatedGPU:
    """The simulated GPU behind a pynvml handle (`c_nvmlDevice_t`) taken while the simulation is active.

    Raises:
        ValueError: `handle` is not one of the simulated GPUs now beneath pynvml.
    """
    return nvml_library.simulated_gpu(handle)


def _env_number(name: str, kind: type, expected: str) -> Any:
    """The variable `name` as a finite `kind`, None when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise InvalidInputError(f"{name}={text!r} is not {expected}: set it so, or unset it.")
    return value


def enqueue_work(gpu_index: int, work_s: float) -> None:
    """Queue work on simulated GPU `gpu_index` (its CUDA index: `cuda:gpu_index` under this process's
    `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER`) that uses no host CPU: a stand-in for a
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
    system.cuda_gpus()[gpu_index].enqueue(work_s)


def enqueue_if_simulated(gpu_index: int, work_s: float) -> None:
    """`enqueue_work` while a simulation is active; nothing otherwise, so that code which paces toy steps
    by simulated work runs unchanged on real GPUs."""
    if active() is not None:
        enqueue_work(gpu_index, work_s)


def work_seconds(owner: str, work_s: float) -> float:
    """`work_s` as seconds of simulated work for `owner`'s argument.

    Raises:
        ValueError: `work_s` is not a number >= 0.
    """
    if not work_s >= 0:
        raise ValueError(f"{owner}: work_s must be >= 0 seconds, got {work_s!r}.")
    return float(work_s)


def disable() -> None:
    """Stop simulating in this process and forget the exported environment variables."""
    devices.reset()  # restores what this process changed first
    _attach(None)  # pynvml and amdsmi get back the libraries they had (normally the real drivers')
    for name in (SIMULATE_ENV, _NOISE_ENV, _SEED_ENV, _FAULTS_ENV, _STATE_ENV, _IDEAL_ENV, _REFRESH_ENV):
        os.environ.pop(name, None)
