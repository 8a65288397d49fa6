"""Zeus's `zeus.metric`: energy histograms, cumulative energy counters and power gauges pushed to a Pushgateway.

Same classes, signatures, metric names (`energy_monitor_{gpu,cpu,dram}_energy_joules`,
`power_monitor_gpu_power_watts`) and labels (`window`, `index`) as Zeus 0.16. Unlike Zeus, the counter and the
gauge sample in a thread of this process rather than a spawned process (a simulated or zeusd-controlled GPU
set is the same one the trainer sees, and nothing is re-imported), each push adds to the job's group instead of
replacing it (`pushadd`: the three classes may share one `job`), the counter's last partial period is pushed at
`end_window`, and a Pushgateway that does not answer is logged, not raised into the training loop.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.power import instant_power_mw
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

__all__ = ["Metric", "EnergyHistogram", "EnergyCumulativeCounter", "PowerGauge"]

logger = logging.getLogger(__name__)

_GPU_ENERGY = "energy_monitor_gpu_energy_joules"
_CPU_ENERGY = "energy_monitor_cpu_energy_joules"
_DRAM_ENERGY = "energy_monitor_dram_energy_joules"
_GPU_POWER = "power_monitor_gpu_power_watts"
_GPU_ENERGY_BOUND = "energy_monitor_gpu_energy_bound_joules"
_GPU_COUNTED_BOUND = "energy_monitor_gpu_energy_counter_bound_joules"
_LABELS = ("window", "index")
# One help text per name: the histogram and the counter share their names, and a Pushgateway holding both
# complains of differing help strings.
_HELP = {"GPU": "GPU energy (J)", "CPU": "CPU package energy (J)", "DRAM": "DRAM energy (J)"}


def _prometheus_client():
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "zeus_callbacks' Prometheus metrics need prometheus_client: install it with "
            f"`pip install 'zeus-callbacks[prometheus]'`. ({e})"
        ) from None
    return prometheus_client


class _Pusher:
    """Pushes one registry to a Pushgateway under `job`; a failure is logged (once until a push succeeds).

    Figures of simulated GPUs are pushed in the group `simulated="true"` (a label on each of their series).
    """

    def __init__(self, url: str, job: str, registry: Any, simulated: bool) -> None:
        self._push = _prometheus_client().pushadd_to_gateway
        self.url, self.job, self.registry = url, job, registry
        self._grouping_key = {"simulated": "true"} if simulated else {}
        self._lock = threading.Lock()
        self._failing = False

    def __call__(self) -> None:
        with self._lock:
            try:
                self._push(self.url, job=self.job, registry=self.registry, grouping_key=self._grouping_key)
            except Exception as e:  # a gateway down must not stop training
                if not self._failing:
                    logger.warning("Pushing metrics of job %r to %s failed: %s", self.job, self.url, e)
                self._failing = True
            else:
                if self._failing:
                    logger.info("Pushing metrics of job %r to %s works again.", self.job, self.url)
                self._failing = False


def _indices(cls: str, name: str, value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, Sequence) and not isinstance(value, str):
        if all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            return list(value)
    raise InvalidInputError(f"`{cls}({name}={value!r})`: expected a list of device indices, e.g. [0, 1].")


def _gateway(
    cls: str, pushgateway_url: str | None, prometheus_url: str | None, job: str | None
) -> tuple[str, str]:
    """(URL, job): `prometheus_url` is the keyword Zeus's documentation uses for `pushgateway_url`."""
    if pushgateway_url is not None and prometheus_url is not None and pushgateway_url != prometheus_url:
        raise InvalidInputError(
            f"`{cls}(pushgateway_url={pushgateway_url!r}, prometheus_url={prometheus_url!r})`: give the "
            "Pushgateway's URL once (`prometheus_url` is another name for `pushgateway_url`)."
        )
    url = pushgateway_url if pushgateway_url is not None else prometheus_url
    if not isinstance(url, str) or not url:
        raise InvalidInputError(
            f"`{cls}(pushgateway_url={url!r})`: expected the Pushgateway's URL, e.g. 'http://localhost:9091'."
        )
    if not isinstance(job, str) or not job:
        raise InvalidInputError(f"`{cls}(job={job!r})`: expected the Pushgateway job name, e.g. 'training'.")
    return url, job


