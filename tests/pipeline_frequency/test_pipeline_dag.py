"""Schedules match torch.distributed.pipelining's execution order; the DAG has the Perseus edges."""

from __future__ import annotations

import pytest

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.pipelining import schedule_order

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


class _RecordingStage:
    """Just enough of a `_PipelineStageBase` for a single-stage schedule to run without a process group."""

    def __init__(self, num_stages: int, stage_index: int) -> None:
        self.num_stages = num_stages
        self.stage_index = stage_index
        self.is_last = stage_index == num_stages - 1
        self.calls: list[Instruction] = []

    def get_fwd_recv_ops(self, *args, **kwargs):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.calls.append(Instruction(self.stage_index, "forward", mb))

    def backward_one_chunk(self, mb, *args, **kwargs):
        self.calls.append(Instruction(self.stage_index, "backward", mb))

    def perform_reduce_grad(self, *args, **kwargs):
        pass


class _RecordingChunk(_RecordingStage):
    """One model chunk (virtual stage) of a rank, for multi-stage schedules; calls go to the rank's list."""

    def __init__(self, num_ranks: int, num_chunks: int, rank: int, chunk: int, calls: list) -> None:
        super().__init__(num_ranks * num_chunks, chunk * num_ranks + rank)
        self.group_size, self.group_rank = num_ranks, rank
        self.is_first = self.stage_index == 0
        self.submod = None
        self.calls = calls

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.calls.append(Instruction(self.group_rank, "forward", mb, self.stage_index))

    def backward_one_chunk(self, mb, *args, **kwargs):
        self.calls.append(Instruction(self.group_rank, "backward", mb, self.stage_index))


def _multi_schedule(cls, num_ranks: int, num_chunks: int, num_microbatches: int, rank: int):
    calls: list[Instruction] = []
    chunks = [_RecordingChunk(num_ranks, num_chunks, rank, c, calls) for c in range(num_chunks)]
    return cls(chunks, num_microbatches), calls


def _torch_multi_order(cls, num_ranks: int, num_chunks: int, num_microbatches: int):
    """Per-rank compute order of torch's own runtime (`_step_microbatches`), and its `pipeline_order` read
    by `schedule_order`."""
    executed = []
    for rank in range(num_ranks):
        schedule, calls = _multi_schedule(cls, num_ranks, num_chunks, num_microbatches, rank)
        schedule._initialize_stages = lambda *args, **kwargs: None
        schedule._step_microbatches()
        executed.append(calls)
    return executed, schedule_order(schedule)


def _torch_order(cls, num_stages: int, num_microbatches: int) -> list[list[Instruction]]:
    """Per-stage compute order of torch's own `_step_microbatches` (what a training step executes)."""
    order = []
    for rank in range(num_stages):
        stage = _RecordingStage(num_stages, rank)
        schedule = cls(stage, num_microbatches)
        schedule._initialize_stage = lambda *args, **kwargs: None  # shape inference needs real stages
        schedule._step_microbatches()
        order.append(stage.calls)
    return order


@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 1), (2, 2), (2, 5), (4, 4), (4, 8), (8, 16)])
def test_1f1b_matches_torch(num_stages, num_microbatches):
    expected = _torch_order(schedules.Schedule1F1B, num_stages, num_microbatches)
    assert build_schedule("1f1b", num_stages, num_microbatches) == expected


@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 3), (2, 2), (3, 5), (4, 8)])
def test_gpipe_matches_torch(num_stages, num_microbatches):
    expected = _torch_order(schedules.ScheduleGPipe, num_stages, num_microbatches)
    assert build_schedule("gpipe", num_stages, num_microbatches) == expected


@pytest.mark.parametrize(
    "num_ranks,num_chunks,num_microbatches",
    [(4, 2, 8), (2, 2, 2), (4, 3, 4), (4, 2, 6), (3, 2, 5), (2, 1, 3)],
)
@pytest.mark.parametrize("kind", ["interleaved-1f1b", "looped-bfs"])
def test_multi_stage_schedules_match_torch(kind, num_ranks, num_chunks, num_microbatches):
    cls = {
        "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
        "looped-bfs": schedules.ScheduleLoopedBFS,
    }[kind]
    executed, read = _torch_multi_order(cls, num_ranks, num_chunks, num_microbatches)
    assert read == executed  # torch's pipeline_order is what its runtime runs
    assert build_schedule(kind, num_ranks, num_microbatches, num_chunks) == executed


