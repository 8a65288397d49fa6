"""Perseus time-energy frontier of a pipeline iteration: which SM clock each instruction should run at.

The energy model (effective energy, plans and their time and energy) is in `energy_model`, the search
over each instruction's options in `plan_search`; `solve` and `frontier` combine them with `exact`.

How a plan is found (`solve`, and every `frontier` point):

1. A greedy search slows down the instruction step that saves the most energy per second of added time,
   among the steps that fit within the instruction's slack (latest minus earliest start against the
   target); slacks are kept exact by propagating each change forward and backward through the DAG, and a
   lazy priority queue finds the best step (slacks only shrink, so priorities only fall).
2. With scipy (the `pipeline` extra), `exact.refine`: the LP relaxation of the exact integer program (each
   instruction on the lower convex hull of its options: a time-cost tradeoff LP) gives a lower bound on
   every plan; its durations rounded to the next faster option are improved by local search (below); while
   the best plan is not proven within 0.1 % of that bound, HiGHS' branch and bound is asked whether any
   plan is 0.1 % cheaper (an objective cutoff: its root's cuts usually answer "none", a proof), then for
   the cheapest plan, each time for at most a number of nodes (never a number of seconds: the same inputs
   give the same plan on any machine). The gap proven is kept with the plan (`Plan.proven_gap`) and logged
   (INFO when above 0.1 %).
3. Local search repairs the greedy's mistakes: an *exchange* speeds one instruction up, freezes it and hands
   the freed slack to the others; an *ejection* slows one down past its slack and speeds up the cheapest
   instructions on the paths that overrun.

Why this mix (measured on `benchmarks/pipeline_planner.py`'s profiles, 4x8 to 8x32, 29 clocks, and 100
random small pipelines with 3-8 clocks): the greedy with local search alone ends 0.4-1.5 % above the LP bound
and takes up to 20 s at 8x32 off the all-max time; rounding the LP and searching locally from there ends
0.1-0.25 % above the bound in about a second at 8x32. The optimum lies between the two, and the LP cannot
tell where: on A40-like profiles with a flat, power-capped top (issue 36,
`benchmarks/pipeline_measured_options.py`, 8x12, 75 clocks) the rounded plan is 0.13-0.16 % above the LP at every target, and the cutoff
question proves it within 0.1 % in 0.4-4 s at nine targets of ten; the tenth took an unanswered question
(25 s) and the cheapest-plan search (32 s): 71 s for an 8-point frontier. HiGHS' branch and bound alone,
without the cutoff, needs 20-35 s for its root on the same programs. Programs of more than
`exact._MAX_BINARIES` option binaries (8x24 there) are searched only near the LP's and the plan's options
before the question: at 8x24 that benchmark's six targets are all proven within 0.1 % (minutes each), and so
are the 8 points of `pipeline-plan --points 6` (25 minutes); above
`exact._MAX_PROVABLE_BINARIES` (8x48) the LP's bound is kept. Unlike
Phillips-Dessouky (lowtime), nothing is quantised: plans use the profiled options as measured. Without scipy
the planner runs steps 1 and 3 only, over several deadlines, and cannot tell its distance to the optimum.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from zeus_callbacks.core.pipeline_frequency import energy_model
from zeus_callbacks.core.pipeline_frequency.dag import Instruction, PipelineDAG
from zeus_callbacks.core.pipeline_frequency.energy_model import REL_TOL, Frontier, OptionTable, Plan, as_dag
from zeus_callbacks.core.pipeline_frequency.energy_model import FrequencyOption as FrequencyOption
from zeus_callbacks.core.pipeline_frequency.energy_model import evaluate as evaluate
from zeus_callbacks.core.pipeline_frequency.energy_model import max_frequency_plan as max_frequency_plan
from zeus_callbacks.core.pipeline_frequency.energy_model import pareto_options as pareto_options
from zeus_callbacks.core.pipeline_frequency.plan_search import PlanSearch

__all__ = [*energy_model.__all__, "solve", "frontier"]  # the model's records re-exported

logger = logging.getLogger(__name__)

# Branch-and-bound nodes HiGHS may explore for `solve`'s plan and for each frontier point: work, not seconds.
SOLVE_NODE_LIMIT = 200
FRONTIER_NODE_LIMIT = 60


def solve(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
    target_time_s: float | None = None,
    num_deadlines: int = 8,
    max_passes: int = 8,
    node_limit: int = SOLVE_NODE_LIMIT,
    slow_proof: bool = True,
) -> Plan:
    """The least-energy plan found whose iteration time does not exceed `target_time_s`.

    With scipy (the `pipeline` extra): the greedy search and the LP relaxation's rounded plan, each improved
    by local search, then HiGHS' branch and bound for at most `node_limit` nodes while the best plan is not
    proven within 0.1 % of the optimum (see `exact.refine`); the proven gap is the plan's `proven_gap`. No
    step depends on the clock, so the same inputs give the same plan on any machine. Without scipy: the best of one
    search that prices iteration time at the total blocking power and searches that minimise effective energy
    under `num_deadlines` deadlines spread from the fastest time to the target.

    Args:
        dag: The iteration's DAG (`build_dag`) or a per-stage schedule (`build_schedule`).
        options: Profiled options of each `(stage, kind)`.
        p_blk_w: Blocking power (W) while a stage waits: one value, or one per stage.
        target_time_s: Deadline on the iteration time; defaults to the all-max-frequency iteration time.
        num_deadlines: Without scipy, deadlines tried between the fastest time and the target (at least 1).
        max_passes: Local-search passes after each greedy search or rounding (0: none; more: slower, better).
        node_limit: With scipy, the most nodes branch and bound may explore (0: never run it).
        slow_proof: False: a program that takes minutes to prove (`exact.slow_to_prove`) keeps the LP's bound,
            in seconds (the optimizer plans so in training, where every rank waits for the plan).

    Raises:
        ValueError: On missing or invalid options, or a target faster than the fastest options allow.
    """
    problem = PlanSearch(as_dag(dag), options, p_blk_w)
    target = problem.tables.max_frequency_time_s if target_time_s is None else float(target_time_s)
    if target < problem.tables.fastest_time_s * (1 - REL_TOL):
        raise ValueError(
            f"`solve(target_time_s={target_time_s!r})` is infeasible: the fastest plan takes "
            f"{problem.tables.fastest_time_s:.6g} s."
        )
    target = max(target, problem.tables.fastest_time_s)
    if _refine_available():
        if not slow_proof and _slow_to_prove(problem, node_limit):
            node_limit = 0
        return problem.best_plan(target, [0] * len(problem.tables.dag), max_passes, node_limit)[1]
    levels = [0] * len(problem.tables.dag)
    problem.optimize(levels, target, priced=True, max_passes=max_passes)
    plans = [problem.plan(levels)]
    lo = problem.tables.fastest_time_s
    steps = max(1, num_deadlines) - 1
    deadlines = {target, *(lo + (target - lo) * k / steps for k in range(steps))}
    plans += problem.sweep(sorted(deadlines), max_passes=max_passes)
    best = min(plans, key=lambda p: p.energy_j)
    logger.debug("Plan for target %.6g s: %.6g s, %.6g J.", target, best.iteration_time_s, best.energy_j)
    return best


def frontier(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
    num_points: int = 24,
    max_passes: int = 1,
    node_limit: int = FRONTIER_NODE_LIMIT,
) -> Frontier:
    """The time-energy frontier, from the fastest plan to the least-energy one.

    With scipy, each of `num_points` targets spread evenly from the fastest time to the least-energy plan's
    time is solved as `solve` does, starting from the previous target's plan, so every point is as close to
    the optimum at its own iteration time as `solve`'s plan. Without scipy, a greedy sweep over targets up to
    the all-slowest time (local search only at the all-max-frequency time). Points that are slower without
    saving energy are dropped; the all-max-frequency time is always one of the targets.

    Args:
        dag: The iteration's DAG (`build_dag`) or a per-stage schedule (`build_schedule`).
        options: Profiled options of each `(stage, kind)`.
        p_blk_w: Blocking power (W) while a stage waits: one value, or one per stage.
        num_points: Number of targets to solve for (at least 2).
        max_passes: Local-search passes per target (with scipy; without, the greedy runs alone).
        node_limit: With scipy, the most nodes branch and bound may explore per target (0: never run it).
    """
    if num_points < 2:
        raise ValueError(f"`frontier(num_points={num_points})` needs at least 2 points.")
    problem = PlanSearch(as_dag(dag), options, p_blk_w)
    lo = problem.tables.fastest_time_s
    plans: list[Plan] = []
    if _refine_available():
        if _slow_to_prove(problem, node_limit):
            logger.warning(
                "Proving %d frontier points of this pipeline within 0.1 %% of the optimum takes minutes each "
                "(%d option binaries); node_limit=0 (`pipeline-plan --proof-nodes 0`) keeps the LP's bound, "
                "in seconds.",
                num_points + 1,
                problem.tables.num_options,
            )
        plans.append(
            problem.best_plan(
                problem.tables.slowest_time_s, [0] * len(problem.tables.dag), max_passes, node_limit
            )[1]
        )
        hi = plans[0].iteration_time_s
        targets = {lo + (hi - lo) * k / (num_points - 1) for k in range(num_points)}
        if problem.tables.max_frequency_time_s < hi:
            targets.add(problem.tables.max_frequency_time_s)
        levels = [0] * len(problem.tables.dag)
        for target in sorted(targets):
            levels, plan = problem.best_plan(target, levels, max_passes, node_limit)
            plans.append(plan)
    else:
        hi = problem.tables.slowest_time_s
        targets = {
            lo,
            problem.tables.max_frequency_time_s,
            *(lo + (hi - lo) * k / (num_points - 1) for k in range(num_points)),
        }
        plans = problem.sweep(sorted(targets), max_passes=0)
        # The default choice (no slowdown) is the point that matters most: refine it as `solve` does.
        levels = [0] * len(problem.tables.dag)
        problem.optimize(levels, problem.tables.max_frequency_time_s, priced=True, max_passes=8)
        plans.append(problem.plan(levels))
    kept: list[Plan] = []
    for plan in sorted(plans, key=lambda p: (p.iteration_time_s, p.energy_j)):
        if not kept or plan.energy_j < kept[-1].energy_j:
            kept.append(plan)
    return Frontier(plans=tuple(kept), max_frequency=problem.tables.max_frequency_plan)


def _slow_to_prove(problem: PlanSearch, node_limit: int) -> bool:
    """Whether branch and bound would run (`node_limit` above 0) on a program that is slow to prove."""
    from zeus_callbacks.core.pipeline_frequency.exact import slow_to_prove

    return node_limit > 0 and slow_to_prove(problem)


_REFINE: list[bool] = []


def _refine_available() -> bool:
    """Whether `exact.refine` can run (scipy installed); says once, at INFO, when it cannot."""
    if not _REFINE:
        from zeus_callbacks.core.pipeline_frequency.exact import scipy_available

        _REFINE.append(scipy_available())
        if not _REFINE[0]:
            logger.info(
                "scipy is not installed: pipeline plans are heuristic, without a proven distance to the "
                "optimum. Install it with `pip install 'zeus-callbacks[pipeline]'`."
            )
    return _REFINE[0]
