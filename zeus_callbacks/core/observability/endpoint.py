"""A Prometheus endpoint served from the training process: per-GPU energy, power, temperature, power limit and
clocks, and the optimizers' phase and choice.

One endpoint per rank, on `port + local_rank()`: each rank already owns its GPU(s), its monitor and its
optimizers, so it exports them with no inter-process traffic, and a lost rank loses only its own series.
Prometheus scrapes each port (a static list, or one target per rank from the job's launcher), as it
scrapes dcgm-exporter per node. Readings are taken in the HTTP server's thread when Prometheus scrapes,
never in the training loop, and cached for `cache_s` so that several scrapers cost one set of NVML reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core import distributed
from zeus_callbacks.core.accounting.identity import job_identity
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.telemetry import read_gpu

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor
    from zeus_callbacks.core.monitor.uncertainty import EnergyBound

__all__ = [
    "MetricsServer",
    "serve_metrics",
    "serve_metrics_from_env",
    "EXPORTED_METRICS",
    "PORT_ENV",
    "ADDR_ENV",
    "JOB_ENV",
]

logger = logging.getLogger(__name__)

PORT_ENV = "ZEUS_CALLBACKS_PROMETHEUS_PORT"
ADDR_ENV = "ZEUS_CALLBACKS_PROMETHEUS_ADDR"
JOB_ENV = "ZEUS_CALLBACKS_JOB"
_INSTALL_HINT = "install it with `pip install 'zeus-callbacks[prometheus]'` (prometheus_client)"

# Every metric the endpoint exports: name -> (type, help). The Grafana dashboard may use only these.
# The job is labelled `train_job`: Prometheus sets `job` itself from the scrape config, and would rename ours.
# Its scheduler, user and partition (Slurm's; a Kubernetes namespace) come from `accounting.identity`.
_JOB_LABELS = ("train_job", "scheduler", "user", "partition")
_GPU_LABELS = ("gpu", "uuid", "name", "rank", *_JOB_LABELS, "simulated")
_OPT_LABELS = ("optimizer", "rank", *_JOB_LABELS, "simulated")
EXPORTED_METRICS: dict[str, tuple[str, str]] = {
    "zeus_callbacks_gpu_energy_joules": ("counter", "GPU energy counter (J since the driver loaded)."),
    "zeus_callbacks_gpu_energy_bound_joules": (
        "counter",
        "How far the energy counter's increase may lie from the true energy (J, either way): its increase over "
        "a range bounds that of zeus_callbacks_gpu_energy_joules.",
    ),
    "zeus_callbacks_gpu_power_watts": ("gauge", "Instantaneous GPU power draw (W)."),
    "zeus_callbacks_gpu_temperature_celsius": ("gauge", "GPU core temperature (degrees C)."),
    "zeus_callbacks_gpu_power_limit_watts": ("gauge", "GPU power limit in force (W)."),
    "zeus_callbacks_gpu_sm_clock_mhz": ("gauge", "GPU SM clock in force (MHz)."),
    "zeus_callbacks_gpu_memory_clock_mhz": ("gauge", "GPU memory clock in force (MHz)."),
    "zeus_callbacks_optimizer_phase": ("gauge", "1 for the optimizer's current phase, 0 for the others."),
    "zeus_callbacks_optimizer_optimal_power_limit_watts": (
        "gauge",
        "The power limit the optimizer chose (W).",
    ),
    "zeus_callbacks_optimizer_profiling_steps": ("gauge", "Steps the optimizer has spent profiling."),
    "zeus_callbacks_optimizer_profiling_energy_joules": ("gauge", "Energy spent profiling (J)."),
    "zeus_callbacks_optimizer_energy_saved_percent": ("gauge", "Measured energy saving of the choice (%)."),
    "zeus_callbacks_optimizer_time_lost_percent": ("gauge", "Measured slowdown of the choice (%)."),
    "zeus_callbacks_optimizer_sm_clock_mhz": ("gauge", "The SM clock the optimizer last locked (MHz)."),
    "zeus_callbacks_optimizer_plan_applied": ("gauge", "1 while a pipeline frequency plan is applied."),
    "zeus_callbacks_exporter_collect_seconds": ("gauge", "Time the last collection took (s)."),
}

_GPU_FIELDS = {
    "energy_j": "zeus_callbacks_gpu_energy_joules",
    "power_w": "zeus_callbacks_gpu_power_watts",
    "temperature_c": "zeus_callbacks_gpu_temperature_celsius",
    "power_limit_w": "zeus_callbacks_gpu_power_limit_watts",
    "sm_clock_mhz": "zeus_callbacks_gpu_sm_clock_mhz",
    "memory_clock_mhz": "zeus_callbacks_gpu_memory_clock_mhz",
}
# Report keys read from `optimizer.report()` -> metric.
_REPORT_FIELDS = {
    "profiling_steps": "zeus_callbacks_optimizer_profiling_steps",
    "profiling_energy_j": "zeus_callbacks_optimizer_profiling_energy_joules",
    "energy_saved_pct": "zeus_callbacks_optimizer_energy_saved_percent",
    "time_lost_pct": "zeus_callbacks_optimizer_time_lost_percent",
    "plan_applied": "zeus_callbacks_optimizer_plan_applied",
}
_PIPELINE_PHASES = ("waiting", "profiling", "applying", "fallback", "inactive")


def _prometheus_client():
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            f"The Prometheus endpoint needs prometheus_client: {_INSTALL_HINT}. ({e})"
        ) from None
    return prometheus_client


def _optimizer_kind(optimizer: object) -> str:
    """`power_limit` or `pipeline_frequency`, by the public state each optimizer offers."""
    if hasattr(optimizer, "optimal_power_limit_w") and hasattr(optimizer, "report"):
        return "power_limit"
    if hasattr(optimizer, "plan_frequencies_mhz") and hasattr(optimizer, "report"):
        return "pipeline_frequency"
    raise InvalidInputError(
        f"`serve_metrics(optimizers=[..., {optimizer!r}])`: expected GlobalPowerLimitOptimizer or "
        "PipelineFrequencyOptimizer objects (the core ones; an adapter's is its `.optimizer`)."
    )


class _Collector:
    """prometheus_client's custom-collector protocol: `collect()` yields metric families, read at scrape time."""

    def __init__(
        self, gpus: Sequence[GPU], job: list[str], rank: int, cache_s: float, clock: Callable[[], float]
    ) -> None:
        self._gpus = list(gpus)
        self._clock = clock  # the GPUs' (a virtual clock's on a virtual-clock simulation)
        self._bounds: dict[str, _CounterBound] = {}  # by UUID
        self._job = job  # the values of _JOB_LABELS
        self._rank = str(rank)
        self._cache_s = cache_s
        self._optimizers: list[tuple[str, Any]] = []
        self._reports: dict[int, dict[str, Any]] = {}  # id(optimizer) -> its last report that could be read
        self._lock = threading.Lock()
        self._cached: list[Any] | None = None
        self._cached_at = -float("inf")
        _prometheus_client()
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self._families_of = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}

    def add_optimizer(self, optimizer: object) -> None:
        kind = _optimizer_kind(optimizer)
        with self._lock:
            self._optimizers.append((kind, optimizer))
            self._cached = None

    def describe(self) -> list[Any]:
        return []  # no collection at registration time

    def collect(self) -> Iterator[Any]:
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached_at >= self._cache_s:
                self._cached = self._families()
                self._cached_at = now
            return iter(self._cached)

    def _families(self) -> list[Any]:
        start = time.perf_counter()
        # A counter is written out as `<name>_total` (prometheus_client adds the suffix).
        families = {
            name: self._families_of[kind](name, help_text, labels=_labels_of(name))
            for name, (kind, help_text) in EXPORTED_METRICS.items()
        }
        for gpu in self._gpus:
            reading = read_gpu(gpu)
            labels = [
                str(gpu.index),
                gpu.uuid,
                gpu.name,
                self._rank,
                *self._job,
                "true" if gpu.simulated else "false",
            ]
            for field, metric in _GPU_FIELDS.items():
                value = getattr(reading, field)
                if value is not None:
                    families[metric].add_metric(labels, float(value))
            if reading.energy_j is not None:
                bound = self._bounds.setdefault(gpu.uuid, _CounterBound(gpu))
                families["zeus_callbacks_gpu_energy_bound_joules"].add_metric(
                    labels, bound.add(reading.energy_j, self._clock())
                )
        for kind, optimizer in self._optimizers:
            self._add_optimizer(families, kind, optimizer)
        families["zeus_callbacks_exporter_collect_seconds"].add_metric(
            [self._rank, *self._job], time.perf_counter() - start
        )
        return [f for f in families.values() if f.samples]

    def _add_optimizer(self, families: dict[str, Any], kind: str, optimizer: Any) -> None:
        simulated = bool(getattr(getattr(optimizer, "monitor", None), "simulated", False))
        labels = [kind, self._rank, *self._job, "true" if simulated else "false"]
        phase = optimizer.phase
        known = list(getattr(optimizer, "PHASE_INDEX", None) or _PIPELINE_PHASES)
        for p in known if phase in known else [*known, phase]:
            families["zeus_callbacks_optimizer_phase"].add_metric([*labels, p], 1.0 if p == phase else 0.0)
        report = self._report(optimizer)
        if kind == "power_limit":
            chosen = optimizer.optimal_power_limit_w
            if chosen is not None:
                families["zeus_callbacks_optimizer_optimal_power_limit_watts"].add_metric(
                    labels, float(chosen)
                )
        else:
            clock = optimizer.frequency_mhz
            if clock is not None:
                families["zeus_callbacks_optimizer_sm_clock_mhz"].add_metric(labels, float(clock))
        for key, metric in _REPORT_FIELDS.items():
            value = report.get(key)
            if isinstance(value, (bool, int, float)):
                families[metric].add_metric(labels, float(value))

    def _report(self, optimizer: Any) -> dict[str, Any]:
        """`optimizer.report()`, or its last readable one: the training thread may be changing it right now."""
        try:
            report = optimizer.report()
        except Exception as e:  # e.g. a dict resized by the training thread while being read
            logger.debug(
                "Prometheus endpoint: %r.report() not readable now (%s); last one used.", optimizer, e
            )
            return self._reports.get(id(optimizer), {})
        self._reports[id(optimizer)] = report
        return report


