"""`zeus-callbacks plan`: split a global batch over heterogeneous GPUs and pick their power limits."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from zeus_callbacks.cli.options import add_objective_arguments, objective_from_args
from zeus_callbacks.core.files import write_atomic
from zeus_callbacks.core.heterogeneous.planner import (
    COST_MODELS,
    ZEUS2_METHODS,
    HeteroPlan,
    cost_curve,
    load_profile,
    plan,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="plan local batch sizes and power limits for heterogeneous GPUs",
        description="Split a global batch over GPU types and pick each type's power limit, from measured profiles.",
    )
    parser.add_argument(
        "--profile",
        action="append",
        required=True,
        help="Zeus² profile JSON, or a shipped one (a10, t4); once per GPU type",
    )
    parser.add_argument(
        "--count", action="append", type=int, help="GPUs of each type, in --profile order (default 1)"
    )
    parser.add_argument("--global-batch", type=int, required=True, help="samples per step over all GPUs")
    add_objective_arguments(parser, "--objective")
    parser.add_argument("--cost-model", choices=COST_MODELS, default="sync")
    parser.add_argument(
        "--search", choices=ZEUS2_METHODS, default="naive", help="search of the zeus2 cost model"
    )
    parser.add_argument(
        "--batch-granularity", type=int, default=1, help="local batches are multiples of this"
    )
    parser.add_argument(
        "--allow-extrapolation", action="store_true", help="plan beyond the measured batch sizes"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot cost over the split (two GPU types)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan, print, optionally plot; 2 on bad input."""
    counts = args.count or [1] * len(args.profile)
    try:
        if len(counts) != len(args.profile):
            raise ValueError(f"got {len(args.profile)} --profile but {len(counts)} --count")
        if args.plot and len(args.profile) != 2:
            raise ValueError("--plot needs exactly two --profile")
        objective = objective_from_args(args)
        profiles = [load_profile(p) for p in args.profile]
        result = plan(
            profiles,
            counts,
            args.global_batch,
            objective,
            cost_model=args.cost_model,
            allow_extrapolation=args.allow_extrapolation,
            batch_granularity=args.batch_granularity,
            zeus2_method=args.search,
        )
        if args.plot:
            curve = cost_curve(
                profiles,
                counts,
                args.global_batch,
                objective,
                cost_model=args.cost_model,
                allow_extrapolation=args.allow_extrapolation,
                batch_granularity=args.batch_granularity,
            )
    except (OSError, ValueError) as e:
        print(f"zeus-callbacks plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(_table(result))
    if args.plot:
        try:
            _plot(curve, result, args.plot)
        except (ImportError, OSError) as e:
            print(f"zeus-callbacks plan: cannot write {args.plot}: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"cost curve written to {args.plot}")
    return 0


def _table(result: HeteroPlan) -> str:
    header = (
        f"{'GPU':<12}{'count':>6}{'local batch':>13}{'limit (W)':>11}{'compute (s)':>13}{'energy (J)':>12}"
    )
    lines = [
        f"{result.cost_model} plan, {result.objective}, global batch {result.global_batch} (time, energy per step)",
        header,
        "-" * len(header),
    ]
    for t in result.types:
        mark = " *" if t.extrapolated else ""
        lines.append(
            f"{t.gpu_name:<12}{t.count:>6}{t.local_batch:>13}{t.power_limit_w:>11}"
            f"{t.compute_time_s:>13.4f}{t.energy_j:>12.2f}{mark}"
        )
    lines += [
        "-" * len(header),
        f"step time {result.step_time_s:.4f} s, energy {result.energy_j:.2f} J, cost {result.cost:.4f}",
        f"even split ({result.reference_local_batch:g}/GPU) at max power: step time "
        f"{result.reference_step_time_s:.4f} s, energy {result.reference_energy_j:.2f} J, "
        f"cost {result.reference_cost:.4f}",
        f"savings vs even split: energy {100 * result.energy_saving:.1f}%, cost {100 * result.cost_saving:.1f}%, "
        f"time x{result.slowdown:.3f}",
    ]
    if result.extrapolated or result.reference_extrapolated:
        lines.append(
            "* extrapolated beyond the measured batch sizes"
            + (" (reference too)" * result.reference_extrapolated)
        )
    return "\n".join(lines)


def _plot(curve, result: HeteroPlan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = result.types
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(curve.local_batch_a, curve.cost, label=f"best over power limits ({result.cost_model})")
    if curve.extrapolated.any():
        ax.plot(
            curve.local_batch_a[curve.extrapolated],
            curve.cost[curve.extrapolated],
            ".",
            ms=2,
            label="extrapolated",
        )
    ax.axvline(a.local_batch, color="k", ls="--", lw=1, label=f"plan: {a.local_batch} / {b.local_batch}")
    ax.set_xlabel(f"local batch per {a.gpu_name} (the rest to {b.gpu_name})")
    ax.set_ylabel("cost")
    ax.set_title(f"{result.objective}, global batch {result.global_batch}")
    ax.legend()
    fig.tight_layout()
    image = io.BytesIO()  # rendered here, written as every file of the package is (`files.write_atomic`)
    fig.savefig(image, dpi=120, format=Path(path).suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    write_atomic(path, image.getvalue(), mode=0o644)
