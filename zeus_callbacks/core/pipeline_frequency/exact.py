"""The Perseus problem as an integer program solved by HiGHS: the exact reference, and the planner's certificate.

One binary per instruction and option (exactly one chosen per instruction), a continuous start time per
instruction, and the iteration time `T`: every DAG edge `(u, v)` needs `start[u] + d[u] + delay <= start[v]`,
every instruction ends by `T <= target`. The objective is the planner's energy model at `T`,
`sum(e - P_blk[s] * t) + T * sum(P_blk)` (see `frontier`), minimised by HiGHS through `scipy.optimize.milp`.

Two uses:

- `exact_plan` solves it over every profiled option to a tight gap: the reference that tests and benchmarks
  measure the planner against. Beyond small pipelines it takes minutes, or does not finish.
- `refine` serves the planner (`frontier.solve`, `frontier.frontier`). The LP relaxation of this program
  is the time-cost tradeoff over each instruction's lower convex hull of options, solved in well under a
  second at 8 stages x 32 microbatches; its optimum is a lower bound on every plan, so it *proves* how far a
  plan is from the optimum. Its durations, rounded to the next faster option, are a feasible start that the
  planner's local search improves (usually better than the greedy alone); when the proven gap is still above
  `GAP_GOAL`, HiGHS' branch and bound runs with `mip_rel_gap=GAP_GOAL` for at most a number of nodes and the
  better plan wins. Small pipelines are thereby solved to within `GAP_GOAL`; larger ones come with their
  proven gap.

The planner's search is bounded by work (branch-and-bound nodes), never by seconds: HiGHS is deterministic
for a given node limit, so the same profile gives the same plan, and the same proven gap, on an idle and on a
loaded machine (a time limit made both depend on the host's speed: issue 24).

scipy is optional (the `pipeline` extra): without it `refine` is unavailable and the planner is heuristic.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, PipelineDAG, build_dag
from zeus_callbacks.core.pipeline_frequency.energy_model import options_of
from zeus_callbacks.core.pipeline_frequency.frontier import OptionTable, Plan, evaluate

if TYPE_CHECKING:
    from zeus_callbacks.core.pipeline_frequency.plan_search import PlanSearch

__all__ = ["GAP_GOAL", "exact_plan", "lower_bound", "refine", "scipy_available"]

logger = logging.getLogger(__name__)

GAP_GOAL = 1e-3
"""Relative distance to the optimum (0.1 %) below which the planner stops improving a plan."""
# Branch and bound closes 0.1 % within a few dozen nodes up to about this many option binaries (small
# pipelines or few clocks: the exact test's programs need at most 25); on larger programs it does not within
# thousands of nodes, so it is not tried there.
_MAX_BINARIES = 1000


def scipy_available() -> bool:
    """Whether `scipy.optimize.milp` (HiGHS) can be imported."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


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
    result = program.solve(integral=True, mip_rel_gap=mip_rel_gap, time_limit_s=time_limit_s)
    if result.status != 0 or result.x is None:
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
    from zeus_callbacks.core.pipeline_frequency.plan_search import PlanSearch

    problem = PlanSearch(as_dag(dag), options, p_blk_w)
    program = _Program.build(problem.dag, problem.times, problem.costs, sum(problem.p_blk), target_time_s)
    result = program.solve(integral=False)
    if result.status != 0:
        raise ValueError(f"`lower_bound(target_time_s={target_time_s!r})`: no plan meets the target.")
    return float(result.fun)


def refine(
    problem: PlanSearch, levels: list[int], target_time_s: float, node_limit: int, max_passes: int
) -> tuple[list[int], float]:
    """A plan at least as good as `levels` under `target_time_s`, and a proven lower bound on the optimum.

    Tries the LP relaxation's durations rounded to the next faster option and improved by the planner's local
    search; then, if the best plan is still not proven within `GAP_GOAL`, HiGHS' branch and bound for at most
    `node_limit` nodes (0: never). Nothing depends on the clock: the same inputs give the same result.

    Args:
        problem: The planner's problem (Pareto options per instruction, fastest first).
        levels: A feasible plan (option index per instruction) to improve on; not modified.
        target_time_s: Deadline on the iteration time (s).
        node_limit: HiGHS branch-and-bound node limit (`mip_max_nodes`).
        max_passes: Local-search passes after rounding.

    Returns:
        The best levels found and a lower bound on the energy (J) of every plan within the deadline.
    """
    program = _Program.build(problem.dag, problem.times, problem.costs, sum(problem.p_blk), target_time_s)
    best, best_energy = list(levels), problem.plan(levels).energy_j
    relaxed = program.solve(integral=False)
    if relaxed.status != 0 or relaxed.x is None:
        logger.debug("LP relaxation not solved (HiGHS status %s).", relaxed.status)
        return best, -np.inf
    bound = float(relaxed.fun)
    rounded = program.rounded_down(relaxed.x, problem.times)
    problem.optimize(rounded, target_time_s, priced=True, max_passes=max_passes)
    energy = problem.plan(rounded).energy_j
    if energy < best_energy and problem.feasible(rounded, target_time_s):
        best, best_energy = rounded, energy
    if best_energy <= bound * (1 + GAP_GOAL) or node_limit <= 0 or program.first[-1] > _MAX_BINARIES:
        return best, bound
    result = program.solve(integral=True, mip_rel_gap=GAP_GOAL, node_limit=node_limit)
    if result.x is not None:
        found = program.levels(result.x)
        # HiGHS meets the deadline to its feasibility tolerance: repair a hair's overrun (and fill).
        problem.optimize(found, target_time_s, priced=True, max_passes=0)
        energy = problem.plan(found).energy_j
        if energy < best_energy and problem.feasible(found, target_time_s):
            best, best_energy = found, energy
    dual = getattr(result, "mip_dual_bound", None)
    if dual is not None and np.isfinite(dual):
        bound = max(bound, float(dual))
    return best, bound


@contextlib.contextmanager
def _quiet_stdout(active: bool) -> Iterator[None]:
    """Silence file descriptor 1 while active: scipy's HiGHS prints debug lines from C during branch and
    bound even with `disp=False`, which would corrupt a command's output (`pipeline-plan --json`)."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


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
        indptr, indices, data, lower, upper = [0], [], [], [], []

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
        self,
        integral: bool,
        mip_rel_gap: float = 1e-7,
        node_limit: int | None = None,
        time_limit_s: float | None = None,
    ) -> Any:
        """HiGHS on the program (or its LP relaxation); scipy's `OptimizeResult`.

        `node_limit` bounds branch and bound by work; `time_limit_s` (the exact reference's benchmarks only)
        by the clock, which makes the result depend on the host's speed.
        """
        from scipy.optimize import Bounds, LinearConstraint, milp

        integrality = np.zeros(len(self.cost))
        if integral:
            integrality[: self.first[-1]] = 1
        options: dict[str, Any] = {"disp": False, "mip_rel_gap": mip_rel_gap}
        if node_limit is not None:
            options["node_limit"] = int(node_limit)
        if time_limit_s is not None:
            options["time_limit"] = float(time_limit_s)
        args = {
            "constraints": LinearConstraint(self.matrix, self.lower, self.upper),
            "integrality": integrality,
            "bounds": Bounds(np.zeros(len(self.cost)), self.col_upper),
        }
        with _quiet_stdout(integral):
            result = milp(self.cost, **args, options=options)
            if result.status == 2:  # HiGHS presolve (scipy 1.17) wrongly finds some models infeasible.
                result = milp(self.cost, **args, options={**options, "presolve": False})
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
