"""The simulator's NVML semantics and injected faults, one Python function per NVML function.

Nothing of the package calls this module as its NVML: the real nvidia-ml-py (`pynvml`) does, through the
ctypes callbacks of `zeus_callbacks.sim.nvml_library` installed beneath it as the NVML library, which call
these functions with the `SimulatedGPU` behind each handle and turn an `NVMLError` into its `nvmlReturn_t`.
Only the zeusd test double calls them directly. Errors are the real `pynvml.NVMLError` subclasses.
"""

from __future__ import annotations

import ctypes
from collections import namedtuple
from collections.abc import Callable
from typing import TYPE_CHECKING

import pynvml as _real

from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem

if TYPE_CHECKING:
    from zeus_callbacks.sim.dump_node import DumpBoardModel, LimitScope

# Re-export NVML constants and error classes so `fake_nvml.NVMLError_NoPermission` etc. exist.
for _name in dir(_real):
    if _name.startswith(("NVML_", "NVMLError")) or _name in ("nvmlFriendlyObjectToStruct",):
        globals()[_name] = getattr(_real, _name)
NVMLError = _real.NVMLError

SIMULATED = True  # lets callers label what they report

_system: SimulatedSystem | None = None
_initialized = 0

_MemoryInfo = namedtuple("_MemoryInfo", "total free used")


def attach(system: SimulatedSystem | None) -> None:
    """Make `system` the node this module answers for (None detaches)."""
    global _system, _initialized
    _system = system
    _initialized = 0


def system() -> SimulatedSystem | None:
    """The attached simulated node."""
    return _system


def _nvmlGetFunctionPointer(name: str):  # noqa: N802
    """Present because Zeus checks for it to tell the official bindings from an unofficial `pynvml`."""
    raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


def _gpu(
    handle: object, *, feature: str | None = None, setter: bool = False, call: str | None = None
) -> SimulatedGPU:
    if not _initialized:
        raise _err(_real.NVML_ERROR_UNINITIALIZED)
    if not isinstance(handle, SimulatedGPU):
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    if handle.count_call():
        raise _err(_real.NVML_ERROR_GPU_IS_LOST)
    if call is not None and call in handle.faults.missing:  # an old driver's library lacks the function
        raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
    if call is not None and call in handle.faults.unknown:
        raise _err(_real.NVML_ERROR_UNKNOWN)
    if feature is not None and feature in handle.faults.not_supported:
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
    if setter and (handle.faults.no_permission or handle.faults.no_cap_sys_admin):
        raise _err(_real.NVML_ERROR_NO_PERMISSION)
    return handle


