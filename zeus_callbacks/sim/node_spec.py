"""What a simulated node is made of: its spec string, injected faults and the behaviours switched off."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.sim.specs import spec_for
from zeus_callbacks.sim.traces import Trace, load_trace, shipped_trace

IDEAL_BEHAVIOURS = (
    "energy_counter",
    "power_average",
    "power_window",
    "device_order",
    "interruptible_sync",
    "sensor_gain",
)
"""Hardware behaviours a simulation can switch off (`simulate(ideal=...)`, `ZEUS_CALLBACKS_SIM_IDEAL`)."""


@dataclass
class Faults:
    """Faults injected into one simulated GPU."""

    no_permission: bool = False
    not_supported: frozenset[str] = frozenset()  # subset of _UNSUPPORTABLE
    lost_after_calls: int | None = None
    lost_after_changes: int | None = None  # lost once this process has changed a setting this many times
    no_energy_counter: bool = False
    mig: bool = False
    hidden: bool = False  # counted by NVML, but the job's cgroup does not grant it
    no_cap_sys_admin: bool = False  # root without CAP_SYS_ADMIN: every setter is refused
    empty_clocks: bool = False  # the supported graphics clocks list is empty
    empty_memory_clocks: bool = False  # the supported memory clocks list is empty
    missing: frozenset[str] = frozenset()  # NVML functions an old driver's library lacks: FUNCTION_NOT_FOUND
    unknown: frozenset[str] = frozenset()  # NVML functions whose whole call answers UNKNOWN
    default_limit_w: float | None = None  # a default power limit below the maximum settable (GeForce)


def uuid_for(system_id: str, index: int, vendor: str = "nvidia") -> str:
    """NVIDIA's `GPU-8-4-4-4-12` form; an AMD board's is the `GPU-<16 hex>` of its unique id, as ROCr and HIP
    (and `HIP_VISIBLE_DEVICES`) name it."""
    h = hashlib.sha1(f"{system_id}/{index}".encode()).hexdigest()
    if vendor == "amd":
        return f"GPU-{h[:16]}"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass
class GPUGroup:
    """`COUNT*KIND[:WORKLOAD][@TRACE_FILE]` of a simulation spec."""

    kind: str
    count: int = 1
    workload: str | None = None
    trace_file: str | None = None

    def trace(self) -> Trace:
        if self.trace_file:
            return load_trace(self.trace_file, self.workload or "", gpu_model=self.kind)
        return shipped_trace(spec_for(self.kind).kind, self.workload)


def parse_spec(spec: str) -> list[GPUGroup]:
    """Parse `ZEUS_CALLBACKS_SIMULATE`: comma-separated `[COUNT*]KIND[:WORKLOAD][@TRACE_FILE]` groups.

    Examples: `a40`, `4*a40:imagenet/resnet50/256`, `a10g,t4`, `2*v100:resnet50`,
    `a40:mydata/mynet/64@/data/my_profile.csv`.
    """
    groups = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        count = 1
        if "*" in item:
            n, item = item.split("*", 1)
            if not n.strip().isdigit() or int(n) < 1:
                raise InvalidInputError(
                    f"{SPEC_INPUT} {spec!r}: {raw!r} needs a positive count before '*', e.g. 4*a40."
                )
            count = int(n)
        trace_file = None
        if "@" in item:
            item, trace_file = item.split("@", 1)
        kind, _, workload = item.partition(":")
        try:
            spec_for(kind)
        except ValueError as e:
            raise InvalidInputError(f"{SPEC_INPUT} {spec!r}: {e}") from None
        groups.append(GPUGroup(kind.strip().lower(), count, workload or None, trace_file))
    if not groups:
        raise InvalidInputError(f"{SPEC_INPUT} {spec!r} names no GPU; e.g. ZEUS_CALLBACKS_SIMULATE=a40.")
    vendors = {spec_for(g.kind).vendor for g in groups}
    if len(vendors) > 1:
        raise InvalidInputError(
            f"{SPEC_INPUT} {spec!r} mixes NVIDIA and AMD GPUs; a node is simulated with one vendor's GPUs, as this "
            "package drives one vendor's per process. Simulate them apart, e.g. ZEUS_CALLBACKS_SIMULATE=2*mi300x."
        )
    return groups


def parse_faults(text: str) -> dict[int | None, Faults]:
    """Parse `ZEUS_CALLBACKS_SIM_FAULTS`: `;`-separated `NAME[=VALUE][@GPU_INDEX]`.

    Names: `no_permission` (a user without the right to change settings), `no_cap_sys_admin` (root in a
    container without CAP_SYS_ADMIN), `not_supported=power|clocks|persistence|power_draw|clock_info`
    (repeatable),
    `lost_after=N` (NVML calls), `lost_after_changes=N` (lost once this process has changed the power limit
    or SM clocks N times), `no_energy_counter`, `mig`, `hidden` (NVML counts the GPU but the job's
    cgroup does not grant it: opening it raises NO_PERMISSION), `empty_clocks` (no supported graphics
    clocks listed), `empty_memory_clocks` (no supported memory clocks listed), `default_limit_w=W` (a default
    power limit below the maximum, as on GeForce boards), `missing=FUNCTION` (the NVML library lacks it, as
    an old driver's: FUNCTION_NOT_FOUND), `unknown=FUNCTION` (the whole call answers UNKNOWN); both
    repeatable, FUNCTION one of `FAULTABLE_CALLS`.
    Without `@GPU_INDEX` a fault applies to every GPU; `GPU_INDEX` is the NVML index (PCI bus order).
    """
    out: dict[int | None, Faults] = {}
    for raw in filter(None, (t.strip() for t in text.replace(",", ";").split(";"))):
        item, _, where = raw.partition("@")
        name, eq, value = (t.strip() for t in item.partition("="))
        target = _fault_number(text, raw, where, int, 0) if where else None
        f = out.setdefault(target, Faults())
        if name == "not_supported":
            if (value or "clocks") not in _UNSUPPORTABLE:
                raise _bad_fault(text, raw, f"not_supported takes one of {', '.join(_UNSUPPORTABLE)}")
            f.not_supported = f.not_supported | {value or "clocks"}
        elif name in ("missing", "unknown"):
            if value not in FAULTABLE_CALLS:
                raise _bad_fault(text, raw, f"{name} takes one of {', '.join(FAULTABLE_CALLS)}")
            setattr(f, name, getattr(f, name) | {value})
        elif name == "lost_after":
            f.lost_after_calls = _fault_number(text, raw, value, int, 0)
        elif name == "lost_after_changes":
            f.lost_after_changes = _fault_number(text, raw, value, int, 1)
        elif name in _FLAG_FAULTS:
            if eq:
                raise _bad_fault(text, raw, f"{name} takes no value")
            setattr(f, name, True)
        elif name == "default_limit_w":
            f.default_limit_w = _fault_number(text, raw, value, float, 1)
        else:
            raise _bad_fault(text, raw, f"unknown fault {name!r}")
    return out


# power: the power-limit calls; clocks: clock lists and locks; power_draw: power readings; clock_info: the
# current and maximum clocks (a dump's N/A: GTX680.nvidia-smi-a.txt); persistence: persistence mode.
_UNSUPPORTABLE = ("power", "clocks", "persistence", "power_draw", "clock_info")
# NVML functions the `missing=` and `unknown=` faults may name (the simulated NVML checks these).
FAULTABLE_CALLS = (
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetTotalEnergyConsumption",
)
FAULTS_INPUT = "Simulated faults (ZEUS_CALLBACKS_SIM_FAULTS, or simulate(faults=...))"
SPEC_INPUT = "Simulated GPUs (ZEUS_CALLBACKS_SIMULATE, or simulate(spec))"
_FAULTS_KNOWN = (
    "Known: no_permission, no_cap_sys_admin, not_supported=power|clocks|persistence|power_draw|clock_info, "
    "lost_after=N, "
    "lost_after_changes=N, no_energy_counter, mig, hidden, empty_clocks, empty_memory_clocks, default_limit_w=W, "
    "missing=FUNCTION, unknown=FUNCTION, each optionally @GPU_INDEX."
)


def _bad_fault(text: str, raw: str, why: str) -> InvalidInputError:
    where = repr(text) if raw == text.strip() else f"{text!r}, in {raw!r}"
    return InvalidInputError(f"{FAULTS_INPUT} {where}: {why}. {_FAULTS_KNOWN}")


def _fault_number(text: str, raw: str, value: str, kind: type, lowest: float) -> Any:
    """`value` as a finite `kind` (int or float) >= `lowest`, or an error naming the fault."""
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or not math.isfinite(number) or number < lowest:
        what = "a whole number" if kind is int else "a number"
        raise _bad_fault(text, raw, f"{value!r} is not {what} >= {lowest}")
    return number


_FLAG_FAULTS = (
    "no_permission",
    "no_cap_sys_admin",
    "no_energy_counter",
    "mig",
    "hidden",
    "empty_clocks",
    "empty_memory_clocks",
)


def merge_faults(a: Faults | None, b: Faults | None) -> Faults:
    a, b = a or Faults(), b or Faults()
    return Faults(
        not_supported=a.not_supported | b.not_supported,
        missing=a.missing | b.missing,
        unknown=a.unknown | b.unknown,
        lost_after_calls=b.lost_after_calls if b.lost_after_calls is not None else a.lost_after_calls,
        lost_after_changes=b.lost_after_changes if b.lost_after_changes is not None else a.lost_after_changes,
        default_limit_w=b.default_limit_w if b.default_limit_w is not None else a.default_limit_w,
        **{name: getattr(a, name) or getattr(b, name) for name in _FLAG_FAULTS},
    )


def parse_ideal(text: str) -> frozenset[str]:
    """Parse `ZEUS_CALLBACKS_SIM_IDEAL`: comma-separated hardware behaviours to switch off (`IDEAL_BEHAVIOURS`)."""
    names = frozenset(filter(None, (t.strip() for t in text.replace(";", ",").split(","))))
    unknown = sorted(names - set(IDEAL_BEHAVIOURS))
    if unknown:
        raise InvalidInputError(
            f"Unknown ideal simulator behaviour(s) {', '.join(unknown)} in {text!r} (ZEUS_CALLBACKS_SIM_IDEAL, "
            f"or simulate(ideal=...)). Known: {', '.join(IDEAL_BEHAVIOURS)}."
        )
    return names


def pci_bus_id(nvml_index: int) -> str:
    return f"00000000:{0x17 + 0x10 * nvml_index:02X}:00.0"
