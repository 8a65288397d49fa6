"""The Perseus problem as an integer program solved by HiGHS: the exact reference, and the planner's certificate.

One binary per instruction and option (exactly one chosen per instruction), a continuous start time per
instruction, and the iteration time `T`: every DAG edge `(u, v)` needs `start[u] + d[u] + delay <= start[v]`,
every instruction ends by `T <= target`. The objective is the planner's energy model at `T`,
`sum(e - P_blk[s] * t) + T * sum(P_blk)` (see `frontier`), minimised by HiGHS (`highs.branch_and_bound`: the
build scipy bundles, with the dual bound that `scipy.optimize.milp` drops when a node limit stops a run
without a plan).

Two uses:

- `exact_plan` solves it over every profiled option to a tight gap: the reference that tests and benchmarks
  measure the planner against. Beyond small pipelines it takes minutes, or does not finish.
- `refine` serves the planner (`frontier.solve`, `frontier.frontier`). The LP relaxation of this program
  is the time-cost tradeoff over each instruction's lower convex hull of options, solved in well under a
  second at 8 stages x 32 microbatches; its optimum is a lower bound on every plan, so it *proves* how far a
  plan is from the optimum. Its durations, rounded to the next faster option, are a feasible start that the
  planner's local search improves (usually better than the greedy alone). That plan is typically 0.1-0.2 %
  above the LP bound at every target on profiles with many clocks (issue 36: A40-like profiles with a flat,
  power-capped top), while the optimum lies in between; the LP alone cannot tell. So, while the proven gap
  is above `GAP_GOAL`, HiGHS' branch and bound is asked whether any plan is `GAP_GOAL` cheaper than the best
  (`_Program.cheaper_than`: an objective cutoff, with reduced-cost fixing from the LP): its cuts at the root
  usually answer "none" within a few nodes, which proves the best plan within `GAP_GOAL`. When they do not,
  branch and bound searches for the cheapest plan among those below that cutoff, with a node limit; the
  plan it finds becomes the best, and its dual bound is the proof (also that of a question the node limit
  stopped: the bound HiGHS reached counts, though no plan was found). Small programs (`_SMALL_BINARIES`) are
  searched first, which usually closes the gap alone there. On programs above `_MAX_BINARIES` (e.g. 8
  stages x 24 microbatches x 75 clocks) a search of the whole program is too slow to help, and the question
  about the rounded plan is often too hard (the root lifts the bound 0.05-0.07 % above the LP's, the plan
  is up to 0.2 % above it): the cheaper plan is sought twice among the options within `_NEIGHBOURHOOD`
  clocks of the LP's and the best plan's (half the binaries at 8 x 24), then the question is asked about the
  plan found. Programs above `_MAX_PROVABLE_BINARIES` (8 x 48 x 75) keep the LP's bound: there that work
  took half an hour per target and proved 0.142 %, not 0.1 %.

The planner's search is bounded by work (branch-and-bound nodes), never by seconds: HiGHS is deterministic
for a given node limit, so the same profile gives the same plan, and the same proven gap, on an idle and on a
loaded machine (a time limit made both depend on the host's speed: issue 24).

scipy is optional (the `pipeline` extra): without it `refine` is unavailable and the planner is heuristic.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, PipelineDAG, build_dag
from zeus_callbacks.core.pipeline_frequency.energy_model import options_of
from zeus_callbacks.core.pipeline_frequency.frontier import OptionTable, Plan, evaluate
from zeus_callbacks.core.pipeline_frequency.highs import (
    MipModel,
    MipOptions,
    MipResult,
    MipStatus,
    branch_and_bound,
)

if TYPE_CHECKING:
    from zeus_callbacks.core.pipeline_frequency.plan_search import PlanSearch

__all__ = ["GAP_GOAL", "exact_plan", "lower_bound", "refine", "scipy_available", "slow_to_prove"]

logger = logging.getLogger(__name__)

GAP_GOAL = 1e-3
"""Relative distance to the optimum (0.1 %) below which the planner stops improving a plan."""
# Programs of at most this many option binaries (after Pareto filtering) are searched whole for a plan 0.1 %
# cheaper than the best (`_Program.cheaper_than`); on larger ones a full search is slower than it is useful
# (at 8x24, 14,496 binaries, its first 10 nodes took 100 s), so the cheaper plan is sought among the options
# within `_NEIGHBOURHOOD` clocks of the LP's and the best plan's, and the whole program is only asked the
# cutoff question, whose root cuts lift the bound 0.05-0.07 % above the LP's in 20-60 s there (issue 36, stop
# 39; stop 38 found that neither an incremental formulation nor a sub-program of the LP's options alone moves
# the bound).
_MAX_BINARIES = 8000
# At 5 clocks the two neighbourhood searches stalled 0.165 % above the LP on one 8x24 frontier point (more rounds
# did not help); at 10 they reach 0.153 %, which the question then proves within 0.1 % in seconds.
_NEIGHBOURHOOD = 10
# Programs above this many option binaries keep the LP's bound, in seconds: at 8x48 (28,992) the neighbourhood
# searches and the question took 29 minutes of CPU for one target and proved 0.142 % (the LP: 0.212 %; stop 39,
# with 5-clock neighbourhoods and scipy's `milp`, 35 minutes for nothing beyond the LP); 8x24 (14,496) is
# proven within 0.1 % at every target in minutes. Nothing else tried at 8x48 reached 0.1 % either (stops 41-42:
# HiGHS' own heuristics, neighbourhood and window searches, relax-and-fix, a plan tiled from 8x24, highspy 1.16,
# rows bounding the LP's tight paths): the plans stay 0.19-0.21 % above the LP and the bound 0.065-0.078 % above
# it, 0.127 % proven at best after 17 minutes; a 0.1 % proof needs a plan within 0.18 % or a bound beyond the root's.
_MAX_PROVABLE_BINARIES = 16000
# Nodes of `_prove`'s first question on mid-sized programs; programs of at most `_SMALL_BINARIES` option
# binaries are searched first.
_FIRST_NODES = 10
_SMALL_BINARIES = 1000
# What `cheaper_than` is asked to prove: a hair inside `GAP_GOAL`, so that rounding never reports 0.1000001 %.
_PROOF_GAP = GAP_GOAL * (1 - 1e-6)


def scipy_available() -> bool:
    """Whether `scipy.optimize.milp` (HiGHS) can be imported."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