# -- library --------------------------------------------------------------------------------------
def nvmlInit() -> None:  # noqa: N802 (NVML's names)
    global _initialized
    if _system is None:
        raise _err(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
    _initialized += 1


nvmlInitWithFlags = lambda flags=0: nvmlInit()  # noqa: E731


def nvmlShutdown() -> None:  # noqa: N802
    global _initialized
    if not _initialized:
        raise _err(_real.NVML_ERROR_UNINITIALIZED)
    _initialized -= 1


def nvmlSystemGetDriverVersion() -> str:  # noqa: N802
    """A dump's driver version (`Driver Version`), else "simulated"."""
    return "simulated" if _system is None else _system.driver_version


def nvmlSystemGetNVMLVersion() -> str:  # noqa: N802
    """A dump's NVML version as a real library gives it, the CUDA major version and the driver's (e.g.
    "12.550.127.05" for `CUDA Version : 12.4` and `Driver Version : 550.127.05`), else "simulated"."""
    dump = None if _system is None or _system.dump is None else _system.dump.dump
    if dump is None or dump.cuda_version is None:
        return "simulated"
    return f"{dump.cuda_version.split('.')[0]}.{dump.driver_version}"


def _gpus() -> list[SimulatedGPU]:
    """The node's GPUs in NVML's order; NVML's UNINITIALIZED before `nvmlInit` or with no node attached."""
    if not _initialized or _system is None:
        raise _err(_real.NVML_ERROR_UNINITIALIZED)
    return _system.gpus


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> SimulatedGPU:  # noqa: N802
    count = nvmlDeviceGetCount()
    if not 0 <= index < count:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    return _open(_gpus()[index])


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> SimulatedGPU:  # noqa: N802
    nvmlDeviceGetCount()
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    for g in _gpus():
        if g.uuid == text:
            return _open(g)
    raise _err(_real.NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetHandleByPciBusId(pciBusId: str | bytes) -> SimulatedGPU:  # noqa: N802, N803
    nvmlDeviceGetCount()
    text = (pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId).upper()
    for g in _gpus():
        if g.pci_bus_id.endswith(text) or text.endswith(g.pci_bus_id[4:]):
            return _open(g)
    raise _err(_real.NVML_ERROR_NOT_FOUND)


def _open(g: SimulatedGPU) -> SimulatedGPU:
    """A handle, unless the job's cgroup hides the GPU: NVML counts it but may not open it."""
    if g.faults.hidden:
        raise _err(_real.NVML_ERROR_NO_PERMISSION)
    return g


# -- identity -------------------------------------------------------------------------------------
def nvmlDeviceGetUUID(handle) -> str:  # noqa: N802
    return _gpu(handle).uuid


def nvmlDeviceGetName(handle) -> str:  # noqa: N802
    return _gpu(handle).spec.name


def nvmlDeviceGetIndex(handle) -> int:  # noqa: N802
    return _gpu(handle).index


def nvmlDeviceGetArchitecture(handle) -> int:  # noqa: N802
    g = _gpu(handle, call="nvmlDeviceGetArchitecture")
    if g.faults.no_energy_counter:  # a board without the counter is older than Volta
        return min(_real.NVML_DEVICE_ARCH_PASCAL, g.spec.architecture)
    return g.spec.architecture


def nvmlDeviceGetPciInfo_v3(handle) -> _real.nvmlPciInfo_t:  # noqa: N802
    g = _gpu(handle)
    info = _real.nvmlPciInfo_t()
    domain, bus, rest = g.pci_bus_id.split(":")
    info.busId = info.busIdLegacy = g.pci_bus_id.encode()
    info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    return info


nvmlDeviceGetPciInfo = nvmlDeviceGetPciInfo_v3


def nvmlDeviceGetMigMode(handle) -> list[int]:  # noqa: N802
    g = _gpu(handle)
    if g.board is not None and g.board.mig is None:  # the dump's `MIG Mode : N/A`: a board without MIG
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
    on = g.faults.mig
    mode = _real.NVML_DEVICE_MIG_ENABLE if on else _real.NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMemoryInfo(handle) -> _MemoryInfo:  # noqa: N802
    total = _gpu(handle).spec.memory_bytes
    return _MemoryInfo(total, total, 0)


def nvmlDeviceGetC2cModeInfoV(handle):  # noqa: N802
    _gpu(handle)
    raise _err(_real.NVML_ERROR_NOT_SUPPORTED)


# -- energy and power -----------------------------------------------------------------------------
def nvmlDeviceGetTotalEnergyConsumption(handle) -> int:  # noqa: N802
    if _initialized and type(handle) is SimulatedGPU and handle.plain_reads:
        return int(handle.energy_mj() * handle.sensor_gain)  # the monitor's hot path: no fault can apply
    g = _gpu(handle, call="nvmlDeviceGetTotalEnergyConsumption")
    if g.faults.no_energy_counter:
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
    return int(g.energy_mj() * g.sensor_gain)


def nvmlDeviceGetPowerUsage(handle) -> int:  # noqa: N802
    """A 1-second moving average on Ampere (except GA100, the A100) and newer boards; else the instant reading
    (nvml.h, nvmlDeviceGetPowerUsage; `GPUSpec.power_usage_averaged`). Every power reading and the energy
    counter are the board's true figures times its sensor's gain (`SimulatedGPU.sensor_gain`, `specs.sensor_gain`)."""
    g = _gpu(handle, feature="power_draw")
    return round((g.average_power_mw() if g.power_usage_averaged else g.power_mw()) * g.sensor_gain)


_Field = Callable[[SimulatedGPU], "float | None"]


def _limit(read: _Field) -> _Field:
    """A power-limit field: NOT_SUPPORTED (None) where the board's limits are (the dump's N/A, or a fault)."""
    return lambda g: None if "power" in g.faults.not_supported else read(g)


def _draw(read: _Field) -> _Field:
    """A power-draw field: NOT_SUPPORTED (None) where the board reads no power (the dump's `Power Draw : N/A`)."""
    return lambda g: None if "power_draw" in g.faults.not_supported else read(g)


_POWER_FIELDS = {
    # nvml.h: "supported on Ampere (except GA100) or newer architectures"; elsewhere NOT_SUPPORTED (None).
    _real.NVML_FI_DEV_POWER_AVERAGE: _draw(
        lambda g: g.average_power_mw() * g.sensor_gain if g.spec.has_power_average_field else None
    ),
    _real.NVML_FI_DEV_POWER_INSTANT: _draw(lambda g: g.power_mw() * g.sensor_gain),
    _real.NVML_FI_DEV_POWER_DEFAULT_LIMIT: _limit(lambda g: g.default_power_limit_mw),
    # nvml.h: CURRENT_LIMIT is the "limit currently enforced" (other limiters included), REQUESTED_LIMIT the
    # one "requested by NVML or any other userspace client".
    _real.NVML_FI_DEV_POWER_CURRENT_LIMIT: _limit(lambda g: g.enforced_power_limit_mw),
    _real.NVML_FI_DEV_POWER_REQUESTED_LIMIT: _limit(lambda g: g.power_limit_mw),
    _real.NVML_FI_DEV_POWER_MIN_LIMIT: _limit(lambda g: g.min_power_limit_mw),
    _real.NVML_FI_DEV_POWER_MAX_LIMIT: _limit(lambda g: g.max_power_limit_mw),
}


# Memory power (`NVML_POWER_SCOPE_MEMORY`, nvml.h: "Targets the GPU Memory"): nvidia-smi reads it, nvml.h
# documents no board list. Zeus finds it answered on the H100 and NOT_SUPPORTED on the A40
# (zeus/device/gpu/nvidia.py, `get_average_memory_power_usage`), so Hopper boards answer and older ones do
# not; a board from a dump answers where its `GPU Memory Power Readings` show a draw (not the H100 NVL's).
# Its value is ASSUMED: a fixed share of the board's 1-second average (no per-board split is published).
MEMORY_POWER_SHARE = 0.15


def _memory_power(g: SimulatedGPU) -> float | None:
    if g.board is not None:
        answers = g.board.memory_power
    else:
        answers = g.spec.architecture >= _real.NVML_DEVICE_ARCH_HOPPER and g.spec.has_power_average_field
    return g.average_power_mw() * g.sensor_gain * MEMORY_POWER_SHARE if answers else None


# Module power (`NVML_POWER_SCOPE_MODULE`, nvml.h: "Metrics for the module (e.g. CPU + GPU) are retrieved";
# "CPU here refers to NVIDIA CPU (e.g. Grace)"): answered on a board whose dump shows `Module Power Readings`
# (GH200). Its draw is ASSUMED to be the GPU's plus the rest of the module's as the dump shows it.
def _module(read: Callable[[SimulatedGPU, DumpBoardModel, LimitScope], float]) -> _Field:
    return lambda g: (
        None if g.board is None or g.board.module_limits is None else read(g, g.board, g.board.module_limits)
    )


_MODULE_FIELDS: dict[int, _Field] = {
    _real.NVML_FI_DEV_POWER_INSTANT: _module(
        lambda g, board, m: (g.power_mw() + board.module_other_w * 1000) * g.sensor_gain
    ),
    _real.NVML_FI_DEV_POWER_AVERAGE: _module(
        lambda g, board, m: (g.average_power_mw() + board.module_other_w * 1000) * g.sensor_gain
    ),
    _real.NVML_FI_DEV_POWER_MIN_LIMIT: _module(lambda g, board, m: m.min_mw),
    _real.NVML_FI_DEV_POWER_MAX_LIMIT: _module(lambda g, board, m: m.max_mw),
    _real.NVML_FI_DEV_POWER_DEFAULT_LIMIT: _module(lambda g, board, m: m.default_mw),
    _real.NVML_FI_DEV_POWER_CURRENT_LIMIT: _module(lambda g, board, m: g.module_limit_mw),
    _real.NVML_FI_DEV_POWER_REQUESTED_LIMIT: _module(lambda g, board, m: g.module_limit_mw),
}
_FIELDS_BY_SCOPE: dict[int, dict[int, _Field]] = {
    _real.NVML_POWER_SCOPE_GPU: _POWER_FIELDS,
    _real.NVML_POWER_SCOPE_MODULE: _MODULE_FIELDS,
    _real.NVML_POWER_SCOPE_MEMORY: {_real.NVML_FI_DEV_POWER_AVERAGE: _memory_power},
}


def nvmlDeviceGetFieldValues(handle, fieldIds: list) -> ctypes.Array:  # noqa: N802, N803
    """Power fields (mW, `value.uiVal`) of the whole GPU, of its module (a GH200-like board) and the average of
    its memory (Hopper); each other field or scope answers NOT_SUPPORTED in its own `nvmlReturn`, as NVML does,
    while the call itself succeeds."""
    g = _gpu(handle, call="nvmlDeviceGetFieldValues")
    values = (_real.c_nvmlFieldValue_t * len(fieldIds))()
    stamp = int(g.now() * 1e6)
    for v, field in zip(values, fieldIds, strict=True):
        field_id, scope = field if isinstance(field, tuple) else (field, 0)
        v.fieldId, v.scopeId, v.timestamp = field_id, scope, stamp
        read = _FIELDS_BY_SCOPE.get(scope, {}).get(field_id)
        value = None if read is None else read(g)
        if value is None:
            v.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
            continue
        v.valueType = _real.NVML_VALUE_TYPE_UNSIGNED_INT
        v.value.uiVal = round(value)
        v.nvmlReturn = _real.NVML_SUCCESS
    return values


def nvmlDeviceGetPowerManagementLimitConstraints(handle) -> list[int]:  # noqa: N802
    g = _gpu(handle, feature="power")
    return [g.min_power_limit_mw, g.max_power_limit_mw]


def nvmlDeviceGetPowerManagementDefaultLimit(handle) -> int:  # noqa: N802
    return _gpu(handle, feature="power").default_power_limit_mw


def nvmlDeviceGetPowerManagementLimit(handle) -> int:  # noqa: N802
    """The limit software requested (nvidia-smi's `Requested Power Limit`, older drivers' `Power Limit`)."""
    return _gpu(handle, feature="power").power_limit_mw


def nvmlDeviceGetEnforcedPowerLimit(handle) -> int:  # noqa: N802
    """nvml.h: "the effective power limit that the driver enforces after taking into account all limiters ...
    can be different from nvmlDeviceGetPowerManagementLimit if other limits are set elsewhere" (nvidia-smi's
    `Current Power Limit`, older drivers' `Enforced Power Limit`; a GH200 dump: 700 W of 900 W requested)."""
    return _gpu(handle, feature="power").enforced_power_limit_mw


def nvmlDeviceSetPowerManagementLimit(handle, limit: int) -> None:  # noqa: N802
    g = _gpu(handle, feature="power", setter=True)
    if not g.min_power_limit_mw <= int(limit) <= g.max_power_limit_mw:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    g.set_power_limit_mw(int(limit))


def nvmlDeviceSetPowerManagementLimit_v2(handle, scope: int, limit: int, version: int) -> None:  # noqa: N802
    """nvml.h's `nvmlDeviceSetPowerManagementLimit_v2(device, nvmlPowerValue_v2_t *)`: "a drop-in replacement"
    of the setter above for `powerScope` NVML_POWER_SCOPE_GPU, and the module's limit ("GPU or Total Module")
    for NVML_POWER_SCOPE_MODULE. INVALID_ARGUMENT where the value "contains invalid values" (another scope, a
    limit out of range), NOT_SUPPORTED where the board lacks the scope, ARGUMENT_VERSION_MISMATCH for a version
    other than `nvmlPowerValue_v2` (nvml.h: "The provided version is invalid/unsupported")."""
    if version != _real.nvmlPowerValue_v2:
        _gpu(handle)
        raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    if scope == _real.NVML_POWER_SCOPE_GPU:
        return nvmlDeviceSetPowerManagementLimit(handle, limit)
    g = _gpu(handle, setter=True)
    if scope != _real.NVML_POWER_SCOPE_MODULE:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    module = None if g.board is None else g.board.module_limits
    if module is None:
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
    if not module.min_mw <= int(limit) <= module.max_mw:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    g.set_module_limit_mw(int(limit))


# -- persistence ----------------------------------------------------------------------------------
def nvmlDeviceGetPersistenceMode(handle) -> int:  # noqa: N802
    on = _gpu(handle, feature="persistence").persistence
    return _real.NVML_FEATURE_ENABLED if on else _real.NVML_FEATURE_DISABLED


def nvmlDeviceSetPersistenceMode(handle, mode: int) -> None:  # noqa: N802
    _gpu(handle, feature="persistence", setter=True).set_persistence(mode == _real.NVML_FEATURE_ENABLED)


# -- clocks ---------------------------------------------------------------------------------------
def nvmlDeviceGetSupportedMemoryClocks(handle) -> list[int]:  # noqa: N802
    g = _gpu(handle, feature="clocks")
    return [] if g.faults.empty_memory_clocks else list(g.spec.memory_clocks_mhz)


def nvmlDeviceGetSupportedGraphicsClocks(handle, memoryClockMHz: int) -> list[int]:  # noqa: N802, N803
    g = _gpu(handle, feature="clocks")
    if memoryClockMHz not in g.spec.memory_clocks_mhz:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    return [] if g.faults.empty_clocks else g.spec.supported_sm_clocks_mhz()


def nvmlDeviceGetMaxClockInfo(handle, clock_type: int) -> int:  # noqa: N802
    g = _gpu(handle, feature="clock_info")
    return g.spec.max_sm_clock_mhz if clock_type != _real.NVML_CLOCK_MEM else g.spec.memory_clocks_mhz[0]


def nvmlDeviceGetClockInfo(handle, clock_type: int) -> int:  # noqa: N802
    g = _gpu(handle, feature="clock_info")
    if clock_type == _real.NVML_CLOCK_MEM:
        return g.spec.memory_clocks_mhz[0]
    rel, _ = g.operating_point()
    return int(g.spec.max_sm_clock_mhz / rel)


def nvmlDeviceSetGpuLockedClocks(handle, minGpuClockMHz: int, maxGpuClockMHz: int) -> None:  # noqa: N802, N803
    g = _gpu(handle, feature="clocks", setter=True)
    if not (g.spec.min_sm_clock_mhz <= minGpuClockMHz <= maxGpuClockMHz <= g.spec.max_sm_clock_mhz):
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    g.lock_sm_clocks(int(minGpuClockMHz), int(maxGpuClockMHz))


def nvmlDeviceResetGpuLockedClocks(handle) -> None:  # noqa: N802
    _gpu(handle, feature="clocks", setter=True).reset_sm_clocks()


def nvmlDeviceSetMemoryLockedClocks(handle, minMemClockMHz: int, maxMemClockMHz: int) -> None:  # noqa: N802, N803
    _gpu(handle, feature="clocks", setter=True).set_memory_clocks_locked(True)


def nvmlDeviceResetMemoryLockedClocks(handle) -> None:  # noqa: N802
    _gpu(handle, feature="clocks", setter=True).set_memory_clocks_locked(False)


def nvmlDeviceGetTemperature(handle, sensor: int) -> int:  # noqa: N802
    _gpu(handle)
    return 40
