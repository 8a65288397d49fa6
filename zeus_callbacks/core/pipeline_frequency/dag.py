"""Pipeline-parallel schedules and the computation DAG of one training iteration."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["Instruction", "PipelineDAG", "SCHEDULES", "build_schedule", "build_dag"]

InstructionKind = Literal["forward", "backward"]
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True, order=True)
class Instruction:
    """One computation of a pipeline stage: the forward or backward pass of one microbatch."""

    stage: int
    kind: InstructionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{'F' if self.kind == 'forward' else 'B'}(s{self.stage},m{self.microbatch})"


def build_schedule(kind: str, num_stages: int, num_microbatches: int) -> list[list[Instruction]]:
    """The order in which each stage runs its instructions, as in `torch.distributed.pipelining`.

    `"1f1b"` follows `Schedule1F1B`: stage `s` runs `min(M, S - s)` warm-up forwards, then alternates one
    backward and one forward, then runs the remaining backwards. `"gpipe"` follows `ScheduleGPipe`: every
    forward, then every backward. Unlike torch, 1F1B also accepts fewer microbatches than stages.

    Args:
        kind: `"1f1b"` or `"gpipe"`.
        num_stages: Number of pipeline stages `S`.
        num_microbatches: Number of microbatches `M` per iteration.

    Returns:
        One list per stage, in execution order.

    Raises:
        ValueError: On an unknown schedule or a non-positive size.
    """
    if kind not in SCHEDULES:
        raise ValueError(
            f"`build_schedule(kind={kind!r})` is not a known schedule. Expected one of {SCHEDULES}."
        )
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"`build_schedule(num_stages={num_stages}, num_microbatches={num_microbatches})` needs both >= 1."
        )
    schedule = []
    for stage in range(num_stages):
        fwd = [Instruction(stage, "forward", m) for m in range(num_microbatches)]
        bwd = [Instruction(stage, "backward", m) for m in range(num_microbatches)]
        if kind == "gpipe":
            schedule.append(fwd + bwd)
            continue
        warmup = min(num_microbatches, num_stages - stage)
        order = fwd[:warmup]
        for m in range(num_microbatches):
            order.append(bwd[m])
            if warmup + m < num_microbatches:
                order.append(fwd[warmup + m])
        schedule.append(order)
    return schedule


@dataclass(frozen=True)
class PipelineDAG:
    """The dependency graph of one iteration, instructions numbered in a topological order.

    Build it with `build_dag`. Node `i` is `instructions[i]`; every edge `(u, v)` has `u < v`. An edge may
    carry a delay (`edge_delay_s`, aligned with `edges`; empty: none): `v` starts at least that long after
    `u` ends (communication between stages, the host's time between a stage's instructions).
    """

    schedule: tuple[tuple[Instruction, ...], ...]
    instructions: tuple[Instruction, ...]
    edges: tuple[tuple[int, int], ...]
    _index: dict[Instruction, int] = field(repr=False, compare=False)
    _preds: tuple[tuple[int, ...], ...] = field(repr=False, compare=False)
    _succs: tuple[tuple[int, ...], ...] = field(repr=False, compare=False)
    edge_delay_s: tuple[float, ...] = ()

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.schedule)

    def __len__(self) -> int:
        return len(self.instructions)

    def index(self, instruction: Instruction) -> int:
        """Node number of `instruction`."""
        return self._index[instruction]

    def predecessors(self, node: int) -> tuple[int, ...]:
        """Nodes that must finish before `node` starts."""
        return self._preds[node]

    def successors(self, node: int) -> tuple[int, ...]:
        """Nodes that wait for `node`."""
        return self._succs[node]

    def edge_delays(self) -> list[float]:
        """Delay (s) of every edge, aligned with `edges` (zeros when none were given)."""
        return list(self.edge_delay_s) if self.edge_delay_s else [0.0] * len(self.edges)

    def with_edge_delays(self, delay_s: Callable[[Instruction, Instruction], float]) -> PipelineDAG:
        """The same DAG whose edge `(u, v)` has the delay `delay_s(instructions[u], instructions[v])` (s).

        Raises:
            ValueError: a delay is negative or not finite.
        """
        delays = tuple(float(delay_s(self.instructions[u], self.instructions[v])) for u, v in self.edges)
        bad = [d for d in delays if not 0.0 <= d < float("inf")]
        if bad:
            raise ValueError(f"Edge delays must be finite and >= 0 s, got {bad[0]!r}.")
        return dataclasses.replace(self, edge_delay_s=delays)

    def predecessor_delays(self) -> list[tuple[float, ...]]:
        """For every node, the delays of its incoming edges, aligned with `predecessors(node)`."""
        return self._aligned_delays(incoming=True)

    def successor_delays(self) -> list[tuple[float, ...]]:
        """For every node, the delays of its outgoing edges, aligned with `successors(node)`."""
        return self._aligned_delays(incoming=False)

    def _aligned_delays(self, incoming: bool) -> list[tuple[float, ...]]:
        delay = dict(zip(self.edges, self.edge_delays(), strict=True))
        if incoming:
            return [tuple(delay[u, v] for u in preds) for v, preds in enumerate(self._preds)]
        return [tuple(delay[u, v] for v in succs) for u, succs in enumerate(self._succs)]

    def stages(self) -> np.ndarray:
        """Stage of every node, as an integer array."""
        return np.fromiter((i.stage for i in self.instructions), dtype=np.int64, count=len(self))

    def earliest_start(self, durations_s: Sequence[float] | np.ndarray) -> list[float]:
        """Earliest start time of every node when node `i` takes `durations_s[i]` seconds (edge delays
        included)."""
        d = [float(x) for x in durations_s]
        start = [0.0] * len(d)
        delays = self.predecessor_delays()
        for v, preds in enumerate(self._preds):
            if preds:
                start[v] = max(start[u] + d[u] + x for u, x in zip(preds, delays[v], strict=True))
        return start

    def iteration_time(self, durations_s: Sequence[float] | np.ndarray) -> float:
        """Length of the critical path (s) when node `i` takes `durations_s[i]` seconds."""
        d = [float(x) for x in durations_s]
        start = self.earliest_start(d)
        return max(s + x for s, x in zip(start, d, strict=True))


def build_dag(
    schedule: Sequence[Sequence[Instruction]],
    edge_delay_s: Callable[[Instruction, Instruction], float] | None = None,
) -> PipelineDAG:
    """The dependency DAG of a per-stage schedule such as `build_schedule` returns.

    Edges: consecutive instructions of a stage; `forward(s, m) -> forward(s + 1, m)`;
    `backward(s + 1, m) -> backward(s, m)`; `forward(last, m) -> backward(last, m)`. With `edge_delay_s`,
    each edge `(u, v)` gets that delay (`PipelineDAG.with_edge_delays`); otherwise none.

    Raises:
        ValueError: If the schedule repeats an instruction, misplaces one, or deadlocks (has a cycle).
    """
    position = _positions(schedule)
    flat = list(position)
    raw_edges = _dependencies(schedule, position)
    topo = _topological_order(len(flat), raw_edges)
    renumber = {old: new for new, old in enumerate(topo)}
    edges = sorted((renumber[u], renumber[v]) for u, v in raw_edges)
    preds: list[list[int]] = [[] for _ in flat]
    out: list[list[int]] = [[] for _ in flat]
    for u, v in edges:
        preds[v].append(u)
        out[u].append(v)
    instructions = tuple(flat[old] for old in topo)
    dag = PipelineDAG(
        schedule=tuple(tuple(order) for order in schedule),
        instructions=instructions,
        edges=tuple(edges),
        _index={inst: i for i, inst in enumerate(instructions)},
        _preds=tuple(tuple(p) for p in preds),
        _succs=tuple(tuple(s) for s in out),
    )
    return dag if edge_delay_s is None else dag.with_edge_delays(edge_delay_s)


def _positions(schedule: Sequence[Sequence[Instruction]]) -> dict[Instruction, int]:
    """Every instruction's number in listing order (stage by stage), checking each is listed once, in place."""
    position: dict[Instruction, int] = {}
    for stage, order in enumerate(schedule):
        for inst in order:
            if inst.stage != stage:
                raise ValueError(f"{inst} is listed under stage {stage}.")
            if inst in position:
                raise ValueError(f"{inst} appears twice in the schedule.")
            position[inst] = len(position)
    return position


