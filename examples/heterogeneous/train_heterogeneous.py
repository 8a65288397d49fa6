"""Data-parallel training on two GPU types with a heterogeneous plan, against the even split at maximum power.

    python examples/heterogeneous/train_heterogeneous.py            # 2 CPU processes, simulated A10G + T4

Rank 0 drives GPU 0 (an A10G), rank 1 GPU 1 (a T4), over gloo. The plan comes from the shipped Zeus² profiles
(`load_profile("a10")`, `load_profile("t4")`); both configurations train the same tiny model with real DDP
(uneven local batches, gradients weighted to equal the full global batch), and the monitors' time and energy
of each are printed. Without a GPU the GPUs are simulated (`ZEUS_CALLBACKS_SIMULATE`), and then so is every
figure: see README.md for what the simulation does and does not show.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

from zeus_callbacks import (
    HeteroPlan,
    RankPlan,
    ZeusCost,
    ZeusMonitor,
    apply_power_limit,
    load_profile,
    plan,
    rank_plan,
    restore_power_limits,
    sim,
    uneven_dataloader,
    weight_gradients,
)

DEFAULT_SIMULATION = "a10g:cifar100/shufflenetv2/1024,t4:cifar100/shufflenetv2/1024"
FEATURES = 256
PROFILES = ("a10", "t4")  # rank r runs GPU r of this type


def even_rank_plans(p: HeteroPlan, profiles) -> list[RankPlan]:
    """The reference: the global batch split evenly, every GPU at its maximum power limit."""
    local = p.global_batch // len(profiles)
    return [
        RankPlan(r, len(profiles), prof.gpu_name, local, p.global_batch, r * local, prof.max_power_limit_w)
        for r, prof in enumerate(profiles)
    ]


def gpu_work_s(profile, local_batch: int, time_scale: float) -> float:
    """The profile's compute time of one step of `local_batch` on this GPU type at its maximum power limit."""
    time_s, _, _ = profile.interpolate(local_batch)
    return float(time_s[-1, 0]) * time_scale


