"""zeusd master's AMD backend for the zeusd double: `AmdsmiGpu` and the AMD arms of its errors, rebuilt from
ml-energy/zeus master (75a8b93), `zeusd/src/devices/gpu/amdsmi/mod.rs` ("mod.rs" below), `.../amdsmi/ffi.rs`,
`error.rs` and `startup.rs`. zeusd 0.4 and 0.5 have no AMD backend (their `devices/gpu/` holds `nvml.rs` only).

zeusd loads `libamd_smi.so` with libloading and calls its C functions (mod.rs 148-180); this double calls the
same C functions, with the same arguments, through amdsmi's ctypes bindings (`amdsmi.amdsmi_wrapper`) of the
simulated `libamd_smi.so` (`zeus_callbacks.sim.amdsmi_library`, attached by `sim.amd_backend.attach`), so the
changes land on the simulated node the client's amdsmi reads. What zeusd does, rule by rule:

- numbering: `amdsmi_init(AMDSMI_INIT_AMD_GPUS)`, then every socket's processors in amdsmi's order
  (`enumerate_gpus`, mod.rs 567-574); GPU N is the N-th (`init`, 630-636). No HIP/ROCR variable is read.
- `/discover`: the ASIC's `market_name` (694-715) and the BDF as `{:04x}:{:02x}:{:02x}.{:x}` (ffi.rs 148-156,
  startup.rs 157-158); `cumulative_energy_available` from `validate_energy_counters` (862-960).
- power limit: `amdsmi_set_power_cap(h, 0, mW * 1000)` (980-987); read back `power_cap / 1000`, the range
  `min_power_cap / 1000, max_power_cap / 1000` (989-999). No range check of zeusd's own.
- clocks: `set_gpu_locked_clocks` / `set_mem_locked_clocks` write the two ends with `amdsmi_set_gpu_clk_limit`
  (GFX / MEM, MIN and MAX, MHz), the max first where the new min is above the cached max (766-819,
  `clk_write_order` 613-619); a failed write re-reads the range (`amdsmi_get_clock_info`) and tries once more
  (823-859). `reset_gpu_locked_clocks` and `reset_mem_locked_clocks` are refused ("AMD GPUs cannot reset a
  single clock domain; use reset_locked_clocks", 1009-1029); `reset_locked_clocks` sets the performance level
  to AUTO, all domains (1034-1044).
- persistence mode: refused both ways, "persistence mode is not supported on AMD GPUs" (968-978).
- power: `current_socket_power`, else `average_socket_power`, whichever was not N/A at init (637-644,
  1046-1059), W -> mW.
- errors (`error.rs` 30-40, 71, 80-86): `Invalid request: <text>` 400; `AMDSMI error <status>: <text of
  amdsmi_status_code_to_string>`, 403 for NO_PERM (10), 400 for INVAL (1) and NOT_SUPPORTED (2), else 500.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from zeusd_double_rules import Refusal

# ffi.rs 10-30.
SUCCESS, INVAL, NOT_SUPPORTED, NO_PERM = 0, 1, 2, 10
INIT_AMD_GPUS = 2
CLK_GFX, CLK_MEM = 0, 4
LIMIT_MIN, LIMIT_MAX = 0, 1
PERF_LEVEL_AUTO = 0
POWER_NA = (0xFFFF, 0xFFFFFFFF)  # mod.rs 621-626: the u16 sentinel, and the header's UINT32_MAX
NO_SINGLE_DOMAIN = "AMD GPUs cannot reset a single clock domain; use reset_locked_clocks to reset all domains"
NO_PERSISTENCE = "persistence mode is not supported on AMD GPUs"


class AmdsmiError(Exception):
    """`ZeusdError::AmdSmiError { status, msg }`."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(status, msg)
        self.status, self.msg = status, msg

    def refusal(self) -> Refusal:
        """error.rs: `AMDSMI error {status}: {msg}`, 403 NO_PERM, 400 INVAL / NOT_SUPPORTED, 500 the rest."""
        code = 403 if self.status == NO_PERM else 400 if self.status in (INVAL, NOT_SUPPORTED) else 500
        return Refusal(code, f"AMDSMI error {self.status}: {self.msg}")


def invalid_request(text: str) -> Refusal:
    """`ZeusdError::InvalidRequest`: 400, `Invalid request: {text}`."""
    return Refusal(400, f"Invalid request: {text}")


def is_amd_node() -> bool:
    """Whether the simulated node named by `ZEUS_CALLBACKS_SIMULATE` has AMD GPUs."""
    from zeus_callbacks.sim.system import SimulatedSystem

    return SimulatedSystem(os.environ["ZEUS_CALLBACKS_SIMULATE"]).vendor == "amd"