def _period(cls: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidInputError(f"`{cls}(update_period={value!r})`: expected a positive number of seconds.")
    return float(value)


class Metric(abc.ABC):
    """A measured code range whose figures are pushed to a Prometheus Pushgateway (Zeus's `Metric`)."""

    @abc.abstractmethod
    def begin_window(self, name: str, sync_execution: bool = True) -> None:
        """Start measuring the window `name` (after queued GPU work, with `sync_execution`)."""

    @abc.abstractmethod
    def end_window(self, name: str, sync_execution: bool = True) -> None:
        """Stop measuring the window `name` and push its figures."""


class EnergyHistogram(Metric):
    """Energy of each window, observed into histograms per device and pushed at `end_window`.

    Metrics `energy_monitor_gpu_energy_joules`, `..._cpu_...` and `..._dram_...` (labels `window`, `index`);
    CPU and DRAM where RAPL is readable. An observation outside the buckets is logged. Beside them, the gauge
    `energy_monitor_gpu_energy_bound_joules` holds how far the last window's true GPU energy may lie from the
    observed figure (J, either way; `Measurement.gpu_energy_bound`), for GPUs whose bound is known.

    Args:
        cpu_indices: CPU packages to measure (RAPL); `[]`: none.
        gpu_indices: GPUs to measure.
        pushgateway_url: The Pushgateway, e.g. `http://localhost:9091` (`prometheus_url=`, the name Zeus's
            documentation uses, is taken too).
        job: The Pushgateway job the metrics are grouped under.
        gpu_bucket_range: Histogram bucket bounds of GPU energy (J).
        cpu_bucket_range: Histogram bucket bounds of CPU energy (J).
        dram_bucket_range: Histogram bucket bounds of DRAM energy (J).

    Raises:
        ValueError: an empty bucket range, or bad indices.

    Example::

        histogram = EnergyHistogram(cpu_indices=[], gpu_indices=[0], pushgateway_url="http://localhost:9091",
                                    job="training")
        histogram.begin_window("step")
        train_step()
        histogram.end_window("step")
    """

    def __init__(
        self,
        cpu_indices: list,
        gpu_indices: list,
        pushgateway_url: str | None = None,
        job: str | None = None,
        gpu_bucket_range: Sequence[float] = (50.0, 100.0, 200.0, 500.0, 1000.0),
        cpu_bucket_range: Sequence[float] = (10.0, 50.0, 100.0, 500.0, 1000.0),
        dram_bucket_range: Sequence[float] = (5.0, 10.0, 20.0, 50.0, 150.0),
        *,
        prometheus_url: str | None = None,
    ) -> None:
        for what, buckets in (
            ("gpu", gpu_bucket_range),
            ("cpu", cpu_bucket_range),
            ("dram", dram_bucket_range),
        ):
            if not buckets:
                raise InvalidInputError(
                    f"`EnergyHistogram({what}_bucket_range={buckets!r})`: the bucket range cannot be empty; give "
                    "bucket bounds in joules or leave the argument out for the defaults."
                )
        self.cpu_indices = _indices("EnergyHistogram", "cpu_indices", cpu_indices)
        self.gpu_indices = _indices("EnergyHistogram", "gpu_indices", gpu_indices)
        self.pushgateway_url, self.job = _gateway("EnergyHistogram", pushgateway_url, prometheus_url, job)
        pc = _prometheus_client()
        self.registry = pc.CollectorRegistry()
        self.energy_monitor = ZeusMonitor(gpu_indices=self.gpu_indices, cpu_indices=self.cpu_indices)
        self._buckets = {
            "GPU": tuple(gpu_bucket_range),
            "CPU": tuple(cpu_bucket_range),
            "DRAM": tuple(dram_bucket_range),
        }
        self._histograms = {
            kind: pc.Histogram(name, _HELP[kind], _LABELS, buckets=buckets, registry=self.registry)
            for kind, name, buckets in (
                ("GPU", _GPU_ENERGY, gpu_bucket_range),
                ("CPU", _CPU_ENERGY, cpu_bucket_range),
                ("DRAM", _DRAM_ENERGY, dram_bucket_range),
            )
            if kind == "GPU" or self.energy_monitor.cpu_indices
        }
        self._bound = pc.Gauge(
            _GPU_ENERGY_BOUND, "Bound of the last window's GPU energy (J)", _LABELS, registry=self.registry
        )
        self._push = _Pusher(self.pushgateway_url, self.job, self.registry, self.energy_monitor.simulated)
        self._outside_warned: set[tuple[str, str, int]] = set()

    def begin_window(self, name: str, sync_execution: bool = True) -> None:
        """Start measuring the window `name`."""
        self.energy_monitor.begin_window(f"__EnergyHistogram_{name}", sync_execution=sync_execution)

    def end_window(self, name: str, sync_execution: bool = True) -> None:
        """Observe the window's energy per device and push the histograms."""
        m = self.energy_monitor.end_window(f"__EnergyHistogram_{name}", sync_execution=sync_execution)
        for index, bound_j in m.gpu_energy_bound.items():
            self._bound.labels(window=name, index=index).set(bound_j)
        for kind, energies in (("GPU", m.gpu_energy), ("CPU", m.cpu_energy), ("DRAM", m.dram_energy)):
            if not energies or kind not in self._histograms:
                continue
            lo, hi = min(self._buckets[kind]), max(self._buckets[kind])
            for index, joules in energies.items():
                self._histograms[kind].labels(window=name, index=index).observe(joules)
                if not lo <= joules <= hi and (name, kind, index) not in self._outside_warned:
                    self._outside_warned.add((name, kind, index))
                    logger.warning(
                        "EnergyHistogram window %r: %s %d used %.3f J, outside the buckets [%g, %g] J (said once "
                        "per window and device; pass bucket ranges that fit).",
                        name,
                        kind,
                        index,
                        joules,
                        lo,
                        hi,
                    )
        self._push()


class _Sampler:
    """A thread that calls `sample()` then pushes, every `period_s`, until stopped (then once more)."""

    def __init__(self, name: str, period_s: float, sample: Callable[[], None], push: _Pusher) -> None:
        self._sample, self._push, self._period = sample, push, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"zeus-callbacks-metric-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._tick()
        self._tick()

    def _tick(self) -> None:
        try:
            self._sample()
        except Exception as e:  # a lost GPU stops this window's samples, never the training loop
            logger.warning("Metric sampling failed: %s", e)
            self._stop.set()
            return
        self._push()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=20)