def run_phase(name, rp: RankPlan, profile, monitor: ZeusMonitor, args) -> tuple[float, float]:
    """Train `args.steps` measured steps (after warm-up) on `rp`; returns (time s, this GPU's energy J)."""
    rank = rp.rank
    apply_power_limit(rp, gpu_index=rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    weights = weight_gradients(model, rp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    n = rp.global_batch * (args.steps + args.warmup_steps)
    data = torch.utils.data.TensorDataset(
        torch.randn(n, FEATURES, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    loader = uneven_dataloader(data, rp, seed=0)
    work = gpu_work_s(profile, rp.local_batch, args.time_scale)
    gpus = monitor.gpus
    for step, (x, y) in enumerate(loader):
        if step == args.warmup_steps:
            monitor.begin_window(name)
        # The GPU's share of the step, as the profile measured it at maximum power, queued on the simulated
        # GPU (no host CPU: the host's load does not change it; nothing on a real GPU).
        sim.enqueue_if_simulated(rank, work)
        gpus.step_boundary([rank])  # a simulated GPU stretches it by its slowdown at the applied limit
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()  # DDP all-reduce: the faster rank waits
        optimizer.step()
    m = monitor.end_window(name)
    weights.remove()
    restore_power_limits()
    return m.time, m.gpu_energy[rank]


def worker(rank: int, world: int, store: str, p: HeteroPlan, args) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    # A file rendezvous: no port to pick, so no race with other programs for one.
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    profiles = [load_profile(name) for name in PROFILES]
    monitor = ZeusMonitor(gpu_indices=[rank])
    planned = rank_plan(p)  # each rank's type from its GPU's name (A10G -> a10, T4 -> t4)
    configs = [("even", even_rank_plans(p, profiles)[rank]), ("planned", planned)]
    results: dict[str, list] = {"even": [], "planned": []}
    # Rounds alternate the order of the two configurations, so that a change in the load other programs put
    # on the CPU does not favour one of them; the report takes each one's least disturbed round.
    for r in range(args.rounds):
        for name, rp in configs if r % 2 == 0 else configs[::-1]:
            t, e = run_phase(name, rp, profiles[rank], monitor, args)
            gathered = [None] * world
            torch_dist.all_gather_object(gathered, (t, e, monitor.gpus[rank].name))
            results[name].append(gathered)
    if rank == 0:
        print(report(p, results, args, monitor.simulated))
    torch_dist.barrier()  # no rank tears gloo down while another still talks to it
    torch_dist.destroy_process_group()
    # gloo's threads can abort a spawned process at interpreter teardown (std::terminate); the work is done.
    sys.stdout.flush()
    os._exit(0)


def report(p: HeteroPlan, results, args, simulated: bool) -> str:
    steps = args.steps
    label = "SIMULATED " if simulated else ""
    names = [r[2] for r in results["even"][0]]
    lines = [
        f"{label}GPUs: {', '.join(f'GPU {i} {n}' for i, n in enumerate(names))}"
        + (" -- every figure below is a simulation, not a measurement." if simulated else ""),
        f"Plan ({p.objective}), global batch {p.global_batch}: "
        + ", ".join(f"{t.gpu_name} local batch {t.local_batch} at {t.power_limit_w} W" for t in p.types),
        f"Even split: {p.global_batch // 2} per GPU at maximum power.",
        "",
        f"{'per step':<22}{'time (s)':>10}"
        + "".join(f"{'GPU ' + str(i) + ' (J)':>13}" for i in range(len(names)))
        + f"{'total (J)':>11}{'planner: time (s)':>19}{'energy (J)':>12}",
    ]
    planner = {
        "even": (p.reference_step_time_s, p.reference_energy_j),
        "planned": (p.step_time_s, p.energy_j),
    }
    totals = {}
    for name in ("even", "planned"):
        rows = min(results[name], key=lambda rows: max(r[0] for r in rows))
        step_time = max(r[0] for r in rows) / steps / args.time_scale
        energies = [r[1] / steps / args.time_scale for r in rows]
        totals[name] = (step_time, sum(energies))
        pt, pe = planner[name]
        lines.append(
            f"{name + (' (max power)' if name == 'even' else ''):<22}{step_time:>10.4f}"
            + "".join(f"{e:>13.2f}" for e in energies)
            + f"{sum(energies):>11.2f}{pt:>19.4f}{pe:>12.2f}"
        )
    (te, ee), (tp, ep) = totals["even"], totals["planned"]
    lines += [
        "",
        f"{label}planned vs even split: time x{tp / te:.3f}, energy {100 * (ep / ee - 1):+.1f}% "
        f"(planner predicted time x{p.slowdown:.3f}, energy {-100 * p.energy_saving:+.1f}%).",
        f"(Each configuration: {steps} steps in each of {args.rounds} round(s); the round with the shortest "
        "step time is shown.)",
    ]
    if args.time_scale != 1.0:
        lines.append(f"(Steps ran at {args.time_scale}x the profiled time; figures are rescaled per step.)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=1024, help="samples per step (default 1024)")
    parser.add_argument("--eta", type=float, default=0.5, help="ZeusCost energy weight (default 0.5)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per configuration and round")
    parser.add_argument("--warmup-steps", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both configurations (default 3)")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="run each step at this fraction of the profiled time"
    )
    args = parser.parse_args()
    if not os.environ.get(sim.SIMULATE_ENV) and not torch.cuda.is_available():
        os.environ[sim.SIMULATE_ENV] = DEFAULT_SIMULATION
        print(f"No GPU: simulating {DEFAULT_SIMULATION} (ZEUS_CALLBACKS_SIMULATE).")
    profiles = [load_profile(name) for name in PROFILES]
    p = plan(profiles, [1, 1], args.global_batch, ZeusCost(args.eta))
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "rendezvous")
        mp.spawn(worker, args=(len(profiles), store, p, args), nprocs=len(profiles))


if __name__ == "__main__":
    main()
