"""Schedules match torch.distributed.pipelining's execution order; the DAG has the Perseus edges."""

from __future__ import annotations

import pytest

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_dag, build_schedule

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


def test_1f1b_with_fewer_microbatches_than_stages_is_valid():
    schedule = build_schedule("1f1b", 4, 2)
    assert [len(s) for s in schedule] == [4, 4, 4, 4]
    assert len(build_dag(schedule)) == 16


def test_bad_arguments():
    with pytest.raises(ValueError, match="not a known schedule"):
        build_schedule("interleaved", 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        build_schedule("1f1b", 0, 2)


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
