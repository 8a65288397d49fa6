"""Simulated AMD GPUs at amdsmi's C boundary: a stand-in for `libamd_smi.so` beneath the real `amdsmi` package.

The PyPI `amdsmi` package is a ctypes wrapper: at import, `amdsmi/amdsmi_wrapper.py` calls `find_smi_library()`
(7.0.2: lines 185-205), which tries `ctypes.CDLL(...)` on `libamd_smi.so` in a few places, then binds every C
function as an attribute of the loaded library and sets its `restype` and `argtypes` (lines 211-213 and
2438-3058: 184 functions). `amdsmi/amdsmi_interface.py` is the Python API over them (units, dicts, the
two-call size protocols), raising `AmdSmiLibraryException(status)` for any status but success (`_check_res`,
lines 679-698). `SimulatedAMDSMILibrary` offers exactly that surface: each attribute is a C function pointer
(`ctypes.CFUNCTYPE`) whose prototype has the ABI of the wrapper's declaration (pointers as `void *`, enums as
`uint32_t`), answering from the simulated node's GPUs (`sim/gpu.py`) and AMD facts (`sim/amd_specs.py`).

The wrapper binds at import, so the package reaches whatever library `ctypes.CDLL` returned then:
`sim/amd_backend.py` imports `amdsmi` over this library while a simulated AMD node is attached (and says how).
Why ctypes callbacks rather than a C library: as `sim/nvml_library.py` says, the GPUs' state lives in this
process.

Functions: those listed in `offered_functions()` are modelled; every other `amdsmi_*` symbol answers
`AMDSMI_STATUS_NOT_SUPPORTED` (amdsmi.h: "Feature not supported"), as a board without the feature does; a name
in `withheld` is absent as from an older `libamd_smi.so`, so `CDLL`'s `AttributeError` ("undefined symbol")
stops the wrapper's import, as it does with a mismatched real library.
"""

from __future__ import annotations

import ctypes
import itertools
from ctypes import CFUNCTYPE, c_float, c_int64, c_uint32, c_uint64, c_void_p
from importlib import metadata
from types import ModuleType
from typing import Any

from zeus_callbacks.sim.amd_specs import amd_facts
from zeus_callbacks.sim.c_library import CallbackLibrary, CFunctions
from zeus_callbacks.sim.gpu import SimulatedGPU

__all__ = ["SimulatedAMDSMILibrary", "AMDSMIStatus", "offered_functions", "amd_uuid", "LIBRARY_NAME"]

LIBRARY_NAME = "libamd_smi.so"

# amdsmi_status_t (amdsmi_wrapper.py lines 289-382).
SUCCESS, INVAL, NOT_SUPPORTED, NO_PERM = 0, 1, 2, 10
INPUT_OUT_OF_BOUNDS, NOT_FOUND, NOT_INIT, DRIVER_NOT_LOADED, INSUFFICIENT_SIZE = 17, 31, 32, 34, 41
UNKNOWN_ERROR = 0xFFFFFFFF
# Enums the functions read (amdsmi_wrapper.py): AMDSMI_CLK_TYPE_SYS/GFX = 0, MEM = 4 (lines 401-407);
# AMDSMI_DEV_PERF_LEVEL_AUTO = 0, MANUAL = 3 (1430-1434); AMDSMI_MEM_TYPE_VRAM = 0 (1808); CLK_LIMIT_MIN/MAX
# (1728-1729); AMDSMI_TEMPERATURE_TYPE_EDGE/HOTSPOT (546-549); AMDSMI_PROCESSOR_TYPE_AMD_GPU = 1 (280).
_CLK_GFX, _CLK_MEM, _PERF_AUTO, _PERF_MANUAL, _MEM_VRAM, _AMD_GPU = 0, 4, 0, 3, 0, 1
_UUID_SIZE = 38  # AMDSMI_GPU_UUID_SIZE (amdsmi_interface.py line 84)
_NONE_32 = 0xFFFF  # what amd_smi.cc leaves in a power field it cannot read; the interface turns it to "N/A"