class _CounterBound:
    """The bound of one GPU's energy counter's increases, summed from one collection to the next: each increase
    bounded as a monitor window of its length is (`ZeusMonitor.end_window`), so the sum over the collections in a
    range bounds the counter's increase over it."""

    def __init__(self, gpu: GPU) -> None:
        from zeus_callbacks.core.monitor.monitor import energy_bound_of

        self._bound: EnergyBound = energy_bound_of(gpu)
        self._last: tuple[float, float] | None = None  # (the counter in J, when it was read)
        self.total_j = 0.0

    def add(self, energy_j: float, now_s: float) -> float:
        """The bound so far, with the increase up to `energy_j` read at `now_s` (J)."""
        if self._last is not None:
            before_j, then_s = self._last
            increase = self._bound.counter(energy_j - before_j, now_s - then_s)
            # Unknown only for an increase of nothing in under a refresh: the board's top power meanwhile.
            self.total_j += increase if increase is not None else self._bound.top_w * (now_s - then_s)
        self._last = (energy_j, now_s)
        return self.total_j


def _labels_of(metric: str) -> list[str]:
    if metric.startswith("zeus_callbacks_gpu_"):
        return list(_GPU_LABELS)
    if metric == "zeus_callbacks_optimizer_phase":
        return [*_OPT_LABELS, "phase"]
    if metric.startswith("zeus_callbacks_optimizer_"):
        return list(_OPT_LABELS)
    return ["rank", *_JOB_LABELS]


