"""HiGHS' branch and bound on `exact`'s programs, keeping the dual bound when a node limit stops it.

scipy's `milp` reads HiGHS' results only when the run found a solution
(`scipy/optimize/_highspy/_highs_wrapper.py`, scipy 1.17: the "mipFailCondition" returns before
`mip_dual_bound` is read). The planner's question "is any plan 0.1 % cheaper than this one?" finds none by
design, so when its node limit stops it, the bound HiGHS had proven was lost and the plan kept the LP's (issue
36: on an 8 x 24 frontier point, 0.165 % instead of what HiGHS had reached). `branch_and_bound` passes the same
model and options that `milp` would to the HiGHS build scipy bundles (`scipy.optimize._highspy._core`, scipy >=
1.15), so every answer is the one `milp` gives, and reads the bound whatever the outcome. Where that binding
is missing it calls `milp`, and an unanswered run's bound is lost (said once, at INFO).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MipOptions", "MipResult", "MipStatus", "branch_and_bound"]

logger = logging.getLogger(__name__)


class MipStatus(enum.Enum):
    """How a branch-and-bound run ended."""

    OPTIMAL = "optimal"  # to the requested relative gap
    INFEASIBLE = "infeasible"
    LIMIT = "limit"  # the node (or, for benchmarks, time) limit stopped it
    OTHER = "other"


@dataclass(frozen=True)
class MipOptions:
    """What HiGHS is asked: the relative gap to stop at, and the limits on its work."""

    mip_rel_gap: float
    node_limit: int | None = None
    time_limit_s: float | None = None  # the exact reference's benchmarks only: the host's speed decides
    presolve: bool = True
    heuristics: bool = True

    def as_highs(self) -> dict[str, Any]:
        """HiGHS' option names and values, as `milp` passes them."""
        options: dict[str, Any] = {"log_to_console": False, "mip_rel_gap": self.mip_rel_gap}
        if self.node_limit is not None:
            options["mip_max_nodes"] = int(self.node_limit)
        if self.time_limit_s is not None:
            options["time_limit"] = float(self.time_limit_s)
        if not self.presolve:
            options["presolve"] = "off"
        if not self.heuristics:
            options["mip_heuristic_effort"] = 0.0
        return options


@dataclass(frozen=True)
class MipResult:
    """A run's outcome: the best solution found (None if none) and the proven lower bound (-inf if none)."""

    status: MipStatus
    x: np.ndarray | None
    dual_bound: float


def branch_and_bound(
    cost: np.ndarray,
    rows: Any,
    row_lower: np.ndarray,
    row_upper: np.ndarray,
    col_upper: np.ndarray,
    num_integral: int,
    options: MipOptions,
) -> MipResult:
    """Minimise `cost @ x` subject to `row_lower <= rows @ x <= row_upper`, `0 <= x <= col_upper`, the first
    `num_integral` columns integral.

    Args:
        cost: Objective coefficients, one per column.
        rows: The constraint matrix (scipy sparse), one row per constraint.
        row_lower: Each row's lower bound (-inf: none).
        row_upper: Each row's upper bound (inf: none).
        col_upper: Each column's upper bound (its lower bound is 0).
        num_integral: How many leading columns are integral.
        options: The gap and limits.
    """
    from scipy.sparse import csc_array

    integrality = np.zeros(len(cost), dtype=np.uint8)
    integrality[:num_integral] = 1
    matrix = csc_array(rows)
    core = _bundled_highs()
    with _quiet_stdout():
        if core is None:
            return _through_milp(cost, matrix, row_lower, row_upper, col_upper, integrality, options)
        return _through_core(core, cost, matrix, row_lower, row_upper, col_upper, integrality, options)


def _bundled_highs() -> Any | None:
    """scipy's bundled HiGHS binding, or None (scipy < 1.15, or a scipy that moved it)."""
    try:
        return importlib.import_module("scipy.optimize._highspy._core")
    except ImportError:
        _say_once_bound_lost()
        return None


_said: set[str] = set()


