"""The package root: lazy, star-importable with the core dependencies only, and enough for every example."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zeus_callbacks

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")


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
        "HFSimulatedGPUWork",
        "LightningZeusMonitor",
        "LightningGlobalPowerLimitOptimizer",
        "LightningPipelineFrequencyOptimizer",
        "LightningHeterogeneous",
        "LightningEpochLog",
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
    for script in sorted((ROOT / "examples").rglob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zeus_callbacks"):
                assert node.module in public, f"{script.relative_to(ROOT)} imports {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("zeus_callbacks."), f"{script} imports {alias.name}"
