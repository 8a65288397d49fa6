"""Exact reference for the frequency planner: the Perseus problem as an integer program (needs scipy, dev only).

One binary per instruction and profiled option (exactly one chosen per instruction), a continuous start time
per instruction, and the iteration time `T`: every DAG edge `(u, v)` needs `start[u] + d[u] <= start[v]`,
every instruction ends by `T <= target`. The objective is the planner's energy model at `T`,
`sum(e - P_blk[s] * t) + T * sum(P_blk)` (see `frontier`), minimised by HiGHS through `scipy.optimize.milp`.
Tests and benchmarks use it to measure how far `solve` and `frontier` are from the optimum; it is far too
slow for the product beyond small pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, PipelineDAG, build_dag
from zeus_callbacks.core.pipeline_frequency.frontier import OptionTable, Plan, evaluate

__all__ = ["exact_plan"]


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
        time_limit_s: HiGHS time limit; None: no limit.
        mip_rel_gap: HiGHS relative optimality gap.

    Returns:
        The optimal plan, or None if the target is infeasible or HiGHS stopped without a proven optimum.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    dag = dag if isinstance(dag, PipelineDAG) else build_dag(dag)
    n = len(dag)
    p_blk = [float(p_blk_w)] * dag.num_stages if isinstance(p_blk_w, int | float) else list(p_blk_w)
    choices = []
    for inst in dag.instructions:
        by_freq = {o.frequency_mhz: o for o in options[inst.stage, inst.kind]}
        choices.append([by_freq[f] for f in sorted(by_freq)])
    # Columns: the option binaries, node by node, then the start times, then T.
    first = np.cumsum([0] + [len(c) for c in choices])
    num_x = int(first[-1])
    start_col = num_x
    t_col = num_x + n
    num_cols = t_col + 1
    cost = np.zeros(num_cols)
    for v, (inst, opts) in enumerate(zip(dag.instructions, choices, strict=True)):
        for k, o in enumerate(opts):
            cost[first[v] + k] = o.energy_j - p_blk[inst.stage] * o.time_s
    cost[t_col] = sum(p_blk)

    rows, cols, vals, lo, hi = [], [], [], [], []

    def add_row(entries: list[tuple[int, float]], lower: float, upper: float) -> None:
        r = len(lo)
        for c, x in entries:
            rows.append(r)
            cols.append(c)
            vals.append(x)
        lo.append(lower)
        hi.append(upper)

    def duration(v: int) -> list[tuple[int, float]]:
        return [(first[v] + k, o.time_s) for k, o in enumerate(choices[v])]

    delays = dag.edge_delays() if hasattr(dag, "edge_delays") else [0.0] * len(dag.edges)
    for v in range(n):
        add_row([(first[v] + k, 1.0) for k in range(len(choices[v]))], 1.0, 1.0)
        # start[v] + d[v] - T <= 0
        add_row([(start_col + v, 1.0), *duration(v), (t_col, -1.0)], -np.inf, 0.0)
    for (u, v), delay in zip(dag.edges, delays, strict=True):
        # start[u] + d[u] + delay - start[v] <= 0
        add_row([(start_col + u, 1.0), *duration(u), (start_col + v, -1.0)], -np.inf, -delay)
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), num_cols)).tocsr()
    integrality = np.zeros(num_cols)
    integrality[:num_x] = 1
    upper = np.full(num_cols, np.inf)
    upper[:num_x] = 1
    upper[t_col] = target_time_s
    opts = {"mip_rel_gap": mip_rel_gap, "disp": False}
    if time_limit_s is not None:
        opts["time_limit"] = time_limit_s
    args = {
        "constraints": LinearConstraint(matrix, lo, hi),
        "integrality": integrality,
        "bounds": Bounds(np.zeros(num_cols), upper),
    }
    result = milp(cost, **args, options=opts)
    if result.status == 2:  # HiGHS presolve (scipy 1.17) wrongly finds some of these models infeasible.
        result = milp(cost, **args, options={**opts, "presolve": False})
    if result.status != 0 or result.x is None:
        return None
    freqs = {}
    for v, inst in enumerate(dag.instructions):
        k = int(np.argmax(result.x[first[v] : first[v + 1]]))
        freqs[inst] = choices[v][k].frequency_mhz
    return evaluate(dag, options, p_blk, freqs)
