"""The common mistakes of a newcomer (issue 37), one table: each row is a mistake made as a user makes it (the
real call, or the real `zeus-callbacks` command in a subprocess), and the words its error or warning must hold:
what was wrong, and what to do instead.

Issue 37 counted 28 such mistakes, 14 of them met by a bare Python error or accepted without a word. This table
holds the core's and the CLI's (`ROWS`, 25); `tests/adapters/test_adapter_mistakes.py` holds the adapters':
- a Lightning callback passed to the HF `Trainer` (it failed with `AttributeError ... on_init_end`),
- the core `GlobalPowerLimitOptimizer` passed to the HF `Trainer` (the same `AttributeError`),
- the class `HFGlobalPowerLimitOptimizer` passed instead of an instance,
- `HFGlobalPowerLimitOptimizer()` without a monitor (`TypeError: missing ... monitor`).

Rows moved here from the bad-input tables (not copied): `search=` and `optimum_selector='energy'` and
`profile_steps=0` (test_bad_inputs_optimizers.py's PLO_CASES), `ZeusMonitor(gpu_indices=[1])` on one GPU and
`ZEUS_CALLBACKS_SIM_NOISE=5` (test_bad_inputs.py), `zeus-callbacks report` of a missing folder
(test_bad_inputs_new_features.py). tests/monitor/test_monitor.py still checks the monitor's window errors word
for word, as Zeus words them (its own rule: Zeus's tests match those words).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from helpers import real_driver_present

from zeus_callbacks import (
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    ZeusCost,
    ZeusMonitor,
)


@dataclass(frozen=True)
class _Fixtures:
    sim_gpus: Callable
    monkeypatch: pytest.MonkeyPatch


@dataclass(frozen=True)
class Mistake:
    """One mistake: `make(fixtures)` makes it (returns a CLI's completed process, or raises, or warns); the
    error (`kind`: an exception class; `UserWarning`; "cli": one line on stderr and exit code 2; "usage":
    argparse's usage error; "warns": exit code 0 and one line on stderr; "stderr": a failed script's error)
    must hold every word of `words`."""

    id: str
    make: Callable
    kind: type | str
    words: tuple[str, ...]


def _monitor(fx: _Fixtures) -> ZeusMonitor:
    fx.sim_gpus("a40")
    return ZeusMonitor(gpu_indices=[0])


def _plo(**kw) -> Callable:
    return lambda fx: GlobalPowerLimitOptimizer(_monitor(fx), **kw)


def _cli(*argv: str, env: dict[str, str] | None = None, python: tuple[str, ...] = ()) -> Callable:
    """`zeus-callbacks ARGV` in a subprocess, on a simulated A40 unless `env` says otherwise; `python` runs
    lines before the command (e.g. to make a package unimportable)."""

    def run(fx: _Fixtures) -> subprocess.CompletedProcess:
        code = "; ".join([*python, "from zeus_callbacks.cli import main", f"sys.exit(main({list(argv)!r}))"])
        return subprocess.run(
            [sys.executable, "-c", "import sys; " + code],
            env={**os.environ, "ZEUS_CALLBACKS_SIMULATE": "a40", **(env or {})},
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


def _windows(*calls: tuple[str, str]) -> Callable:
    """Monitor windows begun and ended in the order given, e.g. (("begin", "a"), ("begin", "a"))."""

    def run(fx: _Fixtures) -> None:
        monitor = _monitor(fx)
        for verb, name in calls:
            getattr(monitor, f"{verb}_window")(name)

    return run


def _no_gpu_no_simulation(fx: _Fixtures) -> subprocess.CompletedProcess:
    if real_driver_present():
        pytest.skip("this machine has an NVIDIA driver: ZeusMonitor() finds its GPUs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_CALLBACKS_SIM")}
    return subprocess.run(
        [sys.executable, "-c", "from zeus_callbacks import ZeusMonitor; ZeusMonitor()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# Importing transformers fails in the child as it does where the wheel was installed without `[hf]`.
_NO_HF = ("sys.modules['transformers'] = None", "sys.modules['accelerate'] = None")

ROWS = [
    # -- the objectives ------------------------------------------------------------------------------------
    Mistake(
        "slowdown factor as a string",
        lambda _: MaxSlowdownConstraint(factor="1.1"),
        TypeError,
        ("MaxSlowdownConstraint(factor='1.1')", "must be a number", "not str"),
    ),
    Mistake(
        "slowdown factor 10 meant as 10%",
        lambda _: MaxSlowdownConstraint(10),
        UserWarning,
        ("factor=10", "10x as long", "Did you mean 1.10"),
    ),
    Mistake(
        "slowdown factor 0.1 meant as 10% slower",
        lambda _: MaxSlowdownConstraint(0.1),
        ValueError,
        ("factor=0.1", ">= 1.0", "pass 1.1"),
    ),
    Mistake(
        "eta_knob as a string",
        lambda _: ZeusCost(eta_knob="0.5"),
        TypeError,
        ("ZeusCost(eta_knob='0.5')", "must be a number", "not str"),
    ),
    Mistake(
        "eta_knob as a percentage",
        lambda _: ZeusCost(50),
        ValueError,
        ("eta_knob=50", "[0, 1]", "pass 0.5"),
    ),
    # -- the optimizer's arguments ---------------------------------------------------------------------------
    Mistake(
        "pl_step wider than the range",
        _plo(pl_step=500),
        ValueError,
        ("pl_step=500", "100-300 W", "only its two ends", "pl_step=25"),
    ),
    Mistake(
        "unknown search",
        _plo(search="sweeps"),
        ValueError,
        ("search='sweeps'", "'adaptive', 'sweep', 'zeus'", "did you mean 'sweep'"),
    ),
    Mistake(
        "objective by name",
        _plo(optimum_selector="energy"),
        ValueError,
        ("optimum_selector='energy'", "pass `Energy()`"),
    ),
    Mistake(
        "objective's class, not an instance",
        _plo(optimum_selector=Energy),
        ValueError,
        ("optimum_selector=<class", "is the class", "`Energy()`"),
    ),
    Mistake(
        "slowdown factor where the objective goes",
        lambda fx: GlobalPowerLimitOptimizer(_monitor(fx), 1.1),
        ValueError,
        ("optimum_selector=1.1", "MaxSlowdownConstraint(factor=1.1)"),
    ),
    Mistake(
        "no profiling step",
        _plo(profile_steps=0),
        ValueError,
        ("profile_steps=0", "whole number >= 1"),
    ),
    Mistake(
        "no monitor",
        lambda _: GlobalPowerLimitOptimizer(),
        TypeError,
        ("GlobalPowerLimitOptimizer(...)", "missing a required argument: 'monitor'", "its arguments are"),
    ),
    Mistake(
        "the monitor's class, not an instance",
        lambda fx: (fx.sim_gpus("a40"), GlobalPowerLimitOptimizer(ZeusMonitor)),
        ValueError,
        ("monitor=<class", "is the class", "ZeusMonitor(gpu_indices=[local_rank])"),
    ),
    # -- the monitor -------------------------------------------------------------------------------------------
    Mistake(
        "a GPU index past the visible ones",
        lambda fx: (fx.sim_gpus("a40"), ZeusMonitor(gpu_indices=[1])),
        ValueError,
        ("ZeusMonitor(gpu_indices=[1])", "not among the 1 visible", "CUDA_VISIBLE_DEVICES"),
    ),
    Mistake(
        "a window begun twice",
        _windows(("begin", "step"), ("begin", "step")),
        ValueError,
        ("'step' already exists", "End it before beginning it again", "restart=True"),
    ),
    Mistake(
        "ending a window never begun",
        _windows(("end", "epoch")),
        ValueError,
        ("'epoch' does not exist", "not begun"),
    ),
    Mistake(
        "ending a window twice",
        _windows(("begin", "epoch"), ("end", "epoch"), ("end", "epoch")),
        ValueError,
        ("'epoch' does not exist", "not begun"),
    ),
    Mistake(
        "no GPU and no simulation",
        _no_gpu_no_simulation,
        "stderr",
        ("NVML", "ZEUS_CALLBACKS_SIMULATE=a40"),
    ),
    # -- the environment ---------------------------------------------------------------------------------------
    Mistake(
        "ZEUS_CALLBACKS_SIMULATE=1 to switch it on",
        _cli("devices", env={"ZEUS_CALLBACKS_SIMULATE": "1"}),
        "cli",
        ("ZEUS_CALLBACKS_SIMULATE", "'1'", "Choose one of", "a40"),
    ),
    Mistake(
        "simulator noise as a percentage",
        _cli("devices", env={"ZEUS_CALLBACKS_SIM_NOISE": "5"}),
        "cli",
        ("ZEUS_CALLBACKS_SIM_NOISE", "from 0 to 0.5"),
    ),
    Mistake(
        "a power budget that is not a number",
        lambda fx: (fx.monkeypatch.setenv("ZEUS_CALLBACKS_POWER_BUDGET_W", "250W"), _plo()(fx)),
        ValueError,
        ("ZEUS_CALLBACKS_POWER_BUDGET_W='250W'", "e.g. 250", "or unset it"),
    ),
    # -- the commands ------------------------------------------------------------------------------------------
    Mistake(
        "demo from an install without [hf]",
        _cli("demo", python=_NO_HF),
        "cli",
        ("transformers", "not installed", "pip install 'zeus-callbacks[hf]'"),
    ),
    Mistake(
        "demo with an unknown objective",
        _cli("demo", "--selector", "energi"),
        "usage",
        ("--selector", "invalid choice: 'energi'", "'energy'"),
    ),
    Mistake(
        "--max-slowdown 10 meant as 10%",
        _cli("simulate", "--selector", "max-slowdown", "--max-slowdown", "10"),
        "warns",
        ("--max-slowdown 10", "10x as long", "did you mean --max-slowdown 1.10"),
    ),
    Mistake(
        "report of a folder that does not exist",
        _cli("report", "/nonexistent/run"),
        "cli",
        ("/nonexistent/run", "no such folder", "Pass the RUN_DIR"),
    ),
]


def _outcome(row: Mistake, fx: _Fixtures) -> str:
    """Make the mistake; the message it got, checked to be of the row's kind."""
    if isinstance(row.kind, str):
        proc = row.make(fx)
        err = proc.stderr.strip()
        assert "Traceback" not in err or row.kind == "stderr", err
        if row.kind == "warns":  # legal but unlikely: it runs, with one warning
            assert proc.returncode == 0 and len(err.splitlines()) == 1, err
            return err
        assert proc.returncode != 0, (proc.returncode, err)
        if row.kind == "cli":
            assert proc.returncode == 2 and len(err.splitlines()) == 1, err
        if row.kind == "usage":  # argparse's: the usage, then one line naming the option
            assert proc.returncode == 2, err
            err = err.splitlines()[-1]
        return err
    if row.kind is UserWarning:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row.make(fx)
        said = [w for w in caught if issubclass(w.category, UserWarning)]
        assert len(said) == 1, [str(w.message) for w in caught]
        assert said[0].filename == __file__  # points at the user's line, not the library's
        return str(said[0].message)
    with pytest.raises(row.kind) as info:  # type: ignore[arg-type]
        row.make(fx)
    return str(info.value)


def _marks(row: Mistake) -> list:
    return [pytest.mark.system] if isinstance(row.kind, str) else []  # a subprocess


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=_marks(r)) for r in ROWS])
def test_a_mistake_is_named_with_its_fix(row, sim_gpus, monkeypatch):
    """Fails if the mistake is accepted without a word, or met by an error or warning that does not name it
    and say what to do (every word of the row)."""
    monkeypatch.delenv("ZEUS_CALLBACKS_POWER_BUDGET_W", raising=False)
    message = _outcome(row, _Fixtures(sim_gpus, monkeypatch))
    for word in row.words:
        assert word in message, (word, message)


def test_the_table_covers_issue_37s_count():
    """This table and the adapters' (listed in the module docstring, 4 rows) cover issue 37's 28 mistakes."""
    assert len({r.id for r in ROWS}) == len(ROWS) == 25
