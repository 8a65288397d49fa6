"""Benchmark: our Perseus planner against lowtime 0.3.0 (Phillips-Dessouky) and the exact ILP on synthetic profiles.

For each size (stages x microbatches) it builds one synthetic A40-like profile, then:

- lowtime, set up exactly as Zeus' `examples/pipeline_frequency_optimizer/run_optimization.py` (Perseus'
  reference script) does: every profiled option's cost turned into effective energy `e - P_blk * t` (quantised
  time) *before* lowtime's Pareto filtering, the filtering retried with `noise_factor=0.95` when it leaves 3
  options or fewer, `ExponentialModel(search_strategy="best")`, the `Synchronous1F1B` DAG with the
  forward/backward dependency rules and dummy source/sink, `unit_time` 1 ms; `PhillipsDessouky.run()` is
  iterated from the all-slowest plan down to the fastest. Its plan is the least-energy iterate whose exact
  iteration time is within the all-max-frequency time (or within its own quantised time when every iterate is
  above). A run stopped by `--lowtime-budget-s` is reported as cut off, with no energy.
- ours: `solve(schedule, options, p_blk)` (timed at the all-max time; also `frontier(...)` with 24 points), and
  `solve` again at lowtime's iteration time when that is longer.
- exact: `exact_plan` (HiGHS ILP) at the same time, where it proves optimality within `--exact-limit-s`, and
  `lower_bound` (its LP relaxation), a proven bound on how far ours is from the optimum at every size.

Every plan is re-evaluated with the same exact energy model (`evaluate`). Run:
`PYTHONPATH=. python benchmarks/pipeline_planner.py [--sizes 4x8,4x16,8x16,8x32] [--lowtime-budget-s 3600]`.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.exact import exact_plan, lower_bound
from zeus_callbacks.core.pipeline_frequency.frontier import (
    FrequencyOption,
    evaluate,
    frontier,
    max_frequency_plan,
    pareto_options,
    solve,
)

F_MAX_MHZ = 1740
FREQS_MHZ = list(range(F_MAX_MHZ, 899, -30))  # A40-like SM clock grid: 1740 MHz down to 900 MHz.


def synthetic_profile(
    num_stages: int, seed: int = 0
) -> tuple[dict[tuple[int, str], list[FrequencyOption]], list[float]]:
    """Unequal stages (+-30 % compute), backward ~2x forward, time ~ t_max * (m + (1-m) f_max/f) with a
    memory-bound share m, power ~ P_static + k (f/f_max)^3, 0.5 % measurement noise; P_blk 80-100 W."""
    rng = random.Random(seed)
    options: dict[tuple[int, str], list[FrequencyOption]] = {}
    p_blk = []
    for stage in range(num_stages):
        t_fwd = 0.040 * rng.uniform(0.7, 1.3)
        for kind, t_max, mem in (
            ("forward", t_fwd, rng.uniform(0.1, 0.3)),
            ("backward", 2 * t_fwd * rng.uniform(0.95, 1.05), rng.uniform(0.1, 0.3)),
        ):
            p_static, p_dyn = rng.uniform(70, 90), rng.uniform(180, 230)
            opts = []
            for f in FREQS_MHZ:
                x = f / F_MAX_MHZ
                t = t_max * (mem + (1 - mem) / x) * rng.uniform(0.995, 1.005)
                power = (p_static + p_dyn * x**3) * rng.uniform(0.995, 1.005)
                opts.append(FrequencyOption(f, t, power * t))
            options[stage, kind] = opts
        p_blk.append(rng.uniform(80, 100))
    return options, p_blk


def run_lowtime(
    num_stages: int,
    num_microbatches: int,
    options: dict[tuple[int, str], list[FrequencyOption]],
    p_blk: list[float],
    target_time_s: float,
    unit_time_s: float,
    budget_s: float,
) -> tuple[float, dict, int, bool]:
    """Perseus-style lowtime run; returns (solve seconds, chosen frequencies, iterations, finished)."""
    from lowtime.solver import PhillipsDessouky

    start = time.perf_counter()
    specs = _lowtime_specs(num_stages, options, p_blk, unit_time_s)
    dag = _lowtime_dag(num_stages, num_microbatches, specs)

    solver_s, iterations, finished = time.perf_counter() - start, 0, True
    best, best_energy, last = None, math.inf, None
    schedule = build_schedule("1f1b", num_stages, num_microbatches)
    tick = time.perf_counter()
    for _ in PhillipsDessouky(dag).run():
        iterations += 1
        solver_s += time.perf_counter() - tick
        freqs = _lowtime_knobs(dag)  # Bookkeeping outside the timed region.
        plan = evaluate(schedule, options, p_blk, freqs)
        last = freqs
        if plan.iteration_time_s <= target_time_s * (1 + 1e-9) and plan.energy_j < best_energy:
            best, best_energy = freqs, plan.energy_j
        if solver_s > budget_s:
            finished = False
            break
        tick = time.perf_counter()
    return solver_s, (best if best is not None else last), iterations, finished


def _lowtime_specs(
    num_stages: int,
    options: dict[tuple[int, str], list[FrequencyOption]],
    p_blk: list[float],
    unit_time_s: float,
    noise_factor: float = 0.95,
) -> dict[int, dict[type, Any]]:
    """lowtime's operation specs per stage and instruction class, exactly as Zeus'
    `examples/pipeline_frequency_optimizer/run_optimization.py` prepares them: every profiled option, its
    cost turned into effective energy `e - P_blk * quant_time * unit_time` *before* the Pareto filtering, the
    filtering retried with `noise_factor` when it leaves 3 options or fewer, and `ExponentialModel` fitted with
    `search_strategy="best"`. (The script has one P_blk for all stages; each stage's own is used here, as in
    our planner.)"""
    from lowtime.cost_model import ExponentialModel
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward

    op_spec_map: dict[int, dict[type, Any]] = {}
    for stage in range(num_stages):
        op_spec_map[stage] = {}
        for cls, kind in ((Forward, "forward"), (Backward, "backward")):
            raw = [
                ExecutionOption[int](
                    real_time=o.time_s, unit_time=unit_time_s, cost=o.energy_j, knob=o.frequency_mhz
                )
                for o in options[stage, kind]
            ]
            for opt in raw:  # Effective energy, before filtering, as the reference script does.
                opt.cost -= p_blk[stage] * opt.quant_time * opt.unit_time
            cand = CandidateExecutionOptions[int](options=raw)
            if len(cand.options) <= 3:
                cand = CandidateExecutionOptions[int](options=raw, noise_factor=noise_factor)
            model = ExponentialModel(cand, search_strategy="best")
            op_spec_map[stage][cls] = OperationSpec[int](options=cand, cost_model=model)
    return op_spec_map


def _lowtime_dag(num_stages: int, num_microbatches: int, op_spec_map: dict[int, dict[type, Any]]) -> Any:
    """The 1F1B DAG as Perseus' `run_perseus.py` builds it: nodes 2.., dummy source 0 and sink 1."""
    import networkx as nx
    from lowtime.graph_utils import DependencyResolver, add_sink_node, add_source_node
    from lowtime.perseus.instruction import Instruction as LtInstruction
    from lowtime.perseus.instruction import backward_dep, forward_dep
    from lowtime.perseus.schedule import Synchronous1F1B

    dag = nx.DiGraph()
    node_id = 2  # 0 and 1 are the dummy source and sink.
    stage_nodes: list[list[int]] = []
    for stage in range(num_stages):
        stage_nodes.append([])
        for inst in Synchronous1F1B(num_stages, num_microbatches, stage, op_spec_map[stage]):
            dag.add_node(node_id, op=inst)
            stage_nodes[-1].append(node_id)
            node_id += 1
    for nodes in stage_nodes:
        for a, b in zip(nodes, nodes[1:], strict=False):
            dag.add_edge(a, b)
    resolver = DependencyResolver([forward_dep, backward_dep], LtInstruction)
    for s in range(num_stages - 1):
        for a in stage_nodes[s] + stage_nodes[s + 1]:
            for b in stage_nodes[s] + stage_nodes[s + 1]:
                if a != b and resolver.is_dependent(dag.nodes[a]["op"], dag.nodes[b]["op"]):
                    dag.add_edge(a, b)
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1
    return dag


