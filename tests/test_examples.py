"""Every example runs as a user would start it (single process; the multi-process runs are in the
framework test files), on simulated GPUs, and prints what the optimizer chose."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, tmp_path: Path, *args: str, spec: str | None = None, refresh_ms: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_CALLBACKS_")}
    env["ZEUS_CALLBACKS_SIM_STATE_DIR"] = str(tmp_path / "node")
    if refresh_ms:
        env["ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS"] = refresh_ms
    if spec is not None:
        env["ZEUS_CALLBACKS_SIMULATE"] = spec
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_huggingface_example(tmp_path: Path) -> None:
    out = _run("huggingface/train_power_limit.py", tmp_path, spec="a40", refresh_ms="10")  # toy steps
    assert re.search(r"rank 0: chose (\d+) W \(SIMULATED\) after profiling \[300, ", out), out[-2000:]


@pytest.mark.parametrize("script", ["lightning/train_power_limit.py", "accelerate/train_power_limit.py"])
def test_power_limit_examples(script: str, tmp_path: Path) -> None:
    # The examples' toy steps last a few ms: on the A40's 100 ms energy counter a sample needs dozens of
    # them, more than the example's steps; a 10 ms counter (a fast board's) fits its profile in them.
    out = _run(script, tmp_path, spec="a40", refresh_ms="10")
    found = re.search(r"\(simulated GPU 0\): optimal power limit (\d+) W .*?GPU restored to 300 W", out)
    assert found and 100 <= int(found.group(1)) <= 300, out[-2000:]


def test_pipeline_example(tmp_path: Path) -> None:
    out = _run(
        "pipeline/train_pipeline.py",
        tmp_path,
        *("--before-steps", "3", "--after-steps", "3", "--profile-steps", "2", "--stride-mhz", "90"),
    )
    assert "SIMULATED GPUs: 4x A40" in out
    assert len(re.findall(r"stage \d clocks \(MHz\): \[", out)) == 4, out[-2000:]
    predicted = re.search(r"planner's prediction: energy \+?(-?[\d.]+)% saved, iteration time \+0\.00%", out)
    assert predicted and float(predicted.group(1)) > 5, out[-2000:]
    assert re.search(r"measured: energy [+-][\d.]+% saved", out)
