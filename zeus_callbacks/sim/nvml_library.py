"""Simulated GPUs at NVML's C boundary: a stand-in for `libnvidia-ml.so.1` beneath the real nvidia-ml-py.

nvidia-ml-py (`pynvml`) reaches the driver library in one way only: `_LoadNvmlLibrary` puts a `CDLL` in
`pynvml.nvmlLib`, and every wrapper asks `_nvmlGetFunctionPointer(name)` for `getattr(nvmlLib, name)`
(cached in `_nvmlGetFunctionPointer_cache`), calls it with ctypes arguments (out-parameters by `byref`,
string buffers, arrays of structures) and hands the `nvmlReturn_t` it returns to `_nvmlCheckReturn`.
`SimulatedNVMLLibrary` offers exactly that surface: each attribute is a C function pointer
(`ctypes.CFUNCTYPE`) with the C signature of the NVML function of that name, and `attach` installs the
library as `pynvml.nvmlLib` while a simulation is active. So every simulated run (the package, the tests,
Zeus in the side-by-side benchmarks) runs nvidia-ml-py's own wrappers, structures, versioned names
(`nvmlDeviceGetCount_v2`, ...), two-call size protocols and error classes; a function this library does
not offer raises `NVMLError_FunctionNotFound` from pynvml itself, as an old driver's does.

Why ctypes callbacks rather than a small C `libnvidia-ml.so.1` built at test time: the simulated GPUs'
state lives in this Python process, so a C library would only forward each call back into Python through
the same kind of callback, while needing a C compiler wherever the tests or an example run (and a loader
path trick to be picked up). What the callbacks leave untested is only the dynamic loading itself
(`CDLL("libnvidia-ml.so.1")`), which `_LoadNvmlLibrary` skips because the library is already loaded.

Conventions of the C side, as NVML's: a handle (`nvmlDevice_t`, a pointer to an opaque struct) is a fake,
non-null address per simulated GPU that nothing dereferences (taken as `void *`, the same in the ABI);
`nvmlReturn_t` is the return value; strings and arrays too small for the answer give
`NVML_ERROR_INSUFFICIENT_SIZE`. What each function answers is decided by the Python-level functions of
`zeus_callbacks.sim.fake_nvml` (the simulator's NVML semantics and injected faults), looked up at every
call so that a test patching one of them patches what pynvml reaches. A Python exception other than an
`NVMLError` raised inside a callback (a signal handler's `KeyboardInterrupt`, a test's injected failure)
is re-raised by the function pointer's `errcheck` once the C call has returned, as a signal that arrives
during a real driver call is handled right after it.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from ctypes import CFUNCTYPE, POINTER, c_char, c_char_p, c_int, c_int32, c_uint, c_uint64, c_void_p
from typing import Any

import pynvml

from zeus_callbacks.sim import fake_nvml
from zeus_callbacks.sim.c_library import CallbackLibrary, CFunctions
from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem

__all__ = ["SimulatedNVMLLibrary", "attach", "ensure", "installed", "simulated_gpu", "offered_functions"]

logger = logging.getLogger(__name__)

_SUCCESS = pynvml.NVML_SUCCESS
_HANDLE_BASE = 0x5EED_0000_0000  # fake addresses: non-null, aligned, never dereferenced
_HANDLE_STRIDE = 0x40
_library_numbers = itertools.count(1)

# NVML functions offered: name -> (C prototype, implementation(library, *C arguments) -> None or nvmlReturn_t)
_FUNCTIONS = CFunctions(c_int, _SUCCESS, pynvml.NVML_ERROR_UNKNOWN, pynvml.NVMLError, lambda e: e.value)
_c = _FUNCTIONS.register


def offered_functions() -> frozenset[str]:
    """The NVML function names the simulated library offers (any other is FUNCTION_NOT_FOUND)."""
    return frozenset(_FUNCTIONS.table) | {"nvmlErrorString"}


class SimulatedNVMLLibrary(CallbackLibrary):
    """The simulated node as the NVML shared library: one C function pointer per offered NVML function.

    Args:
        system: The simulated node whose GPUs the handles stand for (answers come from `fake_nvml`,
            attached to the same node by `attach`).
        withheld: NVML function names to leave out, as a driver older than those functions does.

    Example::

        >>> from zeus_callbacks import sim
        >>> system = sim.simulate("a40", virtual_clock=True)
        >>> import pynvml
        >>> pynvml.nvmlInit()
        >>> pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        'NVIDIA A40'
    """

    def __init__(self, system: SimulatedSystem, withheld: frozenset[str] = frozenset()) -> None:
        self.system = system
        self._base = _HANDLE_BASE + next(_library_numbers) * 0x1_0000_0000
        self._gpu_at: dict[int, SimulatedGPU] = {}  # handle address -> GPU
        self._handle_of: dict[int, Any] = {}  # id(GPU) -> its `c_nvmlDevice_t`
        self._handles_lock = threading.Lock()
        super().__init__(_FUNCTIONS, withheld)
        if "nvmlDeviceGetTotalEnergyConsumption" not in self.withheld:
            self.nvmlDeviceGetTotalEnergyConsumption = self._energy_function()
        if "nvmlErrorString" not in self.withheld:
            # `const char *nvmlErrorString(nvmlReturn_t)`: pynvml sets `restype = c_char_p` on it itself.
            self.nvmlErrorString = CFUNCTYPE(c_void_p, c_int)(self._error_string)
            self._error_texts: dict[int, ctypes.Array] = {}

    def __repr__(self) -> str:
        return f"SimulatedNVMLLibrary(spec={self.system.spec!r}, simulated=True)"

    # -- handles ----------------------------------------------------------------------------------
    def handle_for(self, gpu: SimulatedGPU) -> Any:
        """The `c_nvmlDevice_t` that stands for `gpu` (the same address for the library's lifetime)."""
        handle = self._handle_of.get(id(gpu))
        if handle is None:
            with self._handles_lock:
                handle = self._handle_of.get(id(gpu))
                if handle is None:
                    address = self._base + (len(self._gpu_at) + 1) * _HANDLE_STRIDE
                    self._gpu_at[address] = gpu
                    handle = self._handle_of[id(gpu)] = ctypes.cast(address, pynvml.c_nvmlDevice_t)
        return handle

    def gpu_at(self, address: int | None) -> SimulatedGPU | None:
        """The GPU whose handle has `address`, None for an address this library never handed out."""
        return None if address is None else self._gpu_at.get(address)

    def _gpu(self, address: int | None) -> Any:
        """The GPU for `fake_nvml`'s functions; an unknown address is passed on for them to reject."""
        return None if address is None else self._gpu_at.get(address, address)

    # -- calling convention -----------------------------------------------------------------------
    def _energy_function(self) -> Any:
        """`nvmlDeviceGetTotalEnergyConsumption`, the monitor's hot path, in one Python frame of its own."""
        gpu_at, raised = self._gpu_at, self._raised

        def call(h: int, energy: Any) -> int:
            try:
                value = fake_nvml.nvmlDeviceGetTotalEnergyConsumption(gpu_at.get(h, h))
                if not energy:
                    return pynvml.NVML_ERROR_INVALID_ARGUMENT
                energy[0] = value
                return _SUCCESS
            except pynvml.NVMLError as e:
                return e.value
            except BaseException as e:  # noqa: BLE001 - re-raised after the C call by `_reraise`
                raised[threading.get_ident()] = e
                return pynvml.NVML_ERROR_UNKNOWN

        return self.c_function(_FUNCTIONS.table["nvmlDeviceGetTotalEnergyConsumption"][0], call)

    def _error_string(self, code: int) -> int:
        """NVML's text for `code` (pynvml's own table of the driver's texts), as a static C string."""
        text = self._error_texts.get(code)
        if text is None:
            message = pynvml.NVMLError._errcode_to_string.get(code, "Unknown Error")
            text = self._error_texts[code] = ctypes.create_string_buffer(message.encode())
        return ctypes.addressof(text)


# -- helpers of the C side ------------------------------------------------------------------------
def _put_string(text: str, buffer: Any, length: int) -> int | None:
    data = text.encode() + b"\0"
    if not buffer or len(data) > length:
        return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    ctypes.memmove(buffer, data, len(data))
    return None


def _put_uints(values: list[int], count: Any, array: Any) -> int | None:
    """NVML's two-call protocol: with too small an array, the size needed and INSUFFICIENT_SIZE."""
    needed = len(values)
    if not count:
        return pynvml.NVML_ERROR_INVALID_ARGUMENT
    if needed and (not array or count[0] < needed):
        count[0] = needed
        return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    for i, value in enumerate(values):
        array[i] = value
    count[0] = needed
    return None


def _check_out(*pointers: Any) -> None:
    if not all(pointers):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)