def _lowtime_knobs(dag: Any) -> dict[Instruction, int]:
    """The frequency lowtime currently assigns to each instruction (every node but the source and sink)."""
    from lowtime.perseus.instruction import Forward

    out = {}
    for n in dag.nodes:
        if n < 2:
            continue
        op = dag.nodes[n]["op"]
        kind = "forward" if isinstance(op, Forward) else "backward"
        out[Instruction(op.stage_id, kind, op.micro_batch_id)] = op.assigned_knob
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8,4x16,8x16,8x32", help="comma list of STAGESxMICROBATCHES")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--unit-time-s", type=float, default=1e-3, help="lowtime time quantum (Perseus: 1 ms)"
    )
    parser.add_argument(
        "--lowtime-budget-s",
        type=float,
        default=3600.0,
        help="cap on lowtime's solve time (cut off: no result)",
    )
    parser.add_argument(
        "--exact-limit-s", type=float, default=120.0, help="HiGHS time limit of the exact ILP (0: skip it)"
    )
    parser.add_argument("--skip-lowtime", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    rows = []
    for size in args.sizes.split(","):
        num_stages, num_microbatches = (int(x) for x in size.lower().split("x"))
        options, p_blk = synthetic_profile(num_stages, seed=args.seed)
        schedule = build_schedule("1f1b", num_stages, num_microbatches)
        dag = build_dag(schedule)
        ref = max_frequency_plan(dag, options, p_blk)
        n_opts = sum(len(pareto_options(options[k], p_blk[k[0]])) for k in options) / len(options)

        tick = time.perf_counter()
        ours = solve(schedule, options, p_blk)  # from the schedule: DAG construction is inside the timing
        ours_s = time.perf_counter() - tick
        tick = time.perf_counter()
        frontier(schedule, options, p_blk)
        front_s = time.perf_counter() - tick
        assert ours.iteration_time_s <= ref.iteration_time_s * (1 + 1e-9)
        row: dict[str, Any] = {
            "size": size,
            "nodes": len(dag),
            "opts": n_opts,
            "t_ref": ref.iteration_time_s,
            "e_ref": ref.energy_j,
            "ours_s": ours_s,
            "front_s": front_s,
            "ours_t": ours.iteration_time_s,
            "ours_e": ours.energy_j,
            "target": ref.iteration_time_s,
        }
        if not args.skip_lowtime:
            lt_s, lt_freqs, lt_iters, finished = run_lowtime(
                num_stages,
                num_microbatches,
                options,
                p_blk,
                ref.iteration_time_s,
                args.unit_time_s,
                args.lowtime_budget_s,
            )
            row.update(lt_s=lt_s, lt_iters=lt_iters, lt_done=finished)
            if finished:
                lt = evaluate(schedule, options, p_blk, lt_freqs)
                row.update(lt_t=lt.iteration_time_s, lt_e=lt.energy_j)
                # Quantisation can leave every lowtime iterate slightly above the all-max time: compare all
                # three at lowtime's own iteration time then.
                row["target"] = max(lt.iteration_time_s, ref.iteration_time_s)
                at = solve(schedule, options, p_blk, row["target"])
                row.update(ours_t=at.iteration_time_s, ours_e=at.energy_j)
        row["lb_e"] = lower_bound(dag, options, p_blk, row["target"])
        if args.exact_limit_s > 0:
            tick = time.perf_counter()
            exact = exact_plan(dag, options, p_blk, row["target"], time_limit_s=args.exact_limit_s)
            row["ex_s"] = time.perf_counter() - tick
            if exact is not None:
                row.update(ex_t=exact.iteration_time_s, ex_e=exact.energy_j)
        rows.append(row)
        print(_describe(row), flush=True)
    _print_table(rows)


def _print_table(rows: list[dict[str, Any]]) -> None:
    print()
    header = (
        f"{'size':>6} {'instr':>5} {'opts':>4} {'T_maxf s':>9} {'E_maxf J':>9} {'T cmp s':>8} | "
        f"{'ours s':>7} {'E J':>9} {'save%':>6} | {'lowtime s':>9} {'iters':>5} {'E J':>9} | "
        f"{'exact s':>7} {'E J':>9} | {'ours-lt%':>8} {'ours-ex%':>8} {'lt-ex%':>7} {'ours-LB%':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        line = (
            f"{r['size']:>6} {r['nodes']:>5} {r['opts']:>4.1f} {r['t_ref']:>9.4f} {r['e_ref']:>9.1f} "
            f"{r['target']:>8.4f} | {r['ours_s']:>7.3f} {r['ours_e']:>9.1f} "
            f"{100 * (1 - r['ours_e'] / r['e_ref']):>6.2f} | "
        )
        if "lt_s" not in r:
            line += f"{'skipped':>9} {'':>5} {'':>9} | "
        elif "lt_e" in r:
            line += f"{r['lt_s']:>9.2f} {r['lt_iters']:>5} {r['lt_e']:>9.1f} | "
        else:
            line += f"{'cut off':>9} {r['lt_iters']:>5} {'-':>9} | "
        line += f"{r['ex_s']:>7.2f} {r['ex_e']:>9.1f} | " if "ex_e" in r else f"{'-':>7} {'-':>9} | "

        line += f"{_gap(r, 'ours_e', 'lt_e')} {_gap(r, 'ours_e', 'ex_e')} {_gap(r, 'lt_e', 'ex_e'):>7}"
        line += f" {_gap(r, 'ours_e', 'lb_e')}"
        print(line)
    print(
        "\nAll energies at the same iteration time 'T cmp' (the all-max-frequency time, or lowtime's iterate time"
        " when its\nquantisation keeps it above): ours = solve(target=T cmp), lowtime = its least-energy iterate"
        " within T cmp, exact = the ILP\n(HiGHS; '-' = not proven optimal within --exact-limit-s); LB = the LP relaxation's lower bound, so ours-LB% bounds ours-ex%. 'cut off' ="
        " lowtime stopped at --lowtime-budget-s: no result.\nsave% = 1 - ours E / E_maxf (ours at T cmp). 'ours s' = solve from the schedule at the all-max"
        " time. frontier (24 targets) solve time: "
        + ", ".join(f"{r['size']} {r['front_s']:.3f} s" for r in rows)
    )


def _gap(row: dict[str, Any], a: str, b: str) -> str:
    """Percent by which energy `a` exceeds energy `b`, or '-' when either is missing."""
    return f"{100 * (row[a] / row[b] - 1):>+8.3f}" if a in row and b in row else f"{'-':>8}"


def _describe(row: dict) -> str:
    text = (
        f"{row['size']}: ours {row['ours_s']:.3f} s E={row['ours_e']:.1f} J (frontier {row['front_s']:.3f} s)"
    )
    if "lt_e" in row:
        text += f"; lowtime {row['lt_s']:.2f} s ({row['lt_iters']} iters) E={row['lt_e']:.1f} J"
    elif "lt_s" in row:
        text += f"; lowtime cut off after {row['lt_s']:.0f} s ({row['lt_iters']} iters)"
    if "ex_e" in row:
        text += f"; exact {row['ex_s']:.2f} s E={row['ex_e']:.1f} J"
    return text


if __name__ == "__main__":
    main()