_HANDLE_BASE = 0xA3D0_0000_0000
_library_numbers = itertools.count(1)
_P = c_void_p  # every pointer (handles, out-parameters, structures): the same as `T *` in the ABI


class AMDSMIStatus(Exception):
    """A non-success `amdsmi_status_t` raised by a modelled function; the C side returns `.code`."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


_FUNCTIONS = CFunctions(c_uint32, SUCCESS, UNKNOWN_ERROR, AMDSMIStatus, lambda e: e.code)
_c = _FUNCTIONS.register


def offered_functions() -> frozenset[str]:
    """The C functions the simulated library models (any other `amdsmi_*` answers NOT_SUPPORTED)."""
    return frozenset(_FUNCTIONS.table)


class SimulatedAMDSMILibrary(CallbackLibrary):
    """The simulated node as `libamd_smi.so`: one C function pointer per amdsmi function.

    Args:
        withheld: C function names to leave out, as an older library lacks them.
    """

    def __init__(self, withheld: frozenset[str] = frozenset()) -> None:
        self.system: Any = None  # the attached SimulatedSystem (None: answers as a host without amdgpu)
        self.wrapper: ModuleType | None = None  # amdsmi_wrapper, for its structures (set once imported)
        self._initialized = 0
        base = _HANDLE_BASE + next(_library_numbers) * 0x1_0000_0000
        self._base = base
        self._texts: dict[int, Any] = {}
        super().__init__(_FUNCTIONS, withheld)

    def __repr__(self) -> str:
        spec = None if self.system is None else self.system.spec
        return f"SimulatedAMDSMILibrary(spec={spec!r}, simulated=True)"

    def __getattr__(self, name: str) -> Any:
        """A function not modelled: NOT_SUPPORTED for any arguments (the caller passes them, this one reads
        none, which the C calling conventions allow); a withheld or non-amdsmi name: CDLL's AttributeError."""
        if name.startswith("_") or name in self.withheld or not name.startswith("amdsmi_"):
            raise AttributeError(f"{LIBRARY_NAME}: undefined symbol: {name}")
        stub = CFUNCTYPE(c_uint32)(lambda: NOT_SUPPORTED)
        setattr(self, name, stub)
        return stub

    # -- handles ----------------------------------------------------------------------------------
    def handle(self, gpu: SimulatedGPU) -> int:
        """The processor handle (a fake, never dereferenced address) of `gpu`; its socket's is one above."""
        return self._base + 0x100 * (gpu.index + 1)

    def gpu(self, handle: int | None, *, setter: bool = False, feature: str | None = None) -> SimulatedGPU:
        """The GPU behind a processor handle, or the status the real library answers."""
        if not self._initialized:
            raise AMDSMIStatus(NOT_INIT)
        index = ((handle or 0) - self._base) // 0x100 - 1
        if (handle or 0) - self._base != 0x100 * (index + 1) or not 0 <= index < len(self.system.gpus):
            raise AMDSMIStatus(INVAL)
        g = self.system.gpus[index]
        if g.count_call():  # fell off the bus: amdgpu's files are gone, so the device is not found
            raise AMDSMIStatus(NOT_FOUND)
        if feature is not None and feature in g.faults.not_supported:
            raise AMDSMIStatus(NOT_SUPPORTED)
        if setter and (g.faults.no_permission or g.faults.no_cap_sys_admin):
            raise AMDSMIStatus(NO_PERM)  # amdgpu's sysfs setters need root
        return g

    def struct(self, name: str, address: int | None) -> Any:
        """The wrapper's structure `name` at `address` (INVAL for a null pointer, as amdsmi answers)."""
        if not address:
            raise AMDSMIStatus(INVAL)
        return getattr(self.wrapper, name).from_address(address)

    def text(self, value: str) -> int:
        """The address of a static C string holding `value` (kept for the library's lifetime)."""
        buffer = self._texts.get(hash(value))
        if buffer is None:
            buffer = self._texts[hash(value)] = ctypes.create_string_buffer(value.encode())
        return ctypes.addressof(buffer)


