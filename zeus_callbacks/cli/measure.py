"""`zeus-callbacks measure -- CMD ...`: the time and GPU energy of a command, per GPU."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import threading
from typing import Any

from zeus_callbacks.cli.devices import NO_GPU_MESSAGE
from zeus_callbacks.core.device.errors import GPUError, MIGNotSupportedError, NVMLUnavailableError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `measure` subcommand."""
    parser = subparsers.add_parser(
        "measure",
        help="run a command and report its time and energy per GPU",
        description=(
            "Run CMD as a child process (same environment, so a simulated node is shared through its state "
            "files) and report the elapsed time and each GPU's energy over its run. Exits with CMD's code."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    parser.add_argument(
        "--gpus", metavar="I,J", help="GPU indices to measure (after CUDA_VISIBLE_DEVICES; default: all)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run")
    parser.set_defaults(func=run)


def result(
    command: list[str], returncode: int, m: Measurement, lost: dict[int, str] | None = None
) -> dict[str, Any]:
    """The report as plain numbers (s, J, W); `lost`: GPUs that could not be measured, and why. Each energy's
    bound (`..._bound_j`: how far the true energy may lie from it, either way) is None where not known."""
    return {
        "command": command,
        "returncode": returncode,
        "simulated": m.simulated,
        "time_s": m.time,
        "gpu_energy_j": {str(i): e for i, e in m.gpu_energy.items()},
        "gpu_energy_bound_j": {str(i): m.gpu_energy_bound.get(i) for i in m.gpu_energy},
        "total_energy_j": m.total_energy,
        "total_energy_bound_j": m.total_energy_bound,
        "lost": {str(i): why for i, why in (lost or {}).items()},
    }


def _with_bound(energy_j: float, bound_j: float | None) -> str:
    """`123.456 ± 7.890` (J); the figure alone where its bound is not known."""
    return f"{energy_j:.3f}" if bound_j is None else f"{energy_j:.3f} ± {bound_j:.3f}"


def _table(res: dict[str, Any], names: dict[int, str]) -> str:
    lines = []
    if res["simulated"]:
        lines.append("SIMULATED GPUs: these figures are a simulation, not a measurement.")
    lines.append(f"command: {shlex.join(res['command'])}  (exit code {res['returncode']})")
    lines.append(f"time: {res['time_s']:.3f} s")
    t = res["time_s"]
    rows = [["GPU", "name", "energy J", "average power W"]]
    bounds = res.get("gpu_energy_bound_j", {})
    for i, e in res["gpu_energy_j"].items():
        energy = _with_bound(e, bounds.get(i))
        rows.append([i, names[int(i)], energy, f"{e / t:.1f}" if t > 0 else "n/a"])
    for i in res.get("lost", {}):
        rows.append([i, "", "not measured", "(see above)"])
    total = res["total_energy_j"]
    energy = _with_bound(total, res.get("total_energy_bound_j"))
    rows.append(["all", "", energy, f"{total / t:.1f}" if t > 0 else "n/a"])
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _exit_code(returncode: int) -> int:
    """The child's exit code; a child killed by signal N exits 128+N, as in a shell."""
    return 128 - returncode if returncode < 0 else returncode


def _wait(child: subprocess.Popen) -> int:
    """Wait for the child; Ctrl-C reaches it through the terminal and SIGTERM is passed on, so that the
    report still comes after it ends."""
    if threading.current_thread() is not threading.main_thread():
        return child.wait()
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)


def run(args: argparse.Namespace) -> int:
    """Run the command inside a measurement window; returns the command's exit code."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(
            "zeus-callbacks measure: give the command after `--`, e.g. `zeus-callbacks measure -- python train.py`.",
            file=sys.stderr,
        )
        return 2
    try:
        indices = None if args.gpus is None else [int(i) for i in args.gpus.split(",") if i.strip()]
        monitors, lost = _begin(indices)
    except NVMLUnavailableError:
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 1
    except (MIGNotSupportedError, ValueError) as e:
        print(f"zeus-callbacks measure: {e}", file=sys.stderr)
        return 2
    except GPUError as e:  # discovery itself failed (a GPU lost): the command still runs, unmeasured
        print(f"zeus-callbacks measure: {e} Running the command without measuring.", file=sys.stderr)
        monitors, lost = {}, {}
    try:
        child = subprocess.Popen(command)
    except OSError as e:
        for monitor in monitors.values():
            monitor.end_window("command", sync_execution=False, cancel=True)
        print(f"zeus-callbacks measure: cannot run {command[0]!r}: {e}", file=sys.stderr)
        return 127
    returncode = _wait(child)
    if not monitors and not lost:
        return _exit_code(returncode)
    m = _end(monitors, lost)
    for i, why in lost.items():
        print(f"zeus-callbacks measure: GPU {i} not measured: {why}", file=sys.stderr)
    res = result(command, returncode, m, lost)
    if args.json:
        print(json.dumps(res), flush=True)
    else:
        names = {i: mon.gpus[i].name for i, mon in monitors.items()}
        print(_table(res, names), flush=True)
    return _exit_code(returncode)


def _begin(indices: list[int] | None) -> tuple[dict[int, ZeusMonitor], dict[int, str]]:
    """One monitor per GPU with its window open, so that a GPU lost before or during the command costs only
    its own figures; returns the monitors and the GPUs that failed already."""
    if indices is None:
        indices = list(range(len(get_gpus())))
    ZeusMonitor(gpu_indices=indices)  # checks the indices once, with the monitor's own message
    monitors: dict[int, ZeusMonitor] = {}
    lost: dict[int, str] = {}
    for i in indices:
        try:
            monitor = ZeusMonitor(gpu_indices=[i])
            # The child does the GPU work, so this process does not synchronise (that would set up CUDA here).
            monitor.begin_window("command", sync_execution=False)
            monitors[i] = monitor
        except GPUError as e:
            lost[i] = str(e)
    return monitors, lost


def _end(monitors: dict[int, ZeusMonitor], lost: dict[int, str]) -> Measurement:
    """Close every window; a GPU lost meanwhile joins `lost`. One measurement of the GPUs still answering."""
    times, energy, bound, simulated = [], {}, {}, False
    for i, monitor in monitors.items():
        try:
            m = monitor.end_window("command", sync_execution=False)
        except GPUError as e:
            lost[i] = str(e)
            continue
        finally:
            monitor.close()
        times.append(m.time)
        energy.update(m.gpu_energy)
        bound.update(m.gpu_energy_bound)
        simulated = simulated or m.simulated
    return Measurement(
        time=max(times, default=0.0), gpu_energy=energy, simulated=simulated, gpu_energy_bound=bound
    )
