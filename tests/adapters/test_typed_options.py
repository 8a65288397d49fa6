"""A type checker sees every power-limit option of every power-limit adapter (issue 39: `**options: Any` hid
them): mypy, run on a user's script, names a misspelt option and a wrongly typed one, and accepts the
right ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

pytestmark = pytest.mark.system  # a subprocess (tests/tiers.py)

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from zeus_callbacks import ZeusMonitor
from zeus_callbacks.accelerate import PowerLimitOptimizerHelper, prepare_power_limit_optimizer
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer
from zeus_callbacks.ignite import IgnitePowerLimitOptimizer
from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer

m = ZeusMonitor([0])
HFGlobalPowerLimitOptimizer(m, profile_steps=20, search="sweep", report_path="r.html")
LightningGlobalPowerLimitOptimizer(m, wait_steps=2, allow_raising_limit=True)
GlobalPowerLimitOptimizer(m, profile_path="p.json", pl_step=50)
HFGlobalPowerLimitOptimizer(m, warmup=3)
LightningGlobalPowerLimitOptimizer(m, profile_steps="20")
IgnitePowerLimitOptimizer(m, pl_stepp=10)
PowerLimitOptimizerHelper(None, wait_step=1)
prepare_power_limit_optimizer(None, report_path=3)
GlobalPowerLimitOptimizer(m, report_path="r.html")
"""

EXPECTED = {  # line of SCRIPT -> what mypy says there
    13: 'Unexpected keyword argument "warmup" for "HFGlobalPowerLimitOptimizer"',
    14: 'Argument "profile_steps" to "LightningGlobalPowerLimitOptimizer" has incompatible type "str"',
    15: 'Unexpected keyword argument "pl_stepp" for "IgnitePowerLimitOptimizer"',
    16: 'Unexpected keyword argument "wait_step" for "PowerLimitOptimizerHelper"',
    17: 'Argument "report_path" to "prepare_power_limit_optimizer" has incompatible type "int"',
    18: 'Unexpected keyword argument "report_path" for "GlobalPowerLimitOptimizer"',
}


def test_mypy_names_each_wrong_option_and_accepts_the_right_ones(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "mypy.ini"  # the frameworks are not what is checked: skipped, it takes seconds
    config.write_text(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n"
        "[mypy-torch.*,transformers.*,lightning.*,lightning_fabric.*,pytorch_lightning.*,accelerate.*,ignite.*,"
        "numpy.*,scipy.*,deepspeed.*,pandas.*,matplotlib.*]\nfollow_imports = skip\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(tmp_path / "cache"),
         str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    errors = {}
    for line in out.stdout.splitlines():
        if ": error: " in line:
            where, message = line.split(": error: ", 1)
            errors[int(where.rsplit(":", 1)[1])] = message
    assert sorted(errors) == sorted(EXPECTED), out.stdout + out.stderr
    for line, words in EXPECTED.items():
        assert words in errors[line], (line, errors[line])
