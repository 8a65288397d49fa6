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
import functools
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MipModel", "MipOptions", "MipResult", "MipStatus", "branch_and_bound"]

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


@dataclass(frozen=True)
class MipModel:
    """Minimise `cost @ x` subject to `row_lower <= rows @ x <= row_upper` and `0 <= x <= col_upper`, the first
    `num_integral` columns integral. `rows` is a scipy sparse matrix; a bound of -inf or inf is none."""

    cost: np.ndarray
    rows: Any
    row_lower: np.ndarray
    row_upper: np.ndarray
    col_upper: np.ndarray
    num_integral: int

    @property
    def integrality(self) -> np.ndarray:
        """1 for an integral column, 0 for a continuous one, as HiGHS and `milp` take it."""
        out = np.zeros(len(self.cost), dtype=np.uint8)
        out[: self.num_integral] = 1
        return out


def branch_and_bound(model: MipModel, options: MipOptions) -> MipResult:
    """HiGHS' branch and bound on `model` under `options`: the answer `milp` gives, with the dual bound kept
    on a limit stop where scipy bundles the binding."""
    core = _bundled_highs()
    with _quiet_stdout():
        if core is None:
            return _through_milp(model, options)
        return _through_core(core, model, options)


def _bundled_highs() -> Any | None:
    """scipy's bundled HiGHS binding, or None (scipy < 1.15, or a scipy that moved or changed it)."""
    try:
        core = importlib.import_module("scipy.optimize._highspy._core")
    except ImportError:
        core = None
    if core is None or not all(hasattr(core, name) for name in _USED):
        _say_once_bound_lost()
        return None
    return core


# What `_through_core` uses of the binding: a scipy whose private binding lacks any of it gets `milp`.
_USED = ("HighsLp", "_Highs", "MatrixFormat", "HighsVarType", "HighsStatus", "HighsModelStatus", "kHighsInf")


@functools.cache
def _say_once_bound_lost() -> None:
    logger.info(
        "This scipy has no bundled HiGHS binding that zeus_callbacks can use (scipy.optimize._highspy; "
        "tested with scipy 1.17): a proof stopped by its node limit keeps the LP's bound. "
        "`pip install 'scipy==1.17.*'` for tighter proven gaps."
    )


def _through_core(core: Any, model: MipModel, options: MipOptions) -> MipResult:
    """The model `milp` would build (`_highs_wrapper`), run, its results read whatever the outcome."""
    from scipy.sparse import csc_array

    matrix = csc_array(model.rows)  # `milp`'s layout: column-wise, indices sorted
    num_col, num_row = len(model.cost), matrix.shape[0]
    lp = core.HighsLp()
    lp.num_col_, lp.num_row_ = num_col, num_row
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = num_col, num_row
    lp.a_matrix_.format_ = core.MatrixFormat.kColwise
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data.astype(np.float64)
    lp.col_cost_ = np.asarray(model.cost, dtype=np.float64)
    lp.col_lower_ = np.zeros(num_col)
    lp.col_upper_ = np.asarray(model.col_upper, dtype=np.float64)
    lp.row_lower_ = np.asarray(model.row_lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(model.row_upper, dtype=np.float64)
    lp.integrality_ = [core.HighsVarType(int(i)) for i in model.integrality]
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


def _through_milp(model: MipModel, options: MipOptions) -> MipResult:
    """The same run through `milp`: its bound is lost when it stops without a solution."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    # `milp` leaves out the options that are None and passes those it does not know to HiGHS verbatim.
    scipy_options: dict[str, Any] = {
        "disp": False,
        "mip_rel_gap": options.mip_rel_gap,
        "node_limit": options.node_limit,
        "time_limit": options.time_limit_s,
        "presolve": None if options.presolve else False,
        "mip_heuristic_effort": None if options.heuristics else 0.0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = milp(
            model.cost,
            constraints=[LinearConstraint(model.rows, model.row_lower, model.row_upper)],
            integrality=model.integrality,
            bounds=Bounds(np.zeros(len(model.cost)), model.col_upper),
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
