"""Power-limit search on SIMULATED GPUs: this package's GlobalPowerLimitOptimizer against Zeus 0.16's.

Both optimizers run unmodified against the same simulated GPUs (`zeus_callbacks.sim`, virtual clock, the
same noise and seeds): ours through its NVML layer, Zeus's through its own, both over the real
nvidia-ml-py (`pynvml`) beneath which the simulator answers as the NVML library (Zeus's clock patched to
the virtual one, its device synchronisation to a no-op since a virtual GPU has no queued work). Every
workload and batch size of the shipped traces is run (NSDI'23 A40 and V100, every
dataset/network/batch/optimizer key and the Zeus monitor logs; Zeus² A10G and T4 batch sizes) with every
selector.

Accuracy is judged by the trace, not by the measurements: the true time and energy of a step at limit
`pl` are `work * relative_time(pl)` and that times `power(pl)`; a choice counts when its true cost is
within 1% of the best over the same grid of limits. For `MaxSlowdownConstraint(1.1)` (reference: the
time at the maximum limit) a choice counts when its true slowdown is at most 1.1 x 1.01 and its true
energy within 1% of the least energy among truly feasible limits. Zeus's `MaxSlowdownConstraint` picks
the lowest feasible limit rather than the least energy among feasible ones; it is judged by the same
rule. Profiling cost is every step run at a limit under trial (warm-up included) and the GPU energy of
those steps, counted the same way for both.

The grid is the optimizer's own: from the maximum limit down by `pl_step`, 25 W, or the trace's own
spacing where that is finer (T4: 60-70 W in 5 W steps, where 25 W would leave Zeus a single limit).

Run: `python benchmarks/power_limit_search.py [--seeds 4] [--jobs 2] [--gpus a40,v100,a10g,t4]`
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pynvml

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.search import power_limit_grid
from zeus_callbacks.core.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
)

KINDS = ("a40", "v100", "a10g", "t4")
SELECTORS = ("ZeusCost(0.5)", "Energy()", "Time()", "MaxSlowdownConstraint(1.1)")
WORK_S = 0.1  # work of one step at the maximum limit (only ratios matter)
NOISE = 0.02
# Gaussian: 2% per step on time and power. Bursty: that, plus stalls (2% of steps idle 0.5-3x as long)
# and bursts (from 1% of steps, 5-20 steps 10-50% slower), as data loaders, checkpoints and other jobs do.
NOISES = ("gaussian", "bursty")
MAX_STEPS = 20_000
TOLERANCE = 0.01


def our_selector(name: str) -> OptimumSelector:
    return {
        "ZeusCost(0.5)": lambda: ZeusCost(0.5),
        "Energy()": Energy,
        "Time()": Time,
        "MaxSlowdownConstraint(1.1)": lambda: MaxSlowdownConstraint(1.1),
    }[name]()


@dataclass
class Result:
    kind: str
    workload: str
    selector: str
    seed: int
    who: str  # "ours" | "zeus"
    noise: str  # "gaussian" | "bursty"
    chosen_w: int
    steps: int
    energy_j: float
    ok: bool


# -- the truth, from the trace ------------------------------------------------------------------------
def pl_step_for(trace: sim.Trace) -> int:
    spacing = np.diff(trace.power_limits_w)
    return int(min(25, spacing.min())) if len(spacing) else 25


def true_time_energy(trace: sim.Trace, pl: float) -> tuple[float, float]:
    t = WORK_S * trace.relative_time(pl)
    return t, t * trace.power(pl)


def within_tolerance(trace: sim.Trace, grid: list[int], selector: str, chosen: int) -> bool:
    """Whether the true cost at `chosen` is within 1% of the best over `grid` (see the module docstring)."""
    te = np.array([true_time_energy(trace, pl) for pl in grid])
    t, e = te[:, 0], te[:, 1]
    tc, ec = true_time_energy(trace, chosen)
    ref = t[0]  # grid[0] is the maximum limit
    if selector == "MaxSlowdownConstraint(1.1)":
        feasible = t <= 1.1 * ref
        return tc <= 1.1 * ref * (1 + TOLERANCE) and ec <= (1 + TOLERANCE) * e[feasible].min()
    sel = our_selector(selector)
    scores = sel.score(np.append(t, tc), np.append(e, ec), float(grid[0]), ref)
    return bool(scores[-1] <= (1 + TOLERANCE) * scores[:-1].min())


# -- driving the optimizers -----------------------------------------------------------------------------
def _energy_j(system: sim.SimulatedSystem) -> float:
    return sum(g.true_energy_mj() for g in system.gpus) / 1000


def _system(kind: str, workload: str, seed: int, noise: str) -> sim.SimulatedSystem:
    return sim.simulate(
        f"{kind}:{workload}", virtual_clock=True, noise=NOISE, seed=seed, bursts=noise == "bursty"
    )


def run_ours(
    kind: str, workload: str, selector: str, seed: int, pl_step: int, search: str, noise: str
) -> tuple[int, int, float]:
    system = _system(kind, workload, seed, noise)
    opt = GlobalPowerLimitOptimizer(ZeusMonitor(), our_selector(selector), pl_step=pl_step, search=search)
    steps, energy = 0, 0.0
    for _ in range(MAX_STEPS):
        opt.on_step_begin()
        profiling = opt.phase in ("warmup", "profiling")
        before = _energy_j(system)
        system.run_step(WORK_S)
        opt.on_step_end()
        if profiling:
            steps += 1
            energy += _energy_j(system) - before
        if opt.phase == "done":
            break
    chosen = opt.optimal_power_limit_w
    opt.on_train_end()
    sim.disable()
    if chosen is None:
        raise RuntimeError(f"ours did not finish on {kind}:{workload} {selector} seed {seed}: {opt.phase}")
    return chosen, steps, energy


_ZEUS = None


def _import_zeus():
    """Zeus's optimizer module (imported once per process). Zeus imports the same `pynvml` as this package,
    beneath which the simulated GPUs answer: nothing of its NVML access is patched."""
    global _ZEUS
    if _ZEUS is None:
        import zeus.device.gpu as zeus_gpu
        import zeus.device.gpu.nvidia as zeus_nvidia
        import zeus.monitor.energy as zeus_energy
        import zeus.optimizer.power_limit as zeus_pl

        if zeus_nvidia.pynvml is not pynvml:
            raise RuntimeError(f"zeus uses another `pynvml` ({zeus_nvidia.pynvml!r}) than nvidia-ml-py's.")
        zeus_energy.sync_execution_fn = lambda *a, **k: None  # a virtual GPU has no queued work to wait for
        try:
            import torch  # noqa: F401
        except ImportError:
            # Zeus asks torch (or jax) whether it runs distributed; one process without either is not, and
            # there Zeus's own all_reduce returns its input.
            zeus_pl.is_distributed = lambda: False
            zeus_pl.all_reduce = lambda values, operation: values
        _ZEUS = (zeus_gpu, zeus_nvidia, zeus_energy, zeus_pl)
    return _ZEUS


def run_zeus(
    kind: str, workload: str, selector: str, seed: int, pl_step: int, noise: str
) -> tuple[int, int, float]:
    zeus_gpu, zeus_nvidia, zeus_energy, zeus_pl = _import_zeus()
    system = _system(kind, workload, seed, noise)
    # Zeus caches its GPU objects per process; this is a new node. Its monitor reads `time.time`.
    zeus_gpu._gpus = None
    zeus_nvidia.nvml_is_available.cache_clear()
    zeus_energy.time = system.clock.now
    sel = {
        "ZeusCost(0.5)": lambda: zeus_pl.ZeusCost(0.5),
        "Energy()": zeus_pl.Energy,
        "Time()": zeus_pl.Time,
        "MaxSlowdownConstraint(1.1)": lambda: zeus_pl.MaxSlowdownConstraint(1.1),
    }[selector]()
    monitor = zeus_energy.ZeusMonitor(gpu_indices=[0], cpu_indices=[])
    opt = zeus_pl.GlobalPowerLimitOptimizer(monitor, sel, pl_step=pl_step)
    steps, energy = 0, 0.0
    for _ in range(MAX_STEPS):
        opt.on_step_begin()
        if isinstance(opt.state, zeus_pl.Done):
            break
        profiling = isinstance(opt.state, (zeus_pl.Warmup, zeus_pl.Profiling))
        before = _energy_j(system)
        system.run_step(WORK_S)
        opt.on_step_end()
        if profiling:
            steps += 1
            energy += _energy_j(system) - before
    else:
        raise RuntimeError(f"zeus did not finish on {kind}:{workload} {selector} seed {seed}")
    chosen = opt.state.optimal_power_limit // 1000
    sim.disable()
    return chosen, steps, energy


def run_case(args: tuple[str, str, int, str, bool, tuple[str, ...]]) -> list[Result]:
    kind, workload, seeds, search, with_zeus, selectors = args
    logging.disable(logging.WARNING)  # the optimizers' per-limit logs; the table says what matters
    trace = sim.shipped_trace(kind, workload)
    pl_step = pl_step_for(trace)
    grid = power_limit_grid(trace.min_power_limit_w, trace.max_power_limit_w, pl_step)
    out = []
    for noise in NOISES:
        for selector in selectors:
            for seed in range(seeds):
                runs = [("ours", run_ours(kind, workload, selector, seed, pl_step, search, noise))]
                if with_zeus:
                    runs.append(("zeus", run_zeus(kind, workload, selector, seed, pl_step, noise)))
                for who, (chosen, steps, energy) in runs:
                    ok = within_tolerance(trace, grid, selector, chosen)
                    out.append(Result(kind, workload, selector, seed, who, noise, chosen, steps, energy, ok))
    return out


# -- report ---------------------------------------------------------------------------------------------
def _row(label: str, results: list[Result], with_zeus: bool) -> str:
    ours = [r for r in results if r.who == "ours"]
    zeus = [r for r in results if r.who == "zeus"]

    def acc(rs: list[Result]) -> str:
        return f"{100 * np.mean([r.ok for r in rs]):5.1f}%" if rs else "    -"

    def steps(rs: list[Result]) -> float:
        return float(np.mean([r.steps for r in rs])) if rs else float("nan")

    def kj(rs: list[Result]) -> float:
        return float(np.mean([r.energy_j for r in rs])) / 1000 if rs else float("nan")

    line = f"{label:<36}{len(ours):>6}  {acc(ours):>7}{steps(ours):>8.0f}{kj(ours):>9.2f}"
    if with_zeus:
        ratio = steps(ours) / steps(zeus) if zeus else float("nan")
        line += f"  {acc(zeus):>7}{steps(zeus):>8.0f}{kj(zeus):>9.2f}{ratio:>8.2f}"
    return line


def print_report(results: list[Result], with_zeus: bool, command: str, elapsed_s: float, search: str) -> None:
    header = f"{'SIMULATED GPU / selector':<36}{'runs':>6}  {'ours ok':>7}{'steps':>8}{'kJ':>9}"
    if with_zeus:
        header += f"  {'zeus ok':>7}{'steps':>8}{'kJ':>9}{'ratio':>8}"
    print(
        f"# Power-limit search on SIMULATED GPUs (strict energy counter, noise {NOISE:.0%} gaussian and bursty, "
        f"virtual clock, {WORK_S * 1000:.0f} ms steps), ours: search={search!r}"
    )
    print(f"# command: {command}")
    print("# ok: true cost within 1% of the trace's best on the grid; steps/kJ: mean profiling steps and")
    print("# GPU energy per run (warm-up included); ratio: our steps / Zeus's steps. All figures SIMULATED.")
    by_kind: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_kind[r.kind].append(r)
    for kind in KINDS:
        rs = by_kind.get(kind)
        if not rs:
            continue
        print()
        print(header)
        print("-" * len(header))
        for noise in NOISES:
            for selector in SELECTORS:
                sel = [r for r in rs if r.selector == selector and r.noise == noise]
                print(_row(f"{kind} {noise} {selector}", sel, with_zeus))
        print(_row(f"{kind} (sim) all", rs, with_zeus))
    print()
    print(header)
    print("-" * len(header))
    for noise in NOISES:
        for selector in SELECTORS:
            sel = [r for r in results if r.selector == selector and r.noise == noise]
            print(_row(f"all {noise} {selector}", sel, with_zeus))
        print(_row(f"all {noise}", [r for r in results if r.noise == noise], with_zeus))
    print(_row("OVERALL (SIMULATED)", results, with_zeus))
    print(f"\n# {len(results)} runs in {elapsed_s:.0f} s")


def _miss_detail(r: Result) -> str:
    """The chosen limit against the trace's best on the grid: true slowdowns and cost (SIMULATED truth)."""
    trace = sim.shipped_trace(r.kind, r.workload)
    grid = power_limit_grid(trace.min_power_limit_w, trace.max_power_limit_w, pl_step_for(trace))
    te = np.array([true_time_energy(trace, pl) for pl in grid])
    t, e = te[:, 0], te[:, 1]
    if r.selector == "MaxSlowdownConstraint(1.1)":
        feasible = np.flatnonzero(t <= 1.1 * t[0])
        best = int(feasible[np.argmin(e[feasible])])
        cost = e
    else:
        cost = our_selector(r.selector).score(t, e, float(grid[0]), t[0])
        best = int(np.argmin(cost))
    i = grid.index(r.chosen_w)
    return (
        f"slowdown {t[i] / t[0]:.4f} (best {grid[best]} W: {t[best] / t[0]:.4f}), "
        f"cost {100 * (cost[i] / cost[best] - 1):+.2f}%"
    )