_UINT = POINTER(c_uint)
_HANDLE_OUT = POINTER(pynvml.c_nvmlDevice_t)
_HANDLE = c_void_p  # nvmlDevice_t: a pointer to an opaque struct, the same as void * in the ABI
_CHARS = POINTER(c_char)


def _uint_out(name: str, *inputs: Any) -> None:
    """Register `nvmlReturn_t name(nvmlDevice_t, inputs..., unsigned int *out)`, answered by `fake_nvml.name`."""

    def impl(lib: SimulatedNVMLLibrary, h: int, *args: Any) -> None:
        *given, out = args
        value = getattr(fake_nvml, name)(lib._gpu(h), *given)
        _check_out(out)
        out[0] = value

    _c(name, _HANDLE, *inputs, _UINT)(impl)


def _no_out(name: str, *inputs: Any) -> None:
    """Register `nvmlReturn_t name(nvmlDevice_t, inputs...)` (a setter), answered by `fake_nvml.name`."""

    def impl(lib: SimulatedNVMLLibrary, h: int, *given: Any) -> None:
        getattr(fake_nvml, name)(lib._gpu(h), *given)

    _c(name, _HANDLE, *inputs)(impl)


# -- library --------------------------------------------------------------------------------------
@_c("nvmlInit_v2")
def _init(lib: SimulatedNVMLLibrary) -> None:
    fake_nvml.nvmlInit()


