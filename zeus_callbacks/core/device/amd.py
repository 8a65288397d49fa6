"""AMD GPUs through the `amdsmi` Python package: the only module that calls amdsmi.

amdsmi (PyPI `amdsmi`, AMD's ctypes bindings of `libamd_smi.so`) is imported lazily, when discovery looks for
AMD GPUs: `import zeus_callbacks` never imports it. Units, from `amdsmi/amdsmi_interface.py` (7.0.2) and the C
library they wrap: the energy accumulator counts ticks of `counter_resolution` µJ (`amdsmi_get_energy_count`);
power is in W (`amdsmi_get_power_info`: `current_socket_power` on MI300 and newer, `average_socket_power` on
older boards, the other "N/A"); power caps are in µW (`amdsmi_get_power_cap_info`, `amdsmi_set_power_cap`);
clocks in MHz (`amdsmi_get_clock_info`, `amdsmi_set_gpu_clk_range`,
`amdsmi_set_gpu_perf_determinism_mode`) and the DPM levels in Hz
(`amdsmi_get_clk_freq`); temperatures in °C (amd_smi.cc divides ROCm SMI's millidegrees by 1000). Zeus's
`zeus/device/gpu/amd.py` makes the same calls with the same conversions (there, `get_gpu_temperature` divides by
1000 once more). The simulator answers beneath the real package (`zeus_callbacks.sim.amdsmi_library`).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from zeus_callbacks.core.device.backend import Backend, cuda_visible_positions
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.core.device.errors import (
    GPUError,
    GPULostError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    MIGNotSupportedError,
    NVMLUnavailableError,
)

__all__ = ["AMDDevice", "AMDBackend", "real_backend", "load_amdsmi", "amd_error", "hip_visible_positions"]

logger = logging.getLogger(__name__)

# amdsmi_get_gpu_asic_info's `target_graphics_version` -> AMD's architecture (LLVM's AMDGPU processor table).
ARCHITECTURES = {
    "gfx908": "cdna",  # MI100
    "gfx90a": "cdna2",  # MI200
    "gfx940": "cdna3",
    "gfx941": "cdna3",
    "gfx942": "cdna3",  # MI300
    "gfx950": "cdna4",  # MI350
}
SM_CLOCK_STEP_MHZ = 100
"""amdsmi_set_gpu_clk_range takes any MHz within the range amdsmi_get_clock_info gives; the clock list offered to
the pipeline optimizer is that range in these steps, highest first."""
_PERMISSION = (
    "Changing power caps and clocks on AMD GPUs writes amdgpu's sysfs files, which needs root: run as root, or "
    "through Zeus's daemon zeusd built with AMD support (zeusd master; set ZEUSD_SOCK_PATH or ZEUSD_HOST_PORT); "
    "measuring still works."
)


def load_amdsmi() -> ModuleType:
    """The `amdsmi` package, imported quietly (it prints to stdout when `libamd_smi.so` is missing).

    Raises:
        ImportError: the package is absent, or its shared library does not load.
    """
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return importlib.import_module("amdsmi")
    except ImportError:
        raise
    except (KeyError, OSError, AttributeError) as e:  # 7.0.2: KeyError 'libamd_smi.so' without the library
        raise ImportError(f"amdsmi is installed but libamd_smi.so does not load ({e!r})") from None


def amd_error(amdsmi: ModuleType, err: Exception, what: str, gpu: str) -> GPUError:
    """This package's exception for an amdsmi exception, with a message that says what to do.

    Codes (amdsmi_wrapper.py's `amdsmi_status_t`): NO_PERM (10) -> GPUNoPermissionError; NOT_SUPPORTED (2),
    NOT_YET_IMPLEMENTED (3), SETTING_UNAVAILABLE (55) -> GPUNotSupportedError; NOT_FOUND (31),
    AMDGPU_RESTART_ERR (54), FILE_ERROR (14) -> GPULostError; NOT_INIT (32), DRIVER_NOT_LOADED (34),
    FAIL_LOAD_MODULE (4), INIT_ERROR (18) -> NVMLUnavailableError (no library or driver); others GPUError.
    """
    w = amdsmi.amdsmi_wrapper
    code = err.get_error_code() if isinstance(err, amdsmi.AmdSmiLibraryException) else None
    text = err.get_error_info() if isinstance(err, amdsmi.AmdSmiLibraryException) else str(err)
    if code == w.AMDSMI_STATUS_NO_PERM:
        return GPUNoPermissionError(f"{what} on {gpu}: no permission ({text}). {_PERMISSION}")
    if code in (
        w.AMDSMI_STATUS_NOT_SUPPORTED,
        w.AMDSMI_STATUS_NOT_YET_IMPLEMENTED,
        w.AMDSMI_STATUS_SETTING_UNAVAILABLE,
    ):
        return GPUNotSupportedError(f"{what} is not supported on {gpu} by this GPU or driver ({text}).")
    if code in (w.AMDSMI_STATUS_NOT_FOUND, w.AMDSMI_STATUS_AMDGPU_RESTART_ERR, w.AMDSMI_STATUS_FILE_ERROR):
        return GPULostError(
            f"{what} on {gpu}: the GPU does not answer ({text}); it may have fallen off the bus or need a reset. "
            "Check `amd-smi list` and the kernel log; the settings changed by this process are restored when it is back."
        )
    lost_library = (w.AMDSMI_STATUS_NOT_INIT, w.AMDSMI_STATUS_DRIVER_NOT_LOADED, w.AMDSMI_STATUS_INIT_ERROR)
    if code in (*lost_library, w.AMDSMI_STATUS_FAIL_LOAD_MODULE):
        return NVMLUnavailableError(
            f"{what}: amdsmi cannot reach the amdgpu driver ({text}). Load amdgpu (ROCm)."
        )
    return GPUError(f"{what} on {gpu} failed: {text}")


class AMDDevice(Device):
    """One AMD GPU through amdsmi, in this package's units (mW, mJ, MHz).

    Args:
        amdsmi: The `amdsmi` module.
        handle: Its amdsmi processor handle.
        vendor_index: Its place in amdsmi's processor order.
        hip_index: Its HIP index (for the label).
        simulated: Whether it is a simulated GPU (for the label).
    """

    vendor = "amd"

    def __init__(
        self, amdsmi: ModuleType, handle: Any, vendor_index: int, hip_index: int, simulated: bool = False
    ):
        self.amdsmi, self.handle, self.vendor_index = amdsmi, handle, vendor_index
        where = f"HIP device {hip_index} (amdsmi processor {vendor_index})"
        try:
            asic = amdsmi.amdsmi_get_gpu_asic_info(handle)
            self.uuid: str = _hip_uuid(amdsmi, handle, asic)
        except amdsmi.AmdSmiException as e:
            raise amd_error(amdsmi, e, "Opening the GPU", where) from None
        self.name: str = asic["market_name"]
        self.architecture = ARCHITECTURES.get(asic["target_graphics_version"])
        self.label = f"GPU {hip_index} ({self.name}{', simulated' if simulated else ''})"
        self.supports_energy_counter = self._answers(amdsmi.amdsmi_get_energy_count)
        readings = self.power_domains_mw(["device_instant"])
        # MI300 and newer report the current socket power (amdsmi.h); older boards an average over a window
        # amdsmi does not state, which is not the one-second average "device_average" names: unknown (None).
        self.power_usage_domain = "device_instant" if readings and readings[0] is not None else None
        self.supports_power_reading = self.supports_energy_counter or readings is not None

    def _answers(self, fn: Callable[[Any], Any]) -> bool:
        try:
            fn(self.handle)
        except self.amdsmi.AmdSmiLibraryException as e:
            return e.get_error_code() != self.amdsmi.amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED
        return True

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self.handle, *args)
        except self.amdsmi.AmdSmiException as e:
            raise amd_error(self.amdsmi, e, what, self.label) from None

    # -- identity -----------------------------------------------------------------------------
    def pci_bus_id(self) -> str:
        """amdsmi_get_gpu_device_bdf ("0000:26:00.0")."""
        return self._call("Reading the PCI bus id", self.amdsmi.amdsmi_get_gpu_device_bdf)

    def mig_enabled(self) -> bool:
        """Whether the GPU is split into compute partitions (any mode but SPX, which is one partition): each
        partition is a HIP device of its own while power and energy are the whole socket's, so no partition's
        energy can be measured on its own. Refused, as NVIDIA's MIG is."""
        try:
            mode = self.amdsmi.amdsmi_get_gpu_compute_partition(self.handle)
        except self.amdsmi.AmdSmiLibraryException:
            return False  # boards without partitions answer NOT_SUPPORTED
        return mode not in ("", "SPX", "N/A")

    # -- measurement --------------------------------------------------------------------------
    def energy_mj(self) -> int:
        """amdsmi_get_energy_count: `energy_accumulator` x `counter_resolution` (µJ), in mJ."""
        return _energy_mj(self._call("Reading the energy counter", self.amdsmi.amdsmi_get_energy_count))

    def energy_reader(self) -> Callable[[], int]:
        """`energy_mj` with the function and handle bound once."""
        amdsmi, read, handle, label = (
            self.amdsmi,
            self.amdsmi.amdsmi_get_energy_count,
            self.handle,
            self.label,
        )

        def read_counter() -> int:
            try:
                e = read(handle)
            except amdsmi.AmdSmiException as err:
                raise amd_error(amdsmi, err, "Reading the energy counter", label) from None
            return _energy_mj(e)

        return read_counter

    def _socket_power_mw(self, first: str, second: str) -> int:
        info = self._call("Reading power", self.amdsmi.amdsmi_get_power_info)
        for key in (first, second):
            if isinstance(info[key], int):  # the interface gives "N/A" for a field the board leaves unset
                return info[key] * 1000
        raise GPUNotSupportedError(
            f"Reading power is not supported on {self.label}: amdsmi reports no socket power."
        )

    def power_mw(self) -> int:
        """The socket power (W -> mW): the current one on MI300 and newer, else the average."""
        return self._socket_power_mw("current_socket_power", "average_socket_power")

    def average_power_mw(self) -> int:
        """`average_socket_power` where the board reports it (Navi, MI200 and older), else the current."""
        return self._socket_power_mw("average_socket_power", "current_socket_power")

    def instant_power_mw(self) -> int:
        """`current_socket_power` where the board reports it (MI300 and newer), else the average."""
        return self.power_mw()

    def one_second_power_mw(self) -> int | None:
        """None: amdsmi has no one-second average."""
        return None

    def power_domains_mw(self, domains: Sequence[str]) -> list[int | None] | None:
        """One amdsmi_get_power_info: `current_socket_power` as "device_instant" (W -> mW); amdsmi has no
        one-second average nor memory power (None). None where the board reports no power at all."""
        try:
            info = self.amdsmi.amdsmi_get_power_info(self.handle)
        except self.amdsmi.AmdSmiLibraryException as e:
            if e.get_error_code() == self.amdsmi.amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED:
                return None
            raise amd_error(self.amdsmi, e, "Reading power", self.label) from None
        current = info["current_socket_power"]
        instant = current * 1000 if isinstance(current, int) else None
        return [instant if d == "device_instant" else None for d in domains]

    def memory_bytes(self) -> int:
        """amdsmi_get_gpu_memory_total of the VRAM (bytes)."""
        return self._call(
            "Reading memory", self.amdsmi.amdsmi_get_gpu_memory_total, self.amdsmi.AmdSmiMemoryType.VRAM
        )

    def temperature_c(self) -> int:
        """The hotspot (junction) temperature, °C."""
        a = self.amdsmi
        t = a.AmdSmiTemperatureType.HOTSPOT, a.AmdSmiTemperatureMetric.CURRENT
        return int(self._call("Reading the temperature", a.amdsmi_get_temp_metric, *t))

    def clocks_mhz(self) -> tuple[int, int]:
        """(graphics clock, memory clock) now, from amdsmi_get_clock_info (MHz)."""
        a = self.amdsmi
        gfx = self._call("Reading clocks", a.amdsmi_get_clock_info, a.AmdSmiClkType.GFX)["clk"]
        mem = self._call("Reading clocks", a.amdsmi_get_clock_info, a.AmdSmiClkType.MEM)["clk"]
        return int(gfx), int(mem)

    # -- power caps ---------------------------------------------------------------------------
    def _cap_info(self) -> dict[str, int]:
        return self._call("Reading the power cap", self.amdsmi.amdsmi_get_power_cap_info)

    @property
    def power_limit_scope(self) -> str:
        """ "gpu" (the socket's cap, sensor 0) where the cap can be lowered; else GPUNotSupportedError that
        points at the clocks."""
        low, high = self.power_limit_constraints_mw()
        if low >= high:
            raise GPUNotSupportedError(
                f"The power cap of {self.label} cannot be lowered (amdsmi's range is {low / 1000:g}-{high / 1000:g} "
                "W, as on some MI300X systems): use its clocks instead, e.g. the pipeline optimizer's clock "
                "locks (amdsmi_set_gpu_clk_range)."
            )
        return "gpu"

    def power_limit_constraints_mw(self) -> tuple[int, int]:
        """(min_power_cap, max_power_cap), µW -> mW."""
        info = self._cap_info()
        return info["min_power_cap"] // 1000, info["max_power_cap"] // 1000

    def default_power_limit_mw(self) -> int:
        """`default_power_cap` (µW -> mW)."""
        return self._cap_info()["default_power_cap"] // 1000

    def power_limit_mw(self) -> int:
        """`power_cap`, the cap set (µW -> mW)."""
        return self._cap_info()["power_cap"] // 1000

    def enforced_power_limit_mw(self) -> int:
        """The cap set: amdsmi reports no other limiter."""
        return self.power_limit_mw()

    def set_power_limit_mw(self, value_mw: int) -> None:
        """amdsmi_set_power_cap(handle, sensor 0, µW) (AMD: "just use sensor index 0", ROCm/amdsmi issue 139)."""
        self._call("Setting the power cap", self.amdsmi.amdsmi_set_power_cap, 0, int(value_mw) * 1000)

    # -- persistence --------------------------------------------------------------------------
    def persistence_mode(self) -> bool:
        """AMD GPUs have no persistence mode (amdgpu keeps its state while loaded)."""
        raise GPUNotSupportedError(
            f"{self.label}: AMD GPUs have no persistence mode (amdgpu keeps the GPU initialised)."
        )

    def set_persistence_mode(self, enabled: bool) -> None:
        """See `persistence_mode`."""
        self.persistence_mode()

    # -- clocks -------------------------------------------------------------------------------
    def supported_memory_clocks_mhz(self) -> list[int]:
        """The memory clock's DPM levels (amdsmi_get_clk_freq, Hz -> MHz), highest first."""
        freq = self._call(
            "Reading memory clocks", self.amdsmi.amdsmi_get_clk_freq, self.amdsmi.AmdSmiClkType.MEM
        )
        return sorted({int(f) // 1_000_000 for f in freq["frequency"]}, reverse=True)

    def supported_sm_clocks_mhz(self, memory_clock_mhz: int | None = None) -> list[int]:
        """The graphics clock's settable range (amdsmi_get_clk_freq's lowest and highest level) in
        `SM_CLOCK_STEP_MHZ` steps, highest first; the memory clock does not change it."""
        freq = self._call(
            "Reading graphics clocks", self.amdsmi.amdsmi_get_clk_freq, self.amdsmi.AmdSmiClkType.GFX
        )
        levels = [int(f) // 1_000_000 for f in freq["frequency"]]
        if not levels:
            return []
        low, high = min(levels), max(levels)
        return list(range(high, low - 1, -SM_CLOCK_STEP_MHZ))

    def lock_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the graphics clock (MHz): a range through amdsmi_set_gpu_clk_range (performance level manual); one
        frequency (min == max, as the pipeline optimizer locks) through amdsmi_set_gpu_perf_determinism_mode.

        One frequency cannot go through the range setters: amdsmi refuses min >= max (ROCm/amdsmi
        rocm_smi/src/rocm_smi.cc:1612-1614, `rsmi_dev_clk_range_set`; INVAL), and amdgpu refuses a manual
        range whose min is not below its max when `amdsmi_set_gpu_clk_limit` writes the ends one at a time
        (Linux smu_v13_0_6_ppt.c `smu_v13_0_6_set_soft_freq_limited_range`, MI300; aldebaran_ppt.c, MI200).
        Performance determinism is AMD's fixed-clock mode: amdgpu holds the graphics clock at that soft max
        without the PLL stretching (amdsmi.h `amdsmi_set_gpu_perf_determinism_mode`; rocm_smi.cc:1101-1135
        writes "s 1 <MHz>" in level DETERMINISM); `reset_sm_clocks` leaves it (AUTO disables determinism).
        """
        a = self.amdsmi
        if int(min_mhz) == int(max_mhz):
            self._call("Locking the graphics clock", a.amdsmi_set_gpu_perf_determinism_mode, int(max_mhz))
            return
        self._call(
            "Locking the graphics clock",
            a.amdsmi_set_gpu_clk_range,
            int(min_mhz),
            int(max_mhz),
            a.AmdSmiClkType.GFX,
        )

    def reset_sm_clocks(self) -> None:
        """amdsmi_set_gpu_perf_level(AUTO): amdgpu manages every clock again (AMD has no per-domain reset), and
        leaves performance determinism (Linux smu_v13_0_6_set_performance_level sends DisableDeterminism)."""
        a = self.amdsmi
        self._call("Unlocking the clocks", a.amdsmi_set_gpu_perf_level, a.AmdSmiDevPerfLevel.AUTO)


def _energy_mj(count: dict[str, Any]) -> int:
    """mJ from amdsmi_get_energy_count's ticks times their resolution (µJ); amdsmi before 6.2.1 names the
    ticks `power` (as Zeus's amd.py reads them)."""
    ticks = count["energy_accumulator"] if "energy_accumulator" in count else count["power"]
    return int(ticks * count["counter_resolution"] / 1000)


def _hip_uuid(amdsmi: ModuleType, handle: Any, asic: dict[str, Any]) -> str:
    """The UUID HIP and ROCr know the GPU by (`GPU-<unique id>`, what HIP_VISIBLE_DEVICES takes): amdsmi 6.4+'s
    enumeration info, else the ASIC serial (the same unique id)."""
    get = getattr(amdsmi, "amdsmi_get_gpu_enumeration_info", None)
    if get is not None:
        uuid = get(handle).get("hip_uuid")
        if uuid and uuid != "N/A":
            return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return f"GPU-{int(asic['asic_serial'], 16):016x}"


def hip_visible_positions(uuids: Sequence[str | None]) -> list[int]:
    """The positions in `uuids` (the node's GPUs in HIP's order) of the HIP devices this process sees, in its
    numbering: `ROCR_VISIBLE_DEVICES` selects first, then `HIP_VISIBLE_DEVICES` (or, without it,
    `CUDA_VISIBLE_DEVICES`, as HIP reads it) among those, each by index or UUID prefix."""
    positions = list(range(len(uuids)))
    hip = os.environ.get("HIP_VISIBLE_DEVICES")
    for visible in (
        os.environ.get("ROCR_VISIBLE_DEVICES"),
        os.environ.get("CUDA_VISIBLE_DEVICES") if hip is None else hip,
    ):
        keep = cuda_visible_positions(visible, [uuids[p] for p in positions])
        positions = [positions[k] for k in keep]
    return positions


class AMDBackend(Backend):
    """AMD GPUs through amdsmi; the simulator subclasses it (`zeus_callbacks.sim.amd_backend`).

    HIP numbers the GPUs as amdsmi's enumeration info says (`hip_id`, amdsmi 6.4+), else in amdsmi's order; then
    `ROCR_VISIBLE_DEVICES` selects, and `HIP_VISIBLE_DEVICES` (or, without it, `CUDA_VISIBLE_DEVICES`, as HIP
    reads it) selects among those, by index or UUID.
    """

    vendor = "amd"
    library = "amdsmi"

    def __init__(self, amdsmi: ModuleType, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.amdsmi = amdsmi

    def __repr__(self) -> str:
        return f"{type(self).__name__}(amdsmi={self.amdsmi.__name__!r})"

    def init(self) -> None:
        """amdsmi_init for AMD GPUs.

        Raises:
            NVMLUnavailableError: amdsmi cannot reach the amdgpu driver.
        """
        a = self.amdsmi
        try:
            a.amdsmi_init(a.AmdSmiInitFlags.INIT_AMD_GPUS)
        except a.AmdSmiException as e:
            raise amd_error(a, e, "Initialising amdsmi", "this machine") from None

    def _hip_handles(self) -> list[tuple[int, Any]]:
        """(amdsmi index, handle) of the GPUs this process sees, in HIP's numbering."""
        a = self.amdsmi
        try:
            handles = a.amdsmi_get_processor_handles()
            get = getattr(a, "amdsmi_get_gpu_enumeration_info", None)
            ids = [get(h)["hip_id"] for h in handles] if get is not None else list(range(len(handles)))
        except a.AmdSmiException as e:
            raise amd_error(a, e, "Counting the GPUs", "this machine") from None
        order = sorted((hip, i) for i, hip in enumerate(ids) if isinstance(hip, int))
        found = [(i, handles[i]) for _, i in order]
        uuids = [_hip_uuid(a, h, a.amdsmi_get_gpu_asic_info(h)) for _, h in found]
        return [found[p] for p in hip_visible_positions(uuids)]

    def devices(self) -> list[Device]:
        """The HIP devices of this process, in HIP's numbering.

        Raises:
            MIGNotSupportedError: a GPU is split into compute partitions (CPX, ...).
        """
        devices: list[Device] = [
            AMDDevice(self.amdsmi, h, i, hip, self.simulated)
            for hip, (i, h) in enumerate(self._hip_handles())
        ]
        for d in devices:
            if d.mig_enabled():
                raise MIGNotSupportedError(
                    f"{d.label} is split into compute partitions, whose energy amdsmi cannot tell apart. Set it to "
                    f"SPX (`amd-smi set -g {d.vendor_index} -C SPX`) or use another GPU."
                )
        return devices

    def gpu_count(self) -> int:
        """How many HIP devices this process sees."""
        return len(self._hip_handles())

    def driver_versions(self) -> tuple[str | None, str | None]:
        """(amdgpu's version, amdsmi's library version); None where amdsmi does not say."""
        a = self.amdsmi
        try:
            v = a.amdsmi_get_lib_version()
            library = f"{v['major']}.{v['minor']}.{v['release']}"
            handles = a.amdsmi_get_processor_handles()
            driver = a.amdsmi_get_gpu_driver_info(handles[0])["driver_version"] if handles else None
        except a.AmdSmiException:
            return None, None
        return driver, library

    def node_gpu_names(self) -> list[str]:
        """The names of every GPU amdsmi counts, in its order ([] where it cannot say)."""
        a = self.amdsmi
        try:
            return [a.amdsmi_get_gpu_asic_info(h)["market_name"] for h in a.amdsmi_get_processor_handles()]
        except a.AmdSmiException:
            return []


def real_backend() -> AMDBackend | None:
    """The real amdgpu driver's backend, initialised; None where amdsmi cannot load or sees no AMD GPU."""
    try:
        amdsmi = load_amdsmi()
    except ImportError as e:
        logger.debug("No AMD backend: %s", e)
        return None
    backend = AMDBackend(amdsmi)
    try:
        backend.init()
        return backend if backend.gpu_count() else None
    except GPUError as e:
        logger.debug("No AMD GPU: %s", e)
        return None
