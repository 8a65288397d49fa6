"""Cost of one begin_window+end_window pair: this package's ZeusMonitor vs Zeus 0.16's, on simulated NVML.

Both monitors read the same simulated GPUs through the same real nvidia-ml-py (`pynvml`), beneath which
the simulator answers as the NVML library (`zeus_callbacks.sim.nvml_library`, ctypes callbacks at NVML's C
boundary), without device synchronisation (`sync_execution=False`), and measure GPUs only
(`cpu_indices=[]`). The "bare reads" column is the floor both share: the
`pynvml.nvmlDeviceGetTotalEnergyConsumption` calls a pair needs (two per GPU), made in a tight loop.

Run: `python benchmarks/monitor_overhead.py [--pairs 2000] [--repeat 50]`

`--section step` (or `all`) measures instead what the background observers cost a 100 ms training step: the
Prometheus endpoint (scraped by another process) with this package's power timeline (`PowerMonitor`: its
sampling process, the default, and the same in a thread of this process), side by side with Zeus's
`PowerMonitor` (processes it spawns), all at the same sampling period, on a real-clock simulated A40. The step is fixed pure-Python work calibrated to 100 ms: the worst case, since a
Python thread that runs delays it by its GIL time, where a real step mostly waits on the GPU with the GIL free.
Each configuration runs in turn (`--rounds` rounds of `--steps` steps); the figures are the step time against
the run without observers in the same round, and the observers' CPU time per step (threads of this process,
or Zeus's processes), which bounds what they can take from the step.

    python benchmarks/monitor_overhead.py --section step [--rounds 3] [--steps 30] [--scrape-interval 1]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing.context
import multiprocessing.synchronize
import os
import statistics
import sys
import tempfile
import time
import timeit
import warnings
from collections.abc import Callable

import pynvml

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

GPU_COUNTS = (1, 4, 8)

if __name__ == "__mp_main__" and os.environ.get(sim.SIMULATE_ENV):
    # A process Zeus's PowerMonitor spawned (`--section step`): the simulated node its parent selected.
    sim.simulate(
        os.environ[sim.SIMULATE_ENV],
        state_dir=os.environ.get("ZEUS_CALLBACKS_SIM_STATE_DIR"),
        export_env=False,
    )


def _import_zeus():
    """Zeus's monitor class (None, with the reason, when Zeus is missing). Zeus imports the same `pynvml`,
    so it reaches the simulated GPUs with nothing patched."""
    try:
        import zeus.device.gpu as zeus_gpu
        import zeus.device.gpu.nvidia as zeus_nvidia
        from zeus.monitor import ZeusMonitor as ZeusZeusMonitor
    except ImportError as e:
        return None, f"zeus is not importable ({e}); install it with `pip install 'zeus==0.16.*'`"
    if zeus_nvidia.pynvml is not pynvml:
        return None, f"zeus uses another `pynvml` ({zeus_nvidia.pynvml!r}) than nvidia-ml-py's"
    return (ZeusZeusMonitor, zeus_gpu, zeus_nvidia), ""


def _zeus_monitor(zeus, gpu_count: int):
    cls, zeus_gpu, zeus_nvidia = zeus
    # Zeus caches its GPU set and NVML availability per process; the simulated node changed.
    zeus_gpu._gpus = None
    zeus_nvidia.nvml_is_available.cache_clear()
    monitor = cls(gpu_indices=list(range(gpu_count)), cpu_indices=[])
    if len(monitor.gpus) != gpu_count:
        raise RuntimeError(f"Zeus sees {len(monitor.gpus)} GPUs, expected {gpu_count}.")
    return monitor


def _pair(monitor) -> Callable[[], None]:
    begin, end = monitor.begin_window, monitor.end_window

    def pair() -> None:
        begin("w", sync_execution=False)
        end("w", sync_execution=False)

    return pair


def _bare_reads(gpu_count: int) -> Callable[[], None]:
    read = pynvml.nvmlDeviceGetTotalEnergyConsumption
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(gpu_count)]

    def reads() -> None:
        list(map(read, handles))
        list(map(read, handles))

    return reads


def _best_us(fns: dict[str, Callable[[], None]], pairs: int, repeat: int) -> dict[str, float]:
    """Best time per call (µs) of each function; the functions take turns, so load on the machine
    that comes and goes hits them alike."""
    for fn in fns.values():
        fn()  # warm up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit.timeit(fn, number=pairs) / pairs * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2_000, help="window pairs per timing")
    parser.add_argument("--repeat", type=int, default=50, help="timings per figure; the best is reported")
    parser.add_argument(
        "--section",
        choices=("windows", "step", "all"),
        default="windows",
        help="windows: the begin/end_window table (default); step: observers' cost to a 100 ms step; all: both",
    )
    parser.add_argument("--rounds", type=int, default=3, help="step section: rounds of every configuration")
    parser.add_argument(
        "--steps", type=int, default=30, help="step section: steps per configuration and round"
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="step section: seconds between scrapes"
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # Zeus logs at INFO/WARNING while it probes devices
    warnings.simplefilter("ignore")  # Zeus warns on zero-energy windows; the warning call still costs

    if args.section in ("windows", "all"):
        _windows_section(args)
    if args.section in ("step", "all"):
        _step_section(args)
    return 0


def _windows_section(args: argparse.Namespace) -> None:
    zeus, why_not = _import_zeus()
    print(
        "Monitor overhead per begin_window+end_window pair (simulated GPUs beneath nvidia-ml-py, A40, "
        "sync_execution=False)"
    )
    print(f"best of {args.repeat} x {args.pairs} pairs; Python {sys.version.split()[0]}")
    if zeus is None:
        print(f"Zeus column skipped: {why_not}")
    header = (
        f"{'GPUs':>4}  {'ours µs':>8}  {'zeus µs':>8}  {'bare reads µs':>13}  {'zeus/ours':>9}"
        f"  {'ours-bare µs':>12}  {'zeus-bare µs':>12}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="zeus_callbacks-bench-") as state_dir:
        for n in GPU_COUNTS:
            sim.simulate(f"{n}*a40", state_dir=state_dir, export_env=False)
            ours = ZeusMonitor(gpu_indices=list(range(n)))
            fns = {"ours": _pair(ours), "bare": _bare_reads(n)}
            if zeus is not None:
                fns["zeus"] = _pair(_zeus_monitor(zeus, n))
            best = _best_us(fns, args.pairs, args.repeat)
            ours.close()
            ours_us, bare_us, zeus_us = best["ours"], best["bare"], best.get("zeus", float("nan"))
            print(
                f"{n:>4}  {ours_us:>8.2f}  {zeus_us:>8.2f}  {bare_us:>13.2f}  {zeus_us / ours_us:>8.1f}x"
                f"  {ours_us - bare_us:>12.2f}  {zeus_us - bare_us:>12.2f}"
            )
        sim.disable()
    print(
        "Figures are for simulated GPUs (each read a ctypes callback into the simulator): real NVML calls "
        "cost differently, and the same for every monitor."
    )


# -- the observers' cost to a training step (`--section step`) ----------------------------------------------
STEP_S = 0.1


def _calibrated_step(host_s: float, wait_s: float) -> Callable[[], None]:
    """A step: fixed pure-Python work that takes `host_s` when nothing else runs (the best of a few timings),
    then `wait_s` waiting with the GIL released, as `torch.cuda.synchronize()` waits for the GPU."""

    def work(n: int) -> int:
        x = 0
        for i in range(n):
            x ^= i
        return x

    n = 100_000
    best = min(timeit.timeit(lambda: work(n), number=1) for _ in range(5))
    n = max(1, int(n * host_s / best))

    def step() -> None:
        work(n)
        if wait_s:
            time.sleep(wait_s)

    return step


def _cpu_s_of(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total / os.sysconf("SC_CLK_TCK")


_SCRAPER = (
    "import sys, time, urllib.request\n"
    "url, every = sys.argv[1], float(sys.argv[2])\n"
    "while True:\n"
    "    urllib.request.urlopen(url, timeout=10).read()\n"
    "    time.sleep(every)\n"
)


class _PatientEvent(multiprocessing.synchronize.Event):
    def wait(self, timeout=None):
        return super().wait(None if timeout is None else max(timeout, 180.0))


@contextlib.contextmanager
def _patient_spawn():
    """Zeus's PowerMonitor gives its spawned process 10 s to start (`zeus/monitor/power.py`, the
    `ready_events[...].wait(timeout=10.0)`); that process imports torch, which on a loaded host takes longer.
    Here the wait is up to 180 s; what the process does once started is unchanged."""
    real = multiprocessing.context.SpawnContext.Event

    def event(ctx):
        return _PatientEvent(ctx=ctx.get_context())

    multiprocessing.context.SpawnContext.Event = event
    try:
        yield
    finally:
        multiprocessing.context.SpawnContext.Event = real


class _Observers:
    """One configuration's background observers: started, then `stop()`; `cpu_s()` is what they used so far."""

    def __init__(self, kind: str, period_s: float, scrape_every_s: float) -> None:
        import subprocess

        self.kind = kind
        self._stops: list[Callable[[], None]] = []
        self._queries: list[Callable[[str], object]] = []  # run once per step, as a step-logging loop would
        self._pids: list[int] = []
        if kind.startswith("ours:") and "power timeline" in kind:
            from zeus_callbacks.core.monitor.power import PowerMonitor

            pm = PowerMonitor(
                gpu_indices=[0], update_period=period_s, sampling="thread" if "thread" in kind else "process"
            )
            if pm._process is not None:
                self._pids.append(pm._process.pid)
            self._stops.append(pm.stop)
            self._queries.append(pm.get_power_timeline)
        if kind == "ours: endpoint + power timeline":
            from zeus_callbacks.core.observability.endpoint import serve_metrics

            server = serve_metrics(port=0, addr="127.0.0.1", per_rank=False)
            scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER, server.url, str(scrape_every_s)])
            self._stops += [server.stop, scraper.kill]  # stopped in reverse: the scraper first
        if kind == "zeus: PowerMonitor":
            from zeus.monitor.power import PowerMonitor as ZeusPowerMonitor

            # One domain (one process): all three spawn three, whose start can outlast Zeus's 10 s timeout on a
            # loaded host; fewer samples than ours take, so the comparison leans in Zeus's favour.
            with _patient_spawn():
                zpm = ZeusPowerMonitor(
                    gpu_indices=[0], update_period=period_s, power_domains=["device_instant"]
                )
            self._pids = [p.pid for p in zpm.processes.values()]
            self._stops.append(zpm.stop)
            self._queries.append(zpm.get_power_timeline)
        time.sleep(2 * max(period_s, 0.05))  # started and sampling
        self._threads0, self._procs0, self.query_s = self._threads_cpu(), _cpu_s_of(self._pids), 0.0

    @staticmethod
    def _threads_cpu() -> float:
        return time.process_time() - time.thread_time()  # this process's threads but the training thread

    def query(self) -> None:
        """Ask each timeline for its readings so far (the sampling processes' readings come over), timed."""
        t0 = time.perf_counter()
        for query in self._queries:
            query("device_instant")
        self.query_s += time.perf_counter() - t0

    def gil_s(self) -> float:
        """Time the observers held this process (its other threads' CPU, and the queries): what a step that
        holds the GIL loses to them at least, on any host."""
        return self._threads_cpu() - self._threads0 + self.query_s

    def other_processes_cpu_s(self) -> float:
        """CPU of the sampling processes (ours or Zeus's): runs beside the step where a core is free."""
        return _cpu_s_of(self._pids) - self._procs0

    def stop(self) -> None:
        for stop in reversed(self._stops):
            stop()


