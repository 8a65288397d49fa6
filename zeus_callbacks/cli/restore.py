"""`zeus-callbacks restore`: put back GPU settings left changed by processes that died without restoring them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zeus_callbacks.cli.devices import NO_GPU_MESSAGE
from zeus_callbacks.core.device.errors import MIGNotSupportedError, NVMLUnavailableError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.journal import read_journal, trusted_dir
from zeus_callbacks.core.device.state_guard import JournalEntry, guard, journal_dir, restore_defaults


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `restore` subcommand."""
    parser = subparsers.add_parser(
        "restore",
        help="restore GPU settings left changed by a process that died hard (SIGKILL, OOM)",
        description=(
            "Every power-limit and clock change is journaled before it is made. A process killed hard leaves "
            "its journal behind; this puts the recorded values back on the GPUs this process sees."
        ),
    )
    parser.add_argument(
        "--include-live",
        action="store_true",
        help="also undo the changes of processes still running (they may change the GPU again)",
    )
    parser.add_argument(
        "--to-default",
        action="store_true",
        help=(
            "also put every visible GPU back to its default power limit and unlocked SM clocks (for a limit "
            "left by a run whose journal is lost); GPUs a running process owns are skipped unless --include-live"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print the restored settings as JSON")
    parser.set_defaults(func=run)


def _value(entry: JournalEntry) -> str:
    if entry.knob == "power_limit":
        return f"{entry.original / 1000:g} W"
    if entry.knob == "sm_clocks":
        return "unlocked"
    return "on" if entry.original else "off"


def _as_dict(entry: JournalEntry) -> dict[str, Any]:
    return {
        "uuid": entry.uuid,
        "name": entry.name,
        "knob": entry.knob,
        "original": entry.original,
        "route": entry.route,
        "zeusd": entry.zeusd,
    }


def _left_behind() -> int:
    """Journal entries still on disk (other processes', or for GPUs not visible here)."""
    directory = journal_dir()
    # The guard already warned about what it would not read: count quietly.
    if directory is None or not trusted_dir(directory, warn=False):
        return 0
    count = 0
    for path in directory.glob("*.json"):
        try:
            count += len(read_journal(path)["entries"])
        except (OSError, ValueError):
            continue
    return count


def run(args: argparse.Namespace) -> int:
    """Restore and report; 1 when there is no GPU and no simulation."""
    try:
        gpus = get_gpus()  # discovery already repairs the journals of dead processes
    except NVMLUnavailableError:
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 1
    except MIGNotSupportedError as e:
        print(e, file=sys.stderr)
        return 1
    restored, gpus.repaired = list(gpus.repaired), []
    restored += guard().repair_dead_runs(gpus, include_live=args.include_live)
    defaults = restore_defaults(gpus, include_live=args.include_live) if args.to_default else []
    left = _left_behind()
    if args.json:
        out: dict[str, Any] = {
            "simulated": gpus.simulated,
            "restored": [_as_dict(e) for e in restored],
            "left": left,
        }
        if args.to_default:
            out["to_default"] = {g.uuid: what for g, what in defaults}
        print(json.dumps(out))
        return 0
    label = " (SIMULATED GPUs)" if gpus.simulated else ""
    for g, what in defaults:
        print(f"{g.label}: {what}{'' if what.startswith(('skipped', 'not ')) else ' (defaults)'}.")
    by_uuid = {g.uuid: g.label for g in gpus}
    if not restored and not defaults:
        print(f"Nothing to restore{label}.")
    for entry in restored:
        via = "" if entry.zeusd is None else f" through zeusd at {entry.zeusd}"
        print(
            f"Restored {entry.knob} of {by_uuid.get(entry.uuid, entry.name)} to {_value(entry)}{via}{label}."
        )
    if left:
        hint = (
            "" if args.include_live else " or belong to running processes (--include-live to undo those too)"
        )
        print(f"{left} journaled setting(s) left: they are for GPUs not visible here{hint}.")
    return 0