def slow_to_prove(problem: PlanSearch) -> bool:
    """Whether `problem`'s program has more than `_MAX_BINARIES` option binaries and at most
    `_MAX_PROVABLE_BINARIES`: `refine` then takes minutes per plan, not seconds (e.g. 8 stages x 24
    microbatches x 75 clocks: 2-5 minutes). Larger programs keep the LP's bound, in seconds."""
    return _MAX_BINARIES < problem.tables.num_options <= _MAX_PROVABLE_BINARIES


def exact_plan(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
    target_time_s: float,
    time_limit_s: float | None = None,
    mip_rel_gap: float = 1e-7,
) -> Plan | None:
    """The least-energy plan whose iteration time is at most `target_time_s`, solved exactly.

    Every profiled option is a candidate (no Pareto filtering), so the result does not rely on the
    planner's own reasoning. The returned plan is re-evaluated with `evaluate`.

    Args:
        dag: The iteration's DAG or per-stage schedule.
        options: Profiled options of each `(stage, kind)`.
        p_blk_w: Blocking power (W): one value, or one per stage.
        target_time_s: Deadline on the iteration time (s).
        time_limit_s: HiGHS time limit, for benchmarks only (a plan that depends on the host's speed);
            None: no limit.
        mip_rel_gap: HiGHS relative optimality gap.

    Returns:
        The optimal plan, or None if the target is infeasible or HiGHS stopped without a proven optimum.
    """
    dag = dag if isinstance(dag, PipelineDAG) else build_dag(dag)
    p_blk = [float(p_blk_w)] * dag.num_stages if isinstance(p_blk_w, int | float) else list(p_blk_w)
    choices = []
    for inst in dag.instructions:
        by_freq = {o.frequency_mhz: o for o in options_of(options, inst)}
        choices.append([by_freq[f] for f in sorted(by_freq)])
    program = _Program.build(
        dag,
        [[o.time_s for o in opts] for opts in choices],
        [
            [o.energy_j - p_blk[inst.stage] * o.time_s for o in opts]
            for inst, opts in zip(dag.instructions, choices, strict=True)
        ],
        sum(p_blk),
        target_time_s,
    )
    result = program.solve(mip_rel_gap=mip_rel_gap, time_limit_s=time_limit_s)
    if result.status is not MipStatus.OPTIMAL or result.x is None:
        return None
    levels = program.levels(result.x)
    freqs = {
        inst: choices[v][k].frequency_mhz
        for v, (inst, k) in enumerate(zip(dag.instructions, levels, strict=True))
    }
    return evaluate(dag, options, p_blk, freqs)