@_c("nvmlInitWithFlags", c_uint)
def _init_with_flags(lib: SimulatedNVMLLibrary, flags: int) -> None:
    fake_nvml.nvmlInit()


@_c("nvmlShutdown")
def _shutdown(lib: SimulatedNVMLLibrary) -> None:
    fake_nvml.nvmlShutdown()


@_c("nvmlSystemGetDriverVersion", _CHARS, c_uint)
def _driver_version(lib: SimulatedNVMLLibrary, buffer: Any, length: int) -> int | None:
    return _put_string(fake_nvml.nvmlSystemGetDriverVersion(), buffer, length)


@_c("nvmlSystemGetNVMLVersion", _CHARS, c_uint)
def _nvml_version(lib: SimulatedNVMLLibrary, buffer: Any, length: int) -> int | None:
    return _put_string(fake_nvml.nvmlSystemGetNVMLVersion(), buffer, length)


@_c("nvmlDeviceGetCount_v2", _UINT)
def _count(lib: SimulatedNVMLLibrary, count: Any) -> None:
    _check_out(count)
    count[0] = fake_nvml.nvmlDeviceGetCount()


@_c("nvmlDeviceGetHandleByIndex_v2", c_uint, _HANDLE_OUT)
def _handle_by_index(lib: SimulatedNVMLLibrary, index: int, device: Any) -> None:
    _check_out(device)
    device[0] = lib.handle_for(fake_nvml.nvmlDeviceGetHandleByIndex(index))


