"""PowerMonitor: a background power timeline per GPU, with Zeus's `zeus.monitor.power` interface.

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
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from zeus_callbacks.core.device.errors import GPUError, InvalidInputError, nvml_error
from zeus_callbacks.core.device.gpus import GPU, get_gpus
from zeus_callbacks.core.device.power import energy_refresh_period_s
from zeus_callbacks.core.monitor.timeline import (
    Poller,
    Series,
    check_gpu_indices,
    check_max_samples,
    check_period,
    integrate,
    weak_poll,
)

__all__ = [
    "PowerMonitor",
    "PowerDomain",
    "PowerSample",
    "infer_counter_update_period",
    "MIN_UPDATE_PERIOD_S",
    "MAX_UPDATE_PERIOD_S",
]

logger = logging.getLogger(__name__)

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
class PowerSample:
    """One power reading (Zeus's `PowerSample`): when, which GPU, how much (mW)."""

    timestamp: float
    gpu_index: int
    power_mw: float


@dataclass(frozen=True, slots=True)
class _Reader:
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


def _probe(gpu: GPU) -> _Reader:
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
    return _Reader(fields, usage)


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
        reader = _probe(gpu)

        def read(gpu: GPU = gpu, reader: _Reader = reader) -> object:
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


def _domains(value: object) -> list[PowerDomain] | None:
    if value is None:
        return None
    call = f"`PowerMonitor(power_domains={value!r})`"
    names = ", ".join(repr(d.value) for d in PowerDomain)
    if isinstance(value, (str, PowerDomain)) or not isinstance(value, Sequence | set | frozenset):
        raise InvalidInputError(f"{call}: expected a list of power domains ({names}).")
    if not value:
        raise InvalidInputError(f"{call}: name at least one domain ({names}), or pass None for every one.")
    out = []
    for d in value:
        try:
            out.append(PowerDomain(d))
        except ValueError:
            raise InvalidInputError(f"{call}: {d!r} is not a power domain; choose from {names}.") from None
    return list(dict.fromkeys(out))


class PowerMonitor:
    """Sample the power of GPUs in the background and keep a timeline per GPU and power domain.

    Zeus's `zeus.monitor.power.PowerMonitor`, drop-in. One daemon thread (not a spawned process, so nothing
    re-imports the main module) reads every monitored GPU once per `update_period`, storing a reading when it
    changes. Timestamps come from the device layer's clock: `time.time()` on real GPUs (pass `time.time()`
    values to `get_energy`), the virtual clock on a virtual-clock simulation.

    Args:
        gpu_indices: GPUs to monitor, as the framework numbers them (after `CUDA_VISIBLE_DEVICES`); None:
            every visible GPU. GPUs may be of different models.
        update_period: Seconds between two readings; None infers half the GPUs' power-reading refresh
            (10-100 ms; measured once per GPU, up to about a second the first time).
        max_samples_per_gpu: Readings kept per GPU and domain (None: all).
        power_domains: Domains to sample (`PowerDomain` or their names); None: every domain all the GPUs offer.
        background: False starts no thread: readings are taken only when `poll()` is called (a virtual-clock
            simulation, or a loop that wants to decide when NVML is read).

    Raises:
        InvalidInputError: (a ValueError) a bad argument, or a requested domain some GPU lacks (the message
            names the GPU and the domains it offers).

    Example::

        monitor = PowerMonitor(gpu_indices=[0])
        start = time.time()
        train()
        joules = monitor.get_energy(start, time.time())[0]
        monitor.stop()
    """

    def __init__(
        self,
        gpu_indices: list[int] | None = None,
        update_period: float | None = None,
        max_samples_per_gpu: int | None = None,
        power_domains: list[DomainName] | None = None,
        *,
        background: bool = True,
    ) -> None:
        if update_period is not None:
            update_period = check_period("PowerMonitor", "update_period", update_period)
        max_samples = check_max_samples("PowerMonitor", max_samples_per_gpu)
        requested = _domains(power_domains)
        gpus = get_gpus()
        self.gpu_indices: list[int] = check_gpu_indices("PowerMonitor", gpu_indices, len(gpus))
        self.simulated: bool = gpus.simulated
        self._clock = gpus.clock
        self._gpus = [gpus[i] for i in self.gpu_indices]
        readers = [_probe(g) for g in self._gpus]
        offered = [{d for d, _, _ in r.fields} | ({r.usage} if r.usage else set()) for r in readers]
        supported = [d for d in PowerDomain if all(d in o for o in offered)]
        if requested is None:
            self.measurement_domains: list[PowerDomain] = supported
        else:
            for d in requested:
                for g, o in zip(self._gpus, offered, strict=True):
                    if d not in o:
                        raise InvalidInputError(
                            f"`PowerMonitor(power_domains=[..., {d.value!r}])`: {g.label} does not offer "
                            f"{d.value!r} (it offers {sorted(x.value for x in o)}). Leave it out, or pass "
                            "power_domains=None for every domain all the GPUs offer."
                        )
            self.measurement_domains = requested
        if not self.measurement_domains:
            raise InvalidInputError(
                f"`PowerMonitor(gpu_indices={self.gpu_indices})`: these GPUs offer no power domain in common "
                f"({', '.join(f'{g.label}: {sorted(x.value for x in o)}' for g, o in zip(self._gpus, offered, strict=True))})."
            )
        if PowerDomain.DEVICE_INSTANT not in self.measurement_domains:
            logger.warning("PowerMonitor: device_instant is not sampled, so `get_power` is unavailable.")
        wanted = set(self.measurement_domains)
        self._readers = [
            _Reader(tuple(f for f in r.fields if f[0] in wanted), r.usage if r.usage in wanted else None)
            for r in readers
        ]
        self._series = {d: {i: Series(max_samples) for i in self.gpu_indices} for d in self.measurement_domains}
        self._lock = threading.Lock()
        self._failed: dict[int, str] = {}
        self.update_period: float = (
            infer_counter_update_period(self.gpu_indices) if update_period is None else update_period
        )
        if self.update_period < MIN_UPDATE_PERIOD_S:
            logger.warning(
                "PowerMonitor(update_period=%g): faster than any GPU updates its power reading (every 20 ms "
                "at best); readings will repeat.",
                self.update_period,
            )
        logger.info(
            "PowerMonitor on %sGPUs %s: %s every %.0f ms.",
            "SIMULATED " if self.simulated else "",
            self.gpu_indices,
            ", ".join(d.value for d in self.measurement_domains),
            self.update_period * 1000,
        )
        self.poll()
        self._poller: Poller | None = None
        if background:
            self._poller = Poller("zeus-callbacks-power-monitor", self.update_period, weak_poll(self))
            self._finalizer = weakref.finalize(self, self._poller.stop)

    # -- sampling ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every monitored GPU's domains once, now (what the background thread does every period)."""
        with self._lock:
            for gpu, index, reader in zip(self._gpus, self.gpu_indices, self._readers, strict=True):
                if index in self._failed:
                    continue
                t = self._clock()
                try:
                    if reader.fields:
                        values = _read_fields(gpu, [(f, s) for _, f, s in reader.fields])
                        for (domain, _, _), mw in zip(reader.fields, values or (), strict=False):
                            if mw:  # NOT_SUPPORTED now and then, or 0 mW, when polled fast: skipped
                                self._series[domain][index].add(t, mw)
                    if reader.usage is not None:
                        mw = gpu.power_mw()
                        if mw > 0:
                            self._series[reader.usage][index].add(t, mw)
                except GPUError as e:
                    self._failed[index] = str(e)
                    logger.warning("PowerMonitor: %s stopped answering (%s); its timeline ends here.", gpu.label, e)

    def stop(self) -> None:
        """Stop sampling (idempotent; also done when the monitor is garbage-collected or at exit)."""
        if self._poller is not None:
            self._finalizer()

    # -- queries (Zeus's) -------------------------------------------------------------------------
    def _domain(self, power_domain: object) -> PowerDomain:
        try:
            domain = PowerDomain(power_domain)
        except ValueError:
            names = ", ".join(repr(d.value) for d in PowerDomain)
            raise InvalidInputError(f"{power_domain!r} is not a power domain; choose from {names}.") from None
        if domain not in self.measurement_domains:
            raise InvalidInputError(
                f"Power domain {domain.value!r} is not being monitored; monitored: "
                f"{[d.value for d in self.measurement_domains]}."
            )
        return domain

    def get_power_timeline(
        self,
        power_domain: DomainName,
        gpu_index: int | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
    ) -> dict[int, list[tuple[float, float]]]:
        """The timeline of one domain: {GPU index: [(timestamp, watts), ...]}, oldest first, filtered to
        [start_time, end_time] where given; `gpu_index` selects one GPU."""
        domain = self._domain(power_domain)
        indices = self.gpu_indices if gpu_index is None else [gpu_index]
        with self._lock:
            return {
                i: [(t, mw / 1000) for t, mw in self._series[domain][i].points(start_time, end_time)]
                for i in indices
                if i in self._series[domain]
            }

    def get_all_power_timelines(
        self, gpu_index: int | None = None, start_time: float | None = None, end_time: float | None = None
    ) -> dict[str, dict[int, list[tuple[float, float]]]]:
        """Every monitored domain's timeline, by domain name."""
        return {
            d.value: self.get_power_timeline(d, gpu_index, start_time, end_time) for d in self.measurement_domains
        }

    def get_energy(self, start_time: float, end_time: float) -> dict[int, float] | None:
        """Energy (J) per GPU between two times: the trapezoidal integral of device_instant power (else
        device_average), over the part of [start_time, end_time] the timeline covers. None before the first
        reading.

        Raises:
            InvalidInputError: neither device domain is monitored, or the times are not numbers in order.
        """
        for t in (start_time, end_time):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t:
                raise InvalidInputError(f"`get_energy({start_time!r}, {end_time!r})`: expected two times (s).")
        if end_time < start_time:
            raise InvalidInputError(
                f"`get_energy({start_time!r}, {end_time!r})`: end_time is before start_time; pass (start, end)."
            )
        domain = next(
            (d for d in (PowerDomain.DEVICE_INSTANT, PowerDomain.DEVICE_AVERAGE) if d in self.measurement_domains),
            None,
        )
        if domain is None:
            raise InvalidInputError(
                "PowerMonitor.get_energy needs device_instant or device_average power; monitored: "
                f"{[d.value for d in self.measurement_domains]}."
            )
        with self._lock:
            series = self._series[domain]
            if all(series[i].latest() is None for i in self.gpu_indices):
                return None
            return {i: integrate(series[i].points(), start_time, end_time) / 1000 for i in self.gpu_indices}

    def get_power(self, time: float | None = None) -> dict[int, float] | None:
        """device_instant power (W) per GPU: the latest reading, or the one closest to `time`; None while
        some GPU has no reading.

        Raises:
            InvalidInputError: device_instant is not monitored.
        """
        if PowerDomain.DEVICE_INSTANT not in self.measurement_domains:
            raise InvalidInputError(
                "PowerMonitor.get_power needs device_instant power; monitored: "
                f"{[d.value for d in self.measurement_domains]}."
            )
        series = self._series[PowerDomain.DEVICE_INSTANT]
        out: dict[int, float] = {}
        with self._lock:
            for i in self.gpu_indices:
                point = series[i].latest() if time is None else series[i].nearest(time)
                if point is None:
                    return None
                out[i] = point[1] / 1000
        return out

    @property
    def failed_gpus(self) -> dict[int, str]:
        """GPUs that stopped answering (index -> why); their timelines end at their last reading."""
        return dict(self._failed)