def lower_bound(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
    target_time_s: float,
) -> float:
    """A lower bound (J) on the energy of every plan within `target_time_s`: the LP relaxation's optimum.

    Raises:
        ValueError: On invalid options or an infeasible target.
    """
    from zeus_callbacks.core.pipeline_frequency.energy_model import as_dag
    from zeus_callbacks.core.pipeline_frequency.plan_search import SearchTables

    t = SearchTables.build(as_dag(dag), options, p_blk_w)
    program = _Program.build(t.dag, t.times, t.costs, sum(t.p_blk), target_time_s)
    relaxed = program.relaxation()
    if relaxed is None:
        raise ValueError(f"`lower_bound(target_time_s={target_time_s!r})`: no plan meets the target.")
    return relaxed.bound_j


def refine(
    problem: PlanSearch, levels: list[int], target_time_s: float, node_limit: int, max_passes: int
) -> tuple[list[int], float]:
    """A plan at least as good as `levels` under `target_time_s`, and a proven lower bound on the optimum.

    Tries the LP relaxation's durations rounded to the next faster option and improved by the planner's local
    search; then, while the best plan is not proven within `GAP_GOAL`, asks HiGHS' branch and bound for a
    plan `GAP_GOAL` cheaper (`_prove`). Nothing depends on the clock: the same inputs give the same result.

    Args:
        problem: The planner's problem (Pareto options per instruction, fastest first).
        levels: A feasible plan (option index per instruction) to improve on; not modified.
        target_time_s: Deadline on the iteration time (s).
        node_limit: HiGHS branch-and-bound node limit (`mip_max_nodes`) per question (0: never asked).
        max_passes: Local-search passes after rounding.

    Returns:
        The best levels found and a lower bound on the energy (J) of every plan within the deadline.
    """
    t = problem.tables
    program = _Program.build(t.dag, t.times, t.costs, sum(t.p_blk), target_time_s)
    best = _Incumbent(problem, target_time_s, list(levels))
    relaxed = program.relaxation()
    if relaxed is None:
        return best.levels, -np.inf
    rounded = program.rounded_down(relaxed.x, t.times)
    problem.optimize(rounded, target_time_s, priced=True, max_passes=max_passes)
    best.offer(rounded, repair=False)
    bound = relaxed.bound_j
    if node_limit > 0 and program.first[-1] <= _MAX_PROVABLE_BINARIES:
        bound = _prove(program, relaxed, best, node_limit)
    return best.levels, bound