@_c("nvmlDeviceGetHandleByUUID", c_char_p, _HANDLE_OUT)
def _handle_by_uuid(lib: SimulatedNVMLLibrary, uuid: bytes | None, device: Any) -> None:
    _check_out(uuid, device)
    assert uuid is not None  # a null `const char *` was refused just above
    device[0] = lib.handle_for(fake_nvml.nvmlDeviceGetHandleByUUID(uuid))


@_c("nvmlDeviceGetHandleByPciBusId_v2", c_char_p, _HANDLE_OUT)
def _handle_by_pci(lib: SimulatedNVMLLibrary, bus_id: bytes | None, device: Any) -> None:
    _check_out(bus_id, device)
    assert bus_id is not None  # a null `const char *` was refused just above
    device[0] = lib.handle_for(fake_nvml.nvmlDeviceGetHandleByPciBusId(bus_id))


# -- identity -------------------------------------------------------------------------------------
@_c("nvmlDeviceGetUUID", _HANDLE, _CHARS, c_uint)
def _uuid(lib: SimulatedNVMLLibrary, h: int, buffer: Any, length: int) -> int | None:
    return _put_string(fake_nvml.nvmlDeviceGetUUID(lib._gpu(h)), buffer, length)


@_c("nvmlDeviceGetName", _HANDLE, _CHARS, c_uint)
def _name(lib: SimulatedNVMLLibrary, h: int, buffer: Any, length: int) -> int | None:
    return _put_string(fake_nvml.nvmlDeviceGetName(lib._gpu(h)), buffer, length)


@_c("nvmlDeviceGetPciInfo_v3", _HANDLE, POINTER(pynvml.nvmlPciInfo_t))
def _pci_info(lib: SimulatedNVMLLibrary, h: int, info: Any) -> None:
    value = fake_nvml.nvmlDeviceGetPciInfo_v3(lib._gpu(h))
    _check_out(info)
    info[0] = value


@_c("nvmlDeviceGetMigMode", _HANDLE, _UINT, _UINT)
def _mig_mode(lib: SimulatedNVMLLibrary, h: int, current: Any, pending: Any) -> None:
    now, later = fake_nvml.nvmlDeviceGetMigMode(lib._gpu(h))
    _check_out(current, pending)
    current[0], pending[0] = now, later


@_c("nvmlDeviceGetMemoryInfo", _HANDLE, POINTER(pynvml.c_nvmlMemory_t))
def _memory_info(lib: SimulatedNVMLLibrary, h: int, memory: Any) -> None:
    value = fake_nvml.nvmlDeviceGetMemoryInfo(lib._gpu(h))
    _check_out(memory)
    memory[0].total, memory[0].free, memory[0].used = value.total, value.free, value.used


@_c("nvmlDeviceGetMemoryInfo_v2", _HANDLE, POINTER(pynvml.c_nvmlMemory_v2_t))
def _memory_info_v2(lib: SimulatedNVMLLibrary, h: int, memory: Any) -> None:
    value = fake_nvml.nvmlDeviceGetMemoryInfo(lib._gpu(h))
    _check_out(memory)
    if memory[0].version != pynvml.nvmlMemory_v2:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    m = memory[0]
    m.total, m.reserved, m.free, m.used = value.total, 0, value.free, value.used


@_c("nvmlDeviceGetC2cModeInfoV", _HANDLE, POINTER(pynvml.c_nvmlC2cModeInfo_v1_t))
def _c2c_mode(lib: SimulatedNVMLLibrary, h: int, info: Any) -> None:
    value = fake_nvml.nvmlDeviceGetC2cModeInfoV(lib._gpu(h))
    _check_out(info)
    info[0].isC2cEnabled = int(value.isC2cEnabled)


# -- energy and power -----------------------------------------------------------------------------
@_c("nvmlDeviceGetTotalEnergyConsumption", _HANDLE, POINTER(c_uint64))
def _total_energy(lib: SimulatedNVMLLibrary, h: int, energy: Any) -> None:
    """Registers the prototype; the library's own `_energy_function` answers (the hot path)."""
    raise NotImplementedError


