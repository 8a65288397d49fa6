"""Perseus time-energy frontier of a pipeline iteration: which SM clock each instruction should run at.

Energy model of one iteration of length `T`: the energy of every instruction plus, on every stage `s`, the
blocking power `P_blk[s]` for the time that stage is not computing, `P_blk[s] * (T - busy[s])`. At a fixed
`T` this is `sum(e_i - P_blk[s_i] * t_i) + T * sum(P_blk)`, so each instruction only needs its *effective
energy* `e - P_blk * t`, and options that are slower without a lower effective energy are never useful.

How a plan is found (`solve`, and every `frontier` point):

1. A greedy search slows down the instruction step that saves the most energy per second of added time,
   among the steps that fit within the instruction's slack (latest minus earliest start against the
   target); slacks are kept exact by propagating each change forward and backward through the DAG, and a
   lazy priority queue finds the best step (slacks only shrink, so priorities only fall).
2. With scipy (the `pipeline` extra), `exact.refine`: the LP relaxation of the exact integer program (each
   instruction on the lower convex hull of its options: a time-cost tradeoff LP) gives a lower bound on
   every plan; its durations rounded to the next faster option are improved by local search (below); while
   the best plan is not proven within 0.1 % of that bound, HiGHS' branch and bound runs for at most a number
   of nodes (never a number of seconds: the same inputs give the same plan on any machine) on small
   programs. The gap proven is kept with the plan (`Plan.proven_gap`) and logged (INFO when above 0.1 %).
3. Local search repairs the greedy's mistakes: an *exchange* speeds one instruction up, freezes it and hands
   the freed slack to the others; an *ejection* slows one down past its slack and speeds up the cheapest
   instructions on the paths that overrun.

Why this mix (measured on `benchmarks/pipeline_planner.py`'s profiles, 4x8 to 8x32, 29 clocks, and 100
random small pipelines with 3-8 clocks): the greedy with local search alone ends 0.4-1.5 % above the LP bound
and takes up to 20 s at 8x32 off the all-max time; rounding the LP and searching locally from there ends
0.1-0.25 % above the bound (at 4x8, where the optimum is known, the bound is 0.13 % below it, and the plan
0.06 % above it) in about a second at 8x32. HiGHS' branch and bound alone needs 4-30 s to close 0.1 % at 4x8 and does not within a
minute from 4x16 on (nor restricted to the LP's neighbourhood), but closes small programs (the 3-8-clock
pipelines of the exact test) in milliseconds: there it makes the plan provably within 0.1 %. Unlike
Phillips-Dessouky (lowtime), nothing is quantised: plans use the profiled options as measured. Without scipy
the planner runs steps 1 and 3 only, over several deadlines, and cannot tell its distance to the optimum.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, PipelineDAG, build_dag

__all__ = [
    "FrequencyOption",
    "Plan",
    "Frontier",
    "pareto_options",
    "evaluate",
    "max_frequency_plan",
    "solve",
    "frontier",
]

logger = logging.getLogger(__name__)

OptionTable = Mapping[tuple[int, str], Sequence["FrequencyOption"]]
"""Profiled options of each instruction type, keyed by `(stage, kind)` with kind `"forward"`/`"backward"`."""

# Relative tolerance on the target time, to absorb floating-point rounding of sums of durations.
_REL_TOL = 1e-9
# Branch-and-bound nodes HiGHS may explore for `solve`'s plan and for each frontier point: work, not seconds.
SOLVE_NODE_LIMIT = 200
FRONTIER_NODE_LIMIT = 60
# Ejections cost far more than exchanges and matter with few, coarse options per instruction: they run only
# when (instructions x options per instruction) is at most this.
_EJECT_MAX_WORK = 1000


@dataclass(frozen=True)
class FrequencyOption:
    """One profiled operating point of an instruction type."""

    frequency_mhz: int
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class Plan:
    """An SM frequency for every instruction of the iteration, with its predicted time and energy.

    `proven_gap` is how far above the optimum under the plan's target its energy can be at most, relative
    (0.001: within 0.1 %), proven by the LP relaxation or branch and bound; None when not proven (no scipy,
    or a plan not made by the planner).
    """

    frequencies_mhz: Mapping[Instruction, int]
    iteration_time_s: float
    energy_j: float
    schedule: tuple[tuple[Instruction, ...], ...] = field(repr=False, compare=False)
    proven_gap: float | None = field(default=None, compare=False)

    def stage_frequencies(self) -> list[list[int]]:
        """Frequency (MHz) of each stage's instructions, in the stage's execution order."""
        return [[self.frequencies_mhz[inst] for inst in order] for order in self.schedule]


@dataclass(frozen=True)
class Frontier:
    """Time-energy Pareto frontier of an iteration, with the all-max-frequency reference point.

    `plans` are sorted by increasing time and strictly decreasing energy.
    """

    plans: tuple[Plan, ...]
    max_frequency: Plan

    def choose(self, target_time_s: float | None = None) -> Plan:
        """The least-energy plan whose iteration time is at most `target_time_s`.

        `target_time_s` defaults to the iteration time with every instruction at its maximum frequency.

        Raises:
            ValueError: If no plan meets the target.
        """
        target = self.max_frequency.iteration_time_s if target_time_s is None else target_time_s
        feasible = [p for p in self.plans if p.iteration_time_s <= target * (1 + _REL_TOL)]
        if not feasible:
            fastest = self.plans[0].iteration_time_s
            raise ValueError(
                f"No plan meets the target of {target:.6g} s; the fastest takes {fastest:.6g} s."
            )
        return min(feasible, key=lambda p: p.energy_j)


def pareto_options(options: Sequence[FrequencyOption], p_blk_w: float) -> list[FrequencyOption]:
    """Options worth choosing, sorted by increasing time (so by decreasing effective energy).

    An option is dropped when another is at least as fast with no more effective energy `e - p_blk_w * t`.
    """
    kept: list[FrequencyOption] = []
    best_cost = float("inf")
    for opt in sorted(options, key=lambda o: (o.time_s, o.energy_j - p_blk_w * o.time_s, -o.frequency_mhz)):
        cost = opt.energy_j - p_blk_w * opt.time_s
        if cost < best_cost:
            kept.append(opt)
            best_cost = cost
    return kept


def evaluate(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
    frequencies_mhz: Mapping[Instruction, int],
) -> Plan:
    """Iteration time and energy of running each instruction at the given frequency.

    Raises:
        ValueError: If an instruction's frequency has no profiled option.
    """
    dag = _as_dag(dag)
    p_blk = _per_stage(p_blk_w, dag.num_stages)
    lookup = {key: {o.frequency_mhz: o for o in opts} for key, opts in options.items()}
    chosen = []
    for inst in dag.instructions:
        try:
            chosen.append(lookup[inst.stage, inst.kind][frequencies_mhz[inst]])
        except KeyError:
            raise ValueError(f"No profiled option for {inst} at {frequencies_mhz.get(inst)} MHz.") from None
    return _make_plan(dag, p_blk, chosen)


def max_frequency_plan(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
) -> Plan:
    """The reference plan: every instruction at the highest profiled frequency of its type."""
    dag = _as_dag(dag)
    _check_options(dag, options)
    top = {key: max(opts, key=lambda o: o.frequency_mhz) for key, opts in options.items()}
    return _make_plan(
        dag, _per_stage(p_blk_w, dag.num_stages), [top[i.stage, i.kind] for i in dag.instructions]
    )


def solve(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
    target_time_s: float | None = None,
    num_deadlines: int = 8,
    max_passes: int = 8,
    node_limit: int = SOLVE_NODE_LIMIT,
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

    Raises:
        ValueError: On missing or invalid options, or a target faster than the fastest options allow.
    """
    problem = _Problem(_as_dag(dag), options, p_blk_w)
    target = problem.max_frequency_time_s if target_time_s is None else float(target_time_s)
    if target < problem.fastest_time_s * (1 - _REL_TOL):
        raise ValueError(
            f"`solve(target_time_s={target_time_s!r})` is infeasible: the fastest plan takes "
            f"{problem.fastest_time_s:.6g} s."
        )
    target = max(target, problem.fastest_time_s)
    if _refine_available():
        return problem.best_plan(target, [0] * len(problem.dag), max_passes, node_limit)[1]
    levels = [0] * len(problem.dag)
    problem.optimize(levels, target, priced=True, max_passes=max_passes)
    plans = [problem.plan(levels)]
    lo = problem.fastest_time_s
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
    problem = _Problem(_as_dag(dag), options, p_blk_w)
    lo = problem.fastest_time_s
    plans: list[Plan] = []
    if _refine_available():
        plans.append(
            problem.best_plan(problem.slowest_time_s, [0] * len(problem.dag), max_passes, node_limit)[1]
        )
        hi = plans[0].iteration_time_s
        targets = {lo + (hi - lo) * k / (num_points - 1) for k in range(num_points)}
        if problem.max_frequency_time_s < hi:
            targets.add(problem.max_frequency_time_s)
        levels = [0] * len(problem.dag)
        for target in sorted(targets):
            levels, plan = problem.best_plan(target, levels, max_passes, node_limit)
            plans.append(plan)
    else:
        hi = problem.slowest_time_s
        targets = {
            lo,
            problem.max_frequency_time_s,
            *(lo + (hi - lo) * k / (num_points - 1) for k in range(num_points)),
        }
        plans = problem.sweep(sorted(targets), max_passes=0)
        # The default choice (no slowdown) is the point that matters most: refine it as `solve` does.
        levels = [0] * len(problem.dag)
        problem.optimize(levels, problem.max_frequency_time_s, priced=True, max_passes=8)
        plans.append(problem.plan(levels))
    kept: list[Plan] = []
    for plan in sorted(plans, key=lambda p: (p.iteration_time_s, p.energy_j)):
        if not kept or plan.energy_j < kept[-1].energy_j:
            kept.append(plan)
    return Frontier(plans=tuple(kept), max_frequency=problem.max_frequency_plan)


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


