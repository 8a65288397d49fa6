"""Perseus in one job: a 4-stage Schedule1F1B pipeline whose off-critical-path instructions get lower clocks.

Runs on 4 CPU processes (gloo), each driving one simulated A40 (`ZEUS_CALLBACKS_SIMULATE=4*a40`, GPU index =
rank). The stages are deliberately unequal, so the lighter ones have slack. The optimizer measures the
iterations at the maximum clocks first, then profiles every stage's forward and backward per SM clock,
plans the clocks on rank 0 and applies them; the script prints the iteration time and energy before and
after. All figures are SIMULATED.

    python examples/pipeline/train_pipeline.py                 # spawns 4 ranks
    torchrun --nproc_per_node 4 examples/pipeline/train_pipeline.py
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from zeus_callbacks import PipelineFrequencyOptimizer, ZeusMonitor, instrument
from zeus_callbacks.sim import SimulatedKernels

NUM_STAGES = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="8,6,6,6", help="Linear layers per stage (unequal on purpose)")
    p.add_argument("--width", type=int, default=16, help="hidden size")
    p.add_argument(
        "--kernel-ms",
        type=float,
        default=4.0,
        help="simulated GPU time of one layer's forward per microbatch at the maximum clock (backward: twice); "
        "0 makes the host's CPU time the GPU's work instead (try --width 768 then)",
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--before-steps", type=int, default=10, help="steps measured at the maximum clocks")
    p.add_argument("--after-steps", type=int, default=10, help="steps measured with the plan applied")
    p.add_argument("--stride-mhz", type=int, default=45, help="gap between profiled SM clocks")
    p.add_argument("--profile-steps", type=int, default=4, help="measured steps per profiled clock")
    p.add_argument(
        "--slack-margin", type=float, default=0.0, help="extra planning margin of a lowered clock's time"
    )
    p.add_argument(
        "--profile-csv", default=None, help="write the profile here (replay: zeus-callbacks pipeline-plan)"
    )
    p.add_argument("--max-steps", type=int, default=200, help="give up if the plan is not applied by then")
    p.add_argument("--verbose", action="store_true", help="print every step's phase, time and energy")
    return p.parse_args()


def make_stage_module(layers: int, width: int, gpu: int, kernel_ms: float) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    if kernel_ms > 0:
        blocks.append(SimulatedKernels(gpu, layers * kernel_ms / 1000))
    return nn.Sequential(*blocks)


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one "GPU" worth of host work per rank
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    layers = [int(x) for x in args.layers.split(",")]
    module = make_stage_module(layers[rank], args.width, rank, args.kernel_ms)
    stage = PipelineStage(module, stage_index=rank, num_stages=world_size, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss)
    sgd = torch.optim.SGD(module.parameters(), lr=1e-4)

    pfo = PipelineFrequencyOptimizer(
        monitor=ZeusMonitor(gpu_indices=[rank]),  # simulated GPU `rank` of the node
        wait_steps=1 + args.before_steps,  # the first step sets the schedule up; then the baseline
        warmup_steps=1,
        profile_steps=args.profile_steps,
        frequency_stride_mhz=args.stride_mhz,
        profile_path=args.profile_csv,
        slack_margin=args.slack_margin,
    )
    instrument(stage, schedule, pfo)

    batch = args.microbatches * args.microbatch_size
    x = torch.randn(batch, args.width)
    y = torch.randn(batch, args.width)
    history: list[tuple[str, float, float]] = []  # (phase, time s, energy J) of this rank's steps
    after = 0
    try:
        for _ in range(args.max_steps):
            phase = pfo.phase
            if rank == 0:
                schedule.step(x)
            elif rank == world_size - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            sgd.step()
            sgd.zero_grad()
            m = pfo.metrics()
            history.append((phase, float(m["iteration_time_s"]), float(m["iteration_energy_j"])))
            after += phase == "applying"
            if after >= args.after_steps or pfo.phase in ("inactive", "fallback"):
                break
        report = pfo.report()
    finally:
        pfo.on_train_end()

    histories = [None] * world_size
    dist.all_gather_object(histories, history)
    if rank == 0:
        print_summary(histories, report, args)
    dist.destroy_process_group()


def print_summary(histories: list, report: dict, args: argparse.Namespace) -> None:
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
    print("\n== Perseus pipeline frequency plan (SIMULATED GPUs: 4x A40) ==")
    print(f"stages (Linear layers): {args.layers}, microbatches: {args.microbatches}, schedule: 1F1B")
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


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if len(args.layers.split(",")) != NUM_STAGES:
        raise SystemExit(f"--layers needs {NUM_STAGES} comma-separated counts, one per stage")
    os.environ.setdefault("ZEUS_CALLBACKS_SIMULATE", f"{NUM_STAGES}*a40")
    if "RANK" in os.environ:  # torchrun
        os.environ.setdefault(
            "ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.gettempdir() + "/zeus_callbacks-pipeline-example"
        )
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("ZEUS_CALLBACKS_SIM_STATE_DIR", tempfile.mkdtemp(prefix="zeus-callbacks-pipeline-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(run, args=(NUM_STAGES, args), nprocs=NUM_STAGES, join=True)


if __name__ == "__main__":
    main()
