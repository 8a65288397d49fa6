"""`zeus-callbacks simulate`: run the power-limit optimizer on a simulated GPU built from a profile file, or on
the simulated node an `nvidia-smi -q` dump describes (`--from FILE`)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Any

from zeus_callbacks.cli.options import GPU_KINDS, add_objective_arguments, objective_from_args
from zeus_callbacks.core.power_limit.options import PowerLimitOptions

_WORK_S = 0.1  # one step's work at the maximum limit; only ratios matter on a virtual clock
_MAX_STEPS = 100_000


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `simulate` subcommand."""
    parser = subparsers.add_parser(
        "simulate",
        help="what-if: run the power-limit optimizer on a SIMULATED GPU built from a profile file",
        description=(
            "Run GlobalPowerLimitOptimizer on a simulated GPU (virtual clock, finishes in seconds) whose "
            "speed and power follow a measured profile, and report the limit it picks, what profiling cost, "
            "and the saving against the maximum limit. Every figure is a SIMULATION."
        ),
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="profile file (NSDI'23 summary CSV, Zeus² JSON or Zeus monitor CSV); default: the shipped one of --gpu",
    )
    parser.add_argument(
        "--from",
        dest="dump",
        metavar="FILE",
        help="build the node a saved `nvidia-smi -q` output describes (a path, or a shipped dump's name such "
        "as A10 or V100_x8): its GPUs, ranges and limits in force, timing from the nearest traced GPU",
    )
    parser.add_argument(
        "--workload", metavar="KEY", help="workload key in the file (e.g. imagenet/resnet50/256)"
    )
    add_objective_arguments(parser)
    parser.add_argument(
        "--gpu", choices=GPU_KINDS, help="simulated GPU model (default: guessed from the file name, else a40)"
    )
    parser.add_argument("--noise", type=float, default=0.02, help="relative per-step noise (default 0.02)")
    parser.add_argument("--seed", type=int, default=0)
    defaults = PowerLimitOptions  # the optimizer's own defaults
    parser.add_argument("--search", choices=("adaptive", "sweep"), default=defaults.search)
    parser.add_argument("--wait-steps", type=int, default=defaults.wait_steps)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--profile-steps", type=int, default=defaults.profile_steps)
    parser.add_argument(
        "--pl-step", type=int, default=defaults.pl_step, help="stride between profiled limits (W)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


class _Error(Exception):
    pass


def _guess_gpu(path: str | None) -> str:
    if path:
        name = Path(path).name.lower()
        for kind, pattern in (
            ("a10g", r"a10g?(?![0-9])"),
            ("a40", r"a40"),
            ("v100", r"v100"),
            ("t4", r"t4(?![0-9])"),
        ):
            if re.search(pattern, name):
                return kind
    return "a40"


def simulate_run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the optimizer on the simulated GPU and return the result as plain data."""
    from zeus_callbacks import sim
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor
    from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer

    if not 0 <= args.noise <= 0.5:
        raise _Error(
            f"--noise {args.noise!r} must be a number from 0 to 0.5 (the relative spread, e.g. 0.02)"
        )
    if args.pl_step <= 0:
        raise _Error(f"--pl-step {args.pl_step!r} must be a positive number of watts")
    spec = _spec(args)
    selector = objective_from_args(args)
    system = sim.simulate(spec, noise=args.noise, seed=args.seed, virtual_clock=True)
    trace = system.gpus[0].trace  # the dump's first board's, or the one GPU's
    kind = _node_label(system) if system.dump is not None else args.gpu or _guess_gpu(args.trace)
    try:
        opt = GlobalPowerLimitOptimizer(
            ZeusMonitor(),
            selector,
            wait_steps=args.wait_steps,
            warmup_steps=args.warmup_steps,
            profile_steps=args.profile_steps,
            pl_step=args.pl_step,
            search=args.search,
        )
        steps = 0
        while opt.phase not in ("done", "inactive") and steps < _MAX_STEPS:
            opt.on_step_begin()
            system.run_step(_WORK_S)
            opt.on_step_end()
            steps += 1
        report = opt.report()
        opt.on_train_end()
    finally:
        sim.disable()
    chosen = report["optimal_power_limit_w"]
    if chosen is None:
        raise _Error(f"the optimizer did not finish ({report.get('inactive_reason', report['phase'])})")
    top = opt.grid[0]

    def truth(pl: float) -> tuple[float, float]:
        in_force = _in_force_w(system.gpus[0], pl)
        t = _WORK_S * trace.relative_time(in_force)
        return t, t * trace.power(in_force)

    t_max, e_max = truth(top)
    t_opt, e_opt = truth(chosen)
    measured = {row["power_limit_w"]: row for row in report["power_limits"]}
    return {
        "simulated": True,
        "gpu": kind,
        **({} if system.dump is None else {"node": _node(system)}),
        "trace": trace.source,
        "workload": trace.workload,
        "selector": repr(selector),
        "search": args.search,
        "noise": args.noise,
        "seed": args.seed,
        "power_limit_range_w": [opt.grid[-1], top],
        "optimal_power_limit_w": chosen,
        "profiling_steps": report["profiling_steps"],
        "profiling_energy_j": report["profiling_energy_j"],
        "limits_profiled": len(measured),
        "energy_saved_pct_true": 100 * (1 - e_opt / e_max),
        "time_lost_pct_true": 100 * (t_opt / t_max - 1),
        "energy_saved_pct_measured": report.get("energy_saved_pct", math.nan),
        "time_lost_pct_measured": report.get("time_lost_pct", math.nan),
        "power_limits": report["power_limits"],
    }


def _spec(args: argparse.Namespace) -> str:
    """The simulation spec the arguments ask for (see `zeus_callbacks.sim`)."""
    from zeus_callbacks import sim

    if args.dump is not None:
        if args.trace is not None or args.gpu is not None:
            raise _Error("--from builds the whole node from the dump: leave out --trace and --gpu")
        path = Path(args.dump)
        target = str(path.resolve()) if path.is_file() else args.dump  # else a shipped dump's name
        return f"nvidia-smi:{target}" + (f":{args.workload}" if args.workload else "")
    kind = args.gpu or _guess_gpu(args.trace)
    if args.trace is None:
        return f"{kind}:{args.workload}" if args.workload else kind
    path = Path(args.trace)
    if not path.is_file():
        raise _Error(f"trace file {args.trace!r} does not exist. {sim.DATA_FORMATS_HELP}")
    if any(c in str(path) for c in ",@"):
        raise _Error(f"trace file name {args.trace!r} may not contain ',' or '@'")
    return f"{kind}:{args.workload or ''}@{path.resolve()}"


def _in_force_w(gpu: Any, limit_w: float) -> float:
    """The limit a simulated board enforces once the optimizer sets `limit_w`: the same, but on a board from a
    dump held by its other limiters (GH200: 700 W), and set on the module where the GPU scope is N/A."""
    board = gpu.board
    if board is None:
        return limit_w
    mw = round(limit_w * 1000)
    if board.gpu_limits is None and board.module_limits is not None:
        return board.enforced_mw(gpu.power_limit_mw, mw) / 1000
    return board.enforced_mw(mw, gpu.module_limit_mw) / 1000


def _node_label(system: Any) -> str:
    """ "8 x Tesla V100-SXM2-16GB" (with each model's count)."""
    names: dict[str, int] = {}
    for gpu in system.gpus:
        names[gpu.spec.name] = names.get(gpu.spec.name, 0) + 1
    return ", ".join(f"{n} x {name}" for name, n in names.items())


def _node(system: Any) -> dict[str, Any]:
    """What the node built from a dump is: its file, driver, and each GPU's range and limit in force."""
    return {
        "dump": system.dump.dump.source,
        "driver_version": system.driver_version,
        "provenance": system.gpus[0].provenance,
        "gpus": [
            {
                "name": g.spec.name,
                "uuid": g.uuid,
                "power_limit_range_w": [g.min_power_limit_mw / 1000, g.max_power_limit_mw / 1000],
                "power_limit_in_force_w": g.enforced_power_limit_mw / 1000,
            }
            for g in system.gpus
        ],
    }


def _text(r: dict[str, Any]) -> str:
    node = r.get("node")
    what = f"node of {r['gpu']} from {node['dump']} ({node['provenance']})" if node else f"{r['gpu']} GPU"
    lines = [
        f"SIMULATED {what}, {r['workload']} ({r['trace']}), noise {r['noise']:g}, seed {r['seed']}",
        f"{r['selector']}, {r['search']} search over {r['power_limit_range_w'][0]}-{r['power_limit_range_w'][1]} W",
        f"{'limit (W)':>10}{'time/step (s)':>15}{'energy/step (J)':>17}{'steps':>7}  note",
    ]
    for row in r["power_limits"]:
        note = (
            "chosen"
            if row["power_limit_w"] == r["optimal_power_limit_w"]
            else ("pruned" if row["pruned"] else "")
        )
        lines.append(
            f"{row['power_limit_w']:>10}{row['time_per_step_s']:>15.4f}{row['energy_per_step_j']:>17.2f}{row['steps']:>7}  {note}"
        )
    lines += [
        f"chosen power limit: {r['optimal_power_limit_w']} W (simulated)",
        f"profiling took {r['profiling_steps']} steps and {r['profiling_energy_j']:.1f} J over {r['limits_profiled']} limits",
        f"vs the maximum limit, by the trace:        energy saved {r['energy_saved_pct_true']:.1f}%, "
        f"time lost {r['time_lost_pct_true']:.1f}%",
        f"vs the maximum limit, by the measurements: energy saved {r['energy_saved_pct_measured']:.1f}%, "
        f"time lost {r['time_lost_pct_measured']:.1f}%",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Simulate and print; 2 on bad input."""
    # The optimizer's per-limit warnings would drown the result; the result says what matters.
    package_logger = logging.getLogger("zeus_callbacks")
    level = package_logger.level
    package_logger.setLevel(logging.ERROR if not args.verbose else logging.INFO)
    try:
        result = simulate_run(args)
    except (_Error, OSError, ValueError, KeyError) as e:
        msg = str(e).strip("'\"") if isinstance(e, KeyError) else str(e)
        print(f"zeus-callbacks simulate: {msg}", file=sys.stderr)
        return 2
    finally:
        package_logger.setLevel(level)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_text(result))
    return 0
