"""HiGHS' branch and bound through scipy's bundled binding (`core/pipeline_frequency/highs.py`): the answers
`milp` gives, plus the dual bound `milp` drops when a node limit stops a run that found no plan (issue 36).

Deterministic: an A40-like 4 x 4 program (SIMULATED, from the shipped traces), node limits, no clock.
"""

from __future__ import annotations

import logging
import sys
import types

import numpy as np
import pytest

from zeus_callbacks.core.pipeline_frequency import highs
from zeus_callbacks.core.pipeline_frequency.highs import MipOptions, MipStatus

pytest.importorskip("scipy")


@pytest.fixture
def program(a40_program):
    """`a40_program`'s integer program, its LP relaxation and its exact optimum (J)."""
    _, program, relaxed = a40_program
    optimum = program.solve()
    assert optimum.status is MipStatus.OPTIMAL
    return program, relaxed, float(program.cost @ optimum.x)


def _without_binding(monkeypatch):
    monkeypatch.setattr(highs, "_bundled_highs", lambda: None)


def test_an_unanswered_question_keeps_the_bound_highs_proved(program, monkeypatch):
    """Rule: when the node limit stops the question "is any plan cheaper than the cutoff?" before it finds one
    or proves there is none, the bound HiGHS proved is kept: above the LP's, never above the optimum. Fails
    through `milp` (the last assertion: scipy reads HiGHS' results only when a plan was found), as every plan
    was proven before this: an 8 x 24 frontier point then kept 0.165 % where HiGHS had proven more."""
    prog, relaxed, optimum_j = program
    cutoff = optimum_j * (1 - 1e-6)  # so close to the optimum that one node cannot answer
    found, bound = prog.cheaper_than(cutoff, relaxed, 1, prove_only=True)
    assert found is None
    assert relaxed.bound_j < bound <= optimum_j
    assert bound / relaxed.bound_j - 1 > 0.5 * (optimum_j / relaxed.bound_j - 1)  # the root's cuts lift it
    _without_binding(monkeypatch)
    assert prog.cheaper_than(cutoff, relaxed, 1, prove_only=True) == (None, -np.inf)


@pytest.mark.parametrize(
    "run",
    ["exact optimum", "question answered none", "search stopped by its node limit", "question unanswered"],
)
def test_the_bundled_binding_answers_as_milp(program, run, monkeypatch):
    """Rule: the same model and options give the same status and plan through the bundled binding as through
    `milp` (so every plan is the one computed before), and the same bound wherever `milp` reads one. Fails
    where `branch_and_bound` builds a different model (row order, matrix, options) than `milp` passes."""
    prog, relaxed, optimum_j = program
    cases = {
        "exact optimum": (prog.col_upper, None, MipOptions(1e-7)),
        "question answered none": (
            prog.col_upper,
            relaxed.bound_j * (1 - 1e-4),
            MipOptions(5e-4, node_limit=10, presolve=False, heuristics=False),
        ),
        "search stopped by its node limit": (
            prog.col_upper,
            None,
            MipOptions(0.0, node_limit=1, presolve=False),
        ),
        "question unanswered": (
            prog.col_upper,
            optimum_j * (1 - 1e-6),
            MipOptions(5e-4, node_limit=1, presolve=False, heuristics=False),
        ),
    }
    col_upper, cutoff, options = cases[run]
    from scipy.sparse import csr_matrix

    row = None if cutoff is None else (csr_matrix(prog.cost.reshape(1, -1)), -np.inf, cutoff)
    core = prog._branch_and_bound(col_upper, row, options)
    _without_binding(monkeypatch)
    via_milp = prog._branch_and_bound(col_upper, row, options)
    assert (core.x is None) == (via_milp.x is None)
    if core.x is not None:
        assert np.array_equal(core.x, via_milp.x)
    if np.isfinite(via_milp.dual_bound):
        assert core.dual_bound == via_milp.dual_bound
    # scipy reports the node limit as an unknown status: without a plan, the fallback cannot tell it apart.
    assert (core.status, via_milp.status) == {
        "exact optimum": (MipStatus.OPTIMAL, MipStatus.OPTIMAL),
        "question answered none": (MipStatus.INFEASIBLE, MipStatus.INFEASIBLE),
        "search stopped by its node limit": (MipStatus.LIMIT, MipStatus.LIMIT),
        "question unanswered": (MipStatus.LIMIT, MipStatus.OTHER),
    }[run]


@pytest.mark.parametrize("binding", ["missing", "changed"])
def test_a_scipy_without_the_binding_is_said_once(program, binding, monkeypatch, caplog):
    """Rule: without the bundled binding (scipy < 1.15), or with one that lacks what `highs` uses (a later
    scipy that changed it), branch and bound still runs, through `milp`, and the lost bound is said once at
    INFO with what to do."""
    prog, _, _ = program
    highs._say_once_bound_lost.cache_clear()
    stand_in = None if binding == "missing" else types.SimpleNamespace(HighsLp=object)
    monkeypatch.setitem(sys.modules, "scipy.optimize._highspy._core", stand_in)
    caplog.set_level(logging.INFO, logger=highs.__name__)
    for _ in range(2):
        assert prog.solve().status is MipStatus.OPTIMAL
    said = [r for r in caplog.records if "bundled HiGHS" in r.getMessage()]
    assert len(said) == 1 and "pip install 'scipy==1.17.*'" in said[0].getMessage()
