"""The slack-based search over each instruction's options behind `frontier.solve` and `frontier.frontier`.

`SearchTables`: what the DAG and the options give, built once; `PlanSearch`: a greedy slow-down within every
instruction's slack, then local search (exchanges and ejections), its state per target.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Callable, Iterable, Sequence

from zeus_callbacks.core.pipeline_frequency.dag import PipelineDAG
from zeus_callbacks.core.pipeline_frequency.energy_model import (
    REL_TOL,
    FrequencyOption,
    OptionTable,
    Plan,
    check_options,
    make_plan,
    max_frequency_plan,
    options_of,
    pareto_options,
    per_stage,
)

__all__ = ["PlanSearch", "SearchTables"]

logger = logging.getLogger("zeus_callbacks.core.pipeline_frequency.frontier")

# Ejections cost far more than exchanges and matter with few, coarse options per instruction: they run only
# when (instructions x options per instruction) is at most this.
_EJECT_MAX_WORK = 1000


@dataclasses.dataclass(frozen=True)
class SearchTables:
    """What the search reads and never changes, built once from the DAG: each node's Pareto options (fastest
    first), their times and effective energies, the DAG's adjacency and edge delays, and the iteration times
    of the all-fastest, all-slowest and all-maximum-frequency plans."""

    dag: PipelineDAG
    p_blk: list[float]
    opts: list[Sequence[FrequencyOption]]
    times: list[list[float]]
    costs: list[list[float]]
    preds: list[tuple[int, ...]]
    succs: list[tuple[int, ...]]
    pred_delays: list[tuple[float, ...]]
    succ_delays: list[tuple[float, ...]]
    sinks: list[int]
    fastest_time_s: float
    slowest_time_s: float
    max_frequency_plan: Plan

    @property
    def num_options(self) -> int:
        """Pareto options over all nodes: the exact program's option binaries (`exact`)."""
        return sum(len(node) for node in self.times)

    @classmethod
    def build(cls, dag: PipelineDAG, options: OptionTable, p_blk_w: float | Sequence[float]) -> SearchTables:
        """The tables of `dag` with `options` per instruction type and blocking power `p_blk_w` (per stage)."""
        check_options(dag, options)
        p_blk = per_stage(p_blk_w, dag.num_stages)
        by_type = {key: pareto_options(opts, p_blk[key[0]]) for key, opts in options.items()}
        opts = [options_of(by_type, i) for i in dag.instructions]
        times = [[o.time_s for o in node] for node in opts]
        succs = [dag.successors(v) for v in range(len(dag))]
        return cls(
            dag=dag,
            p_blk=p_blk,
            opts=opts,
            times=times,
            costs=[
                [o.energy_j - p_blk[inst.stage] * o.time_s for o in node]
                for inst, node in zip(dag.instructions, opts, strict=True)
            ],
            preds=[dag.predecessors(v) for v in range(len(dag))],
            succs=succs,
            pred_delays=dag.predecessor_delays(),
            succ_delays=dag.successor_delays(),
            sinks=[v for v in range(len(dag)) if not succs[v]],
            fastest_time_s=dag.iteration_time([t[0] for t in times]),
            slowest_time_s=dag.iteration_time([t[-1] for t in times]),
            max_frequency_plan=max_frequency_plan(dag, options, p_blk),
        )

    @property
    def max_frequency_time_s(self) -> float:
        """The all-maximum-frequency plan's iteration time (s)."""
        return self.max_frequency_plan.iteration_time_s


