"""How PowerMonitor reads power: the domains each GPU offers, one reading of them, and how often they change.

Each power domain is read from the NVML source that measures it on the GPU's generation (nvml.h):

- `device_instant`: the field `NVML_FI_DEV_POWER_INSTANT` ("Current GPU power, supported on all
  architectures"); where a driver's NVML lacks the field, `nvmlDeviceGetPowerUsage`, which is the instant
  reading on boards before Ampere and on GA100 (A100, A30).
- `device_average`: the field `NVML_FI_DEV_POWER_AVERAGE` ("GPU power averaged over 1 sec interval, supported
  on Ampere (except GA100) or newer architectures"); without the field, `nvmlDeviceGetPowerUsage` on those
  boards, where it is that 1-second average.
- `memory_average`: `NVML_FI_DEV_POWER_AVERAGE` with `NVML_POWER_SCOPE_MEMORY` (nvml.h: "Targets the GPU
  Memory"), as nvidia-smi reads it; Zeus finds it on the H100 and not on the A40.

A field NVML answers NOT_SUPPORTED (in its own `nvmlReturn`) is a domain the GPU lacks. All field domains of
a GPU are read in one `nvmlDeviceGetFieldValues` call per tick, from one daemon thread that sleeps between
ticks. Unlike PyPI Zeus 0.16.0, whose `update_period=None` infers 0 s and then polls without pause, the
inferred period is half the GPU's power-reading refresh, kept within 10-100 ms.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from zeus_callbacks.core.device.errors import GPUError, nvml_error
from zeus_callbacks.core.device.gpus import GPU, get_gpus
from zeus_callbacks.core.device.power import energy_refresh_period_s

__all__ = [
    "PowerDomain",
    "DomainName",
    "PowerReader",
    "probe",
    "read_power",
    "infer_counter_update_period",
    "MIN_UPDATE_PERIOD_S",
    "MAX_UPDATE_PERIOD_S",
]

logger = logging.getLogger("zeus_callbacks.core.monitor.power")

# Half the fastest power update measured on NVIDIA boards (Volta, every 20 ms: Yang et al., SC'24, as in
# sim/specs.py), and Zeus's slowest useful rate (ten times a second).
MIN_UPDATE_PERIOD_S = 0.01
MAX_UPDATE_PERIOD_S = 0.1
_DEFAULT_REFRESH_S = 0.1  # a reading that never moved while measured: assume the common 100 ms update
_PROBE_SLEEP_S = 0.001
_PROBE_BUDGET_S = 0.5
_PROBE_CHANGES = 6
_GA100 = ("A100", "A30", "A800")  # GA100 boards: nvml.h's "except GA100"
_NOT_OFFERED = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_FUNCTION_NOT_FOUND")


class PowerDomain(Enum):
    """What a power reading measures (Zeus's names)."""

    DEVICE_INSTANT = "device_instant"
    DEVICE_AVERAGE = "device_average"
    MEMORY_AVERAGE = "memory_average"


DomainName = PowerDomain | Literal["device_instant", "device_average", "memory_average"]


@dataclass(frozen=True, slots=True)
class PowerReader:
    """How one GPU's domains are read: fields in one call, and the domain `nvmlDeviceGetPowerUsage` gives."""

    fields: tuple[tuple[PowerDomain, int, int], ...]  # (domain, field id, scope)
    usage: PowerDomain | None


def _is_ga100(gpu: GPU) -> bool:
    return any(name in gpu.name for name in _GA100)


def _read_fields(gpu: GPU, fields: Sequence[tuple[int, int]]) -> list[int | None] | None:
    """Field values (mW) in one call, None for each field not answered; None when the call is not offered."""
    nvml = gpu.nvml
    get = getattr(nvml, "nvmlDeviceGetFieldValues", None)
    if get is None:
        return None
    try:
        values = get(gpu.handle, list(fields))
    except nvml.NVMLError as e:
        offered = {getattr(nvml, name) for name in _NOT_OFFERED} | {nvml.NVML_ERROR_UNKNOWN}
        if getattr(e, "value", None) in offered:
            return None
        raise nvml_error(nvml, e, "Reading power", gpu.label) from None
    return [int(v.value.uiVal) if v.nvmlReturn == nvml.NVML_SUCCESS else None for v in values]


def probe(gpu: GPU) -> PowerReader:
    """Which domains `gpu` offers and how each is read (see the module's docstring)."""
    nvml = gpu.nvml
    wanted = [
        (PowerDomain.DEVICE_INSTANT, nvml.NVML_FI_DEV_POWER_INSTANT, nvml.NVML_POWER_SCOPE_GPU),
        (PowerDomain.DEVICE_AVERAGE, nvml.NVML_FI_DEV_POWER_AVERAGE, nvml.NVML_POWER_SCOPE_GPU),
        (PowerDomain.MEMORY_AVERAGE, nvml.NVML_FI_DEV_POWER_AVERAGE, nvml.NVML_POWER_SCOPE_MEMORY),
    ]
    answered = _read_fields(gpu, [(f, s) for _, f, s in wanted]) or [None] * len(wanted)
    # A memory reading of 0 mW is NVML's answer on boards that do not measure it (Zeus warns of it).
    fields = tuple(w for w, v in zip(wanted, answered, strict=True) if v is not None and v > 0)
    have = {d for d, _, _ in fields}
    arch, ampere = gpu.architecture, nvml.NVML_DEVICE_ARCH_AMPERE
    usage: PowerDomain | None = None
    if arch is not None:
        averaged = arch >= ampere and not _is_ga100(gpu)
        usage = PowerDomain.DEVICE_AVERAGE if averaged else PowerDomain.DEVICE_INSTANT
        if usage in have:
            usage = None
        else:
            try:
                gpu.power_mw()
            except GPUError:
                usage = None
    return PowerReader(fields, usage)


def read_power(gpu: GPU, reader: PowerReader) -> list[tuple[PowerDomain, int]]:
    """One reading of each domain `reader` names (mW); a domain that answered NOT_SUPPORTED or 0 mW this
    time (as NVML does now and then when polled fast) is left out.

    Raises:
        GPUError: the GPU stopped answering.
    """
    out: list[tuple[PowerDomain, int]] = []
    if reader.fields:
        values = _read_fields(gpu, [(f, s) for _, f, s in reader.fields])
        out += [(d, mw) for (d, _, _), mw in zip(reader.fields, values or (), strict=False) if mw]
    if reader.usage is not None:
        mw = gpu.power_mw()
        if mw > 0:
            out.append((reader.usage, mw))
    return out


_refresh_s: dict[str, float | None] = {}
_refresh_lock = threading.Lock()


def _power_refresh_s(gpu: GPU, read: Any) -> float | None:
    """How often `gpu`'s power reading changes (s), measured once per GPU by polling it with sleeps.

    A reading that changes at nearly every read is not quantised by a refresh this can see (a continuous
    estimate, or an update faster than 2.5 ms): the energy counter's refresh, which the driver updates
    with the same sensor, stands in. On a virtual clock nothing moves while polling, so the backend's
    known period is used.
    """
    with _refresh_lock:
        if gpu.uuid in _refresh_s:
            return _refresh_s[gpu.uuid]
    if gpu.backend.virtual_clock:
        period = gpu.backend.known_energy_refresh_s(gpu.handle) or None
    else:
        period = _measure_refresh(read)
        if period is not None and period < 2.5 * _PROBE_SLEEP_S and gpu.supports_energy_counter:
            period = energy_refresh_period_s(gpu)
    with _refresh_lock:
        _refresh_s[gpu.uuid] = period
    return period


def _measure_refresh(read: Any) -> float | None:
    last, changes = read(), []
    deadline = time.monotonic() + _PROBE_BUDGET_S
    while len(changes) < _PROBE_CHANGES and time.monotonic() < deadline:
        time.sleep(_PROBE_SLEEP_S)
        value = read()
        if value != last:
            changes.append(time.monotonic())
            last = value
    if len(changes) < 3:
        return None
    return statistics.median(b - a for a, b in zip(changes, changes[1:], strict=False))


def infer_counter_update_period(gpu_indices: Sequence[int]) -> float:
    """The polling period for these GPUs (s): half the fastest power-reading refresh among their models,
    kept within `MIN_UPDATE_PERIOD_S`-`MAX_UPDATE_PERIOD_S` (never 0, so polling always sleeps)."""
    gpus = get_gpus()
    refreshes: dict[str, float] = {}
    for i in gpu_indices:
        gpu = gpus[i]
        if gpu.name in refreshes:
            continue
        reader = probe(gpu)

        def read(gpu: GPU = gpu, reader: PowerReader = reader) -> object:
            if reader.fields:
                return _read_fields(gpu, [(f, s) for _, f, s in reader.fields[:1]])
            return gpu.power_mw()

        refresh = _power_refresh_s(gpu, read)
        logger.info(
            "%s: power reading refreshes every %s.",
            gpu.label,
            "(unknown; assuming 100 ms)" if refresh is None else f"{refresh * 1000:.0f} ms",
        )
        refreshes[gpu.name] = _DEFAULT_REFRESH_S if refresh is None else refresh
    return min(MAX_UPDATE_PERIOD_S, max(MIN_UPDATE_PERIOD_S, min(refreshes.values()) / 2))