@_c("nvmlDeviceGetFieldValues", _HANDLE, c_int32, c_void_p)
def _field_values(lib: SimulatedNVMLLibrary, h: int, count: int, values: int | None) -> None:
    """`values` is an array of `count` `nvmlFieldValue_t` whose `fieldId` and `scopeId` the caller set."""
    gpu = lib._gpu(h)
    if count <= 0 or not values:
        fake_nvml.nvmlDeviceGetName(gpu)  # a bad handle or uninitialised library answers first
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    array = (pynvml.c_nvmlFieldValue_t * count).from_address(values)
    answered = fake_nvml.nvmlDeviceGetFieldValues(gpu, [(v.fieldId, v.scopeId) for v in array])
    ctypes.memmove(values, answered, ctypes.sizeof(array))


@_c("nvmlDeviceGetPowerManagementLimitConstraints", _HANDLE, _UINT, _UINT)
def _limit_constraints(lib: SimulatedNVMLLibrary, h: int, low: Any, high: Any) -> None:
    lo, hi = fake_nvml.nvmlDeviceGetPowerManagementLimitConstraints(lib._gpu(h))
    _check_out(low, high)
    low[0], high[0] = lo, hi


@_c("nvmlDeviceSetPowerManagementLimit_v2", _HANDLE, POINTER(pynvml.c_nvmlPowerValue_v2_t))
def _set_limit_v2(lib: SimulatedNVMLLibrary, h: int, value: Any) -> None:
    """nvml.h declares `powerScope` an `unsigned char` followed by padding, nvidia-ml-py a `c_uint`: only the
    scope's byte is read. (nvidia-ml-py 13.615's wrapper drops this function's return code.)"""
    if not value:
        fake_nvml.nvmlDeviceGetName(lib._gpu(h))  # a bad handle or uninitialised library answers first
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    v = value[0]
    fake_nvml.nvmlDeviceSetPowerManagementLimit_v2(
        lib._gpu(h), v.powerScope & 0xFF, v.powerValueMw, v.version
    )


# -- clocks ---------------------------------------------------------------------------------------
@_c("nvmlDeviceGetSupportedMemoryClocks", _HANDLE, _UINT, _UINT)
def _memory_clocks(lib: SimulatedNVMLLibrary, h: int, count: Any, clocks: Any) -> int | None:
    return _put_uints(fake_nvml.nvmlDeviceGetSupportedMemoryClocks(lib._gpu(h)), count, clocks)


@_c("nvmlDeviceGetSupportedGraphicsClocks", _HANDLE, c_uint, _UINT, _UINT)
def _graphics_clocks(
    lib: SimulatedNVMLLibrary, h: int, memory_mhz: int, count: Any, clocks: Any
) -> int | None:
    values = fake_nvml.nvmlDeviceGetSupportedGraphicsClocks(lib._gpu(h), memory_mhz)
    return _put_uints(values, count, clocks)


@_c("nvmlDeviceGetTemperatureV", _HANDLE, POINTER(pynvml.c_nvmlTemperature_v1_t))
def _temperature_v(lib: SimulatedNVMLLibrary, h: int, reading: Any) -> None:
    gpu = lib._gpu(h)
    _check_out(reading)
    if reading[0].version != pynvml.nvmlTemperature_v1:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    reading[0].temperature = fake_nvml.nvmlDeviceGetTemperature(gpu, reading[0].sensorType)


# Functions of one `unsigned int` answer, or none (setters); the inputs after the handle are `unsigned int`
# (the enums `nvmlClockType_t`, `nvmlTemperatureSensors_t` and `nvmlEnableState_t` included).
for _function, _inputs in {
    "nvmlDeviceGetIndex": 0,
    "nvmlDeviceGetArchitecture": 0,
    "nvmlDeviceGetPowerUsage": 0,
    "nvmlDeviceGetPowerManagementDefaultLimit": 0,
    "nvmlDeviceGetPowerManagementLimit": 0,
    "nvmlDeviceGetEnforcedPowerLimit": 0,
    "nvmlDeviceGetPersistenceMode": 0,
    "nvmlDeviceGetMaxClockInfo": 1,
    "nvmlDeviceGetClockInfo": 1,
    "nvmlDeviceGetTemperature": 1,
}.items():
    _uint_out(_function, *[c_uint] * _inputs)
