"""Fixtures of the pipeline-frequency tests: the planner's integer program on an A40-like profile (SIMULATED)."""

from __future__ import annotations

import pytest
from a40_profiles import P_BLK_W, a40_rows

from zeus_callbacks.core.pipeline_frequency import exact
from zeus_callbacks.core.pipeline_frequency.dag import build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.plan_search import PlanSearch
from zeus_callbacks.core.pipeline_frequency.planning import options_from_rows


@pytest.fixture
def a40_program():
    """A 4-stage x 4-microbatch 1F1B pipeline on the A40-like profile (30 MHz steps), as the planner's problem,
    its integer program at the all-maximum plan's time and that program's LP relaxation."""
    pytest.importorskip("scipy")
    options = options_from_rows(a40_rows(num_stages=4, step_mhz=30))
    problem = PlanSearch(build_dag(build_schedule("1f1b", 4, 4)), options, P_BLK_W)
    t = problem.tables
    target = problem.plan([0] * len(t.dag)).iteration_time_s
    program = exact._Program.build(t.dag, t.times, t.costs, sum(t.p_blk), target)
    relaxed = program.relaxation()
    assert relaxed is not None
    return problem, program, relaxed
