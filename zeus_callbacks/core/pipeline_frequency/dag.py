"""Pipeline-parallel schedules and the computation DAG of one training iteration."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = [
    "Instruction",
    "PipelineDAG",
    "SCHEDULES",
    "MULTI_STAGE_SCHEDULES",
    "build_schedule",
    "build_dag",
]

InstructionKind = Literal["forward", "backward"]
# Schedules of one model stage per rank (found from the order of forwards and backwards alone).
SCHEDULES = ("1f1b", "gpipe")
# Schedules of several model stages (chunks) per rank: `torch.distributed.pipelining`'s
# `ScheduleInterleaved1F1B` and `ScheduleLoopedBFS`.
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "looped-bfs")


@dataclass(frozen=True, order=True)
class Instruction:
    """One computation of a pipeline rank: the forward or backward pass of one microbatch.

    `stage` is the rank's place in the pipeline (its GPU, whose clock is planned). With several model
    chunks per rank (interleaved schedules), `virtual_stage` is the chunk's place in the model, torch's
    `stage_index`: data flows from virtual stage `v` to `v + 1`. None: one stage per rank (`virtual_stage`
    is then `stage`).
    """

    stage: int
    kind: InstructionKind
    microbatch: int
    virtual_stage: int | None = None

    @property
    def model_stage(self) -> int:
        """The model stage this instruction computes: `virtual_stage`, else `stage`."""
        return self.stage if self.virtual_stage is None else self.virtual_stage

    @property
    def trace_key(self) -> str | tuple[str, int]:
        """What a rank records of this instruction: its kind, with the virtual stage when there is one."""
        return self.kind if self.virtual_stage is None else (self.kind, self.virtual_stage)

    def __str__(self) -> str:
        v = "" if self.virtual_stage is None else f",v{self.virtual_stage}"
        return f"{'F' if self.kind == 'forward' else 'B'}(s{self.stage}{v},m{self.microbatch})"


def build_schedule(
    kind: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> list[list[Instruction]]:
    """The order in which each stage runs its instructions, as in `torch.distributed.pipelining`.

    `"1f1b"` follows `Schedule1F1B`: stage `s` runs `min(M, S - s)` warm-up forwards, then alternates one
    backward and one forward, then runs the remaining backwards. `"gpipe"` follows `ScheduleGPipe`: every
    forward, then every backward. Unlike torch, 1F1B also accepts fewer microbatches than stages.

    With `num_chunks` model chunks per rank (`V`; rank `r` holds virtual stages `r, r + S, ...`):
    `"interleaved-1f1b"` follows `ScheduleInterleaved1F1B` (see `_interleaved_1f1b`) and `"looped-bfs"`
    `ScheduleLoopedBFS` (every forward of each chunk in turn, then every backward of each chunk from the
    last, microbatches in reverse). At run time `pipelining.instrument` reads torch's own order instead.

    Args:
        kind: One of `SCHEDULES` or `MULTI_STAGE_SCHEDULES`.
        num_stages: Number of pipeline stages (ranks) `S`.
        num_microbatches: Number of microbatches `M` per iteration.
        num_chunks: Model chunks per rank `V` (multi-stage schedules only).

    Returns:
        One list per stage (rank), in execution order.

    Raises:
        ValueError: On an unknown schedule, a non-positive size, chunks for a single-stage schedule, or a
            number of microbatches torch's interleaved 1F1B does not accept.
    """
    if kind not in SCHEDULES + MULTI_STAGE_SCHEDULES:
        raise ValueError(
            f"`build_schedule(kind={kind!r})` is not a known schedule. Expected one of "
            f"{SCHEDULES + MULTI_STAGE_SCHEDULES}."
        )
    if num_stages < 1 or num_microbatches < 1 or num_chunks < 1:
        raise ValueError(
            f"`build_schedule(num_stages={num_stages}, num_microbatches={num_microbatches}, "
            f"num_chunks={num_chunks})` needs all >= 1."
        )
    if kind in MULTI_STAGE_SCHEDULES:
        build = _interleaved_1f1b if kind == "interleaved-1f1b" else _looped_bfs
        return [build(rank, num_stages, num_microbatches, num_chunks) for rank in range(num_stages)]
    if num_chunks != 1:
        raise ValueError(
            f"`build_schedule(kind={kind!r}, num_chunks={num_chunks})`: {kind} runs one stage per rank; "
            f"pass num_chunks=1, or one of {MULTI_STAGE_SCHEDULES}."
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


def _interleaved_1f1b(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int) -> list[Instruction]:
    """Rank `rank`'s order in torch's `ScheduleInterleaved1F1B` (depth first, Megatron's interleaving).

    Microbatches go in rounds of `P = M // max(1, M // S)` (torch requires `M` a multiple of the number of
    rounds). Counting the rank's `V * M` forwards as slots `0, 1, ...`, slot `k` is a forward of chunk
    `(k // P) mod V`; its `W = min((V - 1) * P + 2 * (S - 1 - r), V * M)` warm-up forwards come first,
    then each further forward is followed by a backward, then the last `W` backwards; backward slot `j`
    (from 0) is of chunk `V - 1 - (j // P) mod V`. Each chunk takes its microbatches in order.
    """
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        raise ValueError(
            f"`build_schedule('interleaved-1f1b', num_stages={num_ranks}, num_microbatches={num_microbatches})`: "
            f"torch's interleaved 1F1B needs the microbatches to be a multiple of {rounds} (the rounds of "
            f"{num_ranks} microbatches)."
        )
    per_round = num_microbatches // rounds
    total = num_chunks * num_microbatches
    warmup = min((num_chunks - 1) * per_round + 2 * (num_ranks - 1 - rank), total)
    next_mb = {"forward": [0] * num_chunks, "backward": [0] * num_chunks}

    def take(kind: InstructionKind, chunk: int) -> Instruction:
        mb = next_mb[kind][chunk]
        next_mb[kind][chunk] += 1
        return Instruction(rank, kind, mb, chunk * num_ranks + rank)

    order = [take("forward", (k // per_round) % num_chunks) for k in range(warmup)]
    for j in range(total):
        if warmup + j < total:
            order.append(take("forward", ((warmup + j) // per_round) % num_chunks))
        order.append(take("backward", num_chunks - 1 - (j // per_round) % num_chunks))
    return order


def _looped_bfs(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int) -> list[Instruction]:
    """Rank `rank`'s order in torch's `ScheduleLoopedBFS`: breadth first over its chunks."""
    chunks = range(num_chunks)
    fwd = [
        Instruction(rank, "forward", m, c * num_ranks + rank) for c in chunks for m in range(num_microbatches)
    ]
    bwd = [
        Instruction(rank, "backward", m, c * num_ranks + rank)
        for c in reversed(chunks)
        for m in reversed(range(num_microbatches))
    ]
    return fwd + bwd


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

    Edges: consecutive instructions of a stage (rank); and the data passed between model stages (virtual
    stages with interleaving): `forward(v, m) -> forward(v + 1, m)`, `backward(v + 1, m) -> backward(v, m)`,
    `forward(last, m) -> backward(last, m)`. With `edge_delay_s`, each edge `(u, v)` gets that
    delay (`PipelineDAG.with_edge_delays`); otherwise none.

    Raises:
        ValueError: If the schedule repeats an instruction, misplaces one, mixes instructions with and without
            virtual stages, puts one virtual stage on two ranks, or deadlocks (has a cycle).
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
    rank_of: dict[int, int] = {}  # virtual stage -> its rank
    interleaved: set[bool] = set()
    for stage, order in enumerate(schedule):
        for inst in order:
            if inst.stage != stage:
                raise ValueError(f"{inst} is listed under stage {stage}.")
            if inst in position:
                raise ValueError(f"{inst} appears twice in the schedule.")
            interleaved.add(inst.virtual_stage is not None)
            if len(interleaved) > 1:
                raise ValueError(f"{inst}: the schedule mixes instructions with and without virtual stages.")
            if rank_of.setdefault(inst.model_stage, stage) != stage:
                first, second = sorted((rank_of[inst.model_stage], stage))
                raise ValueError(
                    f"{inst}: virtual stage {inst.model_stage} is on stages {first} and {second}."
                )
            position[inst] = len(position)
    return position


def _dependencies(
    schedule: Sequence[Sequence[Instruction]], position: dict[Instruction, int]
) -> set[tuple[int, int]]:
    """Edges between listing numbers: each stage's order, and the data passed between model stages."""
    by_work = {(i.model_stage, i.kind, i.microbatch): n for i, n in position.items()}
    last = max((i.model_stage for i in position), default=0)
    edges: set[tuple[int, int]] = set()
    for order in schedule:
        for a, b in zip(order, order[1:], strict=False):
            edges.add((position[a], position[b]))
    for inst, n in position.items():
        v, m = inst.model_stage, inst.microbatch
        nxt: tuple[int, str, int] | None
        if inst.kind == "forward":
            nxt = (v + 1, "forward", m) if v < last else (v, "backward", m)
        else:
            nxt = (v - 1, "backward", m) if v > 0 else None
        if nxt is not None and nxt in by_work:
            edges.add((n, by_work[nxt]))
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