class AmdsmiLibrary:
    """A fresh view of the simulated node as `libamd_smi.so`, initialised (the node's state lives in files)."""

    def __init__(self, faults: str) -> None:
        from zeus_callbacks.sim import amd_backend
        from zeus_callbacks.sim.system import SimulatedSystem

        system = SimulatedSystem(
            os.environ["ZEUS_CALLBACKS_SIMULATE"],
            faults=faults,
            state_dir=os.environ.get("ZEUS_CALLBACKS_SIM_STATE_DIR") or None,
        )
        self.c = amd_backend.attach(system).amdsmi_wrapper  # the C functions, as libloading gives them
        self.check(self.c.amdsmi_init(INIT_AMD_GPUS))

    def check(self, status: int) -> None:
        """mod.rs `check_status` (482-488), with the status text (`status_message`, 232-247)."""
        if status != SUCCESS:
            text = self.c.amdsmi_status_code_to_string.argtypes[-1]._type_()  # char *
            ok = self.c.amdsmi_status_code_to_string(status, ctypes.byref(text)) == SUCCESS and bool(text)
            raise AmdsmiError(
                status, ctypes.cast(text, ctypes.c_char_p).value.decode() if ok else str(status)
            )

    def _handles(self, get: Any, *first: Any) -> list[Any]:
        count = ctypes.c_uint32(0)
        self.check(get(*first, ctypes.byref(count), None))
        array = (ctypes.c_void_p * count.value)()
        if count.value:
            self.check(get(*first, ctypes.byref(count), array))
        return list(array[: count.value])

    def gpus(self) -> list[Any]:
        """`enumerate_gpus` (mod.rs 567-574): each socket's processor handles, sockets in amdsmi's order."""
        out = []
        for socket in self._handles(self.c.amdsmi_get_socket_handles):
            out.extend(self._handles(self.c.amdsmi_get_processor_handles, socket))
        return out

    def out(self, fn: Any, h: Any, *args: Any) -> Any:
        """Call `fn(h, *args, &out)` where `out` is the last argument's structure; return it."""
        value = fn.argtypes[-1]._type_()
        self.check(fn(h, *args, ctypes.byref(value)))
        return value