def _prove(program: _Program, relaxed: _Relaxation, best: _Incumbent, node_limit: int) -> float:
    """Improve `best` and the bound until it is proven within `GAP_GOAL`, with at most three calls of branch
    and bound (`cheaper_than`), each for at most `node_limit` nodes. A *question* asks whether any plan is
    `GAP_GOAL` cheaper than the best ("none" proves it, as the root's cuts usually answer); a *search* looks for
    the cheapest plan (its dual bound is a proof, and its plan the new best); a *neighbourhood* search looks for
    it among the options near the LP's and the best plan's (no proof). Small programs are searched, then asked;
    mid-sized ones asked (in at most `_FIRST_NODES` nodes), searched, and asked about the plan found; programs
    above `_MAX_BINARIES` are searched in the neighbourhood twice (the second time around the plan the first
    found), then asked. Returns the bound proven."""
    bound = relaxed.bound_j
    size = program.first[-1]
    if size <= _SMALL_BINARIES:
        steps = [_Step.SEARCH, _Step.QUESTION]
    elif size <= _MAX_BINARIES:
        steps = [_Step.FIRST_QUESTION, _Step.SEARCH, _Step.QUESTION]
    else:
        steps = [_Step.NEIGHBOURHOOD, _Step.NEIGHBOURHOOD, _Step.QUESTION]
    for step in steps:
        if best.energy_j <= bound * (1 + GAP_GOAL):
            break
        nodes = min(node_limit, _FIRST_NODES) if step is _Step.FIRST_QUESTION else node_limit
        near = best.levels if step is _Step.NEIGHBOURHOOD else None
        prove_only = step in (_Step.FIRST_QUESTION, _Step.QUESTION)
        found, dual = program.cheaper_than(best.energy_j / (1 + _PROOF_GAP), relaxed, nodes, prove_only, near)
        bound = max(bound, dual)
        best.offer(found)
    return bound


class _Step(enum.Enum):
    """One call of branch and bound in `_prove`."""

    FIRST_QUESTION = "first question"  # the question, for at most `_FIRST_NODES` nodes
    QUESTION = "question"
    SEARCH = "search"
    NEIGHBOURHOOD = "neighbourhood search"


class _Incumbent:
    """The best plan found under the deadline: its levels and energy."""

    def __init__(self, problem: PlanSearch, target_time_s: float, levels: list[int]) -> None:
        self._problem, self._target_s = problem, target_time_s
        self.levels, self.energy_j = levels, problem.plan(levels).energy_j

    def offer(self, levels: list[int] | None, repair: bool = True) -> None:
        """Keep `levels` if it meets the deadline with less energy. With `repair` (HiGHS' plans: HiGHS meets
        the deadline to its feasibility tolerance) a hair's overrun is sped up first, and slack filled."""
        if levels is None:
            return
        if repair:
            self._problem.optimize(levels, self._target_s, priced=True, max_passes=0)
        energy = self._problem.plan(levels).energy_j
        if energy < self.energy_j and self._problem.feasible(levels, self._target_s):
            self.levels, self.energy_j = levels, energy


@dataclass(frozen=True)
class _Relaxation:
    """The LP relaxation's optimum: its value (a lower bound, J), solution and reduced costs."""

    bound_j: float
    x: np.ndarray
    reduced_costs: np.ndarray