# (name, host Python s, GPU wait s): the worst case, and a step that mostly waits for the GPU.
STEP_KINDS = (("host-bound", STEP_S, 0.0), ("GPU-bound", 0.1 * STEP_S, 0.9 * STEP_S))


def _step_section(args: argparse.Namespace) -> None:
    zeus, why_not = _import_zeus()
    try:
        from zeus_callbacks.core.monitor.power import PowerMonitor
    except ImportError as e:
        print(f"Step section skipped: this package's PowerMonitor is not importable ({e}).")
        return
    kinds = [
        "none (the host's drift)",
        "ours: power timeline",
        "ours: power timeline (thread)",
        "ours: endpoint + power timeline",
    ]
    if zeus is not None:
        kinds.append("zeus: PowerMonitor")
    steps = {name: _calibrated_step(host_s, wait_s) for name, host_s, wait_s in STEP_KINDS}
    rel = {
        (k, s): [] for k in kinds for s in steps
    }  # step time against the block without observers before it
    step_ms = {(k, s): [] for k in kinds for s in steps}
    gil = {k: [] for k in kinds}  # GIL time taken from the training thread per wall s, per round
    procs = {k: [] for k in kinds}  # other processes' CPU per wall s, per round

    def block(step: Callable[[], None], observers: _Observers | None) -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
            if observers is not None:
                observers.query()
        return (time.perf_counter() - t0) / args.steps

    with tempfile.TemporaryDirectory(prefix="zeus_callbacks-bench-") as state_dir:
        sim.simulate("a40", state_dir=state_dir)  # exported: the sampling processes simulate it too
        period_s = PowerMonitor(gpu_indices=[0], background=False).update_period
        for _ in range(args.rounds):
            for kind in kinds:
                baseline = {name: block(step, None) for name, step in steps.items()}
                observers = _Observers(kind, period_s, args.scrape_interval)  # "none...": no observers
                wall0 = time.perf_counter()
                for name, step in steps.items():
                    t = block(step, observers)
                    step_ms[kind, name].append(t * 1000)
                    rel[kind, name].append(t / baseline[name] - 1)
                wall = time.perf_counter() - wall0
                gil[kind].append(observers.gil_s() / wall)
                procs[kind].append(observers.other_processes_cpu_s() / wall)
                observers.stop()
        sim.disable()
    print()
    print(
        f"Observers' cost to a {STEP_S * 1000:.0f} ms step: 1 simulated A40 beneath nvidia-ml-py, real clock; "
        f"power sampled every {period_s * 1000:.0f} ms (ours and Zeus's), the endpoint scraped every "
        f"{args.scrape_interval:g} s by another process"
    )
    print(
        f"host-bound: {STEP_S * 1000:.0f} ms of pure-Python work (GIL held: the worst case); GPU-bound: "
        f"{STEP_KINDS[1][1] * 1000:.0f} ms of it, then {STEP_KINDS[1][2] * 1000:.0f} ms waiting with the GIL "
        f"released; {args.rounds} rounds x {args.steps} steps each; medians over rounds"
    )
    if zeus is None:
        print(f"Zeus row skipped: {why_not}")
    header = (
        f"{'observers':<32}  {'host-bound ms':>13}  {'vs before':>9}  {'GPU-bound ms':>12}  {'vs before':>9}"
        f"  {'GIL taken per 100 ms':>20}  {'other processes CPU per 100 ms':>30}"
    )
    print(header)
    print("-" * len(header))
    for kind in kinds:
        cols = [
            (statistics.median(step_ms[kind, name]), statistics.median(rel[kind, name]) * 100)
            for name in steps
        ]
        (h_ms, h_rel), (g_ms, g_rel) = cols
        gil_ms = statistics.median(gil[kind]) * STEP_S * 1000
        proc_ms = statistics.median(procs[kind]) * STEP_S * 1000
        print(
            f"{kind:<32}  {h_ms:>13.2f}  {h_rel:>+8.2f}%  {g_ms:>12.2f}  {g_rel:>+8.2f}%  {gil_ms:>17.3f} ms"
            f"  {proc_ms:>27.3f} ms"
        )
    print(
        "'vs before': step time (with one query of each power timeline per step, as a logging loop makes) "
        "against the same steps without observers just before, in the same round; the host's own drift moves "
        "it either way, by several percent on a shared 2-core VM. 'GIL taken': CPU time of this process's "
        "threads other than the training thread, plus the time the training thread spent in the queries, per "
        "100 ms of wall time: what a step that holds the GIL loses to the observers at least, on any host, and "
        "the figure the 1% goal is checked on. 'other processes CPU': the sampling processes' CPU, which runs "
        "beside the step where a core is free. SIMULATED GPU: its NVML answers are Python callbacks, dearer "
        "than a real driver's."
    )


if __name__ == "__main__":
    sys.exit(main())