# -- helpers of the C side ------------------------------------------------------------------------
def _out(address: int | None, kind: Any) -> Any:
    if not address:
        raise AMDSMIStatus(INVAL)
    return ctypes.cast(address, ctypes.POINTER(kind))


def _put_string(text: str, address: int | None, length: int) -> None:
    data = text.encode() + b"\0"
    if not address:
        raise AMDSMIStatus(INVAL)
    if len(data) > length:
        raise AMDSMIStatus(INSUFFICIENT_SIZE)
    ctypes.memmove(address, data, len(data))


def _fill_handles(addresses: list[int], count: int | None, array: int | None) -> None:
    """amdsmi's two-call protocol: with a null array, the count; else the handles (at most `*count`)."""
    n = _out(count, c_uint32)
    if array:
        if n[0] < len(addresses):
            n[0] = len(addresses)
            raise AMDSMIStatus(INSUFFICIENT_SIZE)
        out = ctypes.cast(array, ctypes.POINTER(c_void_p))
        for i, address in enumerate(addresses):
            out[i] = address
    n[0] = len(addresses)


def amd_uuid(gpu: SimulatedGPU) -> str:
    """amdsmi's UUID of a board, built as amd-smi prints it ("<rev>ff<device id>-0000-1000-80<..>-<unique id>")
    from the HIP UUID `GPU-<16 hex of the unique id>` the simulated board carries."""
    unique = gpu.uuid.removeprefix("GPU-")
    device = amd_facts(gpu.spec.kind).device_id
    return f"00ff{device:04x}-0000-1000-80{unique[:2]}-{unique[4:16]}"


# -- library --------------------------------------------------------------------------------------
@_c("amdsmi_init", c_uint64)
def _init(lib: SimulatedAMDSMILibrary, flags: int) -> None:
    if lib.system is None:
        raise AMDSMIStatus(DRIVER_NOT_LOADED)  # no amdgpu driver beneath: nothing to initialise
    lib._initialized += 1


@_c("amdsmi_shut_down")
def _shut_down(lib: SimulatedAMDSMILibrary) -> None:
    if not lib._initialized:
        raise AMDSMIStatus(NOT_INIT)
    lib._initialized -= 1


@_c("amdsmi_get_lib_version", _P)
def _lib_version(lib: SimulatedAMDSMILibrary, version: int | None) -> None:
    """The installed amdsmi package's version (the library it stands in for), build "simulated"."""
    v = lib.struct("amdsmi_version_t", version)
    numbers = (metadata.version("amdsmi").split(".") + ["0", "0"])[:3]
    v.major, v.minor, v.release = (int(n) if n.isdigit() else 0 for n in numbers)
    v.build = ctypes.cast(lib.text("simulated"), ctypes.POINTER(ctypes.c_char))


@_c("amdsmi_status_code_to_string", c_uint32, _P)
def _status_text(lib: SimulatedAMDSMILibrary, status: int, out: int | None) -> None:
    names = lib.wrapper.amdsmi_status_t__enumvalues if lib.wrapper else {}
    _out(out, c_void_p)[0] = lib.text(names.get(status, "AMDSMI_STATUS_UNKNOWN_ERROR"))


@_c("amdsmi_get_socket_handles", _P, _P)
def _socket_handles(lib: SimulatedAMDSMILibrary, count: int | None, array: int | None) -> None:
    """One socket per GPU, as amdsmi groups a discrete GPU's partitions by its PCI device."""
    if not lib._initialized:
        raise AMDSMIStatus(NOT_INIT)
    _fill_handles([lib.handle(g) + 1 for g in lib.system.gpus], count, array)