def _dependencies(
    schedule: Sequence[Sequence[Instruction]], position: dict[Instruction, int]
) -> set[tuple[int, int]]:
    """Edges between listing numbers: each stage's order, and the data passed between stages."""
    num_stages = len(schedule)
    edges: set[tuple[int, int]] = set()
    for order in schedule:
        for a, b in zip(order, order[1:], strict=False):
            edges.add((position[a], position[b]))
    for inst in position:
        s, m = inst.stage, inst.microbatch
        if inst.kind == "forward":
            nxt = Instruction(s + 1, "forward", m) if s + 1 < num_stages else Instruction(s, "backward", m)
        else:
            nxt = Instruction(s - 1, "backward", m) if s > 0 else None
        if nxt is not None and nxt in position:
            edges.add((position[inst], position[nxt]))
    return edges


def _topological_order(num_nodes: int, edges: set[tuple[int, int]]) -> list[int]:
    """Kahn's algorithm, preferring the earliest-listed ready node so the numbering is deterministic.

    Raises:
        ValueError: the edges have a cycle (the schedule deadlocks).
    """
    succs: list[list[int]] = [[] for _ in range(num_nodes)]
    indeg = [0] * num_nodes
    for u, v in edges:
        succs[u].append(v)
        indeg[v] += 1
    ready = [i for i, d in enumerate(indeg) if d == 0]
    heapq.heapify(ready)
    topo: list[int] = []
    while ready:
        u = heapq.heappop(ready)
        topo.append(u)
        for v in succs[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, v)
    if len(topo) != num_nodes:
        raise ValueError("The schedule deadlocks: its dependency graph has a cycle.")
    return topo
