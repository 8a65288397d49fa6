"""`zeus-callbacks jobs`: sum energy ledgers per job, user or partition (a table, or JSON)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `jobs` subcommand."""
    from zeus_callbacks.core.accounting.ledger import GROUPINGS, LEDGER_ENV

    parser = subparsers.add_parser(
        "jobs",
        help="sum energy ledgers per job, user or partition",
        description=(
            "Sum the energy ledgers the callbacks append to (ledger_path=, or $ZEUS_CALLBACKS_LEDGER): one line of "
            "every rank of every run, its final line, else its last checkpoint's (a run that died after a "
            "checkpoint), per job (default), user or partition. Energy is shown with the bound the lines carry; "
            "SIM marks simulated figures, CKPT groups counted up to a checkpoint for some rank."
        ),
    )
    parser.add_argument("ledgers", nargs="*", metavar="LEDGER", help=f"ledger files (default: ${LEDGER_ENV})")
    parser.add_argument("--by", choices=GROUPINGS, default="job", help="what to sum per (default: job)")
    parser.add_argument("--json", action="store_true", help="print JSON and nothing else")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the sums; bad input is reported by the command's error handler (exit 2)."""
    from zeus_callbacks.core.accounting.ledger import LEDGER_ENV, read, totals

    paths = args.ledgers or ([os.environ[LEDGER_ENV]] if os.environ.get(LEDGER_ENV) else [])
    if not paths:
        raise ValueError(f"name a ledger file, or set {LEDGER_ENV}: e.g. `zeus-callbacks jobs ledger.jsonl`.")
    contents = read(paths)
    rows = totals(contents.entries, by=args.by)
    if args.json:
        json.dump(
            {"by": args.by, "totals": [asdict(r) for r in rows], "skipped_lines": contents.skipped},
            sys.stdout,
        )
        sys.stdout.write("\n")
        return 0
    print(_table(args.by, rows))
    if contents.skipped:
        print(f"{contents.skipped} line(s) were not ledger lines and were skipped.", file=sys.stderr)
    return 0


def _table(by: str, rows: list) -> str:
    head = (
        by.upper(),
        "JOBS",
        "PROCS",
        "RANKS",
        "GPUS",
        "ENERGY kWh",
        "±",
        "GPU-h",
        "CO2eq kg",
        "COST",
        "",
    )
    lines = [head]
    for r in rows:
        lines.append(
            (
                r.key,
                str(r.jobs),
                str(r.runs),
                str(r.ranks),
                str(r.gpus),
                f"{r.energy_j / 3.6e6:.4g}",
                "?"
                if r.energy_bound_j is None or not r.energy_j
                else f"{100 * r.energy_bound_j / r.energy_j:.1f}%",
                f"{r.gpu_hours:.3f}",
                "-" if r.co2eq_g is None else f"{r.co2eq_g / 1000:.3f}",
                "-" if r.cost is None else f"{r.cost:.2f}",
                " ".join(
                    f
                    for f, on in (("SIM", r.simulated), ("FAILED", r.failed), ("CKPT", r.checkpointed))
                    if on
                ),
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in lines
    )
