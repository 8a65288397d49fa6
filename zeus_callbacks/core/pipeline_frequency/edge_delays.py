"""The time between pipeline instructions, measured in the job: the DAG's edge delays and the step's overhead.

An instruction `v` starts once each predecessor `u` in the DAG has ended and, after it, `delay(u, v)` has
passed: between stages, the point-to-point communication (send, transfer, receive, and the schedule's own
host time around them); within a stage, the host's time between two of its instructions. So every
measured instance gives `start[v] - end[u] >= delay(u, v)`, with equality where `v` waited for `u` (the
stage was blocked on that input, or was free). The gaps of the input that arrived last therefore measure
the delay of each kind of edge. An edge that never bound (a stage's forward to its backward, where the
stage always waited for the next stage's gradient) holds that wait, the stage's slack, in every gap: it
gets the least delay measured between its stages, not its least gap, or the plan would find no slack.

Kinds of edges: `(from stage, from kind, to stage, to kind)`, e.g. stage 0's forward to stage 1's forward
(the activations sent over that link) or stage 1's backward to its own forward (host time in between).

Instruction starts are compared across ranks on `time.monotonic()`, which ranks on one host share. Across
hosts the clocks differ by an unknown offset that adds to one direction of a link and subtracts from the
other, so such a link's delay is the mean of its two directions' estimates (activations and their
gradients have the same size), which cancels the offset.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, PipelineDAG
from zeus_callbacks.core.pipeline_frequency.recorder import StepTimeline, undisturbed_estimate

__all__ = ["EdgeKind", "EdgeDelays", "edge_kind", "measure_edge_delays"]

logger = logging.getLogger(__name__)

STEP = "step"  # the "kind" of the step's overhead in `EdgeDelays.to_rows`

EdgeKind = tuple[int, str, int, str]
"""`(from stage, from kind, to stage, to kind)` of a DAG edge; kinds `"forward"`/`"backward"`."""


@dataclass(frozen=True)
class EdgeDelays:
    """Measured delay (s) of each kind of DAG edge, and the step's time outside the DAG.

    `step_overhead_s` is the time of a step (its slowest rank's, as the pipeline's) beyond the span of the
    first stage's instructions (the first stage runs the iteration's first and last): predicted step time =
    the DAG's longest path + `step_overhead_s`.
    """

    delays_s: Mapping[EdgeKind, float] = field(default_factory=dict)
    step_overhead_s: float = 0.0

    def delay_s(self, u: Instruction, v: Instruction) -> float:
        """The delay of edge `u -> v` (0 for a kind of edge that was not measured)."""
        return self.delays_s.get((u.stage, u.kind, v.stage, v.kind), 0.0)

    def apply(self, dag: PipelineDAG) -> PipelineDAG:
        """`dag` with these delays on its edges."""
        return dag.with_edge_delays(self.delay_s) if self.delays_s else dag

    def to_rows(self) -> list[tuple[int, str, int, str, float]]:
        """Plain rows `(from stage, from kind, to stage, to kind, delay s)`, sorted; the step's overhead is
        the row `(0, "step", 0, "step", overhead s)`."""
        rows = [(*kind, float(d)) for kind, d in sorted(self.delays_s.items())]
        return [*rows, (0, STEP, 0, STEP, float(self.step_overhead_s))]

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[Any]]) -> EdgeDelays:
        """The inverse of `to_rows` (no rows: no delays)."""
        delays, overhead = {}, 0.0
        for a, ka, b, kb, d in rows:
            if ka == STEP:
                overhead = float(d)
            else:
                delays[int(a), str(ka), int(b), str(kb)] = float(d)
        return cls(delays, overhead)


def edge_kind(u: Instruction, v: Instruction) -> EdgeKind:
    """The kind of the DAG edge `u -> v`."""
    return (u.stage, u.kind, v.stage, v.kind)


def measure_edge_delays(
    dag: PipelineDAG, steps: Sequence[Mapping[int, StepTimeline]], quantile: float = 0.1
) -> EdgeDelays:
    """The delay of every kind of edge of `dag` from the instructions of the profiled steps.

    Each instance of an instruction started after the input it waited for: of its incoming edges, the one
    with the least gap (the input that arrived last; between hosts, less their clocks' offset) is *tight*.
    A kind's delay is the median of its tight gaps (the typical time of a wait that decided when an
    instruction started). A kind that never was tight only ever had gaps spent waiting for another input
    (its floor, the `quantile` of its gaps, is that wait: the stage's slack): its delay is the least
    measured delay between the same two stages, at most its floor (its floor when none was measured).
    The step overhead is the median over steps.

    Args:
        dag: The iteration's DAG (its schedule is the order each stage ran).
        steps: Per profiled step, stage -> that stage's `StepTimeline`. Steps whose timelines do not match
            the schedule (another number of instructions) are skipped.
        quantile: The low quantile of a kind's gaps taken as its floor.

    Returns:
        The delays; empty when no step matched.
    """
    instances, overheads, hosts = _gaps_per_step(dag, steps)
    if not instances:
        return EdgeDelays()
    kinds = {(u, v): edge_kind(dag.instructions[u], dag.instructions[v]) for u, v in dag.edges}
    gaps: dict[EdgeKind, list[float]] = {}
    for gap in instances:
        for edge, g in gap.items():
            gaps.setdefault(kinds[edge], []).append(g)
    floor = {kind: undisturbed_estimate(values, quantile) for kind, values in gaps.items()}
    base = dict(floor)
    _cancel_clock_offsets(base, gaps, hosts, quantile)
    tight = _tight_gaps(dag, instances, kinds, floor, base)
    # Tight gaps are taken above the floor, so that an offset between clocks (cancelled in `base`) drops out.
    delays = {kind: max(0.0, base[kind] + undisturbed_estimate(t, 0.5)) for kind, t in tight.items()}
    for kind, b in base.items():
        if kind not in tight:  # never the last input: no more than the least delay seen between its stages
            seen = [d for k, d in delays.items() if k in tight and (k[0], k[2]) == (kind[0], kind[2])]
            delays[kind] = max(0.0, min([b, *seen]))
    overhead = undisturbed_estimate(overheads, 0.5) if overheads else 0.0
    logger.debug("Edge delays (s): %s; step overhead %.3g s.", delays, overhead)
    return EdgeDelays(delays, overhead)


def _gaps_per_step(
    dag: PipelineDAG, steps: Sequence[Mapping[int, StepTimeline]]
) -> tuple[list[dict[tuple[int, int], float]], list[float], dict[int, str]]:
    """Per step whose timelines match the schedule: each edge's gap (s); each such step's overhead beyond
    the first stage's span; and each stage's host."""
    instances: list[dict[tuple[int, int], float]] = []
    overheads: list[float] = []
    hosts: dict[int, str] = {}
    lengths = [len(order) for order in dag.schedule]
    for step in steps:
        if sorted(step) != list(range(dag.num_stages)) or any(
            len(step[s].starts_s) != n for s, n in enumerate(lengths)
        ):
            continue
        start: dict[Instruction, float] = {}
        end: dict[Instruction, float] = {}
        for s, order in enumerate(dag.schedule):
            hosts[s] = step[s].host
            for inst, t0, dt in zip(order, step[s].starts_s, step[s].times_s, strict=True):
                start[inst], end[inst] = t0, t0 + dt
        instances.append(
            {(u, v): start[dag.instructions[v]] - end[dag.instructions[u]] for u, v in dag.edges}
        )
        # The pipeline's step takes as long as its slowest rank's; the DAG spans the first stage's
        # instructions (it runs the iteration's first and last).
        slowest = max(t.step_time_s for t in step.values())
        first = step[0]
        if slowest > 0 and first.starts_s:
            span = first.starts_s[-1] + first.times_s[-1] - first.starts_s[0]
            overheads.append(max(0.0, slowest - span))
    return instances, overheads, hosts


def _tight_gaps(
    dag: PipelineDAG,
    instances: Sequence[Mapping[tuple[int, int], float]],
    kinds: Mapping[tuple[int, int], EdgeKind],
    floor: Mapping[EdgeKind, float],
    base: Mapping[EdgeKind, float],
) -> dict[EdgeKind, list[float]]:
    """Per kind of edge, the gaps above its floor of the instances where it was the input that arrived
    last (least gap, less the hosts' clock offset `floor - base`), the one that decided when its
    instruction started. Not the gap nearest its kind's floor: a stage that always waits for the next
    stage's gradient has a floor that is that wait, its slack, not host time."""
    tight: dict[EdgeKind, list[float]] = {}
    incoming = [[(u, v) for u in dag.predecessors(v)] for v in range(len(dag))]
    for gap in instances:
        for edges in incoming:
            if edges:
                edge = min(edges, key=lambda e: gap[e] - floor[kinds[e]] + base[kinds[e]])
                tight.setdefault(kinds[edge], []).append(gap[edge] - floor[kinds[edge]])
    return tight


def _cancel_clock_offsets(
    delays: dict[EdgeKind, float], gaps: Mapping[EdgeKind, list[float]], hosts: Mapping[int, str], q: float
) -> None:
    """Between stages on different hosts, both directions of a link get the mean of the two directions'
    estimates, in which the offset between the hosts' clocks cancels."""
    links = {
        (min(k[0], k[2]), max(k[0], k[2]))
        for k in gaps
        if k[0] != k[2] and hosts.get(k[0]) != hosts.get(k[2])
    }
    for a, b in sorted(links):
        forth = [k for k in gaps if (k[0], k[2]) == (a, b)]
        back = [k for k in gaps if (k[0], k[2]) == (b, a)]
        if forth and back:
            both = (_mean_estimate(gaps, forth, q) + _mean_estimate(gaps, back, q)) / 2
            for k in forth + back:
                delays[k] = max(0.0, both)


def _mean_estimate(gaps: Mapping[EdgeKind, list[float]], kinds: Sequence[EdgeKind], q: float) -> float:
    return sum(undisturbed_estimate(gaps[k], q) for k in kinds) / len(kinds)