def _say_once_bound_lost() -> None:
    if "bound" not in _said:
        _said.add("bound")
        logger.info(
            "scipy has no bundled HiGHS binding (scipy.optimize._highspy, scipy >= 1.15): a proof stopped by "
            "its node limit keeps the LP's bound. `pip install -U scipy` for tighter proven gaps."
        )


def _through_core(
    core: Any,
    cost: np.ndarray,
    matrix: Any,
    row_lower: np.ndarray,
    row_upper: np.ndarray,
    col_upper: np.ndarray,
    integrality: np.ndarray,
    options: MipOptions,
) -> MipResult:
    """The model `milp` would build (`_highs_wrapper`), run, its results read whatever the outcome."""
    lp = core.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), matrix.shape[0]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(cost), matrix.shape[0]
    lp.a_matrix_.format_ = core.MatrixFormat.kColwise
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data.astype(np.float64)
    lp.col_cost_ = np.asarray(cost, dtype=np.float64)
    lp.col_lower_ = np.zeros(len(cost))
    lp.col_upper_ = np.asarray(col_upper, dtype=np.float64)
    lp.row_lower_ = np.asarray(row_lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(row_upper, dtype=np.float64)
    lp.integrality_ = [core.HighsVarType(int(i)) for i in integrality]
    highs = core._Highs()
    for name, value in options.as_highs().items():
        if highs.setOptionValue(name, value) == core.HighsStatus.kError:
            raise ValueError(f"HiGHS refused option {name}={value!r}.")
    highs.passModel(lp)
    if highs.run() == core.HighsStatus.kError:
        return MipResult(MipStatus.OTHER, None, -np.inf)
    model = highs.getModelStatus()
    info = highs.getInfo()
    limits = (
        core.HighsModelStatus.kTimeLimit,
        core.HighsModelStatus.kIterationLimit,
        core.HighsModelStatus.kSolutionLimit,
    )
    if model == core.HighsModelStatus.kOptimal:
        status = MipStatus.OPTIMAL
    elif model in limits:
        status = MipStatus.LIMIT
    elif model == core.HighsModelStatus.kInfeasible:
        status = MipStatus.INFEASIBLE
    else:
        status = MipStatus.OTHER
    if status not in (MipStatus.OPTIMAL, MipStatus.LIMIT):
        return MipResult(status, None, -np.inf)
    found = status is MipStatus.OPTIMAL or info.objective_function_value != core.kHighsInf
    x = np.array(highs.getSolution().col_value) if found else None
    return MipResult(status, x, float(info.mip_dual_bound))


def _through_milp(
    cost: np.ndarray,
    matrix: Any,
    row_lower: np.ndarray,
    row_upper: np.ndarray,
    col_upper: np.ndarray,
    integrality: np.ndarray,
    options: MipOptions,
) -> MipResult:
    """The same run through `milp`: its bound is lost when it stops without a solution."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    scipy_options: dict[str, Any] = {"disp": False, "mip_rel_gap": options.mip_rel_gap}
    if options.node_limit is not None:
        scipy_options["node_limit"] = int(options.node_limit)
    if options.time_limit_s is not None:
        scipy_options["time_limit"] = float(options.time_limit_s)
    if not options.presolve:
        scipy_options["presolve"] = False
    if not options.heuristics:
        scipy_options["mip_heuristic_effort"] = 0.0  # passed to HiGHS verbatim (scipy warns that it does)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = milp(
            cost,
            constraints=[LinearConstraint(matrix, row_lower, row_upper)],
            integrality=integrality,
            bounds=Bounds(np.zeros(len(cost)), col_upper),
            options=scipy_options,
        )
    # scipy reports HiGHS' node limit (kSolutionLimit) as "other" (4): a run that stopped with a plan hit a limit.
    status = {0: MipStatus.OPTIMAL, 1: MipStatus.LIMIT, 2: MipStatus.INFEASIBLE}.get(
        result.status, MipStatus.OTHER if result.x is None else MipStatus.LIMIT
    )
    dual = getattr(result, "mip_dual_bound", None)
    return MipResult(status, result.x, float(dual) if dual is not None else -np.inf)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1: HiGHS prints its banner and debug lines from C even with logging off, which
    would corrupt a command's output (`pipeline-plan --json`)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
