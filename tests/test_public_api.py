"""The package root: lazy, star-importable with the core dependencies only, and enough for every example."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zeus_callbacks

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")


@pytest.mark.system
def test_star_import_needs_no_framework(run_python) -> None:
    code = (
        "import sys\n"
        "from zeus_callbacks import *\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "name",
    [
        "HFZeusMonitor",
        "HFGlobalPowerLimitOptimizer",
        "HFPipelineFrequencyOptimizer",
        "HFHeterogeneousCallback",
        "HeterogeneousTrainer",
        "HFEpochLog",
        "LightningZeusMonitor",
        "LightningGlobalPowerLimitOptimizer",
        "LightningPipelineFrequencyOptimizer",
        "LightningHeterogeneous",
        "LightningEpochLog",
        "instrument_megatron",
        "instrument_deepspeed",
    ],
)
def test_adapters_are_importable_by_name_but_not_starred(name: str) -> None:
    assert name not in zeus_callbacks.__all__
    assert name in dir(zeus_callbacks)
    assert getattr(zeus_callbacks, name).__name__ == name


def test_every_starred_name_resolves() -> None:
    for name in zeus_callbacks.__all__:
        assert getattr(zeus_callbacks, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        zeus_callbacks.nothing  # noqa: B018


def test_version_comes_from_one_module() -> None:
    from zeus_callbacks.version import __version__

    assert zeus_callbacks.__version__ == __version__


def test_examples_import_only_public_modules() -> None:
    public = {"zeus_callbacks", "zeus_callbacks.huggingface", "zeus_callbacks.accelerate"}
    public |= {"zeus_callbacks.lightning", "zeus_callbacks.lightning.pl", "zeus_callbacks.sim"}
    public |= {"zeus_callbacks.megatron", "zeus_callbacks.deepspeed"}  # the pipeline engines' adapters
    for script in sorted((ROOT / "examples").rglob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zeus_callbacks"):
                assert node.module in public, f"{script.relative_to(ROOT)} imports {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("zeus_callbacks."), f"{script} imports {alias.name}"


def test_zeus_small_utilities_are_exported_with_zeus_signatures(monkeypatch) -> None:
    """Zeus's `zeus.utils.env.get_env` (its `train_single.py` reads `ZEUS_MAX_SLOWDOWN` with it) and
    `zeus.utils.metric.zeus_cost`, importable from the package root with the same parameters."""
    import inspect

    from zeus_callbacks import get_env, zeus_cost

    assert {"get_env", "zeus_cost"} <= set(zeus_callbacks.__all__)
    assert list(inspect.signature(get_env).parameters) == ["name", "valtype", "default"]
    assert list(inspect.signature(zeus_cost).parameters) == ["energy", "time", "eta_knob", "max_power"]
    monkeypatch.delenv("ZEUS_MAX_SLOWDOWN", raising=False)
    assert get_env("ZEUS_MAX_SLOWDOWN", float, 1.1) == 1.1  # train_single.py's call
    monkeypatch.setenv("ZC_TEST_INT", "123")
    assert get_env("ZC_TEST_INT", int) == 123 and get_env("ZC_TEST_INT", int, default=321) == 123
    assert get_env("ZC_TEST_INT", str) == "123"
    for raw, want in (("true", True), ("True", True), ("false", False), ("FALSE", False)):
        monkeypatch.setenv("ZC_TEST_BOOL", raw)
        assert get_env("ZC_TEST_BOOL", bool) is want
    monkeypatch.setenv("ZC_TEST_BOOL", "fault")
    with pytest.raises(ValueError, match=r"Strange boolean .*ZC_TEST_BOOL='fault'.*true or false"):
        get_env("ZC_TEST_BOOL", bool)
    monkeypatch.delenv("ZC_TEST_NONE", raising=False)
    with pytest.raises(ValueError, match=r"Missing environment variable 'ZC_TEST_NONE': set it"):
        get_env("ZC_TEST_NONE", str)
    assert get_env("ZC_TEST_NONE", int, default=123) == 123
    monkeypatch.setenv("ZC_TEST_INT", "12x")
    with pytest.raises(ValueError, match=r"ZC_TEST_INT='12x' is not a valid int"):
        get_env("ZC_TEST_INT", int)
    assert zeus_cost(energy=2000.0, time=10.0, eta_knob=0.25, max_power=300) == 0.25 * 2000 + 0.75 * 300 * 10
    assert zeus_cost(100.0, 1.0, 1.0, 300) == 100.0 and zeus_cost(100.0, 1.0, 0.0, 300) == 300.0


def test_zeus_metric_classes_are_exported_with_zeus_signatures() -> None:
    """`zeus.metric`'s `EnergyHistogram`, `EnergyCumulativeCounter`, `PowerGauge`: Zeus's parameters, in its
    order, with its defaults (ours add only the keyword-only `prometheus_url`, the name Zeus's docs use)."""
    import inspect

    zeus_metric = pytest.importorskip("zeus.metric")
    for name in ("EnergyHistogram", "EnergyCumulativeCounter", "PowerGauge"):
        assert name in zeus_callbacks.__all__
        ours = inspect.signature(getattr(zeus_callbacks, name)).parameters
        theirs = inspect.signature(getattr(zeus_metric, name)).parameters
        assert list(ours)[: len(theirs)] == list(theirs), name
        assert [p for p in ours if p not in theirs] == ["prometheus_url"], name
        for p, zp in theirs.items():
            if zp.default is not inspect.Parameter.empty:
                assert list(ours[p].default) == list(zp.default), (name, p)
