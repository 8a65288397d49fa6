"""`zeus-callbacks report` on the directory of a run on two simulated AMD MI300Xs (virtual clock, reached through
the real `amdsmi` package): the GPUs are named and labelled SIMULATED with their figures, and the page names no
other vendor's library."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from helpers import run_cli
from report_builders import simulated_run

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("amdsmi") is None, reason="the amd extra is not installed"
)


def _text(html: str) -> str:
    """The page's visible text, one space between pieces (charts and styles left out)."""
    html = re.sub(r"<(svg|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_report_of_an_mi300x_run_names_both_gpus_simulated_with_their_figures(tmp_path: Path, capsys):
    from zeus_callbacks import sim

    _, opt, steps = simulated_run(tmp_path / "run", spec="2*mi300x", steps_after_choice=20)
    uuids = [g.uuid for g in sim.active().gpus]
    rc, stdout, err = run_cli(capsys, ["report", str(tmp_path / "run")])
    assert rc == 0, err
    html = (tmp_path / "run" / "report.html").read_text()
    text = _text(html)
    assert "Energy report: AMD Instinct MI300X (SIMULATED)" in text and 'id="simulated-banner"' in html
    assert f"Steps {steps} " in text
    for i, uuid in enumerate(uuids):  # each GPU's row: its index, model, UUID, energy (kJ) and mean power (W)
        assert re.search(rf"GPU {i} AMD Instinct MI300X {uuid} [\d.]+ kJ \d+ W", text), text
    chosen = opt.optimal_power_limit_w
    assert 250 <= chosen < 750 and f"Chosen power limit {chosen} W" in text
    assert "750 W " in text and "250 W " in text  # the profile spans the MI300X's 250-750 W
    assert "NVML" not in html  # AMD GPUs are read through amdsmi: the page names no NVIDIA library
