"""How PowerMonitor reads power: the domains each GPU offers, one reading of them, and how often they change.

Each power domain is read from the source its GPU's `Device` names for it (`Device.power_domains_mw`; on
NVIDIA, nvml.h's fields):

- `device_instant`: the instantaneous draw (NVIDIA: `NVML_FI_DEV_POWER_INSTANT`, "Current GPU power, supported
  on all architectures"); where a driver lacks it, the standard reading where that is the instant one
  (NVIDIA boards before Ampere, and GA100: A100, A30).
- `device_average`: power averaged over one second (NVIDIA: `NVML_FI_DEV_POWER_AVERAGE`, "supported on Ampere
  (except GA100) or newer architectures"); without it, the standard reading on those boards, where it is that
  1-second average (`Device.power_usage_domain` says which domain the standard reading is).
- `memory_average`: the memory's average power (NVIDIA: `NVML_FI_DEV_POWER_AVERAGE` with the memory scope),
  as nvidia-smi reads it; Zeus finds it on the H100 and not on the A40.

A domain the GPU does not answer is one it lacks. All field domains of a GPU are read in one call per tick,
from one daemon thread that sleeps between ticks. Unlike PyPI Zeus 0.16.0, whose `update_period=None` infers
0 s and then polls without pause, the inferred period is half the GPU's power-reading refresh, kept within
10-100 ms.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.gpus import GPU, get_gpus
from zeus_callbacks.core.device.power import energy_refresh_period_s, measure_refresh_s

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


class PowerDomain(Enum):
    """What a power reading measures (Zeus's names)."""

    DEVICE_INSTANT = "device_instant"
    DEVICE_AVERAGE = "device_average"
    MEMORY_AVERAGE = "memory_average"


DomainName = PowerDomain | Literal["device_instant", "device_average", "memory_average"]


@dataclass(frozen=True, slots=True)
class PowerReader:
    """How one GPU's domains are read: `fields` in one `Device.power_domains_mw` call, and the domain its
    standard reading (`power_mw`) gives."""

    fields: tuple[PowerDomain, ...]
    usage: PowerDomain | None


def _read_fields(gpu: GPU, fields: Sequence[PowerDomain]) -> list[int | None] | None:
    """The domains' readings (mW) in one call, None for each one not answered; None when not offered."""
    return gpu.device.power_domains_mw([d.value for d in fields])


def probe(gpu: GPU) -> PowerReader:
    """Which domains `gpu` offers and how each is read (see the module's docstring)."""
    wanted = tuple(PowerDomain)
    answered = _read_fields(gpu, wanted) or [None] * len(wanted)
    # A memory reading of 0 mW is NVML's answer on boards that do not measure it (Zeus warns of it).
    fields = tuple(d for d, v in zip(wanted, answered, strict=True) if v is not None and v > 0)
    domain = gpu.device.power_usage_domain
    usage = None if domain is None or PowerDomain(domain) in fields else PowerDomain(domain)
    if usage is not None:
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
        values = _read_fields(gpu, reader.fields)
        out += [(d, mw) for d, mw in zip(reader.fields, values or (), strict=False) if mw]
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
        period = gpu.backend.known_energy_refresh_s(gpu.device) or None
    else:
        period = measure_refresh_s(
            read, changes=_PROBE_CHANGES, budget_s=_PROBE_BUDGET_S, poll_s=_PROBE_SLEEP_S, min_changes=3
        )
        if period is not None and period < 2.5 * _PROBE_SLEEP_S and gpu.supports_energy_counter:
            period = energy_refresh_period_s(gpu)
    with _refresh_lock:
        _refresh_s[gpu.uuid] = period
    return period


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
                return _read_fields(gpu, reader.fields[:1])
            return gpu.power_mw()

        refresh = _power_refresh_s(gpu, read)
        logger.info(
            "%s: power reading refreshes every %s.",
            gpu.label,
            "(unknown; assuming 100 ms)" if refresh is None else f"{refresh * 1000:.0f} ms",
        )
        refreshes[gpu.name] = _DEFAULT_REFRESH_S if refresh is None else refresh
    return min(MAX_UPDATE_PERIOD_S, max(MIN_UPDATE_PERIOD_S, min(refreshes.values()) / 2))