for _function, _inputs in {
    "nvmlDeviceSetPowerManagementLimit": 1,
    "nvmlDeviceSetPersistenceMode": 1,
    "nvmlDeviceSetGpuLockedClocks": 2,
    "nvmlDeviceResetGpuLockedClocks": 0,
    "nvmlDeviceSetMemoryLockedClocks": 2,
    "nvmlDeviceResetMemoryLockedClocks": 0,
}.items():
    _no_out(_function, *[c_uint] * _inputs)


# -- installing the library beneath pynvml ---------------------------------------------------------
_installed: SimulatedNVMLLibrary | None = None
_saved: tuple[Any, int] | None = None  # pynvml's library and init count before the simulation


def _require_nvidia_ml_py() -> None:
    if not hasattr(pynvml, "_nvmlGetFunctionPointer_cache") or not hasattr(pynvml, "nvmlLib"):
        raise RuntimeError(
            f"The `pynvml` module at {getattr(pynvml, '__file__', '?')} is not nvidia-ml-py's, which the "
            "simulator answers beneath: run `pip uninstall pynvml && pip install nvidia-ml-py`."
        )


def attach(system: SimulatedSystem | None, withheld: frozenset[str] = frozenset()) -> None:
    """Make `system` the node that `fake_nvml` answers for and install it beneath pynvml as the NVML
    library (None: detach and give pynvml back the library it had, normally none).

    Raises:
        RuntimeError: the `pynvml` module is not nvidia-ml-py's (the unofficial `pynvml` package).
    """
    global _installed, _saved
    if system is not None:
        _require_nvidia_ml_py()
    fake_nvml.attach(system)
    with pynvml.libLoadLock:
        if system is None:
            if _installed is not None and _saved is not None:
                pynvml.nvmlLib, pynvml._nvmlLib_refcount = _saved
            _installed = _saved = None
        else:
            if _installed is None:
                _saved = (pynvml.nvmlLib, pynvml._nvmlLib_refcount)
            _installed = SimulatedNVMLLibrary(system, withheld)
            pynvml.nvmlLib, pynvml._nvmlLib_refcount = _installed, 0
        pynvml._nvmlGetFunctionPointer_cache.clear()
    logger.debug("NVML library beneath pynvml: %r.", pynvml.nvmlLib)


def ensure(system: SimulatedSystem) -> SimulatedNVMLLibrary:
    """The installed library for `system`, attaching `system` first when another (or none) is installed."""
    if _installed is None or _installed.system is not system or pynvml.nvmlLib is not _installed:
        attach(system)
    assert _installed is not None  # attach(system) installed it
    return _installed


def installed() -> SimulatedNVMLLibrary | None:
    """The simulated library installed beneath pynvml, None when pynvml reaches the real driver."""
    return _installed if pynvml.nvmlLib is _installed else None


def simulated_gpu(handle: Any) -> SimulatedGPU:
    """The simulated GPU behind a pynvml handle (`c_nvmlDevice_t`) that the installed library handed out, or
    behind a device layer's `GPU` or `NVIDIADevice` (whose handle it is).

    Raises:
        ValueError: no simulated library is installed, or it did not hand out `handle`.
    """
    handle = getattr(getattr(handle, "device", handle), "handle", handle)
    library = installed()
    gpu = None if library is None else library.gpu_at(ctypes.cast(handle, c_void_p).value)
    if gpu is None:
        raise ValueError(
            f"{handle!r} is not a handle of the simulated GPUs now beneath pynvml; take handles from "
            "pynvml after `zeus_callbacks.sim.simulate(...)` and while it is active."
        )
    return gpu