class AmdsmiGpu:
    """zeusd's per-GPU state (mod.rs 460-469): the power field chosen at init, the cached clock ranges, whether
    the energy counter passed validation. The library is opened afresh for every command."""

    def __init__(self, index: int, lib: AmdsmiLibrary) -> None:
        self.index = index
        handles = lib.gpus()
        if index >= len(handles):
            raise RuntimeError(f"GPU index {index} does not exist.")  # GpuNotFoundError at startup
        h = handles[index]
        power = lib.out(lib.c.amdsmi_get_power_info, h)
        self.power_field = next(
            (
                f
                for f in ("current_socket_power", "average_socket_power")
                if getattr(power, f) not in POWER_NA
            ),
            None,
        )
        self.bounds: dict[int, tuple[int, int] | None] = {}
        for kind in (CLK_GFX, CLK_MEM):
            try:
                info = lib.out(lib.c.amdsmi_get_clock_info, h, kind)
                self.bounds[kind] = (info.min_clk, info.max_clk)
            except AmdsmiError:
                self.bounds[kind] = None
        self.name = lib.out(lib.c.amdsmi_get_gpu_asic_info, h).market_name.decode()
        bdf = lib.out(lib.c.amdsmi_get_gpu_device_bdf, h).as_uint
        self.pci_address = f"{bdf >> 16:04x}:{(bdf >> 8) & 0xFF:02x}:{(bdf >> 3) & 0x1F:02x}.{bdf & 0x7:x}"
        # validate_energy_counters (862-960) compares 0.5 s of the counter with the power reading times 0.5 s;
        # a simulated counter integrates the simulated power, so it passes wherever it answers at all.
        try:
            self._energy_mj(lib, h)
            self.energy_available = True
        except AmdsmiError as e:
            if e.status != NOT_SUPPORTED:
                raise
            self.energy_available = False

    @staticmethod
    def _energy_mj(lib: AmdsmiLibrary, h: Any) -> int:
        """mod.rs 730-748: ticks times the resolution (µJ), / 1000."""
        ticks, resolution, timestamp = ctypes.c_uint64(), ctypes.c_float(), ctypes.c_uint64()
        lib.check(
            lib.c.amdsmi_get_energy_count(
                h, ctypes.byref(ticks), ctypes.byref(resolution), ctypes.byref(timestamp)
            )
        )
        return int(ticks.value * resolution.value / 1000.0)

    def run(self, faults: str, name: str, q: dict[str, Any]) -> Any:
        """The command `name` with query `q`: its result, or a `Refusal` (as zeusd's task answers)."""
        try:
            lib = AmdsmiLibrary(faults)
            return self._command(lib, lib.gpus()[self.index], name, q)
        except AmdsmiError as e:
            return e.refusal()
        except Refusal as r:
            return r

    def _command(self, lib: AmdsmiLibrary, h: Any, name: str, q: dict[str, Any]) -> Any:  # noqa: C901 - one arm a route
        c = lib.c
        if name in ("set_persistence_mode", "get_persistence_mode"):
            raise invalid_request(NO_PERSISTENCE)
        if name in ("reset_gpu_locked_clocks", "reset_mem_locked_clocks"):
            raise invalid_request(NO_SINGLE_DOMAIN)
        if name == "set_power_limit":
            return lib.check(c.amdsmi_set_power_cap(h, 0, q["power_limit_mw"] * 1000))
        if name in ("get_power_limit", "get_power_limit_constraints"):
            info = lib.out(c.amdsmi_get_power_cap_info, h, 0)
            if name == "get_power_limit":
                return {"power_limit_mw": info.power_cap // 1000}
            return {
                "min_power_limit_mw": info.min_power_cap // 1000,
                "max_power_limit_mw": info.max_power_cap // 1000,
            }
        if name in ("set_gpu_locked_clocks", "set_mem_locked_clocks"):
            kind = CLK_GFX if name == "set_gpu_locked_clocks" else CLK_MEM
            return self._set_locked_clocks(lib, h, kind, q["min_clock_mhz"], q["max_clock_mhz"])
        if name == "reset_locked_clocks":
            lib.check(c.amdsmi_set_gpu_perf_level(h, PERF_LEVEL_AUTO))
            self.bounds = {CLK_GFX: None, CLK_MEM: None}
            return None
        if name == "get_power":
            watts = (
                None
                if self.power_field is None
                else getattr(lib.out(c.amdsmi_get_power_info, h), self.power_field)
            )
            if watts is None or watts in POWER_NA:
                raise AmdsmiError(NOT_SUPPORTED, "AMDSMI_STATUS_NOT_SUPPORTED")
            return watts * 1000
        if name == "get_cumulative_energy":
            if not self.energy_available:
                raise invalid_request(
                    "The cumulative energy counter of this GPU is not available. It is either unsupported or "
                    "failed validation at zeusd startup (see https://github.com/ROCm/amdsmi/issues/38). Poll "
                    "/gpu/get_power and integrate over time instead."
                )
            return {"energy_mj": self._energy_mj(lib, h)}
        raise RuntimeError(f"no AMD command {name}")

    def _write_ends(self, lib: AmdsmiLibrary, h: Any, kind: int, lo: int, hi: int, max_first: bool) -> None:
        """mod.rs `write_locked_clocks` (766-799)."""
        ends = [(LIMIT_MIN, lo), (LIMIT_MAX, hi)]
        for limit, mhz in reversed(ends) if max_first else ends:
            lib.check(lib.c.amdsmi_set_gpu_clk_limit(h, kind, limit, mhz))

    def _set_locked_clocks(self, lib: AmdsmiLibrary, h: Any, kind: int, lo: int, hi: int) -> None:
        """mod.rs `set_locked_clocks` (801-859): cached range, write order, one re-read and retry, revert."""
        cached = self.bounds.get(kind)
        if cached is None:
            info = lib.out(lib.c.amdsmi_get_clock_info, h, kind)
            cached = self.bounds[kind] = (info.min_clk, info.max_clk)
        try:
            self._write_ends(lib, h, kind, lo, hi, lo > cached[1])
            self.bounds[kind] = (lo, hi)
            return
        except AmdsmiError:
            self.bounds[kind] = None
        info = lib.out(lib.c.amdsmi_get_clock_info, h, kind)
        queried = (info.min_clk, info.max_clk)
        try:
            self._write_ends(lib, h, kind, lo, hi, lo > queried[1])
            self.bounds[kind] = (lo, hi)
        except AmdsmiError:
            self.bounds[kind] = None
            try:  # put the range it had back (841-855), then report the error
                self._write_ends(lib, h, kind, cached[0], cached[1], cached[0] > queried[1])
                self.bounds[kind] = cached
            except AmdsmiError:
                pass
            raise
