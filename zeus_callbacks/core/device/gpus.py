"""GPUs behind an NVML backend (real or simulated): discovery, energy, power limits, clocks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from zeus_callbacks.core.device import power, setters, state_guard
from zeus_callbacks.core.device.backend import (
    NVMLBackend,
    active_backend,
    nvml_inventory,
    nvml_text,
    reset_backend,
)
from zeus_callbacks.core.device.errors import (
    SIMULATION_HINT,
    GPUError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    MIGNotSupportedError,
    nvml_error,
)

__all__ = ["GPU", "GPUs", "get_gpus", "reset", "SIMULATION_HINT"]

logger = logging.getLogger(__name__)

# nvidia-ml-py's names of the power-limit fields (nvml.h: NVML_FI_DEV_POWER_MIN_LIMIT 187 ... REQUESTED 192).
_MIN_LIMIT, _MAX_LIMIT = "NVML_FI_DEV_POWER_MIN_LIMIT", "NVML_FI_DEV_POWER_MAX_LIMIT"
_DEFAULT_LIMIT, _CURRENT_LIMIT = "NVML_FI_DEV_POWER_DEFAULT_LIMIT", "NVML_FI_DEV_POWER_CURRENT_LIMIT"
_REQUESTED_LIMIT = "NVML_FI_DEV_POWER_REQUESTED_LIMIT"


class GPU:
    """One GPU: NVML queries and settings in the units NVML uses (mW, mJ, MHz).

    `index` is the CUDA index (what frameworks call GPU i, `cuda:i`); `nvml_index` is NVML's (PCI bus
    order), which differs on mixed nodes. The two are tied by the UUID, never by position. `architecture`
    is NVML's `NVML_DEVICE_ARCH_*`, None where the library cannot tell (an old driver's NVML lacks the call).

    Changes of power limit, clocks and persistence go through the process's `GPUStateGuard`, which
    records the value in force before the first change and restores it at the end.
    """

    def __init__(self, backend: NVMLBackend, index: int, uuid: str) -> None:
        self.backend = backend
        self.nvml: ModuleType = backend.nvml
        self.index = index
        self.uuid = uuid
        self.simulated = backend.simulated
        self.provenance: str | None = backend.provenance(uuid)  # e.g. a modelled (not traced) simulated board
        self._scope: str | None = None  # `power_limit_scope`, once found
        nvml = self.nvml
        try:
            self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            self.nvml_index: int = nvml.nvmlDeviceGetIndex(self.handle)
            self.name: str = nvml_text(nvml.nvmlDeviceGetName(self.handle))
            self.architecture: int | None = _architecture(nvml, self.handle, self.name)
        except nvml.NVMLError as e:
            raise nvml_error(nvml, e, "Opening the GPU", f"CUDA device {index} ({uuid})") from None
        # Volta and newer have the counter; where the architecture is unknown, the probe below decides.
        self.supports_energy_counter = (
            self.architecture is None or self.architecture >= nvml.NVML_DEVICE_ARCH_VOLTA
        )
        if self.supports_energy_counter:
            try:
                nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            except nvml.NVMLError:
                self.supports_energy_counter = False
        # Without a counter a monitor samples the power; a board that reports no power either (GTX680's dump:
        # `Power Draw : N/A`) can only be timed.
        self.supports_power_reading = self.supports_energy_counter or self._reads_power()

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

    def __repr__(self) -> str:
        sim = ", simulated" if self.simulated else ""
        return f"GPU(index={self.index}, nvml_index={self.nvml_index}, name={self.name!r}{sim})"

    @property
    def label(self) -> str:
        """A human label: `GPU 0 (NVIDIA A40, simulated)`."""
        return f"GPU {self.index} ({self.name}{', simulated' if self.simulated else ''})"

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self.handle, *args)
        except self.nvml.NVMLError as e:
            raise nvml_error(self.nvml, e, what, self.label) from None

    # -- measurement --------------------------------------------------------------------------
    def energy_mj(self) -> int:
        """Total energy since the driver loaded (mJ); Volta and newer."""
        try:
            return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except self.nvml.NVMLError as e:
            raise nvml_error(self.nvml, e, "Reading the energy counter", self.label) from None

    def power_mw(self) -> int:
        """Current power draw (mW)."""
        return self._call("Reading power", self.nvml.nvmlDeviceGetPowerUsage)

    def memory_bytes(self) -> int:
        """Total memory (bytes)."""
        return int(self._call("Reading memory info", self.nvml.nvmlDeviceGetMemoryInfo).total)

    # -- power limits -------------------------------------------------------------------------
    # Where NVML answers NOT_SUPPORTED for the GPU's own power limit, a board may still take a limit on its
    # module (GPU and CPU, e.g. Grace; nvml.h `NVML_POWER_SCOPE_MODULE`): read with nvmlDeviceGetFieldValues
    # (`NVML_FI_DEV_POWER_*_LIMIT` with scopeId 1, nvml.h: "1 - Module scope") and set with
    # nvmlDeviceSetPowerManagementLimit_v2. nvidia-smi shows both scopes (`GPU Power Readings` and
    # `Module Power Readings`, e.g. thamada/gls's GH200 dump).
    @property
    def power_limit_scope(self) -> str:
        """Which power limit this GPU's settings act on: "gpu" (NVML's GPU scope: nearly every board) or
        "module" (its module's, where the GPU scope is N/A and the module scope is settable).

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
        lo, hi = self._limit_mw(
            "Reading power-limit constraints",
            self.nvml.nvmlDeviceGetPowerManagementLimitConstraints,
            _MIN_LIMIT,
            _MAX_LIMIT,
        )
        return lo, hi

    def default_power_limit_mw(self) -> int:
        """The default power limit (mW), of the `power_limit_scope`."""
        nvml = self.nvml
        what = "Reading the default power limit"
        return self._limit_mw(what, nvml.nvmlDeviceGetPowerManagementDefaultLimit, _DEFAULT_LIMIT)[0]

    def power_limit_mw(self) -> int:
        """The power limit set (mW; nvidia-smi's `Requested Power Limit`), of the `power_limit_scope`: what
        a change sets and a restore puts back."""
        nvml = self.nvml
        return self._limit_mw(
            "Reading the power limit", nvml.nvmlDeviceGetPowerManagementLimit, _REQUESTED_LIMIT
        )[0]

    def enforced_power_limit_mw(self) -> int:
        """The power limit in force (mW; nvidia-smi's `Current Power Limit`), of the `power_limit_scope`: the
        one set, or lower where another limiter holds the board below it (a real GH200 runs at 700 W
        under a 900 W request)."""
        nvml = self.nvml
        what = "Reading the enforced power limit"
        return self._limit_mw(what, nvml.nvmlDeviceGetEnforcedPowerLimit, _CURRENT_LIMIT)[0]

    def starting_power_limit_mw(self) -> int:
        """The limit in force before this process changed it (mW): the one the state guard recorded before
        its first change, else the lower of the one set and the enforced one."""
        recorded = state_guard.guard().recorded(self, "power_limit")
        if recorded is not None:
            return int(recorded)
        return min(self.power_limit_mw(), self.enforced_power_limit_mw())

    def set_power_limit_mw(self, value_mw: int) -> None:
        """Set the power limit (mW) of the `power_limit_scope`, recorded first so that it is restored at
        the end."""
        lo, hi = self.power_limit_constraints_mw()
        if not lo <= value_mw <= hi:
            raise ValueError(
                f"Power limit {value_mw / 1000:g} W is outside {self.label}'s range [{lo / 1000:g}, {hi / 1000:g}] W."
            )
        recorded = state_guard.guard().before_change(self, "power_limit")
        if self.power_limit_mw() != value_mw:
            self._change(recorded, "power_limit", lambda r: r.set_power_limit_mw(self, int(value_mw)))

    def _change(self, recorded: bool, knob: str, change: Callable[[setters.Route], None]) -> None:
        """Make a journaled change through this process's route (NVML or zeusd); a refused first change leaves
        no journal entry behind."""
        try:
            change(setters.route())
        except (GPUNoPermissionError, GPUNotSupportedError):
            if recorded:
                state_guard.guard().discard(self, knob)
            raise

    # -- persistence --------------------------------------------------------------------------
    def persistence_mode(self) -> bool:
        """Whether persistence mode is on."""
        mode = self._call("Reading persistence mode", self.nvml.nvmlDeviceGetPersistenceMode)
        return mode == self.nvml.NVML_FEATURE_ENABLED

    def set_persistence_mode(self, enabled: bool) -> None:
        """Turn persistence mode on or off (restored at the end)."""
        recorded = state_guard.guard().before_change(self, "persistence")
        self._change(recorded, "persistence", lambda r: r.set_persistence_mode(self, bool(enabled)))

    # -- clocks -------------------------------------------------------------------------------
    def supported_memory_clocks_mhz(self) -> list[int]:
        """Supported memory clocks, highest first."""
        return sorted(
            self._call("Reading memory clocks", self.nvml.nvmlDeviceGetSupportedMemoryClocks), reverse=True
        )

    def supported_sm_clocks_mhz(self, memory_clock_mhz: int | None = None) -> list[int]:
        """Supported SM (graphics) clocks at a memory clock (default: the highest), highest first.

        Empty where NVML lists none, or lists no memory clock to ask at: the clocks cannot be locked.
        """
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
        """Lock the SM clock into [min_mhz, max_mhz] (reset at the end)."""
        recorded = state_guard.guard().before_change(self, "sm_clocks")
        self._change(recorded, "sm_clocks", lambda r: r.lock_sm_clocks(self, int(min_mhz), int(max_mhz)))

    def reset_sm_clocks(self) -> None:
        """Unlock the SM clock."""
        setters.route().reset_sm_clocks(self)

    # -- permissions and synchronisation --------------------------------------------------------
    def may_change_settings(self) -> bool:
        """Whether this process may change power limits and clocks: through NVML, when it holds CAP_SYS_ADMIN
        (a real GPU); through zeusd, always (the daemon changes them; a refusal shows at the first change)."""
        return setters.route().may_change(self)

    def synchronize(self) -> None:
        """Wait for the work queued on this GPU."""
        self.backend.synchronize(self.index, self.handle)


class GPUs(Sequence[GPU]):
    """The GPUs this process may use, in CUDA's numbering (`CUDA_DEVICE_ORDER`, `CUDA_VISIBLE_DEVICES`).

    Each CUDA device is tied to its NVML handle by UUID. GPUs NVML counts but the job may not open
    (a container's or cgroup's device list) are skipped with one log message.
    """

    def __init__(self, backend: NVMLBackend) -> None:
        self.backend = backend
        self.nvml: ModuleType = backend.nvml
        self.simulated = backend.simulated
        self.clock: Callable[[], float] = backend.clock
        self.virtual_clock = backend.virtual_clock
        try:
            _, denied, failed = nvml_inventory(self.nvml)
        except self.nvml.NVMLError as e:
            raise nvml_error(self.nvml, e, "Counting the GPUs", "this machine") from None
        if denied:
            logger.info(
                "NVML counts %d GPU(s) this process may not open (NVML index %s: no permission, e.g. not "
                "granted to this container or job); skipped.",
                len(denied),
                ", ".join(map(str, denied)),
            )
        uuids = backend.cuda_uuids()
        for i, uuid in enumerate(uuids):
            if uuid.startswith("MIG-"):
                raise MIGNotSupportedError(
                    f"CUDA device {i} is the MIG device {uuid}; NVML cannot measure or control MIG instances. "
                    "Select whole GPUs (CUDA_VISIBLE_DEVICES) or disable MIG."
                )
        self._gpus = [GPU(backend, i, uuid) for i, uuid in enumerate(uuids)]  # a failed one of ours raises
        for g in self._gpus:
            _refuse_mig(g)
        ours = {g.nvml_index for g in self._gpus}
        for i, e in failed.items():
            if i not in ours:  # another job's GPU (e.g. lost) stops only the jobs that use it
                logger.warning(
                    "NVML GPU %d does not answer (%s); it is not one of this process's GPUs, so it is skipped.",
                    i,
                    e,
                )
        # Settings left by dead processes that discovery put back (`zeus-callbacks restore` reports them).
        self.repaired: list[Any] = []

    def __getitem__(self, index):  # type: ignore[override]
        return self._gpus[index]

    def __len__(self) -> int:
        return len(self._gpus)

    def __iter__(self) -> Iterator[GPU]:
        return iter(self._gpus)

    def synchronize(self, indices: Sequence[int]) -> None:
        """Wait for the work queued on these GPUs."""
        for i in indices:
            self._gpus[i].synchronize()

    def step_boundary(self, indices: Sequence[int]) -> None:
        """Mark the end of a training step.

        A real GPU needs nothing here: its bounded launch queue already stops the host from running more
        than about a step ahead. A backend without one (the simulator) says so with
        `sync_at_step_boundary`, and the GPUs synchronise here instead, so that a slowdown shows in the
        step it happened in.
        """
        if self.backend.sync_at_step_boundary:
            self.synchronize(indices)

    def energy_reader(self, indices: Sequence[int]) -> Callable[[], list[int]]:
        """A function that reads the energy counters (mJ) of these GPUs, in this order, in one call.

        The monitor's hot path (two calls per window): the NVML function and handles are bound once.

        Raises (when called):
            GPUError: a counter could not be read (a lost GPU, or one without an energy counter).
        """
        nvml = self.nvml
        read = nvml.nvmlDeviceGetTotalEnergyConsumption
        handles = [self._gpus[i].handle for i in indices]
        labels = ", ".join(self._gpus[i].label for i in indices)

        def read_counters() -> list[int]:
            try:
                return list(map(read, handles))
            except nvml.NVMLError as e:
                raise nvml_error(nvml, e, "Reading the energy counter", labels) from None

        return read_counters


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


def _refuse_mig(gpu: GPU) -> None:
    try:
        current, _ = gpu.nvml.nvmlDeviceGetMigMode(gpu.handle)
    except gpu.nvml.NVMLError:
        return  # pre-Ampere GPUs do not support MIG
    if current == gpu.nvml.NVML_DEVICE_MIG_ENABLE:
        raise MIGNotSupportedError(
            f"{gpu.label} is in MIG mode; NVML cannot measure or control MIG instances. Disable MIG "
            f"(`nvidia-smi -i {gpu.nvml_index} -mig 0`) or use another GPU."
        )


_lock = threading.Lock()
_gpus: GPUs | None = None


def get_gpus(repair: bool = True) -> GPUs:
    """The process's GPUs (discovered once) through the active NVML backend (see `backend`).

    At the first discovery, settings left changed by processes that died hard are put back, unless
    `repair` is False (read-only callers such as `zeus-callbacks doctor`).

    Raises:
        NVMLUnavailableError: no NVML library or driver, and no other backend (simulation) selected.
        MIGNotSupportedError: a MIG device or a GPU in MIG mode is visible.
    """
    global _gpus
    with _lock:
        if _gpus is None:
            backend = active_backend()
            nvml = backend.nvml
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as e:
                raise nvml_error(nvml, e, "Initialising NVML", "this machine") from None
            _gpus = GPUs(backend)
            if repair:
                _gpus.repaired = state_guard.guard().repair_dead_runs(_gpus)
        return _gpus


def reset() -> None:
    """Forget the discovered GPUs and the backend (after the simulation or `CUDA_VISIBLE_DEVICES` changed).

    What this process changed on the old GPUs is restored first.
    """
    global _gpus
    with _lock:
        _gpus = None
    state_guard.reset()
    setters.forget()
    power.forget_refresh_periods()
    reset_backend()