@_c("amdsmi_get_processor_handles", _P, _P, _P)
def _processor_handles(
    lib: SimulatedAMDSMILibrary, socket: int | None, count: int | None, array: int | None
) -> None:
    gpu = lib.gpu((socket or 1) - 1)
    _fill_handles([lib.handle(gpu)], count, array)


@_c("amdsmi_get_processor_type", _P, _P)
def _processor_type(lib: SimulatedAMDSMILibrary, h: int | None, out: int | None) -> None:
    lib.gpu(h)
    _out(out, c_uint32)[0] = _AMD_GPU


# -- identity -------------------------------------------------------------------------------------
@_c("amdsmi_get_gpu_device_bdf", _P, _P)
def _bdf(lib: SimulatedAMDSMILibrary, h: int | None, out: int | None) -> None:
    """The union's `as_uint`: function in bits 0-2, device 3-7, bus 8-15, domain 16-63 (wrapper lines 902-932)."""
    g = lib.gpu(h)
    domain, bus, rest = g.pci_bus_id.split(":")
    device, function = rest.split(".")
    value = int(function, 16) | int(device, 16) << 3 | int(bus, 16) << 8 | int(domain, 16) << 16
    lib.struct("amdsmi_bdf_t", out).as_uint = value


@_c("amdsmi_get_gpu_device_uuid", _P, _P, _P)
def _uuid(lib: SimulatedAMDSMILibrary, h: int | None, length: int | None, buffer: int | None) -> None:
    g = lib.gpu(h)
    n = _out(length, c_uint32)
    if n[0] < _UUID_SIZE:
        n[0] = _UUID_SIZE
        raise AMDSMIStatus(INSUFFICIENT_SIZE)
    _put_string(amd_uuid(g), buffer, n[0])


@_c("amdsmi_get_gpu_enumeration_info", _P, _P)
def _enumeration(lib: SimulatedAMDSMILibrary, h: int | None, out: int | None) -> None:
    """HIP's index and UUID (amdsmi 6.4+): HIP numbers the GPUs the job may use in the node's order."""
    g = lib.gpu(h)
    info = lib.struct("amdsmi_enumeration_info_t", out)
    visible = [x for x in lib.system.gpus if not x.faults.hidden]
    info.drm_card, info.drm_render = g.index, 128 + g.index
    info.hsa_id = g.index + 1  # KFD node 0 is the CPU
    info.hip_id = visible.index(g) if g in visible else 0xFFFFFFFF
    info.hip_uuid = g.uuid.encode()


@_c("amdsmi_get_gpu_asic_info", _P, _P)
def _asic(lib: SimulatedAMDSMILibrary, h: int | None, out: int | None) -> None:
    g = lib.gpu(h)
    facts = amd_facts(g.spec.kind)
    info = lib.struct("amdsmi_asic_info_t", out)
    info.market_name = g.spec.name.encode()
    info.vendor_id, info.subvendor_id = 0x1002, 0x1002
    info.vendor_name = facts.vendor_name.encode()
    info.device_id, info.rev_id, info.subsystem_id = facts.device_id, 0, facts.device_id
    info.asic_serial = g.uuid.removeprefix("GPU-").upper().encode()
    info.oam_id, info.num_of_compute_units = g.index, facts.compute_units
    info.target_graphics_version = facts.gfx_version


@_c("amdsmi_get_gpu_driver_info", _P, _P)
def _driver(lib: SimulatedAMDSMILibrary, h: int | None, out: int | None) -> None:
    lib.gpu(h)
    info = lib.struct("amdsmi_driver_info_t", out)
    info.driver_name, info.driver_version = b"amdgpu", lib.system.driver_version.encode()


@_c("amdsmi_get_gpu_compute_partition", _P, _P, c_uint32)
def _compute_partition(lib: SimulatedAMDSMILibrary, h: int | None, buffer: int | None, length: int) -> None:
    """SPX (one partition) unless the `mig` fault stands for CPX (a GPU split into one partition per XCD)."""
    g = lib.gpu(h)
    _put_string("CPX" if g.faults.mig else amd_facts(g.spec.kind).compute_partition, buffer, length)