def _as_dag(dag: PipelineDAG | Sequence[Sequence[Instruction]]) -> PipelineDAG:
    return dag if isinstance(dag, PipelineDAG) else build_dag(dag)


def _per_stage(p_blk_w: float | Sequence[float], num_stages: int) -> list[float]:
    values = (
        [float(p_blk_w)] * num_stages if isinstance(p_blk_w, int | float) else [float(p) for p in p_blk_w]
    )
    if len(values) != num_stages:
        raise ValueError(f"`p_blk_w` has {len(values)} values for {num_stages} stages.")
    if any(not p >= 0 for p in values):
        raise ValueError(f"`p_blk_w={p_blk_w!r}` must be non-negative.")
    return values


def _check_options(dag: PipelineDAG, options: OptionTable) -> None:
    for key in sorted({(i.stage, i.kind) for i in dag.instructions}):
        opts = options.get(key)
        if not opts:
            raise ValueError(f"No profiled options for stage {key[0]} {key[1]}.")
        for o in opts:
            if not (o.time_s > 0 and o.energy_j >= 0):
                raise ValueError(
                    f"Stage {key[0]} {key[1]}: invalid option {o} (needs time > 0, energy >= 0)."
                )


def _make_plan(dag: PipelineDAG, p_blk: Sequence[float], chosen: Sequence[FrequencyOption]) -> Plan:
    durations = [o.time_s for o in chosen]
    time_s = dag.iteration_time(durations)
    busy = [0.0] * dag.num_stages
    for inst, t in zip(dag.instructions, durations, strict=True):
        busy[inst.stage] += t
    energy = sum(o.energy_j for o in chosen) + sum(p * (time_s - b) for p, b in zip(p_blk, busy, strict=True))
    return Plan(
        frequencies_mhz={inst: o.frequency_mhz for inst, o in zip(dag.instructions, chosen, strict=True)},
        iteration_time_s=time_s,
        energy_j=energy,
        schedule=dag.schedule,
    )