@dataclass
class _Program:
    """The integer program's arrays: columns are the option binaries node by node, the start times, then T."""

    cost: np.ndarray
    matrix: Any
    lower: np.ndarray
    upper: np.ndarray
    col_upper: np.ndarray
    first: np.ndarray

    @classmethod
    def build(
        cls,
        dag: PipelineDAG,
        times: Sequence[Sequence[float]],
        costs: Sequence[Sequence[float]],
        price_w: float,
        target_time_s: float,
    ) -> _Program:
        from scipy.sparse import csr_matrix

        n = len(dag)
        first = np.cumsum([0] + [len(t) for t in times])
        num_x = int(first[-1])
        start_col, t_col = num_x, num_x + n
        cost = np.zeros(t_col + 1)
        cost[:num_x] = np.concatenate([np.asarray(c, dtype=float) for c in costs])
        cost[t_col] = price_w
        flat_times = np.concatenate([np.asarray(t, dtype=float) for t in times])
        delays = dag.edge_delays()
        indptr: list[int] = [0]
        indices: list[int] = []
        data: list[float] = []
        lower: list[float] = []
        upper: list[float] = []

        def add_row(
            cols: list[int] | np.ndarray, vals: list[float] | np.ndarray, lo: float, hi: float
        ) -> None:
            indices.extend(cols)
            data.extend(vals)
            indptr.append(len(indices))
            lower.append(lo)
            upper.append(hi)

        for v in range(n):
            span = range(first[v], first[v + 1])
            add_row(list(span), [1.0] * len(span), 1.0, 1.0)
            # start[v] + d[v] - T <= 0
            add_row([start_col + v, *span, t_col], [1.0, *flat_times[span], -1.0], -np.inf, 0.0)
        for (u, v), delay in zip(dag.edges, delays, strict=True):
            span = range(first[u], first[u + 1])
            # start[u] + d[u] + delay - start[v] <= 0
            add_row([start_col + u, *span, start_col + v], [1.0, *flat_times[span], -1.0], -np.inf, -delay)
        matrix = csr_matrix((data, indices, indptr), shape=(len(lower), t_col + 1))
        col_upper = np.full(t_col + 1, np.inf)
        col_upper[:num_x] = 1.0
        col_upper[t_col] = target_time_s
        return cls(cost, matrix, np.array(lower), np.array(upper), col_upper, first)

    def solve(
        self, mip_rel_gap: float = 1e-7, node_limit: int | None = None, time_limit_s: float | None = None
    ) -> MipResult:
        """HiGHS' branch and bound on the program.

        `node_limit` bounds it by work; `time_limit_s` (the exact reference's benchmarks only) by the clock,
        which makes the result depend on the host's speed.
        """
        options = MipOptions(mip_rel_gap, node_limit=node_limit, time_limit_s=time_limit_s)
        return self._branch_and_bound(self.col_upper, None, options)

    def relaxation(self) -> _Relaxation | None:
        """The LP relaxation's optimum with its reduced costs (HiGHS through `linprog`); None if unsolved."""
        from scipy.optimize import linprog

        matrix = self.matrix.tocsr()
        equal = self.lower == self.upper
        args = {
            "A_ub": matrix[~equal],
            "b_ub": self.upper[~equal],
            "A_eq": matrix[equal],
            "b_eq": self.upper[equal],
            "bounds": np.column_stack([np.zeros(len(self.cost)), self.col_upper]),
            "method": "highs",
        }
        result = linprog(self.cost, **args)
        if result.status == 2:  # as in `_branch_and_bound`: presolve's wrong infeasibility
            result = linprog(self.cost, **args, options={"presolve": False})
        if result.status != 0 or result.x is None:
            logger.debug("LP relaxation not solved (HiGHS status %s).", result.status)
            return None
        return _Relaxation(float(result.fun), result.x, np.asarray(result.lower.marginals, dtype=float))

    def cheaper_than(
        self,
        cutoff_j: float,
        relaxed: _Relaxation,
        node_limit: int,
        prove_only: bool,
        near: Sequence[int] | None = None,
    ) -> tuple[list[int] | None, float]:
        """Branch and bound, for at most `node_limit` nodes, among the plans of energy below `cutoff_j`.

        Every option whose reduced cost alone lifts the relaxation above `cutoff_j` is left out (no plan
        that cheap can choose it). With `prove_only`, the program also gets the row `energy <= cutoff_j` and
        HiGHS' primal heuristics and presolve are off (heuristics cost most of the root's work and proving
        "none" needs none; a wrong "infeasible" from presolve, see `_branch_and_bound`, would be a false
        proof); otherwise HiGHS searches for the cheapest plan (to half of `GAP_GOAL`), and "infeasible" is
        only believed without presolve. With `near` (levels), the search is only among each node's options within
        `_NEIGHBOURHOOD` of the relaxation's and of `near`'s: a smaller program, whose answer proves nothing.

        Returns:
            The levels of the best plan found (None if none), and a lower bound on every plan's energy:
            `cutoff_j` when no plan is below it, else the lower of it and branch and bound's dual bound (-inf
            if HiGHS gives none, or with `near`).
        """
        from scipy.sparse import csr_matrix

        num_x = int(self.first[-1])
        slack = 1e-7 * (1.0 + abs(cutoff_j))  # the reduced costs are exact to HiGHS' tolerances only
        upper = self.col_upper.copy()
        upper[:num_x][relaxed.bound_j + relaxed.reduced_costs[:num_x] > cutoff_j + slack] = 0.0
        if near is not None:
            upper[:num_x][~self._near(relaxed.x, near)] = 0.0
        # A search stops at half the goal: HiGHS measures its gap from its own best plan, not from ours.
        options = MipOptions(GAP_GOAL / 2, node_limit=node_limit)
        row = None
        if prove_only:
            row = (csr_matrix(self.cost.reshape(1, -1)), -np.inf, cutoff_j)
            options = replace(options, presolve=False, heuristics=False)
        result = self._branch_and_bound(upper, row, options)
        found = None if result.x is None else self.levels(result.x)
        if near is not None:
            return found, -np.inf
        if result.status is MipStatus.INFEASIBLE:
            return None, cutoff_j
        # The bound HiGHS proved, also when the node limit stopped a question that found no plan (scipy's `milp`
        # drops it there, see `highs`: an 8x24 point then kept the LP's 0.165 % where HiGHS had proven 0.106 %).
        bound = min(result.dual_bound, cutoff_j) if np.isfinite(result.dual_bound) else -np.inf
        return found, bound

    def _near(self, x: np.ndarray, levels: Sequence[int]) -> np.ndarray:
        """Which option binaries lie within `_NEIGHBOURHOOD` options of the span of each node's options that
        `x` (the relaxation's solution) uses and of its option in `levels`."""
        keep = np.zeros(int(self.first[-1]), dtype=bool)
        for (a, b), level in zip(zip(self.first[:-1], self.first[1:], strict=True), levels, strict=True):
            used = np.flatnonzero(x[a:b] > 1e-9)
            lo = max(0, min(int(used.min(initial=level)), level) - _NEIGHBOURHOOD)
            hi = min(b - a - 1, max(int(used.max(initial=level)), level) + _NEIGHBOURHOOD)
            keep[a + lo : a + hi + 1] = True
        return keep

    def _branch_and_bound(
        self, col_upper: np.ndarray, row: tuple[Any, float, float] | None, options: MipOptions
    ) -> MipResult:
        """The program, with `row` (matrix, lower, upper) below its rows, under `options`. An "infeasible" with
        presolve on is checked again without it: HiGHS presolve (scipy 1.17) wrongly finds some models so."""
        from scipy.sparse import vstack

        matrix, lower, upper = self.matrix, self.lower, self.upper
        if row is not None:
            extra, lo, hi = row
            matrix, lower, upper = (
                vstack([matrix, extra], format="csc"),
                np.append(lower, lo),
                np.append(upper, hi),
            )
        model = MipModel(self.cost, matrix, lower, upper, col_upper, int(self.first[-1]))
        result = branch_and_bound(model, options)
        if result.status is MipStatus.INFEASIBLE and options.presolve:
            result = branch_and_bound(model, replace(options, presolve=False))
        return result

    def levels(self, x: np.ndarray) -> list[int]:
        """The option chosen for each node by an integral solution."""
        return [int(np.argmax(x[a:b])) for a, b in zip(self.first[:-1], self.first[1:], strict=True)]

    def rounded_down(self, x: np.ndarray, times: Sequence[Sequence[float]]) -> list[int]:
        """For each node the slowest option no slower than the relaxation's duration: feasible if it was."""
        out = []
        for (a, b), opts in zip(zip(self.first[:-1], self.first[1:], strict=True), times, strict=True):
            duration = float(np.dot(x[a:b], opts)) * (1 + 1e-12)
            out.append(max((k for k, t in enumerate(opts) if t <= duration), default=0))
        return out