class MetricsServer:
    """A running Prometheus endpoint (see `serve_metrics`): where it listens, and `stop()`.

    Attributes:
        port: The port it listens on (the one the OS chose, for `port=0`).
        addr: The address it is bound to.
        registry: Its `prometheus_client.CollectorRegistry` (register more collectors on it to export them too).
    """

    def __init__(self, server: Any, thread: threading.Thread, collector: _Collector, registry: Any) -> None:
        self._server = server
        self._thread = thread
        self._collector = collector
        self.registry = registry
        self.addr: str = server.server_address[0]
        self.port: int = int(server.server_address[1])
        self._stopped = False

    @property
    def url(self) -> str:
        """The metrics URL, e.g. `http://127.0.0.1:9464/metrics` (`localhost` for an all-interfaces bind)."""
        host = self.addr if self.addr not in ("", "0.0.0.0", "::") else "localhost"
        return f"http://{host}:{self.port}/metrics"

    def add_optimizer(self, optimizer: object) -> None:
        """Export an optimizer made after the server started."""
        self._collector.add_optimizer(optimizer)

    def stop(self) -> None:
        """Stop serving and close the port; calling it again does nothing."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"MetricsServer(url={self.url!r}{', stopped' if self._stopped else ''})"


def _rank() -> int:
    """The global rank: torch.distributed's once initialised, else the launcher's `RANK` (set before it is)."""
    if distributed.is_distributed():
        return distributed.rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def serve_metrics(
    port: int = 9464,
    monitor: ZeusMonitor | None = None,
    optimizers: Iterable[object] = (),
    job: str | None = None,
    addr: str = "0.0.0.0",
    cache_s: float = 0.5,
    per_rank: bool = True,
) -> MetricsServer:
    """Serve a Prometheus endpoint from this process, in a background thread, until `stop()`.

    Exports, per GPU (labels `gpu` (CUDA index), `uuid`, `name`, `rank`, the job's, `simulated`): the energy
    counter and the bound of its increases (`zeus_callbacks_gpu_energy_bound_joules`: its `increase()` over a
    range is how far the energy counter's may lie from the true energy, either way), power, temperature, power limit and SM and memory clocks in force; per optimizer (labels
    `optimizer`, `rank`, the job's, `simulated`): its phase, its choice, and the figures of its `report()`.
    The job's labels are `train_job`, `scheduler` (`slurm`, `torchrun`, `kubernetes`, `local`), `user` and
    `partition` (Slurm's, or the Kubernetes namespace; empty elsewhere), from the scheduler's variables
    (`zeus_callbacks.core.accounting.identity`). Simulated GPUs carry `simulated="true"`. Names are in
    `EXPORTED_METRICS`.

    Args:
        port: The base port: the endpoint listens on `port + local_rank()` (one port per rank on a node);
            0: any free port (read it from `.port`).
        monitor: The `ZeusMonitor` whose GPUs are exported; None: every GPU this process sees.
        optimizers: `GlobalPowerLimitOptimizer` / `PipelineFrequencyOptimizer` objects to export, read only
            through their public state (`phase`, `optimal_power_limit_w`, `frequency_mhz`, `report()`).
        job: The `train_job` label; default `$ZEUS_CALLBACKS_JOB`, else the scheduler's job id (Slurm job,
            torchrun run id, Kubernetes pod), else an id every process of the job shares.
        addr: The address to bind: all interfaces by default, so that a Prometheus on another host can
            scrape it (as dcgm-exporter's :9400); `127.0.0.1` keeps it to this machine.
        cache_s: Scrapes within this many seconds of the last collection are answered from it.
        per_rank: Add `local_rank()` to `port` (default). False: exactly `port`.

    Returns:
        The running `MetricsServer`.

    Raises:
        ImportError: prometheus_client is not installed (the message says how to install it).
        InvalidInputError: a bad argument, or the port cannot be bound (the message names it).

    Example::

        server = serve_metrics(port=9464, monitor=monitor, optimizers=[plo])
        train()
        server.stop()
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInputError(f"`serve_metrics(port={port!r})`: expected a TCP port number in [0, 65535].")
    if isinstance(cache_s, bool) or not isinstance(cache_s, (int, float)) or not 0 <= cache_s < 3600:
        raise InvalidInputError(f"`serve_metrics(cache_s={cache_s!r})`: expected seconds in [0, 3600).")
    if job is not None and (not isinstance(job, str) or not job.strip()):
        raise InvalidInputError(
            f"`serve_metrics(job={job!r})`: expected a non-empty job name (the `train_job` label), or None for "
            f"${JOB_ENV}."
        )
    if monitor is not None and not hasattr(monitor, "gpu_indices"):
        raise InvalidInputError(
            f"`serve_metrics(monitor={monitor!r})`: expected a ZeusMonitor (or None for every GPU this "
            "process sees)."
        )
    pc = _prometheus_client()
    from zeus_callbacks.core.device.gpus import get_gpus

    gpus = [monitor.gpus[i] for i in monitor.gpu_indices] if monitor is not None else list(get_gpus())
    rank = _rank()
    bound = port + distributed.local_rank() if per_rank and port else port
    if bound > 65535:
        raise InvalidInputError(f"`serve_metrics(port={port})`: port {bound} for local rank is past 65535.")
    identity = job_identity()
    job_labels = [job or os.environ.get(JOB_ENV) or identity.job_id, identity.scheduler, identity.user]
    clock = monitor.gpus.clock if monitor is not None else get_gpus().clock
    collector = _Collector(gpus, [*job_labels, identity.partition or ""], rank, float(cache_s), clock)
    for optimizer in optimizers:
        collector.add_optimizer(optimizer)
    registry = pc.CollectorRegistry(auto_describe=True)
    registry.register(collector)
    try:
        server, thread = pc.start_http_server(bound, addr=addr, registry=registry)
    except OSError as e:
        raise InvalidInputError(
            f"`serve_metrics(port={port})`: cannot listen on {addr or '*'}:{bound} ({e}). Choose a free port "
            f"(`{PORT_ENV}`), or 0 for any."
        ) from None
    metrics = MetricsServer(server, thread, collector, registry)
    simulated = any(g.simulated for g in gpus)
    logger.info(
        "Prometheus endpoint for rank %d at %s (%d GPU%s%s).",
        rank,
        metrics.url,
        len(gpus),
        "" if len(gpus) == 1 else "s",
        ", SIMULATED" if simulated else "",
    )
    return metrics


def serve_metrics_from_env(
    monitor: ZeusMonitor | None = None, optimizers: Iterable[object] = ()
) -> MetricsServer | None:
    """`serve_metrics` on `$ZEUS_CALLBACKS_PROMETHEUS_PORT` (address `$ZEUS_CALLBACKS_PROMETHEUS_ADDR`, default
    all interfaces); None when the variable is unset or empty: the switch the adapters offer.

    Raises:
        InvalidInputError: the variable is not a port number, or the port cannot be bound.
    """
    raw = os.environ.get(PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise InvalidInputError(
            f"{PORT_ENV}={raw!r} is not a port number; set it to the base port (e.g. 9464) or unset it."
        ) from None
    if not 0 <= port <= 65535:
        raise InvalidInputError(
            f"{PORT_ENV}={raw!r} is not a TCP port in [0, 65535]; set it to the base port (e.g. 9464) or unset it."
        )
    return serve_metrics(
        port=port, monitor=monitor, optimizers=optimizers, addr=os.environ.get(ADDR_ENV, "0.0.0.0")
    )