class PlanSearch:
    """The slack-based search over each node's Pareto options (`tables`, index `levels[v]`, fastest first).

    The search state is `levels`, durations `d`, earliest starts `es` and latest starts `ls` against the
    deadline; a node's slack is `ls[v] - es[v]`, and lengthening it by at most that keeps the deadline.
    """

    def __init__(self, dag: PipelineDAG, options: OptionTable, p_blk_w: float | Sequence[float]) -> None:
        self.tables = SearchTables.build(dag, options, p_blk_w)
        # The search's state, set by `optimize` for each target: each node's level and duration, earliest and
        # latest starts, the plan's effective energy, the price of a second, the deadline and its tolerance.
        self.levels: list[int] = []
        self.d: list[float] = []
        self.es: list[float] = []
        self.ls: list[float] = []
        self.total_cost = 0.0
        self.price = 0.0
        self.deadline = 0.0
        self.tol = 0.0

    def plan(self, levels: Sequence[int]) -> Plan:
        t = self.tables
        return make_plan(t.dag, t.p_blk, [opts[k] for opts, k in zip(t.opts, levels, strict=True)])

    def feasible(self, levels: Sequence[int], target_time_s: float) -> bool:
        """Whether the plan's iteration time is within `target_time_s`."""
        durations = [t[k] for t, k in zip(self.tables.times, levels, strict=True)]
        return self.tables.dag.iteration_time(durations) <= target_time_s * (1 + REL_TOL)

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
        self.price = sum(self.tables.p_blk) if priced else 0.0
        self.deadline = target_time_s
        self.tol = target_time_s * REL_TOL
        self.levels = levels
        self.d = [self.tables.times[v][levels[v]] for v in range(n)]
        self.total_cost = sum(self.tables.costs[v][levels[v]] for v in range(n))
        self.es = [0.0] * n
        self.ls = [0.0] * n
        self._forward(range(n))
        self._backward(range(n))
        # A start that overruns the deadline (HiGHS' plans can, by its feasibility tolerance) is sped up first.
        self._repair(set(range(n)), frozen=-1)
        self._fill(range(n), frozen=-1)
        eject = sum(len(t) for t in self.tables.times) <= _EJECT_MAX_WORK
        for _ in range(max_passes):
            if not (
                self._pass(self._exchange, slower=False) or (eject and self._pass(self._eject, slower=True))
            ):
                break

    def _pass(self, move: Callable[[int, int], bool], slower: bool) -> bool:
        """Try `move` on every node: one level slower (or faster), then to the slowest (or fastest) level."""
        improved = False
        for v in range(len(self.levels)):
            level, last = self.levels[v], len(self.tables.times[v]) - 1
            targets = (level + 1, last) if slower else (level - 1, 0)
            for k in dict.fromkeys(targets):
                if 0 <= k <= last and k != level and move(v, k):
                    improved = True
                    break
        return improved

    def sweep(self, deadlines: Sequence[float], max_passes: int) -> list[Plan]:
        """Unpriced plans for increasing deadlines, each search starting from the previous plan."""
        levels = [0] * len(self.tables.dag)
        plans = []
        for deadline in sorted(deadlines):
            self.optimize(levels, deadline, priced=False, max_passes=max_passes)
            plans.append(self.plan(levels))
        return plans

    def _makespan(self) -> float:
        return max(self.es[v] + self.d[v] for v in self.tables.sinks)

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
        t = self.tables
        times, costs, levels, d, es, ls = t.times, t.costs, self.levels, self.d, self.es, self.ls
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
        self.total_cost += self.tables.costs[v][level] - self.tables.costs[v][self.levels[v]]
        self.levels[v] = level
        self.d[v] = self.tables.times[v][level]
        touched = self._forward(self.tables.succs[v])
        touched |= self._backward([v])
        touched.add(v)
        return touched

    def _best_step(self, v: int, makespan: float) -> tuple[float, int]:
        """Best (energy saved per added second, level) among slow-downs within `v`'s slack.

        Energy saved is the drop in effective energy less the blocking energy of any growth of the iteration.
        """
        times, costs, level = self.tables.times[v], self.tables.costs[v], self.levels[v]
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
        t = self.tables
        es, d, preds, succs, delays = self.es, self.d, t.preds, t.succs, t.pred_delays
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
        t = self.tables
        ls, d, preds, succs, delays = self.ls, self.d, t.preds, t.succs, t.succ_delays
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
