"""What the three pipeline examples share (`examples/pipeline`, `examples/megatron`, `examples/deepspeed`):
the optimizer's options, the training loop that measures before and after the plan, the summary, and
starting 4 local ranks. Each example keeps its own model and engine; the benchmarks reuse this too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from zeus_callbacks import PipelineFrequencyOptimizer, ZeusMonitor

NUM_STAGES = 4
# (phase, iteration time s, energy J) of one of this rank's steps
Step = tuple[str, float, float]


def add_optimizer_args(p: argparse.ArgumentParser, *, profile_steps: int, before_after: int) -> None:
    """The options of the optimizer and of the training loop, as every pipeline example takes them."""
    p.add_argument(
        "--before-steps", type=int, default=before_after, help="steps measured at the maximum clocks"
    )
    p.add_argument(
        "--after-steps", type=int, default=before_after, help="steps measured with the plan applied"
    )
    p.add_argument("--stride-mhz", type=int, default=45, help="gap between profiled SM clocks")
    p.add_argument(
        "--profile-steps", type=int, default=profile_steps, help="measured steps per profiled clock"
    )
    p.add_argument("--min-mhz", type=int, default=None, help="lowest clock to profile")
    p.add_argument("--patience", type=int, default=2, help="clocks without a gain before a stage stops")
    p.add_argument(
        "--slack-margin", type=float, default=0.0, help="extra planning margin of a lowered clock's time"
    )
    p.add_argument(
        "--profile-csv", default=None, help="write the profile here (replay: zeus-callbacks pipeline-plan)"
    )
    p.add_argument("--max-steps", type=int, default=200, help="give up if the plan is not applied by then")
    p.add_argument("--out", default=None, help="write each rank's results here (JSON, for the tests)")
    p.add_argument(
        "--hold", action="store_true", help="after the run, keep training with the plan until signalled"
    )
    p.add_argument("--verbose", action="store_true", help="print every step's phase, time and energy")


def make_optimizer(rank: int, args: argparse.Namespace, wait_steps: int) -> PipelineFrequencyOptimizer:
    """This rank's optimizer on its GPU (index = rank: one node), as the options say."""
    return PipelineFrequencyOptimizer(
        monitor=ZeusMonitor(gpu_indices=[rank]),
        wait_steps=wait_steps,
        warmup_steps=1,
        profile_steps=args.profile_steps,
        frequency_stride_mhz=args.stride_mhz,
        min_frequency_mhz=args.min_mhz,
        patience=args.patience,
        slack_margin=args.slack_margin,
        profile_path=args.profile_csv,
    )


@dataclass
class Run:
    """One rank's training run: its steps, the optimizer's report and the clock it locked last."""

    history: list[Step] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    locked_mhz: int | None = None


def train(
    rank: int, pfo: PipelineFrequencyOptimizer, step: Callable[[], None], args: argparse.Namespace
) -> Run:
    """Train until `--after-steps` steps ran with the plan (or the optimizer gave up); with `--hold`, go on
    training with the plan until the process is signalled. `pfo.on_train_end()` restores the clocks."""
    run = Run()
    after = 0
    try:
        for _ in range(args.max_steps):
            phase = pfo.phase
            step()
            m = pfo.metrics()
            run.history.append((phase, float(m["iteration_time_s"]), float(m["iteration_energy_j"])))
            after += phase == "applying"
            if after >= args.after_steps or pfo.phase in ("inactive", "fallback"):
                break
        run.report, run.locked_mhz = pfo.report(), pfo.frequency_mhz
        if args.hold and pfo.phase == "applying":
            print(f"holding rank {rank} pid {os.getpid()}", flush=True)
            while True:
                step()
    finally:
        pfo.on_train_end()
    return run


def write_results(rank: int, results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """This rank's results as `--out/rank{rank}.json` (when `--out` is given)."""
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results, default=str))


def print_before_after(histories: list[list[Step]], report: dict[str, Any], args: argparse.Namespace) -> None:
    """Every stage's planned clocks, and the median iteration time and energy before and after the plan."""

    def per_step(phase: str, skip: int) -> tuple[float, float, int]:
        rows = [[h for h in hist if h[0] == phase][skip:] for hist in histories]
        n = min(len(r) for r in rows)
        times = [max(r[i][1] for r in rows) for i in range(n)]  # the pipeline is as slow as its slowest stage
        energies = [sum(r[i][2] for r in rows) for i in range(n)]  # every GPU's energy
        # Medians: on a shared host a few steps are slowed by other processes competing for the CPUs.
        return statistics.median(times), statistics.median(energies), n

    if args.verbose:
        for i, steps in enumerate(zip(*histories, strict=False)):
            print(
                f"step {i:3d} {steps[0][0]:<10} {max(h[1] for h in steps):8.4f} s {sum(h[2] for h in steps):9.2f} J"
            )
    if "predicted" not in report:
        print(f"no plan: {report.get('reason')}")
        return
    print(
        f"profiling: {report['profiling_steps']} steps; blocking power (W): "
        + ", ".join(f"{p:.0f}" for p in report["blocking_power_w"].values())
    )
    for stage, freqs in report["plan_frequencies_mhz"].items():
        print(f"  stage {stage} clocks (MHz): {freqs}")
    t0, e0, n0 = per_step("waiting", skip=1)  # the first step sets the schedule up
    t1, e1, n1 = per_step("applying", skip=1)  # the first planned step still ran a profiling clock in part
    pred = report["predicted"]
    print(f"{'':<28}{'iteration time (s)':>20}{'energy (J)':>14}")
    print(f"{'before (all max clocks)':<28}{t0:>20.4f}{e0:>14.2f}   ({n0} steps)")
    print(f"{'after (planned clocks)':<28}{t1:>20.4f}{e1:>14.2f}   ({n1} steps)")
    print(f"measured: energy {100 * (1 - e1 / e0):+.1f}% saved, iteration time {100 * (t1 / t0 - 1):+.2f}%")
    print(
        f"{'predicted, all max clocks':<28}{pred['max_clock_iteration_time_s']:>20.4f}"
        f"{pred['max_clock_energy_j']:>14.2f}"
    )
    print(f"{'predicted, planned clocks':<28}{pred['iteration_time_s']:>20.4f}{pred['energy_j']:>14.2f}")
    print(
        f"planner's prediction: energy {pred['energy_saved_pct']:+.1f}% saved, iteration time "
        f"{pred['time_change_pct']:+.2f}% (from the profile and the measured time between instructions)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: Callable[..., None], args: argparse.Namespace, name: str) -> None:
    """Run `run(rank, world_size, args)` on every rank: this process's under torchrun (`RANK` set), else
    `NUM_STAGES` local processes. 4 simulated A40s (GPU index = rank) unless `ZEUS_CALLBACKS_SIMULATE` says
    otherwise; their state is kept in a directory named after `name`."""
    os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", f"{NUM_STAGES}*a40")
    if "RANK" in os.environ:  # torchrun (or the deepspeed launcher): every rank shares the node's state
        os.environ.setdefault(
            "ZEUS_CALLBACKS_SIM_STATE_DIR", f"{tempfile.gettempdir()}/zeus_callbacks-{name}"
        )
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.mkdtemp(prefix=f"zeus-callbacks-{name}-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    # A SIGTERM to the launcher ends it through SystemExit, so that mp.spawn stops the ranks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    mp.spawn(run, args=(NUM_STAGES, args), nprocs=NUM_STAGES, join=True)