def test_interleaved_microbatches_torch_refuses_are_refused():
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        schedules.ScheduleInterleaved1F1B([_RecordingChunk(4, 2, 0, c, []) for c in range(2)], 11)
    with pytest.raises(ValueError, match="multiple of 2"):
        build_schedule("interleaved-1f1b", 4, 11, 2)
    assert len(build_schedule("interleaved-1f1b", 4, 10, 2)[0]) == 40


@pytest.mark.parametrize("name", ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"])
def test_zero_bubble_schedules_are_refused(name):
    schedule, _ = _multi_schedule(getattr(schedules, name), 2, 2, 4, 0)
    with pytest.raises(ValueError, match="input- and weight-gradient halves.*ScheduleInterleaved1F1B"):
        schedule_order(schedule)
    with pytest.raises(TypeError, match="not a multi-stage"):
        schedule_order(object())


def test_interleaved_dag_edges():
    order = build_schedule("interleaved-1f1b", 2, 2, 2)  # virtual stages 0, 2 on rank 0; 1, 3 on rank 1
    dag = build_dag(order)
    assert len(dag) == 16 and dag.num_stages == 2
    assert list(dag.stages()).count(0) == 8
    edges = {(dag.instructions[u], dag.instructions[v]) for u, v in dag.edges}
    F = lambda r, v, m: Instruction(r, "forward", m, v)  # noqa: E731
    B = lambda r, v, m: Instruction(r, "backward", m, v)  # noqa: E731
    assert (F(0, 0, 1), F(1, 1, 1)) in edges
    assert (F(1, 1, 0), F(0, 2, 0)) in edges  # from the last rank back to the first, next chunk
    assert (F(1, 3, 1), B(1, 3, 1)) in edges  # the last virtual stage turns around
    assert (B(0, 2, 0), B(1, 1, 0)) in edges
    assert (F(1, 1, 0), B(1, 1, 0)) not in edges  # rank 1's first chunk is not the model's last stage
    # Uniform unit durations: 8 instructions per rank, rank 1 starts 1 later and rank 0 ends 1 after it.
    assert dag.iteration_time([1.0] * len(dag)) == pytest.approx(10.0)
    assert str(F(1, 3, 1)) == "F(s1,v3,m1)"


def test_1f1b_with_fewer_microbatches_than_stages_is_valid():
    schedule = build_schedule("1f1b", 4, 2)
    assert [len(s) for s in schedule] == [4, 4, 4, 4]
    assert len(build_dag(schedule)) == 16


def test_bad_arguments():
    with pytest.raises(ValueError, match="not a known schedule"):
        build_schedule("interleaved", 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        build_schedule("1f1b", 0, 2)
    with pytest.raises(ValueError, match="one stage per rank"):
        build_schedule("gpipe", 2, 2, num_chunks=2)


def test_dag_edges_and_topological_numbering():
    dag = build_dag(build_schedule("1f1b", 3, 4))
    assert len(dag) == 24 and dag.num_stages == 3
    assert all(u < v for u, v in dag.edges)
    edges = {(dag.instructions[u], dag.instructions[v]) for u, v in dag.edges}
    F = lambda s, m: Instruction(s, "forward", m)  # noqa: E731
    B = lambda s, m: Instruction(s, "backward", m)  # noqa: E731
    assert (F(0, 1), F(1, 1)) in edges
    assert (B(2, 1), B(1, 1)) in edges
    assert (F(2, 3), B(2, 3)) in edges
    assert (F(0, 2), B(0, 0)) in edges  # stage 0 runs 3 warm-up forwards, then B0
    assert (B(0, 0), F(0, 3)) in edges
    assert not any(a.kind == "backward" and b.kind == "forward" and a.stage != b.stage for a, b in edges)
    # Uniform durations: 1F1B takes 2 * (M + S - 1) forward-equivalents with backward == forward.
    assert dag.iteration_time([1.0] * len(dag)) == pytest.approx(2 * (4 + 3 - 1))


def test_dag_rejects_bad_schedules():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="twice"):
        build_dag([schedule[0] + [schedule[0][0]], schedule[1]])
    with pytest.raises(ValueError, match="listed under stage"):
        build_dag([schedule[1], schedule[0]])
    deadlock = [list(reversed(schedule[0])), schedule[1]]
    with pytest.raises(ValueError, match="cycle"):
        build_dag(deadlock)
    interleaved = build_schedule("interleaved-1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="mixes"):
        build_dag([interleaved[0] + [Instruction(0, "forward", 5)], interleaved[1]])
    with pytest.raises(ValueError, match="virtual stage 1 is on stages 0 and 1"):
        build_dag([interleaved[0] + [Instruction(0, "forward", 5, 1)], interleaved[1]])
