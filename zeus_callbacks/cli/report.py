"""`zeus-callbacks report`: write a recorded run's report, one self-contained HTML file."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `report` subcommand."""
    parser = subparsers.add_parser(
        "report",
        help="write a recorded run's report: one self-contained HTML file",
        description=(
            "Write the report of the run recorded in RUN_DIR (by the callbacks' report_path= option, "
            "RunRecorder, or `zeus-callbacks demo --report`): power over time per GPU with the power limit in "
            "force, energy per step, the power-limit profile and choice, the pipeline plan, and the run's "
            "energy, CO2eq and cost. One HTML file with inline SVG: no network, no script."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="folder holding record.rank*.json")
    parser.add_argument(
        "-o", "--output", metavar="FILE.html", help="where to write the report (default RUN_DIR/report.html)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Render the report; bad input is reported by the command's error handler (exit 2)."""
    from zeus_callbacks.core.report.html import write_report

    out = Path(args.output) if args.output else Path(args.run_dir) / "report.html"
    if out.is_dir():
        raise ValueError(f"-o {str(out)!r} is a folder: pass a file name, e.g. {str(out / 'report.html')!r}.")
    path = write_report(args.run_dir, out)
    print(f"Report written to {path}.")
    return 0