@_c("amdsmi_get_gpu_memory_total", _P, c_uint32, _P)
def _memory_total(lib: SimulatedAMDSMILibrary, h: int | None, kind: int, out: int | None) -> None:
    g = lib.gpu(h)
    if kind != _MEM_VRAM:
        raise AMDSMIStatus(NOT_SUPPORTED)
    _out(out, c_uint64)[0] = g.spec.memory_bytes


@_c("amdsmi_get_temp_metric", _P, c_uint32, c_uint32, _P)
def _temperature(
    lib: SimulatedAMDSMILibrary, h: int | None, sensor: int, metric: int, out: int | None
) -> None:
    """°C: amd_smi.cc divides ROCm SMI's millidegrees by 1000. The dump's idle junction temperature, constant."""
    g = lib.gpu(h)
    if metric != 0 or sensor > 2:  # AMDSMI_TEMP_CURRENT of the edge, junction (hotspot) and memory sensors
        raise AMDSMIStatus(NOT_SUPPORTED)
    _out(out, c_int64)[0] = amd_facts(g.spec.kind).junction_c


# -- energy and power -----------------------------------------------------------------------------
@_c("amdsmi_get_energy_count", _P, _P, _P, _P)
def _energy(
    lib: SimulatedAMDSMILibrary, h: int | None, acc: int | None, res: int | None, ts: int | None
) -> None:
    """The accumulator in ticks of `counter_resolution` µJ, refreshed as the board's counter (`energy_mj`),
    and a timestamp in ns (amdsmi.h)."""
    g = lib.gpu(h)
    if g.faults.no_energy_counter:
        raise AMDSMIStatus(NOT_SUPPORTED)
    resolution = amd_facts(g.spec.kind).energy_resolution_uj
    _out(acc, c_uint64)[0] = int(g.energy_mj() * g.sensor_gain * 1000 / resolution)
    _out(res, c_float)[0] = resolution
    _out(ts, c_uint64)[0] = int(g.now() * 1e9)


@_c("amdsmi_get_power_info", _P, _P)
def _power(lib: SimulatedAMDSMILibrary, h: int | None, out: int | None) -> None:
    """Watts. amdsmi.h: `current_socket_power` on MI300 and newer, `average_socket_power` on Navi and MI200 and
    older; the other is left 0xFFFF (amd_smi.cc), which the interface turns to "N/A"."""
    g = lib.gpu(h, feature="power_draw")
    info = lib.struct("amdsmi_power_info_t", out)
    watts = round(g.power_mw() * g.sensor_gain / 1000)
    info.socket_power = info.current_socket_power = watts
    info.average_socket_power = _NONE_32
    info.gfx_voltage = info.soc_voltage = info.mem_voltage = _NONE_32
    info.power_limit = g.power_limit_mw // 1000


@_c("amdsmi_get_power_cap_info", _P, c_uint32, _P)
def _power_cap(lib: SimulatedAMDSMILibrary, h: int | None, sensor: int, out: int | None) -> None:
    """µW (amdsmi_interface.py 2112-2131; Zeus's amd.py divides by 1000 for mW). Sensor 0 only."""
    g = lib.gpu(h, feature="power")
    if sensor != 0:
        raise AMDSMIStatus(NOT_SUPPORTED)
    info = lib.struct("amdsmi_power_cap_info_t", out)
    info.power_cap, info.default_power_cap = g.power_limit_mw * 1000, g.default_power_limit_mw * 1000
    info.min_power_cap, info.max_power_cap = g.min_power_limit_mw * 1000, g.max_power_limit_mw * 1000
    info.dpm_cap = g.max_power_limit_mw * 1000