def print_misses(results: list[Result]) -> None:
    print("\n# misses (SIMULATED): who noise kind workload selector seed chosen, against the trace's best")
    for r in results:
        if not r.ok:
            print(
                f"  {r.who:<5}{r.noise:<9}{r.kind:<6}{r.workload:<42}{r.selector:<28}{r.seed:>3}{r.chosen_w:>6}"
                f"  {_miss_detail(r)}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4, help="noise seeds per workload and selector")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--gpus", default=",".join(KINDS), help="comma-separated simulated GPU kinds")
    parser.add_argument("--workload", default="", help="only workloads whose key contains this")
    parser.add_argument(
        "--selectors", default=",".join(SELECTORS), help="comma-separated subset of the selectors"
    )
    parser.add_argument("--search", default="adaptive", choices=("adaptive", "sweep"))
    parser.add_argument("--no-zeus", action="store_true", help="run only this package's optimizer")
    parser.add_argument("--misses", action="store_true", help="list the runs that missed the 1%% band")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.gpus.split(",") if k.strip()]
    selectors = tuple(s.strip() for s in args.selectors.split(",") if s.strip())
    unknown = [s for s in selectors if s not in SELECTORS]
    if unknown:
        parser.error(f"unknown selector(s) {unknown}; choose from {', '.join(SELECTORS)}")
    with_zeus = not args.no_zeus
    if with_zeus:
        try:
            _import_zeus()
        except ImportError as e:
            print(f"zeus is not importable ({e}); install `zeus==0.16.*` or pass --no-zeus", file=sys.stderr)
            return 2
    cases = [
        (kind, w, args.seeds, args.search, with_zeus, selectors)
        for kind in kinds
        for w in sim.shipped_workloads(kind)
        if args.workload in w
    ]
    start = time.monotonic()
    if args.jobs > 1:
        with mp.get_context("fork").Pool(args.jobs) as pool:
            chunks = pool.map(run_case, cases, chunksize=1)
    else:
        chunks = [run_case(c) for c in cases]
    results = [r for chunk in chunks for r in chunk]
    command = "python benchmarks/power_limit_search.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    print_report(results, with_zeus, command.strip(), time.monotonic() - start, args.search)
    if args.misses:
        print_misses(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
