"""The HTML renderer on synthetic records: the figures and numbers it shows, SIMULATED on every figure of
simulated GPUs, "not given" without an intensity or price, self-contained and well-formed SVG."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from report_builders import pipeline_report, synthetic_record

from zeus_callbacks.core.report.html import render_report, write_report
from zeus_callbacks.core.report.pipeline_plan import pipeline_plan
from zeus_callbacks.core.report.records import write_record
from zeus_callbacks.core.report.svg import nice_ticks, tick_text

SVG_NS = "{http://www.w3.org/2000/svg}"


def svgs(html: str) -> list[ET.Element]:
    """Every inline <svg>, parsed as XML (a malformed one fails the test)."""
    return [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", html, flags=re.S)]


def classes(el: ET.Element) -> set[str]:
    return set(el.get("class", "").split())


def text_of(el: ET.Element) -> str:
    return " ".join(t.text or "" for t in el.iter(f"{SVG_NS}text"))


def test_simulated_run_shows_every_figure_labelled():
    html = render_report([synthetic_record()])
    charts = svgs(html)
    kinds = [sorted(classes(c) - {"chart"}) for c in charts]
    assert kinds.count(["timeline"]) == 2  # one per GPU
    assert kinds.count(["steps"]) == 2 and kinds.count(["profile"]) == 3
    assert all("SIMULATED" in text_of(c) for c in charts)
    assert 'id="simulated-banner"' in html and "<title>Energy report: NVIDIA A40 (SIMULATED)</title>" in html
    # Each timeline draws the power and the limit in force, with units on both axes and a legend.
    timeline = charts[0]
    assert len(timeline.findall(f".//{SVG_NS}polyline")) == 2
    words = text_of(timeline)
    assert "power (W)" in words and "time since the start (s)" in words
    assert "power draw" in words and "power limit" in words
    # The profile: one point per limit, pruned ones hollow, the choice marked.
    profile = charts[4]
    points = profile.findall(f".//{SVG_NS}circle")
    assert len(points) == 3 and [p.get("fill") == "white" for p in points] == [False, True, False]
    assert "chosen 250 W" in text_of(profile)
    # Energy per step: bars averaged over 10 steps (1 s of 0.1 s steps), coloured by the limit in force.
    bars = charts[2].findall(f".//{SVG_NS}rect[@class='bar']")
    assert len(bars) == 10 and len({b.get("fill") for b in bars}) == 2


def test_numbers_energy_co2_cost():
    html = render_report([synthetic_record(carbon=400.0, price=0.2)])
    # 2 GPUs x (50 x 20 J + 50 x 15 J) = 3,500 J = 0.000972 kWh.
    assert "3,500 J" in html
    assert "0.389 g</b> at 400 gCO2eq/kWh (SIMULATED)" in html
    assert "0.000194 USD</b> at 0.2 USD/kWh (SIMULATED)" in html
    assert "25.0% less energy and 5.0% more time per step" in html
    # Run time and energy spent at each limit, from the steps: 5 s and 2,000 J at 300 W.
    row = re.search(r"<tr class=\"\"><td>300 W</td>.*?</tr>", html).group(0)
    assert "<td>5 s</td><td>2,000 J</td>" in row.replace("5.00 s", "5 s")


def test_the_run_energy_shows_its_bound_where_the_record_has_one():
    record = synthetic_record()
    assert "± " not in render_report([record])  # an older record, or a GPU without a counter: no bound
    record.total_energy_bound_j = [100.0, 75.0]
    assert "3,500 J ± 175 J" in render_report([record])


def test_sources_of_intensity_and_price_are_shown():
    record = synthetic_record()
    record.carbon_intensity_source, record.price_source = (
        "Germany, 2023 average, owid-ember-2023",
        "my tariff",
    )
    html = render_report([record])
    assert "at 400 gCO2eq/kWh (Germany, 2023 average, owid-ember-2023)" in html
    assert "USD/kWh (my tariff)" in html


def test_measured_run_without_intensity_or_price():
    html = render_report([synthetic_record(simulated=False, carbon=None, price=None)])
    assert "SIMULATED" not in html
    assert html.count("not given") >= 2
    assert "no carbon intensity given" in html and "no electricity price given" in html


def test_pipeline_plan_drawn_over_the_critical_path():
    record = synthetic_record()
    record.pipeline = pipeline_plan(pipeline_report())
    html = render_report([record])
    (gantt,) = [c for c in svgs(html) if "gantt" in classes(c)]
    boxes = gantt.findall(f".//{SVG_NS}rect[@class]")
    assert len(boxes) == 48
    critical = [b for b in boxes if "critical" in classes(b)]
    assert 0 < len(critical) < 48 and all(b.get("stroke") == "#111" for b in critical)
    assert "SIMULATED" in text_of(gantt) and "stage 3" in text_of(gantt)
    assert "time within the iteration (ms)" in text_of(gantt)
    assert "MHz" in text_of(gantt)
    assert "1f1b schedule, 4 stages, 6 microbatches" in html


def test_pipeline_plan_of_a_schedule_not_rebuilt_still_lists_the_clocks():
    report = pipeline_report()
    report["schedule"] = "custom"
    plan = pipeline_plan(report)
    assert plan is not None and plan.instructions == ()
    record = synthetic_record()
    record.pipeline = plan
    html = render_report([record])
    assert "cannot be redrawn" in html and "<td>stage 3</td>" in html


def test_several_ranks_are_one_job():
    html = render_report([synthetic_record(rank=0), synthetic_record(rank=1)])
    assert sum("timeline" in classes(c) for c in svgs(html)) == 4
    assert "GPU 1 (rank 1" in html and "7,000 J" in html


def test_self_contained_and_escaped(tmp_path: Path):
    record = synthetic_record(title='<script>alert("x")</script>')
    write_record(tmp_path / "record.rank0.json", record)
    out = write_report(tmp_path, tmp_path / "out" / "r.html")
    html = out.read_text()
    assert "<script" not in html and "&lt;script&gt;" in html
    assert not re.search(r"\b(src|href)=", html) and "@import" not in html and "url(" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}


def test_run_without_steps_or_optimizer():
    record = synthetic_record()
    record.steps, record.samples, record.power_limit = [], [], None
    html = render_report([record])
    assert "No training step was recorded" in html and "No power samples" in html
    assert "No power-limit optimizer ran" in html


def test_nice_ticks():
    assert nice_ticks(0, 330) == [0, 100, 200, 300, 400]
    assert nice_ticks(0, 65.2, 8) == [0, 10, 20, 30, 40, 50, 60, 70]
    assert tick_text(nice_ticks(0, 1.2))(0.6) == "0.6"
    assert tick_text([0, 20])(40) == "40"


def test_no_records_is_an_error():
    with pytest.raises(ValueError, match="no records"):
        render_report([])
