"""One NVIDIA GPU through NVML behind the `Device` boundary, in NVML's units (mW, mJ, MHz)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from zeus_callbacks.core.device.device import Device
from zeus_callbacks.core.device.errors import GPUError, GPUNotSupportedError
from zeus_callbacks.core.device.nvidia.library import nvml_error, nvml_text

__all__ = ["NVIDIADevice", "ARCHITECTURES"]

logger = logging.getLogger(__name__)

# nvml.h's `NVML_DEVICE_ARCH_*` values, as the lowercase generation names of `Device.architecture`.
ARCHITECTURES = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
    13: "rubin",
}
_VOLTA, _AMPERE = 5, 7
_GA100 = ("A100", "A30", "A800")  # GA100 boards: nvml.h's "except GA100" (NVML_FI_DEV_POWER_AVERAGE)
# nvidia-ml-py's names of the power-limit fields (nvml.h: NVML_FI_DEV_POWER_MIN_LIMIT 187 ... REQUESTED 192).
_MIN_LIMIT, _MAX_LIMIT = "NVML_FI_DEV_POWER_MIN_LIMIT", "NVML_FI_DEV_POWER_MAX_LIMIT"
_DEFAULT_LIMIT, _CURRENT_LIMIT = "NVML_FI_DEV_POWER_DEFAULT_LIMIT", "NVML_FI_DEV_POWER_CURRENT_LIMIT"
_REQUESTED_LIMIT = "NVML_FI_DEV_POWER_REQUESTED_LIMIT"
# The power domains (PowerMonitor's names) as nvml.h's (field, scope): NVML_FI_DEV_POWER_INSTANT "Current GPU
# power, supported on all architectures"; NVML_FI_DEV_POWER_AVERAGE "GPU power averaged over 1 sec interval";
# NVML_POWER_SCOPE_MEMORY "Targets the GPU Memory".
_DOMAINS = {
    "device_instant": ("NVML_FI_DEV_POWER_INSTANT", "NVML_POWER_SCOPE_GPU"),
    "device_average": ("NVML_FI_DEV_POWER_AVERAGE", "NVML_POWER_SCOPE_GPU"),
    "memory_average": ("NVML_FI_DEV_POWER_AVERAGE", "NVML_POWER_SCOPE_MEMORY"),
}
# A field value call that fails in these ways does not offer the field (NOT_SUPPORTED, INVALID_ARGUMENT), the
# call (an old driver's library: FUNCTION_NOT_FOUND), or fails without a reason (UNKNOWN).
_NOT_OFFERED = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_UNKNOWN",
)


def _architecture(nvml: ModuleType, handle: Any, name: str) -> int | None:
    """The GPU's `NVML_DEVICE_ARCH_*`, or None where this NVML cannot say (an old driver's library, or old
    bindings, lack `nvmlDeviceGetArchitecture`)."""
    get = getattr(nvml, "nvmlDeviceGetArchitecture", None)
    try:
        if get is not None:
            return int(get(handle))
    except nvml.NVMLError as e:
        if e.value not in (nvml.NVML_ERROR_FUNCTION_NOT_FOUND, nvml.NVML_ERROR_NOT_SUPPORTED):
            raise
    logger.debug("%s: NVML cannot tell its architecture; its energy counter is probed instead.", name)
    return None


class NVIDIADevice(Device):
    """One NVIDIA GPU through NVML, in NVML's units (mW, mJ, MHz).

    Args:
        nvml: The NVML module (nvidia-ml-py's `pynvml`).
        uuid: The GPU's NVML UUID (`GPU-...`).
        cuda_index: Its CUDA index (for the label).
        simulated: Whether it is a simulated GPU (for the label).

    Raises:
        GPUError: NVML could not open it.
    """

    vendor = "nvidia"

    def __init__(self, nvml: ModuleType, uuid: str, cuda_index: int, simulated: bool = False) -> None:
        self.nvml = nvml
        self.uuid = uuid
        self._scope: str | None = None  # `power_limit_scope`, once found
        try:
            self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            self.vendor_index: int = nvml.nvmlDeviceGetIndex(self.handle)
            self.name: str = nvml_text(nvml.nvmlDeviceGetName(self.handle))
            self.nvml_architecture = _architecture(nvml, self.handle, self.name)
        except nvml.NVMLError as e:
            raise nvml_error(nvml, e, "Opening the GPU", f"CUDA device {cuda_index} ({uuid})") from None
        arch = self.nvml_architecture
        self.architecture = None if arch is None else ARCHITECTURES.get(arch)
        self.label = f"GPU {cuda_index} ({self.name}{', simulated' if simulated else ''})"
        # Volta and newer have the counter; where the architecture is unknown, the probe below decides.
        self.supports_energy_counter = arch is None or arch >= _VOLTA
        if self.supports_energy_counter:
            try:
                nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            except nvml.NVMLError:
                self.supports_energy_counter = False
        # Without a counter a monitor samples the power; a board that reports no power either (GTX680's dump:
        # `Power Draw : N/A`) can only be timed.
        self.supports_power_reading = self.supports_energy_counter or self._reads_power()
        # nvmlDeviceGetPowerUsage is the one-second average on Ampere and newer except GA100 (nvml.h), else
        # the instantaneous draw; None where the architecture is unknown.
        self.power_usage_domain: str | None = None
        if arch is not None:
            averaged = arch >= _AMPERE and not any(n in self.name for n in _GA100)
            self.power_usage_domain = "device_average" if averaged else "device_instant"

    def _reads_power(self) -> bool:
        try:
            self.nvml.nvmlDeviceGetPowerUsage(self.handle)
        except self.nvml.NVMLError as e:
            if e.value != self.nvml.NVML_ERROR_NOT_SUPPORTED:
                return True  # e.g. lost: said by whoever reads it next
            logger.warning(
                "%s measures no energy: it has no energy counter (before Volta) and NVML does not report its "
                "power (nvidia-smi: Power Draw N/A); a monitor gives its time only.",
                self.label,
            )
            return False
        return True

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self.handle, *args)
        except self.nvml.NVMLError as e:
            raise nvml_error(self.nvml, e, what, self.label) from None

    # -- identity -----------------------------------------------------------------------------
    def pci_bus_id(self) -> str:
        """nvmlDeviceGetPciInfo_v3's `busId` ("00000000:3B:00.0"); the older call where bindings lack it."""
        nvml = self.nvml
        get = getattr(nvml, "nvmlDeviceGetPciInfo_v3", None) or nvml.nvmlDeviceGetPciInfo
        return nvml_text(self._call("Reading the PCI bus id", get).busId)

    def mig_enabled(self) -> bool:
        """Whether MIG mode is on (`nvmlDeviceGetMigMode`; pre-Ampere GPUs answer NOT_SUPPORTED: off)."""
        try:
            current, _ = self.nvml.nvmlDeviceGetMigMode(self.handle)
        except self.nvml.NVMLError:
            return False
        return bool(current == self.nvml.NVML_DEVICE_MIG_ENABLE)

    # -- measurement --------------------------------------------------------------------------
    def energy_mj(self) -> int:
        """`nvmlDeviceGetTotalEnergyConsumption` (mJ since the driver loaded); Volta and newer."""
        try:
            return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except self.nvml.NVMLError as e:
            raise nvml_error(self.nvml, e, "Reading the energy counter", self.label) from None

    def energy_reader(self) -> Callable[[], int]:
        """`energy_mj` with the NVML function and handle bound once."""
        nvml, read, handle, label = (
            self.nvml,
            self.nvml.nvmlDeviceGetTotalEnergyConsumption,
            self.handle,
            self.label,
        )

        def read_counter() -> int:
            try:
                return read(handle)
            except nvml.NVMLError as e:
                raise nvml_error(nvml, e, "Reading the energy counter", label) from None

        return read_counter

    def power_mw(self) -> int:
        """`nvmlDeviceGetPowerUsage` (mW): a one-second average on Ampere and newer except GA100."""
        return self._call("Reading power", self.nvml.nvmlDeviceGetPowerUsage)

    def average_power_mw(self) -> int:
        """Power as `nvmlDeviceGetPowerUsage` reports it (mW)."""
        return self.power_mw()

    def power_domains_mw(self, domains: Sequence[str]) -> list[int | None] | None:
        """The power domains' fields (mW) in one `nvmlDeviceGetFieldValues` call, None for each one not
        answered; None when the call is not offered."""
        nvml = self.nvml
        get = getattr(nvml, "nvmlDeviceGetFieldValues", None)
        ids = [tuple(getattr(nvml, n, None) for n in _DOMAINS[d]) for d in domains]
        if get is None or any(None in i for i in ids):
            return None
        try:
            values = get(self.handle, ids)
        except nvml.NVMLError as e:
            if getattr(e, "value", None) in {getattr(nvml, n) for n in _NOT_OFFERED}:
                return None
            raise nvml_error(nvml, e, "Reading power", self.label) from None
        return [int(v.value.uiVal) if v.nvmlReturn == nvml.NVML_SUCCESS else None for v in values]

    def one_second_power_mw(self) -> int | None:
        """`NVML_FI_DEV_POWER_AVERAGE` (mW); None where not offered (before Ampere, the A100 class)."""
        return (self.power_domains_mw(["device_average"]) or [None])[0]

    def instant_power_mw(self) -> int:
        """`NVML_FI_DEV_POWER_INSTANT` (mW) where offered, else `power_mw()`."""
        value = (self.power_domains_mw(["device_instant"]) or [None])[0]
        return self.power_mw() if value is None else value

    def memory_bytes(self) -> int:
        """`nvmlDeviceGetMemoryInfo().total` (bytes)."""
        return int(self._call("Reading memory info", self.nvml.nvmlDeviceGetMemoryInfo).total)

    def temperature_c(self) -> int:
        """`nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)` (°C)."""
        return int(
            self._call(
                "Reading the temperature", self.nvml.nvmlDeviceGetTemperature, self.nvml.NVML_TEMPERATURE_GPU
            )
        )

    def clocks_mhz(self) -> tuple[int, int]:
        """`nvmlDeviceGetClockInfo` of the SM and memory clocks (MHz)."""
        nvml, what = self.nvml, "Reading the clocks"
        sm = self._call(what, nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
        return int(sm), int(self._call(what, nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_MEM))

    # -- power limits -------------------------------------------------------------------------
    # Where NVML answers NOT_SUPPORTED for the GPU's own power limit, a board may still take a limit on its
    # module (GPU and CPU, e.g. Grace; nvml.h `NVML_POWER_SCOPE_MODULE`): read with nvmlDeviceGetFieldValues
    # (`NVML_FI_DEV_POWER_*_LIMIT` with scopeId 1, nvml.h: "1 - Module scope") and set with
    # nvmlDeviceSetPowerManagementLimit_v2. nvidia-smi shows both scopes (`GPU Power Readings` and
    # `Module Power Readings`, e.g. thamada/gls's GH200 dump).
    @property
    def power_limit_scope(self) -> str:
        """ "gpu" (NVML's GPU scope: nearly every board) or "module" (where the GPU scope is N/A and the
        module scope is settable).

        Raises:
            GPUNotSupportedError: neither scope has a settable power limit (e.g. a GeForce GTX 680: N/A).
        """
        if self._scope is None:
            self._scope = self._find_scope()
        return self._scope

    def _find_scope(self) -> str:
        nvml = self.nvml
        try:
            nvml.nvmlDeviceGetPowerManagementLimitConstraints(self.handle)
            return "gpu"
        except nvml.NVMLError as e:
            if e.value != nvml.NVML_ERROR_NOT_SUPPORTED:
                raise nvml_error(nvml, e, "Reading power-limit constraints", self.label) from None
        if hasattr(nvml, "nvmlDeviceSetPowerManagementLimit_v2"):
            try:
                self._module_fields("Reading the module's power-limit range", _MIN_LIMIT, _MAX_LIMIT)
                return "module"
            except GPUError:
                pass
        raise GPUNotSupportedError(
            f"Power-limit control is not supported on {self.label}: NVML answers NOT_SUPPORTED for the GPU's "
            "limit, and its module has none (nvidia-smi -q: Power Limit N/A)."
        )

    def _module_fields(self, what: str, *fields: str) -> list[int]:
        """The module scope's `NVML_FI_DEV_POWER_*` fields (mW), each checked: NVML answers every field in
        its own `nvmlReturn` while the call succeeds."""
        nvml = self.nvml
        ids = [(getattr(nvml, f), nvml.NVML_POWER_SCOPE_MODULE) for f in fields]
        values = self._call(what, nvml.nvmlDeviceGetFieldValues, ids)
        for v in values:
            if v.nvmlReturn != nvml.NVML_SUCCESS:
                raise nvml_error(nvml, nvml.NVMLError(v.nvmlReturn), what, self.label)
        return [int(v.value.uiVal) for v in values]

    def _limit_mw(self, what: str, gpu_scope: Callable[..., Any], *fields: str) -> list[int]:
        """A power-limit reading of the GPU scope, or of the module's `fields` where the GPU scope is N/A."""
        if self._scope != "module":
            try:
                value = self._call(what, gpu_scope)
            except GPUNotSupportedError:
                if self.power_limit_scope != "module":  # raises where neither scope has a settable limit
                    raise
            else:
                self._scope = "gpu"
                return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
        return self._module_fields(what, *fields)

    def power_limit_constraints_mw(self) -> tuple[int, int]:
        """(minimum, maximum) settable power limit (mW), of the `power_limit_scope`."""
        get = self.nvml.nvmlDeviceGetPowerManagementLimitConstraints
        lo, hi = self._limit_mw("Reading power-limit constraints", get, _MIN_LIMIT, _MAX_LIMIT)
        return lo, hi

    def default_power_limit_mw(self) -> int:
        """The default power limit (mW), of the `power_limit_scope`."""
        get = self.nvml.nvmlDeviceGetPowerManagementDefaultLimit
        return self._limit_mw("Reading the default power limit", get, _DEFAULT_LIMIT)[0]

    def power_limit_mw(self) -> int:
        """The power limit set (mW; nvidia-smi's `Requested Power Limit`), of the `power_limit_scope`."""
        get = self.nvml.nvmlDeviceGetPowerManagementLimit
        return self._limit_mw("Reading the power limit", get, _REQUESTED_LIMIT)[0]

    def enforced_power_limit_mw(self) -> int:
        """The power limit in force (mW; nvidia-smi's `Current Power Limit`), of the `power_limit_scope`: the
        one set, or lower where another limiter holds the board below it (a real GH200 runs at 700 W under a
        900 W request)."""
        get = self.nvml.nvmlDeviceGetEnforcedPowerLimit
        return self._limit_mw("Reading the enforced power limit", get, _CURRENT_LIMIT)[0]

    def set_power_limit_mw(self, value_mw: int) -> None:
        """Set the power limit (mW) of the `power_limit_scope` (raw: no guard, no range check)."""
        nvml, what = self.nvml, "Setting the power limit"
        if self.power_limit_scope != "module":
            self._call(what, nvml.nvmlDeviceSetPowerManagementLimit, int(value_mw))
            return
        args = (nvml.NVML_POWER_SCOPE_MODULE, int(value_mw), nvml.nvmlPowerValue_v2)
        self._call(what, nvml.nvmlDeviceSetPowerManagementLimit_v2, *args)
        # nvidia-ml-py's nvmlDeviceSetPowerManagementLimit_v2 drops NVML's return code (pynvml.py: `ret = fn(...)`,
        # then `return NVML_SUCCESS`), so a refusal shows only in the limit read back.
        now = self.power_limit_mw()
        if now != int(value_mw):
            raise GPUNotSupportedError(
                f"{what} on {self.label} (module scope): NVML did not apply {value_mw / 1000:g} W (the module's "
                f"limit reads {now / 1000:g} W). Check `nvidia-smi -q -d POWER` and that this process holds "
                "CAP_SYS_ADMIN."
            )

    # -- persistence --------------------------------------------------------------------------
    def persistence_mode(self) -> bool:
        """Whether persistence mode is on (`nvmlDeviceGetPersistenceMode`)."""
        mode = self._call("Reading persistence mode", self.nvml.nvmlDeviceGetPersistenceMode)
        return bool(mode == self.nvml.NVML_FEATURE_ENABLED)

    def set_persistence_mode(self, enabled: bool) -> None:
        """`nvmlDeviceSetPersistenceMode` (raw)."""
        nvml = self.nvml
        mode = nvml.NVML_FEATURE_ENABLED if enabled else nvml.NVML_FEATURE_DISABLED
        self._call("Setting persistence mode", nvml.nvmlDeviceSetPersistenceMode, mode)

    # -- clocks -------------------------------------------------------------------------------
    def supported_memory_clocks_mhz(self) -> list[int]:
        """`nvmlDeviceGetSupportedMemoryClocks`, highest first."""
        clocks = self._call("Reading memory clocks", self.nvml.nvmlDeviceGetSupportedMemoryClocks)
        return sorted(clocks, reverse=True)

    def supported_sm_clocks_mhz(self, memory_clock_mhz: int | None = None) -> list[int]:
        """`nvmlDeviceGetSupportedGraphicsClocks` at a memory clock (default: the highest), highest first;
        empty where NVML lists none, or lists no memory clock to ask at."""
        mem = memory_clock_mhz
        if mem is None:
            memory_clocks = self.supported_memory_clocks_mhz()
            if not memory_clocks:
                logger.debug("%s: NVML lists no supported memory clocks, so no SM clock either.", self.label)
                return []
            mem = memory_clocks[0]
        clocks = self._call("Reading SM clocks", self.nvml.nvmlDeviceGetSupportedGraphicsClocks, mem)
        return sorted(clocks, reverse=True)

    def lock_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """`nvmlDeviceSetGpuLockedClocks` (raw)."""
        self._call("Locking SM clocks", self.nvml.nvmlDeviceSetGpuLockedClocks, int(min_mhz), int(max_mhz))

    def reset_sm_clocks(self) -> None:
        """`nvmlDeviceResetGpuLockedClocks` (raw)."""
        self._call("Resetting SM clocks", self.nvml.nvmlDeviceResetGpuLockedClocks)