def _sync(monitor: ZeusMonitor, sync_execution: bool) -> None:
    if sync_execution:
        monitor.sync()


class EnergyCumulativeCounter(Metric):
    """Energy counted up per device while a window is open, pushed every `update_period` seconds.

    Metrics `energy_monitor_gpu_energy_joules` (and `..._cpu_...`, `..._dram_...` where RAPL is readable), as
    Prometheus counters (`_total`) labelled `window`, `index`. Beside them, the gauge
    `energy_monitor_gpu_energy_counter_bound_joules` holds how far the true GPU energy since the window began
    may lie from the GPU counter's value (J, either way; the bound of a monitor window that long,
    `Measurement.gpu_energy_bound`), for GPUs whose bound is known.

    Args:
        cpu_indices: CPU packages to measure (RAPL); `[]`: none.
        gpu_indices: GPUs to measure.
        update_period: Seconds between two pushes.
        pushgateway_url: The Pushgateway, e.g. `http://localhost:9091` (`prometheus_url=`, the name Zeus's
            documentation uses, is taken too).
        job: The Pushgateway job the metrics are grouped under.
    """

    def __init__(
        self,
        cpu_indices: list,
        gpu_indices: list,
        update_period: int,
        pushgateway_url: str | None = None,
        job: str | None = None,
        *,
        prometheus_url: str | None = None,
    ) -> None:
        self.cpu_indices = _indices("EnergyCumulativeCounter", "cpu_indices", cpu_indices)
        self.gpu_indices = _indices("EnergyCumulativeCounter", "gpu_indices", gpu_indices)
        self.update_period = _period("EnergyCumulativeCounter", update_period)
        self.pushgateway_url, self.job = _gateway(
            "EnergyCumulativeCounter", pushgateway_url, prometheus_url, job
        )
        pc = _prometheus_client()
        self.registry = pc.CollectorRegistry()
        self.energy_monitor = ZeusMonitor(gpu_indices=self.gpu_indices, cpu_indices=self.cpu_indices)
        self._counters = {
            kind: pc.Counter(name, _HELP[kind], _LABELS, registry=self.registry)
            for kind, name in (("GPU", _GPU_ENERGY), ("CPU", _CPU_ENERGY), ("DRAM", _DRAM_ENERGY))
            if kind == "GPU" or self.energy_monitor.cpu_indices
        }
        self._bound = pc.Gauge(
            _GPU_COUNTED_BOUND,
            "Bound of the counted GPU energy since the window began (J)",
            _LABELS,
            registry=self.registry,
        )
        self._push = _Pusher(self.pushgateway_url, self.job, self.registry, self.energy_monitor.simulated)
        self.window_state: dict[str, _Sampler] = {}
        self._counted_j: dict[str, dict[int, float]] = {}  # window -> GPU -> its counter's value
        self._lock = threading.Lock()  # the monitor's windows are opened and closed from several threads

    def _count(self, name: str) -> None:
        """Count the window's energy up to now: the GPUs' from one monitor window since it began (their NVML
        counters do not wrap, and its bound is the counted figure's), CPU and DRAM per period (RAPL's wrap)."""
        key = f"__EnergyCumulativeCounter_{name}"
        with self._lock:
            period = self.energy_monitor.end_window(key, sync_execution=False)
            self.energy_monitor.begin_window(key, sync_execution=False)
            whole = self.energy_monitor.read_window(f"{key}_whole", sync_execution=False)
        counted = self._counted_j.setdefault(name, {})
        for index, joules in whole.gpu_energy.items():
            if joules > counted.get(index, 0.0):
                self._counters["GPU"].labels(window=name, index=index).inc(joules - counted.get(index, 0.0))
                counted[index] = joules
        for index, bound_j in whole.gpu_energy_bound.items():
            self._bound.labels(window=name, index=index).set(bound_j)
        for kind, energies in (("CPU", period.cpu_energy), ("DRAM", period.dram_energy)):
            if energies and kind in self._counters:
                for index, joules in energies.items():
                    self._counters[kind].labels(window=name, index=index).inc(max(0.0, joules))

    def begin_window(self, name: str, sync_execution: bool = False) -> None:
        """Start counting the window `name` in the background."""
        if name in self.window_state:
            raise ValueError(f"EnergyCumulativeCounter window '{name}' already exists: it is already open.")
        _sync(self.energy_monitor, sync_execution)
        with self._lock:
            self.energy_monitor.begin_window(f"__EnergyCumulativeCounter_{name}", sync_execution=False)
            self.energy_monitor.begin_window(f"__EnergyCumulativeCounter_{name}_whole", sync_execution=False)
        self._counted_j[name] = {}
        self.window_state[name] = _Sampler(name, self.update_period, lambda: self._count(name), self._push)

    def end_window(self, name: str, sync_execution: bool = False) -> None:
        """Stop counting the window `name`; its last partial period is counted and pushed."""
        if name not in self.window_state:
            raise ValueError(f"No active monitoring process found for '{name}'.")
        _sync(self.energy_monitor, sync_execution)
        self.window_state.pop(name).stop()
        with self._lock:
            for key in (f"__EnergyCumulativeCounter_{name}", f"__EnergyCumulativeCounter_{name}_whole"):
                self.energy_monitor.end_window(key, sync_execution=False, cancel=True)


