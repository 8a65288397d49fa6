"""`zeus-callbacks profile`: measure a training script over batch sizes x power limits into a Zeus² profile.

Protocol with the script: the command runs once per batch size with these environment variables (see
`zeus_callbacks.core.heterogeneous.profiler.PROFILE_ENV`), and the script calls
`zeus_callbacks.profile_power_limits(step_fn)`, which reads them, measures one window per power limit and
writes the run where the CLI asked; the runs become one Zeus² profile (`core.heterogeneous.profile_file`):

- `ZEUS_CALLBACKS_PROFILE_BATCH_SIZE`: the local batch size to train with (`profile_batch_size(default)`);
- `ZEUS_CALLBACKS_PROFILE_POWER_LIMITS` (or `..._PL_STEP`), `..._WARMUP_STEPS`, `..._STEPS_PER_WINDOW`,
  `..._GPU_INDEX`: what to measure;
- `ZEUS_CALLBACKS_PROFILE_OUT`: the JSON file the run writes its windows to.

On simulated GPUs (`ZEUS_CALLBACKS_SIMULATE`) a simulated GPU's response to power limits comes from the trace
of one workload, and the shipped traces are keyed by batch size (`a10g:cifar100/shufflenetv2/256`). So that
the simulation reflects the batch size being profiled, each run gets the spec with the workload's batch set
to that run's batch size (the spec's workload, or the kind's default one); `--keep-sim-workload` turns this
off. Every batch size then needs a shipped trace (a10g/t4: 32..1024 in powers of two).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from zeus_callbacks.core.heterogeneous.profile_file import (
    BatchSizeRun,
    build_profile,
    read_run,
    write_profile,
)
from zeus_callbacks.core.heterogeneous.profiler import PROFILE_ENV
from zeus_callbacks.sim import SIMULATE_ENV, parse_spec, shipped_trace

# Default workload of each simulated kind, with the batch size as the last component.
_SIM_DEFAULT_WORKLOAD = {
    "a10g": "cifar100/shufflenetv2/1024",
    "t4": "cifar100/shufflenetv2/1024",
    "a40": "imagenet/resnet50/256",
    "v100": "imagenet/resnet50/256",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `profile` subcommand."""
    parser = subparsers.add_parser(
        "profile",
        help="profile a training script over batch sizes and power limits (Zeus² profile JSON)",
        description=(
            "Run a training script once per batch size; the script measures one window of steps per power "
            "limit with `zeus_callbacks.profile_power_limits`. Writes one Zeus² profile for this "
            "GPU type, for `zeus-callbacks plan --profile`."
        ),
        epilog="Example: zeus-callbacks profile --gpu-name a10 --batch-sizes 32,64,128 --output a10.json "
        "-- python examples/heterogeneous/profile_script.py",
    )
    parser.add_argument("--gpu-name", required=True, help="name of this GPU type in the plan (e.g. a10)")
    parser.add_argument(
        "--batch-sizes", required=True, help="comma-separated local batch sizes (two or more)"
    )
    limits = parser.add_mutually_exclusive_group()
    limits.add_argument("--power-limits", help="comma-separated power limits (W); default: the GPU's range")
    limits.add_argument("--pl-step", type=int, default=25, help="stride over the GPU's range (W, default 25)")
    parser.add_argument(
        "--steps-per-window", type=int, default=10, help="measured steps per limit (default 10)"
    )
    parser.add_argument("--warmup-steps", type=int, default=5, help="unmeasured steps per limit (default 5)")
    parser.add_argument("--gpu-index", type=int, default=0, help="GPU the script trains on (default 0)")
    parser.add_argument("--output", required=True, help="profile JSON to write")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run of the script")
    parser.add_argument(
        "--keep-sim-workload",
        action="store_true",
        help="simulated GPUs: keep ZEUS_CALLBACKS_SIMULATE as is for every batch size",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profile; 0 on success, 2 on bad input, 1 when the script failed, 130 on Ctrl-C."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
        if len(batch_sizes) < 2:
            raise ValueError(
                "--batch-sizes needs at least two batch sizes (the planner interpolates between them)"
            )
        power_limits = _int_list(args.power_limits, "--power-limits") if args.power_limits else None
        if args.steps_per_window < 1 or args.warmup_steps < 0:
            raise ValueError("--steps-per-window must be >= 1 and --warmup-steps >= 0")
        if not command:
            raise ValueError("no training command; put it after `--`")
        sim_specs = _sim_specs(batch_sizes, args.keep_sim_workload)
    except ValueError as e:
        print(f"zeus-callbacks profile: {e}", file=sys.stderr)
        return 2

    runs: dict[int, BatchSizeRun] = {}
    oom_at: int | None = None
    with tempfile.TemporaryDirectory(prefix="zeus-callbacks-profile-") as tmp:
        for b in batch_sizes:
            out = Path(tmp) / f"batch{b}.json"
            env = _batch_env(args, b, out, power_limits, sim_specs)
            print(f"batch size {b}: {' '.join(command)}", file=sys.stderr)
            try:
                returncode = _run_script(command, env, args.timeout)
            except KeyboardInterrupt:
                print(f"zeus-callbacks profile: interrupted at batch size {b}", file=sys.stderr)
                return 130
            result = None if returncode is None else read_run(out)
            failure = _batch_failure(b, returncode, result, args.timeout)
            if failure is not None:
                print(f"zeus-callbacks profile: {failure}", file=sys.stderr)
                return 1
            if result is not None and result.oom:
                oom_at = b
                print(f"batch size {b}: out of GPU memory; stopping at larger batch sizes", file=sys.stderr)
                break
            assert result is not None
            runs[b] = result
    try:
        profile = build_profile(
            runs, gpu_name=args.gpu_name, command=command, simulation=sim_specs, oom_at=oom_at
        )
    except ValueError as e:
        print(f"zeus-callbacks profile: {e}", file=sys.stderr)
        return 1
    write_profile(args.output, profile)
    print(_summary(args.gpu_name, runs, Path(args.output)))
    return 0


def _batch_env(
    args: argparse.Namespace,
    b: int,
    out: Path,
    power_limits: list[int] | None,
    sim_specs: dict[int, str] | None,
) -> dict[str, str]:
    """The environment of batch size `b`'s run: what `profile_power_limits` reads."""
    env = {
        **os.environ,
        PROFILE_ENV["batch_size"]: str(b),
        PROFILE_ENV["out"]: str(out),
        PROFILE_ENV["warmup_steps"]: str(args.warmup_steps),
        PROFILE_ENV["steps_per_window"]: str(args.steps_per_window),
        PROFILE_ENV["gpu_index"]: str(args.gpu_index),
        PROFILE_ENV["pl_step"]: str(args.pl_step),
    }
    if power_limits:
        env[PROFILE_ENV["power_limits"]] = ",".join(map(str, power_limits))
    if sim_specs:
        env[SIMULATE_ENV] = sim_specs[b]
    return env


def _batch_failure(
    b: int, returncode: int | None, result: BatchSizeRun | None, timeout: float | None
) -> str | None:
    """Why batch size `b`'s run failed, in one line; None when it gave a result or ran out of memory."""
    if returncode is None:
        return f"batch size {b} ran past --timeout {timeout}s"
    if result is not None and result.oom:
        return None
    if returncode != 0:
        return f"the script exited with {returncode} at batch size {b} (its output is above)."
    if result is None:
        return (
            f"the script wrote no result at batch size {b}. It must call "
            "`zeus_callbacks.profile_power_limits(step_fn)`."
        )
    return None


def _run_script(command: list[str], env: dict[str, str], timeout: float | None) -> int | None:
    """Run one batch size's command; its exit code, or None when it ran past `timeout` and was killed.

    The command runs in a process group of its own, and a timeout SIGKILLs the whole group: a launcher
    (torchrun, a shell) and the training processes it started alike, so none trains on with the GPU changed
    (the restore watchdog of each puts its GPU back; it lives in a session of its own). A Ctrl-C reaches
    the group too.
    """
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc, signal.SIGKILL)
        return None
    except KeyboardInterrupt:
        _kill_group(proc, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
        raise


def _kill_group(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)
    if signum == signal.SIGKILL:
        proc.wait()


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise ValueError(f"{flag} {text!r}: expected positive integers")
    return values


def sim_workload_for_batch(kind: str, workload: str | None, batch: int) -> str | None:
    """The simulated workload key with its batch (last component) set to `batch`; None if it has no batch."""
    key = workload or _SIM_DEFAULT_WORKLOAD.get(kind)
    if key is None:
        return None
    parts = key.strip("/").split("/")
    # NSDI'23 keys may end in an optimizer: DATASET/NETWORK/BATCH/OPTIMIZER.
    at = 2 if len(parts) == 4 else len(parts) - 1
    if len(parts) < 3 or not parts[at].isdigit():
        return None
    parts[at] = str(batch)
    return "/".join(parts)


def _sim_specs(batch_sizes: list[int], keep: bool) -> dict[int, str]:
    """Per batch size, the simulation spec whose workloads are traced at that batch size ({} if not simulating)."""
    spec = os.environ.get(SIMULATE_ENV)
    if not spec:
        return {}
    if keep:
        return dict.fromkeys(batch_sizes, spec)
    groups = parse_spec(spec)
    out = {}
    for b in batch_sizes:
        items = []
        for g in groups:
            item = f"{g.count}*{g.kind}" if g.count > 1 else g.kind
            workload = None if g.trace_file else sim_workload_for_batch(g.kind, g.workload, b)
            if workload is None:
                workload = g.workload
            else:
                try:
                    shipped_trace(g.kind, workload)
                except (ValueError, FileNotFoundError) as e:
                    raise ValueError(
                        f"simulated {g.kind} has no trace at batch size {b} ({e}). Profile measured batch sizes, "
                        "or pass --keep-sim-workload to simulate every batch size with one trace."
                    ) from None
            items.append(
                item + (f":{workload}" if workload else "") + (f"@{g.trace_file}" if g.trace_file else "")
            )
        out[b] = ",".join(items)
    return out


def _summary(gpu_name: str, runs: dict[int, BatchSizeRun], path: Path) -> str:
    first = next(iter(runs.values()))
    sim = ", SIMULATED" if any(r.simulated for r in runs.values()) else ""
    lines = [
        f"{gpu_name} ({first.gpu_model}{sim}): time (s) / energy (J) per window of {first.steps_per_window} steps"
    ]
    limits = sorted((w.power_limit_w for w in first.windows), reverse=True)
    lines.append(f"{'batch':>7}" + "".join(f"{str(p) + ' W':>18}" for p in limits))
    for b, run in sorted(runs.items()):
        cells = {w.power_limit_w: w for w in run.windows}
        lines.append(
            f"{b:>7}" + "".join(f"{cells[p].time_s:>9.3f}/{cells[p].energy_j:<8.1f}" for p in limits)
        )
    lines.append(f"written to {path}")
    return "\n".join(lines)