@_c("amdsmi_set_power_cap", _P, c_uint32, c_uint64)
def _set_power_cap(lib: SimulatedAMDSMILibrary, h: int | None, sensor: int, cap_uw: int) -> None:
    """µW; a cap outside [min, max] is AMDSMI_STATUS_INVAL (rocm-smi: "Value cannot be less than: ...")."""
    g = lib.gpu(h, feature="power", setter=True)
    if sensor != 0:
        raise AMDSMIStatus(NOT_SUPPORTED)
    if not g.min_power_limit_mw * 1000 <= cap_uw <= g.max_power_limit_mw * 1000:
        raise AMDSMIStatus(INVAL)
    g.set_power_limit_mw(cap_uw // 1000)


# -- clocks ---------------------------------------------------------------------------------------
def _sclk_range(g: SimulatedGPU) -> tuple[int, int]:
    """The locked range, else the settable one (`OD_SCLK`'s levels: the spec's lowest and highest clock)."""
    return g.locked_sm_clocks_mhz or (g.spec.min_sm_clock_mhz, g.spec.max_sm_clock_mhz)


def _sclk_now(g: SimulatedGPU) -> int:
    rel, _ = g.operating_point()
    lo, hi = _sclk_range(g)
    return max(lo, min(hi, int(g.spec.max_sm_clock_mhz / rel)))


@_c("amdsmi_get_clock_info", _P, c_uint32, _P)
def _clock_info(lib: SimulatedAMDSMILibrary, h: int | None, kind: int, out: int | None) -> None:
    """MHz: the clock now and the range it may move in (the locked range, else the DPM range)."""
    g = lib.gpu(h, feature="clock_info")
    info = lib.struct("amdsmi_clk_info_t", out)
    if kind == _CLK_GFX:
        info.clk, (info.min_clk, info.max_clk) = _sclk_now(g), _sclk_range(g)
        info.clk_locked = int(g.locked_sm_clocks_mhz is not None)
    elif kind == _CLK_MEM:
        levels = amd_facts(g.spec.kind).mclk_levels_mhz
        info.clk, info.min_clk, info.max_clk, info.clk_locked = levels[0], levels[0], levels[-1], 0
    else:
        raise AMDSMIStatus(NOT_SUPPORTED)
    info.clk_deep_sleep = 0


@_c("amdsmi_get_clk_freq", _P, c_uint32, _P)
def _clk_freq(lib: SimulatedAMDSMILibrary, h: int | None, kind: int, out: int | None) -> None:
    """The DPM levels in Hz, lowest first, `current` the level in force (rocm-smi's `*`): graphics shows its
    settable range's two ends with the clock now between them (MI300X_x4.rocm-smi-a.txt: 500, 142*, 2100)."""
    g = lib.gpu(h, feature="clocks")
    freq = lib.struct("amdsmi_frequencies_t", out)
    if kind == _CLK_GFX:
        lo, hi = _sclk_range(g)
        now = _sclk_now(g)
        levels = [lo, now, hi] if lo < now < hi else [lo, hi]
        current = levels.index(now) if now in levels else 0
    elif kind == _CLK_MEM:
        levels, current = list(amd_facts(g.spec.kind).mclk_levels_mhz), 0
    else:
        raise AMDSMIStatus(NOT_SUPPORTED)
    freq.has_deep_sleep, freq.num_supported, freq.current = False, len(levels), current
    for i, mhz in enumerate(levels):
        freq.frequency[i] = mhz * 1_000_000


@_c("amdsmi_set_gpu_clk_range", _P, c_uint64, c_uint64, c_uint32)
def _set_clk_range(lib: SimulatedAMDSMILibrary, h: int | None, lo: int, hi: int, kind: int) -> None:
    """MHz, within the OD range (`OD_SCLK`); the performance level becomes manual, as ROCm SMI sets it."""
    g = lib.gpu(h, feature="clocks", setter=True)
    facts = amd_facts(g.spec.kind)
    if kind == _CLK_MEM:
        if not facts.mclk_levels_mhz[0] <= lo <= hi <= facts.mclk_levels_mhz[-1]:
            raise AMDSMIStatus(INVAL)
        g.set_memory_clocks_locked(True)
        return
    if kind != _CLK_GFX:
        raise AMDSMIStatus(NOT_SUPPORTED)
    if not g.spec.min_sm_clock_mhz <= lo < hi <= g.spec.max_sm_clock_mhz:
        raise AMDSMIStatus(INVAL)
    g.lock_sm_clocks(int(lo), int(hi))


@_c("amdsmi_set_gpu_clk_limit", _P, c_uint32, c_uint32, c_uint64)
def _set_clk_limit(lib: SimulatedAMDSMILibrary, h: int | None, kind: int, limit: int, mhz: int) -> None:
    """One end (CLK_LIMIT_MIN 0, MAX 1) of a clock's range in MHz, as zeusd master sets clocks
    (`zeusd/src/devices/gpu/amdsmi/mod.rs` 766-799); an end that would cross the other is INVAL (zeusd orders its
    two writes so that they never cross: `clk_write_order`, 613-619)."""
    g = lib.gpu(h, feature="clocks", setter=True)
    if kind == _CLK_MEM:
        levels = amd_facts(g.spec.kind).mclk_levels_mhz
        if not levels[0] <= mhz <= levels[-1]:
            raise AMDSMIStatus(INVAL)
        g.set_memory_clocks_locked(True)
        return
    if kind != _CLK_GFX or limit not in (0, 1):
        raise AMDSMIStatus(NOT_SUPPORTED if kind != _CLK_GFX else INVAL)
    lo, hi = (int(mhz), _sclk_range(g)[1]) if limit == 0 else (_sclk_range(g)[0], int(mhz))
    if not g.spec.min_sm_clock_mhz <= lo <= hi <= g.spec.max_sm_clock_mhz:
        raise AMDSMIStatus(INVAL)
    if lo == hi:  # amdgpu's commit refuses min >= max (smu_v13_0_6_set_soft_freq_limited_range, -EINVAL),
        raise AMDSMIStatus(NOT_SUPPORTED)  # a failed pp_od_clk_voltage write: rocm_smi_device.cc 880-890
    g.lock_sm_clocks(lo, hi)


@_c("amdsmi_set_gpu_perf_determinism_mode", _P, c_uint64)
def _set_determinism(lib: SimulatedAMDSMILibrary, h: int | None, mhz: int) -> None:
    """Performance determinism at `mhz`: the graphics clock held at that soft max (amdsmi.h), the soft min back
    at the lowest level (smu_v13_0_6_set_soft_freq_limited_range); a clock outside the levels is refused by
    amdgpu ("Invalid max frequency"), which amdsmi answers NOT_SUPPORTED (rocm_smi_device.cc 880-890)."""
    g = lib.gpu(h, feature="clocks", setter=True)
    if not g.spec.min_sm_clock_mhz <= mhz <= g.spec.max_sm_clock_mhz:
        raise AMDSMIStatus(NOT_SUPPORTED)
    g.lock_sm_clocks(g.spec.min_sm_clock_mhz, int(mhz))


@_c("amdsmi_get_gpu_perf_level", _P, _P)
def _perf_level(lib: SimulatedAMDSMILibrary, h: int | None, out: int | None) -> None:
    g = lib.gpu(h)
    locked = g.locked_sm_clocks_mhz is not None or g.memory_clocks_locked
    _out(out, c_uint32)[0] = _PERF_MANUAL if locked else _PERF_AUTO


@_c("amdsmi_set_gpu_perf_level", _P, c_uint32)
def _set_perf_level(lib: SimulatedAMDSMILibrary, h: int | None, level: int) -> None:
    """AUTO hands every clock back to the driver (Zeus's amd.py resets clocks so); other levels are refused."""
    g = lib.gpu(h, feature="clocks", setter=True)
    if level != _PERF_AUTO:
        raise AMDSMIStatus(NOT_SUPPORTED)
    if g.locked_sm_clocks_mhz is not None:
        g.reset_sm_clocks()
    g.set_memory_clocks_locked(False)