class _InstantPower:
    """Stands in for `PowerMonitor` where it is not importable: each GPU's instant power read when asked."""

    def __init__(self, gpu_indices: list[int]) -> None:
        self._gpus = [get_gpus()[i] for i in gpu_indices]

    def get_power(self) -> dict[int, float]:
        return {g.index: instant_power_mw(g) / 1000 for g in self._gpus}

    def stop(self) -> None:
        pass


def _power_monitor(gpu_indices: list[int]) -> Any:
    """A power timeline of these GPUs for one window (the package's `PowerMonitor`, a background thread)."""
    try:
        from zeus_callbacks.core.monitor.power import PowerMonitor  # type: ignore[import-not-found]
    except ImportError:
        return _InstantPower(gpu_indices)
    return PowerMonitor(gpu_indices=gpu_indices)


class PowerGauge(Metric):
    """GPU power while a window is open, set into gauges and pushed every `update_period` seconds.

    Metric `power_monitor_gpu_power_watts` (labels `window`, `index`).

    Args:
        gpu_indices: GPUs to measure.
        update_period: Seconds between two pushes.
        pushgateway_url: The Pushgateway, e.g. `http://localhost:9091` (`prometheus_url=`, the name Zeus's
            documentation uses, is taken too).
        job: The Pushgateway job the metrics are grouped under.
    """

    def __init__(
        self,
        gpu_indices: list,
        update_period: int,
        pushgateway_url: str | None = None,
        job: str | None = None,
        *,
        prometheus_url: str | None = None,
    ) -> None:
        self.gpu_indices = _indices("PowerGauge", "gpu_indices", gpu_indices)
        self.update_period = _period("PowerGauge", update_period)
        self.pushgateway_url, self.job = _gateway("PowerGauge", pushgateway_url, prometheus_url, job)
        pc = _prometheus_client()
        self.registry = pc.CollectorRegistry()
        self._gauge = pc.Gauge(_GPU_POWER, "GPU power draw (W)", _LABELS, registry=self.registry)
        self._push = _Pusher(self.pushgateway_url, self.job, self.registry, get_gpus().simulated)
        self.window_state: dict[str, _Sampler] = {}
        self._power_monitors: dict[str, Any] = {}

    def _set(self, name: str) -> None:
        for index, watts in (self._power_monitors[name].get_power() or {}).items():
            self._gauge.labels(window=name, index=index).set(watts)

    def begin_window(self, name: str, sync_execution: bool = False) -> None:
        """Start pushing the GPUs' power under the window `name`."""
        if name in self.window_state:
            raise ValueError(f"PowerGauge metric '{name}' already exists.")
        self._power_monitors[name] = _power_monitor(self.gpu_indices)
        self._set(name)
        self._push()
        self.window_state[name] = _Sampler(name, self.update_period, lambda: self._set(name), self._push)

    def end_window(self, name: str, sync_execution: bool = False) -> None:
        """Stop pushing the window `name` (its last reading is pushed)."""
        if name not in self.window_state:
            raise ValueError(f"PowerGauge window '{name}' does not exist: it was not begun.")
        self.window_state.pop(name).stop()
        self._power_monitors.pop(name).stop()
