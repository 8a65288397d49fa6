"""PowerMonitor: a background power timeline per GPU, with Zeus's `zeus.monitor.power` interface.

What each power domain reads on each GPU generation, and how often it changes, is in `power_readings`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from zeus_callbacks.core.device.errors import GPUError, InvalidInputError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor.power_readings import (
    MAX_UPDATE_PERIOD_S,
    MIN_UPDATE_PERIOD_S,
    DomainName,
    PowerDomain,
    PowerReader,
    infer_counter_update_period,
    probe,
    read_power,
)
from zeus_callbacks.core.monitor.sampling_process import SamplingProcess, SamplingProcessError
from zeus_callbacks.core.monitor.timeline import (
    Poller,
    Series,
    check_gpu_indices,
    check_max_samples,
    check_period,
    integrate,
    trapezoid_error,
    weak_poll,
)
from zeus_callbacks.core.monitor.uncertainty import EnergyBound, PowerSensor

__all__ = [
    "PowerMonitor",
    "PowerDomain",
    "PowerSample",
    "infer_counter_update_period",
    "MIN_UPDATE_PERIOD_S",
    "MAX_UPDATE_PERIOD_S",
]

logger = logging.getLogger(__name__)

_AVERAGE_WINDOW_S = 1.0  # NVML_FI_DEV_POWER_AVERAGE: "GPU power averaged over 1 sec interval" (nvml.h)


@dataclass(frozen=True, slots=True)
class PowerSample:
    """One power reading (Zeus's `PowerSample`): when, which GPU, how much (mW)."""

    timestamp: float
    gpu_index: int
    power_mw: float


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


def _measured_domains(
    indices: list[int], gpus: list[Any], readers: list[PowerReader], requested: list[PowerDomain] | None
) -> list[PowerDomain]:
    """The domains to sample: those requested (each offered by every GPU), else every domain all offer."""
    offered = [set(r.fields) | ({r.usage} if r.usage else set()) for r in readers]
    if requested is not None:
        for d in requested:
            for g, o in zip(gpus, offered, strict=True):
                if d not in o:
                    raise InvalidInputError(
                        f"`PowerMonitor(power_domains=[..., {d.value!r}])`: {g.label} does not offer "
                        f"{d.value!r} (it offers {sorted(x.value for x in o)}). Leave it out, or pass "
                        "power_domains=None for every domain all the GPUs offer."
                    )
        return requested
    supported = [d for d in PowerDomain if all(d in o for o in offered)]
    if not supported:
        each = ", ".join(
            f"{g.label}: {sorted(x.value for x in o)}" for g, o in zip(gpus, offered, strict=True)
        )
        raise InvalidInputError(
            f"`PowerMonitor(gpu_indices={indices})`: these GPUs offer no power domain in common ({each})."
        )
    return supported


class PowerMonitor:
    """Sample the power of GPUs in the background and keep a timeline per GPU and power domain.

    Zeus's `zeus.monitor.power.PowerMonitor`, drop-in. A sampler reads every monitored GPU once per
    `update_period`, and a reading is stored when it changes. By default the sampler is another process
    (`sampling_process`: started with `python -m`, so it never re-imports the main module, nor torch), as
    Zeus's is, so that sampling never takes the GIL from a training step; its readings come over when the
    timeline is queried. Where no other process can reach the GPUs (a simulation kept in memory, a virtual
    clock), or with `sampling="thread"`, a daemon thread of this process samples instead. Timestamps come from
    the device layer's clock: `time.time()` on real GPUs (pass `time.time()` values to `get_energy`), the
    virtual clock on a virtual-clock simulation.

    Args:
        gpu_indices: GPUs to monitor, as the framework numbers them (after `CUDA_VISIBLE_DEVICES`); None:
            every visible GPU. GPUs may be of different models.
        update_period: Seconds between two readings; None infers half the GPUs' power-reading refresh
            (10-100 ms; measured once per GPU, up to about a second the first time).
        max_samples_per_gpu: Readings kept per GPU and domain (None: all).
        power_domains: Domains to sample (`PowerDomain` or their names); None: every domain all the GPUs offer.
        background: False starts no sampler: readings are taken only when `poll()` is called (a virtual-clock
            simulation, or a loop that wants to decide when NVML is read).
        sampling: "process" (default) or "thread": where the background sampler runs (see above). A process
            that cannot start within a minute is said in a warning, and a thread samples instead.

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
        sampling: Literal["process", "thread"] = "process",
    ) -> None:
        if sampling not in ("process", "thread"):
            raise InvalidInputError(
                f"`PowerMonitor(sampling={sampling!r})`: expected 'process' (the default) or 'thread'."
            )
        if update_period is not None:
            update_period = check_period("PowerMonitor", "update_period", update_period)
        max_samples = check_max_samples("PowerMonitor", max_samples_per_gpu)
        requested = _domains(power_domains)
        gpus = get_gpus()
        self.gpu_indices: list[int] = check_gpu_indices("PowerMonitor", gpu_indices, len(gpus))
        self.simulated: bool = gpus.simulated
        self._clock = gpus.clock
        self._gpus = [gpus[i] for i in self.gpu_indices]
        readers = [probe(g) for g in self._gpus]
        self.measurement_domains: list[PowerDomain] = _measured_domains(
            self.gpu_indices, self._gpus, readers, requested
        )
        if PowerDomain.DEVICE_INSTANT not in self.measurement_domains:
            logger.warning("PowerMonitor: device_instant is not sampled, so `get_power` is unavailable.")
        wanted = set(self.measurement_domains)
        self._readers = [
            PowerReader(tuple(f for f in r.fields if f in wanted), r.usage if r.usage in wanted else None)
            for r in readers
        ]
        self._series = {
            d: {i: Series(max_samples) for i in self.gpu_indices} for d in self.measurement_domains
        }
        self._lock = threading.Lock()
        self._failed: dict[int, str] = {}
        self._bounds: dict[tuple[int, PowerDomain], EnergyBound] = {}
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
        self._process: SamplingProcess | None = None
        self._poller: Poller | None = None
        if background and sampling == "process" and gpus.backend.reachable_from_other_processes:
            self._process = self._start_process(max_samples)
        self.sampling: str = "process" if self._process is not None else "thread"
        if self._process is not None:
            self._finalizer = weakref.finalize(self, self._process.stop)
            return
        self.poll()
        if background:
            self._poller = Poller("zeus-callbacks-power-monitor", self.update_period, weak_poll(self))
            self._finalizer = weakref.finalize(self, self._poller.stop)

    def _start_process(self, max_samples: int | None) -> SamplingProcess | None:
        targets = [
            (
                i,
                g.uuid,
                [d.value for d in r.fields],
                None if r.usage is None else r.usage.value,
            )
            for i, g, r in zip(self.gpu_indices, self._gpus, self._readers, strict=True)
        ]
        try:
            return SamplingProcess(targets, self.update_period, max_samples)
        except (SamplingProcessError, OSError) as e:
            logger.warning("PowerMonitor: %s; sampling in a thread of this process instead.", e)
            return None

    # -- sampling ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every monitored GPU's domains once, now (what the sampler does every period)."""
        if self._process is not None:
            self._collect(poll_now=True)
            return
        with self._lock:
            for gpu, index, reader in zip(self._gpus, self.gpu_indices, self._readers, strict=True):
                if index in self._failed:
                    continue
                t = self._clock()
                try:
                    for domain, mw in read_power(gpu, reader):
                        self._series[domain][index].add(t, mw)
                except GPUError as e:
                    self._fail(index, str(e))

    def _fail(self, index: int, why: str) -> None:
        self._failed[index] = why
        logger.warning("PowerMonitor: GPU %d stopped answering (%s); its timeline ends here.", index, why)

    def _collect(self, poll_now: bool = False) -> None:
        """Bring the sampling process's readings into the timelines (nothing to do with a thread)."""
        process = self._process
        if process is None:
            return
        try:
            flushed = process.flush(poll_now)
        except SamplingProcessError as e:
            self._process = None
            logger.warning("PowerMonitor: %s; the timelines end at its last readings.", e)
            return
        with self._lock:
            for domain, index, t, mw in flushed.readings:
                self._series[PowerDomain(domain)][index].add(t, mw)
            for index, why in flushed.failed.items():
                if index not in self._failed:
                    self._fail(index, why)

    def stop(self) -> None:
        """Stop sampling (idempotent; also done when the monitor is garbage-collected or at exit). The
        readings taken so far stay queryable."""
        self._collect()
        if self._poller is not None or self._process is not None:
            self._finalizer()
        self._process = None

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
        self._collect()
        return self._timeline(domain, gpu_index, start_time, end_time)

    def _timeline(
        self, domain: PowerDomain, gpu_index: int | None, start_time: float | None, end_time: float | None
    ) -> dict[int, list[tuple[float, float]]]:
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
        """Every monitored domain's timeline, by domain name (the sampling process asked once)."""
        self._collect()
        return {d.value: self._timeline(d, gpu_index, start_time, end_time) for d in self.measurement_domains}

    def get_energy(self, start_time: float, end_time: float) -> dict[int, float] | None:
        """Energy (J) per GPU between two times: the trapezoidal integral of device_instant power (else
        device_average), over the part of [start_time, end_time] the timeline covers. None before the first
        reading. `get_energy_bound` says how far the true energy may lie from it.

        Raises:
            InvalidInputError: neither device domain is monitored, or the times are not numbers in order.
        """
        found = self._energy_points(start_time, end_time)
        if found is None:
            return None
        return {i: integrate(points, start_time, end_time) / 1000 for i, points in found[1].items()}

    def get_energy_bound(self, start_time: float, end_time: float) -> dict[int, float] | None:
        """How far each GPU's true energy between two times may lie from `get_energy`'s figure (J, either way),
        from three sources (docs/energy-uncertainty.md): the sensor's gain; what the readings may miss between
        them (half of each change; where readings are missing, or the timeline does not cover the range,
        anything up to the board's top power); and the readings' lag behind the power they report (one update
        plus half its averaging window: a whole second more for device_average) at the power around the range's
        ends. None before the first reading.

        Raises:
            InvalidInputError: as `get_energy`.
        """
        found = self._energy_points(start_time, end_time)
        if found is None:
            return None
        domain, timelines_mw = found
        out = {}
        for i, points_mw in timelines_mw.items():
            points = [(t, mw / 1000) for t, mw in points_mw]
            bound = self._bound(i, domain)
            energy_j = integrate(points, start_time, end_time)
            missed_j = trapezoid_error(
                points, start_time, end_time, 2 * self.update_period, bound.held_error_w
            )
            out[i] = bound.sampled(energy_j, end_time - start_time, missed_j)
        return out

    def _bound(self, index: int, domain: PowerDomain) -> EnergyBound:
        """GPU `index`'s bound for readings of `domain` (kept: it remembers the highest power seen)."""
        key = (index, domain)
        if key not in self._bounds:
            from zeus_callbacks.core.monitor.monitor import energy_bound_of

            bound = energy_bound_of(self._gpus[self.gpu_indices.index(index)])
            if domain is PowerDomain.DEVICE_AVERAGE:  # nvml.h: "GPU power averaged over 1 sec interval"
                sensor = bound.sensor
                averaged = PowerSensor(sensor.update_s, _AVERAGE_WINDOW_S, f"{sensor.source}; 1 s average")
                bound = EnergyBound(averaged, bound.refresh_s, bound.top_w)
            self._bounds[key] = bound
        return self._bounds[key]

    def _energy_points(
        self, start_time: float, end_time: float
    ) -> tuple[PowerDomain, dict[int, list[tuple[float, float]]]] | None:
        """The domain `get_energy` integrates and each GPU's whole timeline in it (mW), once the times are
        checked; None before the first reading."""
        domain = self._energy_domain(start_time, end_time)
        self._collect()
        with self._lock:
            series = self._series[domain]
            if all(series[i].latest() is None for i in self.gpu_indices):
                return None
            return domain, {i: series[i].points() for i in self.gpu_indices}

    def _energy_domain(self, start_time: float, end_time: float) -> PowerDomain:
        """The domain `get_energy` integrates, once the times are checked."""
        for t in (start_time, end_time):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t:
                raise InvalidInputError(
                    f"`get_energy({start_time!r}, {end_time!r})`: expected two times (s)."
                )
        if end_time < start_time:
            raise InvalidInputError(
                f"`get_energy({start_time!r}, {end_time!r})`: end_time is before start_time; pass (start, end)."
            )
        domain = next(
            (
                d
                for d in (PowerDomain.DEVICE_INSTANT, PowerDomain.DEVICE_AVERAGE)
                if d in self.measurement_domains
            ),
            None,
        )
        if domain is None:
            raise InvalidInputError(
                "PowerMonitor.get_energy needs device_instant or device_average power; monitored: "
                f"{[d.value for d in self.measurement_domains]}."
            )
        return domain

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
        self._collect()
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
        self._collect()
        return dict(self._failed)
