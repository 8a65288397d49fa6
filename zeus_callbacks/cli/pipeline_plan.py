"""`zeus-callbacks pipeline-plan`: Perseus frequency plan of a pipeline-parallel iteration from a profile CSV."""

from __future__ import annotations

import argparse
import json
import math

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.pipeline_frequency.dag import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    build_dag,
    build_schedule,
)
from zeus_callbacks.core.pipeline_frequency.edge_delays import EdgeDelays
from zeus_callbacks.core.pipeline_frequency.frontier import (
    FRONTIER_NODE_LIMIT,
    SOLVE_NODE_LIMIT,
    Frontier,
    Plan,
    frontier,
    solve,
)
from zeus_callbacks.core.pipeline_frequency.planning import options_from_rows
from zeus_callbacks.core.pipeline_frequency.profile_file import (
    edge_delays_path,
    read_edge_delays,
    read_profile,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `pipeline-plan` subcommand."""
    parser = subparsers.add_parser(
        "pipeline-plan",
        help="plan per-instruction SM frequencies of a pipeline-parallel iteration (Perseus)",
        description=(
            "Compute the time-energy frontier of one pipeline iteration from a Perseus profile CSV "
            "(stage,instruction,frequency,time,energy) and pick the least-energy plan within a target time."
        ),
    )
    parser.add_argument(
        "--profile",
        required=True,
        metavar="CSV",
        help="instruction profile (Zeus/Perseus format); the time between instructions is read from "
        "NAME.edges.csv beside it when present (written by PipelineFrequencyOptimizer)",
    )
    parser.add_argument(
        "--p-blk", required=True, metavar="W", help="blocking power (W): one value, or a comma list per stage"
    )
    # Numbers are parsed in `run`, so that a bad one is reported in one line that says what to pass.
    parser.add_argument("--stages", metavar="N", help="pipeline stages (default: as many as the profile has)")
    parser.add_argument("--microbatches", metavar="M", required=True, help="microbatches per iteration")
    parser.add_argument("--schedule", choices=SCHEDULES + MULTI_STAGE_SCHEDULES, default="1f1b")
    parser.add_argument(
        "--chunks",
        metavar="V",
        help="model chunks per stage, for interleaved-1f1b and looped-bfs (default 2; 1 for the others)",
    )
    parser.add_argument(
        "--target-time", metavar="S", help="iteration time bound (default: all at max frequency)"
    )
    parser.add_argument(
        "--points", metavar="N", default="24", help="targets on the frontier (default 24, >= 2)"
    )
    parser.add_argument(
        "--proof-nodes",
        metavar="N",
        help="branch-and-bound nodes per call that may be spent proving each plan within 0.1 %% of the optimum "
        f"(default {FRONTIER_NODE_LIMIT} per frontier point, {SOLVE_NODE_LIMIT} for the plan; 0: the LP bound "
        "alone, fastest; large programs, e.g. 8 stages x 24 microbatches, take minutes per point)",
    )
    parser.add_argument("--json", action="store_true", help="print the frontier and plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Solve and print.

    Raises:
        InvalidInputError: a bad option or profile (`zeus-callbacks` prints it in one line, exit code 2).
        ValueError: no plan meets the target (likewise).
    """
    stages = None if args.stages is None else _integer("--stages", args.stages, 1)
    microbatches = _integer("--microbatches", args.microbatches, 1)
    points = _integer("--points", args.points, 2)
    frontier_nodes, plan_nodes = FRONTIER_NODE_LIMIT, SOLVE_NODE_LIMIT
    if args.proof_nodes is not None:
        frontier_nodes = plan_nodes = _integer("--proof-nodes", args.proof_nodes, 0)
    multi = args.schedule in MULTI_STAGE_SCHEDULES
    chunks = _integer("--chunks", args.chunks, 1) if args.chunks is not None else 2 if multi else 1
    if chunks > 1 and not multi:
        raise InvalidInputError(
            f"--chunks {args.chunks}: {args.schedule} runs one model chunk per stage; pass --schedule "
            f"{' or '.join(MULTI_STAGE_SCHEDULES)} for several."
        )
    target_time = None
    if args.target_time is not None:
        target_time = _number("--target-time", args.target_time, args.target_time, "a positive", "seconds")
    p_blk = [
        _number("--p-blk", args.p_blk, x, "a non-negative", "watts, or one per stage separated by commas")
        for x in str(args.p_blk).split(",")
    ]
    try:
        rows = read_profile(args.profile, num_stages=stages)
        delays = EdgeDelays.from_rows(read_edge_delays(edge_delays_path(args.profile)))
    except OSError as e:
        raise InvalidInputError(f"--profile {args.profile}: {e.strerror or e}") from None
    num_stages = stages or 1 + max(r.stage for r in rows)
    if len(p_blk) == 1:
        p_blk *= num_stages
    elif len(p_blk) != num_stages:
        raise InvalidInputError(
            f"--p-blk {args.p_blk!r}: {len(p_blk)} values for {num_stages} stages; "
            "pass one value (W) for every stage, or one per stage separated by commas."
        )
    # Errors below are the planner's `ValueError`s (e.g. an infeasible target): the command line reports
    # them in one line, exit code 2.
    options = options_from_rows(rows)
    # The time measured between instructions, when the profile has it (`profile.edges.csv`).
    dag = delays.apply(build_dag(build_schedule(args.schedule, num_stages, microbatches, chunks)))
    front = frontier(dag, options, p_blk, num_points=points, node_limit=frontier_nodes)
    chosen = solve(dag, options, p_blk, target_time, node_limit=plan_nodes)
    target = front.max_frequency.iteration_time_s if target_time is None else target_time
    if args.json:
        print(json.dumps(_to_dict(front, chosen, target, args.schedule, chunks), indent=2))
    else:
        print(_text(front, chosen, target, args.schedule, chunks))
    return 0


def _integer(option: str, text: str, low: int) -> int:
    """`text` as an integer >= `low`, or the error that names `option`."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < low:
        raise InvalidInputError(f"{option} {text!r}: pass an integer >= {low}.")
    return value


def _number(option: str, given: str, text: str, kind: str, unit: str) -> float:
    """`text` (part of the `given` value) as a finite number, positive (`kind="a positive"`) or >= 0, or
    the error that names `option`."""
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    low_ok = value > 0 if kind == "a positive" else value >= 0
    if not (math.isfinite(value) and low_ok):
        bad = "" if text == given else f" ({text!r})"
        raise InvalidInputError(f"{option} {given!r}{bad}: pass {kind} finite number ({unit}).")
    return value


def _point(plan: Plan, ref: Plan) -> dict:
    gap = plan.proven_gap
    return {
        "iteration_time_s": plan.iteration_time_s,
        "energy_j": plan.energy_j,
        "energy_saving": 1 - plan.energy_j / ref.energy_j,
        # Relative; null where nothing is proven (no scipy, or the all-max reference).
        "proven_gap": gap if gap is not None and math.isfinite(gap) else None,
    }


def _gap_text(plan: Plan) -> str:
    """How far above the optimum `plan` is proven to be at most, for the table."""
    if plan.proven_gap is None:
        return "unproven (no scipy)"
    if not math.isfinite(plan.proven_gap):
        return "unproven"
    return f"{100 * plan.proven_gap:.3f}%"


def _to_dict(front: Frontier, chosen: Plan, target: float, schedule: str, chunks: int) -> dict:
    ref = front.max_frequency
    return {
        "schedule": schedule,
        "num_stages": len(chosen.schedule),
        "chunks_per_stage": chunks,
        "target_time_s": target,
        "max_frequency": _point(ref, ref),
        "frontier": [_point(p, ref) for p in front.plans],
        "plan": {
            **_point(chosen, ref),
            "stages": [
                [
                    {
                        "instruction": i.kind,
                        "microbatch": i.microbatch,
                        **({} if i.virtual_stage is None else {"virtual_stage": i.virtual_stage}),
                        "frequency_mhz": chosen.frequencies_mhz[i],
                    }
                    for i in order
                ]
                for order in chosen.schedule
            ],
        },
    }


def _text(front: Frontier, chosen: Plan, target: float, schedule: str, chunks: int) -> str:
    ref = front.max_frequency
    chunked = f" x {chunks} chunks" if chunks > 1 else ""
    lines = [
        f"{schedule} pipeline, {len(chosen.schedule)} stages{chunked}: time-energy frontier per iteration",
        f"{'time (s)':>10}{'energy (J)':>12}{'saving':>9}  proven gap to optimum",
    ]
    for p in front.plans:
        lines.append(
            f"{p.iteration_time_s:>10.4f}{p.energy_j:>12.2f}{100 * (1 - p.energy_j / ref.energy_j):>8.2f}%"
            f"  {_gap_text(p)}"
        )
    lines += [
        f"all at max frequency: {ref.iteration_time_s:.4f} s, {ref.energy_j:.2f} J",
        f"chosen plan (target {target:.4f} s): {chosen.iteration_time_s:.4f} s, {chosen.energy_j:.2f} J, "
        f"saving {100 * (1 - chosen.energy_j / ref.energy_j):.2f}%, proven within {_gap_text(chosen)} of the "
        "optimum",
        "SM frequency (MHz) per stage, in execution order (F/B + microbatch"
        + (", @ virtual stage):" if chosen.schedule[0][0].virtual_stage is not None else "):"),
    ]
    for stage, order in enumerate(chosen.schedule):
        cells = " ".join(
            f"{'F' if i.kind == 'forward' else 'B'}{i.microbatch}"
            f"{'' if i.virtual_stage is None else f'@{i.virtual_stage}'}:{chosen.frequencies_mhz[i]}"
            for i in order
        )
        lines.append(f"  stage {stage}: {cells}")
    return "\n".join(lines)
