"""Options shared by several subcommands: the objective and the simulated GPU kind."""

from __future__ import annotations

import argparse
import sys
import warnings

from zeus_callbacks.core.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
)
from zeus_callbacks.sim.specs import SPECS

OBJECTIVES = ("zeus-cost", "energy", "time", "max-slowdown")
GPU_KINDS = tuple(SPECS)


def add_objective_arguments(parser: argparse.ArgumentParser, flag: str = "--selector") -> None:
    """`flag` (one of `OBJECTIVES`), `--eta` and `--max-slowdown`."""
    parser.add_argument(
        flag, dest="objective", choices=OBJECTIVES, default="zeus-cost", help="objective (default zeus-cost)"
    )
    parser.add_argument("--eta", type=float, default=0.5, help="energy weight of zeus-cost (default 0.5)")
    parser.add_argument(
        "--max-slowdown", type=float, default=1.1, help="slowdown bound of max-slowdown (default 1.1)"
    )


def objective_from_args(args: argparse.Namespace) -> OptimumSelector:
    """The selector the objective options ask for (raises ValueError on a bad --eta/--max-slowdown)."""
    if args.objective == "zeus-cost":
        return ZeusCost(args.eta)
    if args.objective == "max-slowdown":
        with warnings.catch_warnings(record=True) as unlikely:  # said in the option's words instead
            warnings.simplefilter("always", UserWarning)
            selector = MaxSlowdownConstraint(args.max_slowdown)
        if unlikely:  # on stderr whatever the command's log level (`simulate` keeps the package's quiet)
            factor = args.max_slowdown
            print(
                f"zeus-callbacks {getattr(args, 'command', '')}: warning: --max-slowdown {factor:g} lets each step "
                f"take up to {factor:g}x as long as at the maximum power limit; did you mean --max-slowdown "
                f"{1 + factor / 100:.2f} ({factor:g}% slower)?",
                file=sys.stderr,
            )
        return selector
    return Energy() if args.objective == "energy" else Time()
