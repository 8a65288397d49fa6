"""Cost of one begin_window+end_window pair: this package's ZeusMonitor vs Zeus 0.16's, on simulated NVML.

Both monitors read the same simulated GPUs through the same real nvidia-ml-py (`pynvml`), beneath which
the simulator answers as the NVML library (`zeus_callbacks.sim.nvml_library`, ctypes callbacks at NVML's C
boundary), without device synchronisation (`sync_execution=False`), and measure GPUs only
(`cpu_indices=[]`). The "bare reads" column is the floor both share: the
`pynvml.nvmlDeviceGetTotalEnergyConsumption` calls a pair needs (two per GPU), made in a tight loop.

Run: `python benchmarks/monitor_overhead.py [--pairs 2000] [--repeat 50]`
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import timeit
import warnings
from collections.abc import Callable

import pynvml

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

GPU_COUNTS = (1, 4, 8)


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
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # Zeus logs at INFO/WARNING while it probes devices
    warnings.simplefilter("ignore")  # Zeus warns on zero-energy windows; the warning call still costs

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
