"""The report as a person sees it: `zeus-callbacks demo --report` opened in headless Chromium renders its
figures with no console message, and its screenshot shows them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from browser import CHROMIUM, SKIP_REASON, open_page
from report_builders import pipeline_report, synthetic_record

from zeus_callbacks.core.report.html import write_report
from zeus_callbacks.core.report.pipeline_plan import pipeline_plan
from zeus_callbacks.core.report.records import write_record

pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON), pytest.mark.slow]

DEMO_ARGS = ["demo", "--steps", "60", "--warmup-steps", "1", "--profile-steps", "4", "--pl-step", "100"]
BANNER_RED = (0xB3, 0x26, 0x1E)


def count(dom: str, cls: str) -> int:
    return len(re.findall(rf'<svg class="[^"]*\b{cls}\b', dom))


def pixels(png: Path) -> tuple[int, int, set]:
    from PIL import Image

    with Image.open(png) as im:
        rgb = im.convert("RGB")
        top = {rgb.getpixel((x, 10)) for x in range(0, rgb.width, 10)}
        sample = {rgb.getpixel((x, y)) for x in range(0, rgb.width, 7) for y in range(0, rgb.height, 7)}
        return rgb.width, rgb.height, top | sample


def test_the_harness_sees_console_errors(tmp_path: Path):
    page = tmp_path / "broken.html"
    page.write_text('<html><body><p>x</p><script>console.error("planted"); no_such();</script></body></html>')
    seen = open_page(page, tmp_path / "broken.png", height=200)
    assert any("planted" in m for m in seen.console) and any("no_such" in m for m in seen.console)


def test_demo_report_renders_in_chromium(sim_state_dir, tmp_path: Path, capsys):
    from zeus_callbacks.cli import main

    report = tmp_path / "demo.html"
    args = [
        *DEMO_ARGS,
        "--noise",
        "0",
        "--report",
        str(report),
        "--carbon-intensity",
        "380",
        "--price",
        "0.15",
    ]
    assert main(args) == 0
    assert f"Report written to {report}" in capsys.readouterr().out
    assert (tmp_path / "demo.run" / "record.rank0.json").exists()
    page = open_page(report, tmp_path / "demo.png", height=2600)
    assert page.console == []
    assert 'id="simulated-banner"' in page.dom
    assert (
        count(page.dom, "timeline") == 1 and count(page.dom, "steps") == 2 and count(page.dom, "profile") == 3
    )
    assert page.dom.count("<polyline") >= 3 and page.dom.count('class="bar"') >= 5
    assert "Chosen: <b>" in page.dom and "gCO2eq/kWh" in page.dom
    width, height, colours = pixels(page.screenshot)
    assert (width, height) == (1000, 2600)
    assert BANNER_RED in colours  # the SIMULATED banner is drawn
    assert len(colours) > 50  # figures, not a blank page


def test_pipeline_plan_renders_in_chromium(tmp_path: Path):
    record = synthetic_record()
    record.pipeline = pipeline_plan(pipeline_report())
    write_record(tmp_path / "run" / "record.rank0.json", record)
    out = write_report(tmp_path / "run", tmp_path / "pipeline.html")
    page = open_page(out, tmp_path / "pipeline.png", height=2900)
    assert page.console == []
    assert count(page.dom, "gantt") == 1 and page.dom.count('class="inst critical"') > 0
