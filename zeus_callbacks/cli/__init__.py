"""The `zeus-callbacks` command: one module per subcommand, each with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from zeus_callbacks.core.device.errors import ZeusCallbacksError

# Subcommand name -> (module under `zeus_callbacks.cli`, one-line help). Each module defines
# `register(subparsers)`, which adds its parser and sets `func=run` where `run(args) -> int`. Only the
# module of the command being run is imported: the command starts fast, and one command's missing
# optional dependency never breaks another.
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "watch the power-limit optimizer pick a limit while HF Trainer fine-tunes a tiny LM"),
    "doctor": (
        "doctor",
        "check this node before training (read-only): GPUs, energy counter, power, permissions",
    ),
    "devices": ("devices", "list the GPUs (real or simulated), their power limits, clocks and permissions"),
    "measure": ("measure", "run a command and report its time and energy per GPU"),
    "restore": ("restore", "restore GPU settings left changed by a process that died hard"),
    "simulate": ("simulate", "run the power-limit optimizer on a SIMULATED GPU built from a profile file"),
    "profile": ("profile", "profile a training script over batch sizes and power limits (Zeus² JSON)"),
    "plan": ("plan", "plan local batch sizes and power limits for heterogeneous GPUs"),
    "pipeline-plan": ("pipeline_plan", "plan per-instruction SM frequencies of a pipeline (Perseus)"),
    "report": ("report", "write a recorded run's report: one self-contained HTML file"),
    "jobs": ("jobs", "sum energy ledgers per job, user or partition"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: the full one of `command`, and a help line for every other subcommand."""
    parser = argparse.ArgumentParser(
        prog="zeus-callbacks",
        description="Measure and cut the GPU energy of deep-learning training (real or simulated GPUs).",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO level, and show the traceback of an error"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _COMMANDS.items():
        if name == command:
            importlib.import_module(f"{__name__}.{module}").register(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in _COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zeus-callbacks` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ZeusCallbacksError, ValueError, OSError) as e:
        if args.verbose or not _input_error(e):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"zeus-callbacks {args.command}: {message}", file=sys.stderr)
        return 2


_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _input_error(e: BaseException) -> bool:
    """Whether `e` reports a bad input in words of ours: the package's errors, file errors, and the
    `ValueError`s this package raises. A `ValueError` raised inside another library is a message we did
    not write (or a bug): it keeps its traceback."""
    if isinstance(e, (ZeusCallbacksError, OSError)):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


if __name__ == "__main__":
    sys.exit(main())