class _Problem:
    """Per-node Pareto options (index `levels[v]`, fastest first) and the slack-based search over them.

    The search state is `levels`, durations `d`, earliest starts `es` and latest starts `ls` against the
    deadline; a node's slack is `ls[v] - es[v]`, and lengthening it by at most that keeps the deadline.
    """

    def __init__(self, dag: PipelineDAG, options: OptionTable, p_blk_w: float | Sequence[float]) -> None:
        _check_options(dag, options)
        self.dag = dag
        self.p_blk = _per_stage(p_blk_w, dag.num_stages)
        by_type = {key: pareto_options(opts, self.p_blk[key[0]]) for key, opts in options.items()}
        self.opts = [by_type[i.stage, i.kind] for i in dag.instructions]
        self.times = [[o.time_s for o in opts] for opts in self.opts]
        self.costs = [
            [o.energy_j - self.p_blk[inst.stage] * o.time_s for o in opts]
            for inst, opts in zip(dag.instructions, self.opts, strict=True)
        ]
        self.preds = [dag.predecessors(v) for v in range(len(dag))]
        self.succs = [dag.successors(v) for v in range(len(dag))]
        self.pred_delays = dag.predecessor_delays()
        self.succ_delays = dag.successor_delays()
        self.sinks = [v for v in range(len(dag)) if not self.succs[v]]
        self.fastest_time_s = dag.iteration_time([t[0] for t in self.times])
        self.slowest_time_s = dag.iteration_time([t[-1] for t in self.times])
        self.max_frequency_plan = max_frequency_plan(dag, options, self.p_blk)
        self.max_frequency_time_s = self.max_frequency_plan.iteration_time_s

    def plan(self, levels: Sequence[int]) -> Plan:
        return _make_plan(self.dag, self.p_blk, [opts[k] for opts, k in zip(self.opts, levels, strict=True)])

    def feasible(self, levels: Sequence[int], target_time_s: float) -> bool:
        """Whether the plan's iteration time is within `target_time_s`."""
        durations = [t[k] for t, k in zip(self.times, levels, strict=True)]
        return self.dag.iteration_time(durations) <= target_time_s * (1 + _REL_TOL)

    def best_plan(
        self, target_time_s: float, start: Sequence[int], max_passes: int, node_limit: int
    ) -> tuple[list[int], Plan]:
        """The priced greedy from `start` (feasible under the target), then `exact.refine`: the levels and the
        plan, with its proven gap (also logged)."""
        from zeus_callbacks.core.pipeline_frequency.exact import GAP_GOAL, refine

        levels = list(start)
        # Local search pays off more from the relaxation's rounded plan than from the greedy: only there.
        self.optimize(levels, target_time_s, priced=True, max_passes=0)
        levels, bound = refine(self, levels, target_time_s, node_limit, max_passes)
        plan = self.plan(levels)
        energy = plan.energy_j
        gap = max(0.0, energy / bound - 1) if bound > 0 else float("inf")
        log = logger.info if gap > GAP_GOAL else logger.debug
        log(
            "Plan for target %.6g s: %.6g J, proven within %.3g %% of the optimum.",
            target_time_s,
            energy,
            100 * gap,
        )
        return levels, dataclasses.replace(plan, proven_gap=gap)

    def optimize(self, levels: list[int], target_time_s: float, priced: bool, max_passes: int) -> None:
        """Improve `levels` in place: least energy with the iteration time within `target_time_s`.

        A greedy slow-down (`_fill`), then passes of two local moves, each kept only if the energy drops:
        an *exchange* speeds one node up (one level, or back to its fastest option), freezes it and greedily
        hands the freed slack to the others, which fixes the greedy's mistake of spending slack that several
        paths share on one node; an *ejection* slows one node down past its slack and makes room by speeding
        up the cheapest nodes on the paths that overrun, which fixes its knapsack-like mistakes with coarse
        options. Priced, iteration time costs the total blocking power per second, so the deadline is only
        used where slowing down saves more than the blocking energy of a longer iteration; unpriced, the search
        minimises the effective energy alone, as if the iteration always took the full deadline.
        """
        n = len(levels)
        self.price = sum(self.p_blk) if priced else 0.0
        self.deadline = target_time_s
        self.tol = target_time_s * _REL_TOL
        self.levels = levels
        self.d = [self.times[v][levels[v]] for v in range(n)]
        self.total_cost = sum(self.costs[v][levels[v]] for v in range(n))
        self.es = [0.0] * n
        self.ls = [0.0] * n
        self._forward(range(n))
        self._backward(range(n))
        # A start that overruns the deadline (HiGHS' plans can, by its feasibility tolerance) is sped up first.
        self._repair(set(range(n)), frozen=-1)
        self._fill(range(n), frozen=-1)
        eject = sum(len(t) for t in self.times) <= _EJECT_MAX_WORK
        for _ in range(max_passes):
            if not (
                self._pass(self._exchange, slower=False) or (eject and self._pass(self._eject, slower=True))
            ):
                break

    def _pass(self, move: Callable[[int, int], bool], slower: bool) -> bool:
        """Try `move` on every node: one level slower (or faster), then to the slowest (or fastest) level."""
        improved = False
        for v in range(len(self.levels)):
            level, last = self.levels[v], len(self.times[v]) - 1
            targets = (level + 1, last) if slower else (level - 1, 0)
            for k in dict.fromkeys(targets):
                if 0 <= k <= last and k != level and move(v, k):
                    improved = True
                    break
        return improved

    def sweep(self, deadlines: Sequence[float], max_passes: int) -> list[Plan]:
        """Unpriced plans for increasing deadlines, each search starting from the previous plan."""
        levels = [0] * len(self.dag)
        plans = []
        for deadline in sorted(deadlines):
            self.optimize(levels, deadline, priced=False, max_passes=max_passes)
            plans.append(self.plan(levels))
        return plans

    def _makespan(self) -> float:
        return max(self.es[v] + self.d[v] for v in self.sinks)

    def _objective(self) -> float:
        return self.total_cost + self.price * self._makespan()

    def _snapshot(self) -> tuple:
        return self.levels[:], self.d[:], self.es[:], self.ls[:], self.total_cost

    def _restore(self, saved: tuple) -> None:
        self.levels[:], self.d[:], self.es[:], self.ls[:], self.total_cost = saved

    def _keep_if_better(self, before: float, saved: tuple) -> bool:
        if self._objective() < before - 1e-12 * (1 + abs(before)):
            return True
        self._restore(saved)
        return False

    def _exchange(self, v: int, level: int) -> bool:
        """Speed `v` up to `level`, refill the freed slack without `v`; keep it if the energy drops."""
        saved, before = self._snapshot(), self._objective()
        self._fill(self._set_level(v, level), frozen=v)
        return self._keep_if_better(before, saved)

    def _eject(self, v: int, level: int) -> bool:
        """Slow `v` down to `level`, speeding up others until the deadline holds; keep it if the energy drops."""
        saved, before = self._snapshot(), self._objective()
        touched = self._repair(self._set_level(v, level), frozen=v)
        if any(self.es[u] - self.ls[u] > self.tol for u in touched):
            self._restore(saved)
            return False
        self._fill(touched, frozen=-1)
        return self._keep_if_better(before, saved)

    def _repair(self, touched: set[int], frozen: int) -> set[int]:
        """Speed up nodes that overrun the deadline (all but `frozen`), cheapest per second first, until none
        does or none can; returns `touched` with every node whose slack changed."""
        times, costs, levels, d, es, ls = self.times, self.costs, self.levels, self.d, self.es, self.ls
        while True:
            best = (float("inf"), -1, -1)
            for u in [u for u in touched if es[u] - ls[u] > self.tol and u != frozen]:
                excess = es[u] - ls[u]
                cur = levels[u]
                for k in range(cur):
                    ratio = (costs[u][k] - costs[u][cur]) / min(d[u] - times[u][k], excess)
                    if ratio < best[0]:
                        best = (ratio, u, k)
            if best[1] < 0:
                return touched
            touched |= self._set_level(best[1], best[2])

    def _set_level(self, v: int, level: int) -> set[int]:
        """Change node `v`'s option and refresh the schedule; returns nodes whose slack changed."""
        self.total_cost += self.costs[v][level] - self.costs[v][self.levels[v]]
        self.levels[v] = level
        self.d[v] = self.times[v][level]
        touched = self._forward(self.succs[v])
        touched |= self._backward([v])
        touched.add(v)
        return touched

    def _best_step(self, v: int, makespan: float) -> tuple[float, int]:
        """Best (energy saved per added second, level) among slow-downs within `v`'s slack.

        Energy saved is the drop in effective energy less the blocking energy of any growth of the iteration.
        """
        times, costs, level = self.times[v], self.costs[v], self.levels[v]
        room = self.ls[v] - self.es[v] + self.tol
        t0, c0 = times[level], costs[level]
        through = self.es[v] + self.deadline - self.ls[v]  # longest path through v
        best_ratio, best_level = 0.0, -1
        for k in range(level + 1, len(times)):
            dt = times[k] - t0
            if dt > room:
                break
            saved = c0 - costs[k] - self.price * max(0.0, through + dt - makespan)
            if saved > best_ratio * dt:
                best_ratio, best_level = saved / dt, k
        return best_ratio, best_level

    def _fill(self, candidates: Iterable[int], frozen: int) -> None:
        """Greedily slow down nodes (all but `frozen`) within their slack, best saving per second first.

        Slack only shrinks while filling (and the iteration only grows), so a queued priority can only be
        too high: a popped entry is re-checked and re-queued at its current value when it dropped.
        """
        makespan = self._makespan()
        heap = []
        for v in candidates:
            if v != frozen:
                ratio, k = self._best_step(v, makespan)
                if k >= 0:
                    heap.append((-ratio, v, self.levels[v]))
        heapq.heapify(heap)
        while heap:
            neg_ratio, v, level = heapq.heappop(heap)
            if level != self.levels[v]:
                continue
            ratio, k = self._best_step(v, makespan)
            if k < 0:
                continue
            if ratio < -neg_ratio:
                heapq.heappush(heap, (-ratio, v, level))
                continue
            self._set_level(v, k)
            makespan = self._makespan()
            ratio, k = self._best_step(v, makespan)
            if k >= 0:
                heapq.heappush(heap, (-ratio, v, self.levels[v]))

    def _forward(self, start: Iterable[int]) -> set[int]:
        """Recompute earliest starts from `start` downstream; returns the nodes that moved.

        Node numbers are topological, so popping the smallest first settles each node once.
        """
        es, d, preds, succs, delays = self.es, self.d, self.preds, self.succs, self.pred_delays
        todo = list(set(start))
        queued = set(todo)
        heapq.heapify(todo)
        changed = set()
        while todo:
            v = heapq.heappop(todo)
            new = max([es[u] + d[u] + x for u, x in zip(preds[v], delays[v])], default=0.0)  # noqa: B905
            if new != es[v]:
                es[v] = new
                changed.add(v)
                for w in succs[v]:
                    if w not in queued:
                        queued.add(w)
                        heapq.heappush(todo, w)
        return changed

    def _backward(self, start: Iterable[int]) -> set[int]:
        """Recompute latest starts from `start` upstream; returns the nodes that moved."""
        ls, d, preds, succs, delays = self.ls, self.d, self.preds, self.succs, self.succ_delays
        todo = [-v for v in set(start)]
        queued = {-v for v in todo}
        heapq.heapify(todo)
        changed = set()
        while todo:
            v = -heapq.heappop(todo)
            new = min([ls[w] - x for w, x in zip(succs[v], delays[v])], default=self.deadline) - d[v]  # noqa: B905
            if new != ls[v]:
                ls[v] = new
                changed.add(v)
                for u in preds[v]:
                    if u not in queued:
                        queued.add(u)
                        heapq.heappush(todo, -u)
        return changed
