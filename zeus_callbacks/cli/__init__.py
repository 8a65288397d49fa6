"""The `zeus-callbacks` command: one module per subcommand, each with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# Subcommand modules under `zeus_callbacks.cli`; each defines `register(subparsers)`, which adds its parser
# and sets `func=run` where `run(args) -> int`.
_COMMANDS = (
    "devices",
    "measure",
    "restore",
    "demo",
    "simulate",
    "profile",
    "plan",
    "pipeline_plan",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="zeus-callbacks",
        description="Measure and cut the GPU energy of deep-learning training (real or simulated GPUs).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:  # a subcommand not built yet in this checkout
            if e.name == f"{__name__}.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zeus-callbacks` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
