"""Render a recorded run (`run_record`) as one self-contained HTML file: inline SVG and CSS, no script, no
network; every figure of simulated GPUs labelled SIMULATED."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from zeus_callbacks.core.files import write_atomic
from zeus_callbacks.core.report.pipeline_figure import pipeline_section
from zeus_callbacks.core.report.records import PowerLimitSummary, RankRecord, StepSpan
from zeus_callbacks.core.report.run_record import load_run
from zeus_callbacks.core.report.saving import saving_text
from zeus_callbacks.core.report.svg import PALETTE, Chart, Series, color_scale, fmt, sim_tag
from zeus_callbacks.version import __version__

__all__ = ["render_report", "write_report"]

_MAX_POINTS = 1500  # per series drawn: a browser draws more, a reader sees no more
_MAX_BARS = 300
_MIN_BAR_S = 1.0
_J_PER_KWH = 3.6e6

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2433;background:#f4f6f9}
main{max-width:960px;margin:0 auto;padding:18px 20px 40px}
h1{font-size:22px;margin:6px 0 2px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #d5dae3;padding-bottom:4px}
.sub{color:#5a6475;margin:0 0 12px}
.banner{background:#b3261e;color:#fff;font-weight:700;letter-spacing:.04em;padding:8px 20px;text-align:center}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{background:#fff;border:1px solid #d5dae3;border-radius:8px;padding:10px 14px;min-width:150px;flex:1}
.card .k{color:#5a6475;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:20px;font-weight:650} .card .n{color:#5a6475;font-size:12px}
svg.chart,svg.gantt{background:#fff;border:1px solid #d5dae3;border-radius:8px;display:block;margin:8px 0;max-width:100%;height:auto}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
svg .title{font-size:13px;font-weight:650;fill:#1d2433} svg .sim-tag{font-size:12px;font-weight:700;fill:#b3261e}
svg .tick{font-size:11px;fill:#5a6475} svg .label{font-size:12px;fill:#1d2433}
svg .grid{stroke:#e6e9ef} svg .axis{stroke:#8a93a3} svg .frame{stroke:#8a93a3}
svg .legend{font-size:11.5px;fill:#1d2433} svg .legend-box{fill:#fff;fill-opacity:.85;stroke:#d5dae3}
svg .marker{stroke-width:1.5;stroke-dasharray:4 3} svg .marker-label{font-size:11px;font-weight:600}
table{border-collapse:collapse;background:#fff;margin:8px 0;font-size:13px}
th,td{border:1px solid #d5dae3;padding:4px 9px;text-align:right} th{background:#eef1f6} td.l,th.l{text-align:left}
tr.chosen td{background:#e3f4ea;font-weight:650}
.note{color:#5a6475;font-size:12.5px} .missing{color:#8a5a00}
footer{color:#5a6475;font-size:12px;margin-top:30px}
"""


def write_report(run_dir: str | Path, out_path: str | Path) -> Path:
    """Read the run recorded in `run_dir` and write its report to `out_path` (atomically).

    Raises:
        InvalidInputError: no readable run record in `run_dir` (the message says what to pass).
        OSError: `out_path` cannot be written.
    """
    html = render_report(load_run(run_dir))
    out = Path(out_path)
    write_atomic(out, html, mode=0o644)  # for a browser or a web server: others may read it
    return out


def render_report(records: list[RankRecord]) -> str:
    """The report of every rank's record of one run, as an HTML document."""
    if not records:
        raise ValueError("render_report: no records to render.")
    first = records[0]
    sim = any(r.simulated for r in records)
    tag = " (SIMULATED)" if sim else ""
    gpus = sum(len(r.gpus) for r in records)
    started = datetime.fromtimestamp(first.started_unix_s, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    status = "finished" if all(r.finished for r in records) else "did not finish"
    failed = [r.failed for r in records if r.failed]
    body = [
        f"<h1>Energy report: {escape(first.title)}{tag}</h1>",
        f'<p class="sub">{gpus} GPU(s) over {len(records)} process(es); started {started}; '
        f"{_duration(max(r.duration_s for r in records))}; run {status}"
        + (f": {escape(failed[0])}" if failed else "")
        + ".</p>",
        _cards(records, sim),
        '<h2 id="timeline">Power over time, per GPU</h2>',
        *_timelines(records, sim),
        '<h2 id="steps">Energy per step</h2>',
        *_step_charts(records, sim),
    ]
    pl = next((r.power_limit for r in records if r.power_limit is not None), None)
    body += ['<h2 id="power-limit">Power-limit profile</h2>', *_power_limit(pl, records, sim)]
    plan = next((r.pipeline for r in records if r.pipeline is not None), None)
    if plan is not None:
        body += ['<h2 id="pipeline">Pipeline plan</h2>', *pipeline_section(plan, sim)]
    body += ['<h2 id="totals">Energy, CO2eq and cost</h2>', _totals(records, sim)]
    body.append(
        f"<footer>Written by zeus-callbacks {escape(__version__)} from {len(records)} run record(s) "
        f"(format version 1). "
        + ("Every figure marked SIMULATED comes from simulated GPUs, not a measurement." if sim else "")
        + "</footer>"
    )
    banner = (
        '<div class="banner" id="simulated-banner">SIMULATED GPUs: every figure in this report is a simulation, '
        "not a measurement</div>"
        if sim
        else ""
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>Energy report: {escape(first.title)}{tag}</title><style>{_CSS}</style></head>"
        f"<body>{banner}<main>{''.join(body)}</main></body></html>\n"
    )


# -- figures ---------------------------------------------------------------------------------------
def _energy_j(r: RankRecord) -> list[float | None]:
    """Each GPU's energy over the run: the counter's, else the sum of its steps."""
    out = []
    for k in range(len(r.gpus)):
        total = r.total_energy_j[k] if k < len(r.total_energy_j) else None
        if total is None:
            parts = [s.energy_j[k] for s in r.steps]
            total = sum(parts) if parts and None not in parts else None  # type: ignore[arg-type]
        out.append(total)
    return out


def _run_energy(records: list[RankRecord]) -> float | None:
    values = [e for r in records for e in _energy_j(r)]
    return None if not values or None in values else sum(values)  # type: ignore[arg-type]


def _run_energy_bound(records: list[RankRecord]) -> float | None:
    """The run energy's bound (J): every GPU's summed, None where one lacks it (an older record, a GPU
    without a counter)."""
    bounds = [b for r in records for b in (r.total_energy_bound_j or [None] * len(r.gpus))]
    return None if not bounds or None in bounds else sum(bounds)  # type: ignore[arg-type]


def _cards(records: list[RankRecord], sim: bool) -> str:
    energy = _run_energy(records)
    first = records[0]
    steps = max((s.last_step for r in records for s in r.steps), default=0)
    duration = max(r.duration_s for r in records)
    label = '<div class="n">SIMULATED</div>' if sim else ""
    cards = [("Steps", f"{steps:,}", ""), ("Time", _duration(duration), "")]
    if energy is None:
        cards.append(("Energy", "unknown", '<div class="n">a GPU did not answer</div>'))
    else:
        bound = _run_energy_bound(records)
        cards.append(
            ("GPU energy", _energy(energy) + ("" if bound is None else f" ± {_energy(bound)}"), label)
        )
        if duration > 0:
            cards.append(("Mean power, all GPUs", f"{fmt(energy / duration)} W", label))
        cards.append(
            ("CO2eq", _co2(energy, first), label if first.carbon_intensity_gco2_per_kwh is not None else "")
        )
        cards.append(("Cost", _cost(energy, first), label if first.price_per_kwh is not None else ""))
    pl = next((r.power_limit for r in records if r.power_limit is not None), None)
    if pl is not None and pl.optimal_power_limit_w is not None:
        saved = "" if pl.energy_saved_pct is None else f"{pl.energy_saved_pct:.1f}% energy/step saved"
        cards.append(
            (
                "Chosen power limit",
                f"{pl.optimal_power_limit_w} W",
                f'<div class="n">{saved}{sim_tag(sim)}</div>',
            )
        )
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="k">{escape(k)}</div><div class="v">{escape(v)}</div>{n}</div>'
            for k, v, n in cards
        )
        + "</div>"
    )


def _timelines(records: list[RankRecord], sim: bool) -> list[str]:
    t0 = min(r.started_unix_s for r in records)
    span = max(r.started_unix_s - t0 + r.duration_s for r in records)
    scale, unit = _time_unit(span)
    out = []
    for r in records:
        offset = r.started_unix_s - t0 if len(records) > 1 else 0.0
        samples = _thin(r.samples)
        xs = [(offset + s.t_s) / scale for s in samples]
        for k, g in enumerate(r.gpus):
            rank = f"rank {r.rank}, " if len(records) > 1 else ""
            chart = Chart(
                title=f"GPU {g.index} ({rank}{g.name}): power and the power limit in force{sim_tag(r.simulated)}",
                x_label=f"time since the start ({unit})",
                y_label="power (W)",
                simulated=r.simulated,
                css_class="chart timeline",
            )
            power = [s.power_w[k] for s in samples]
            limit = [s.power_limit_w[k] for s in samples]
            chart.series.append(Series("power draw", xs, power, PALETTE[0]))
            chart.series.append(Series("power limit", xs, limit, PALETTE[3], kind="step", dashed=True))
            top = max([v for v in (*power, *limit, g.max_power_limit_w) if v is not None] or [1.0])
            chart.y_range = (0.0, top * 1.12)
            chart.x_range = (0.0, span / scale)
            out.append(chart.render())
        if not r.samples:
            out.append('<p class="missing">No power samples were recorded.</p>')
    out.append(
        f'<p class="note">Power is read from the GPU driver every {records[0].sample_interval_s:g} s '
        "(instantaneous draw where the GPU offers it); the dashed line is the power limit in force.</p>"
    )
    return out


def _job_steps(records: list[RankRecord]) -> list[tuple[StepSpan, float | None]]:
    """Rank 0's step spans, each with the job's energy (every rank's GPUs) over the same steps."""
    by_span: dict[tuple[int, int], list[float | None]] = defaultdict(list)
    for r in records:
        for s in r.steps:
            by_span[s.first_step, s.last_step].extend(s.energy_j)
    out: list[tuple[StepSpan, float | None]] = []
    for s in records[0].steps:
        parts = by_span[s.first_step, s.last_step]
        out.append((s, None if None in parts or not parts else sum(parts)))  # type: ignore[arg-type]
    return out


def _bars(steps: list[tuple[StepSpan, float | None]]) -> tuple[list[tuple[StepSpan, float | None]], int]:
    """Consecutive steps at one power limit grouped into bars of `k` steps each (returned): at most about
    `_MAX_BARS` bars, each spanning at least `_MIN_BAR_S` so the energy counter's refreshes (20-100 ms) even
    out."""
    times = sorted(s.time_s / s.num_steps for s, _ in steps)
    median = times[len(times) // 2] if times else 0.0
    total = sum(s.num_steps for s, _ in steps)
    k = max(1, math.ceil(total / _MAX_BARS), math.ceil(_MIN_BAR_S / median) if median > 0 else 1)
    out: list[tuple[StepSpan, float | None]] = []
    group: list[tuple[StepSpan, float | None]] = []

    def close() -> None:
        if group:
            a, b = group[0][0], group[-1][0]
            energies = [e for _, e in group]
            energy = None if None in energies else sum(energies)  # type: ignore[arg-type]
            span = StepSpan(
                a.first_step,
                b.last_step,
                b.end_s,
                sum(s.time_s for s, _ in group),
                (energy,),
                b.power_limit_w,
            )
            out.append((span, energy))
            group.clear()

    for s, e in steps:
        if group and (
            s.power_limit_w != group[-1][0].power_limit_w
            or sum(g.num_steps for g, _ in group) + s.num_steps > k
        ):
            close()
        group.append((s, e))
    close()
    return out, k


def _step_charts(records: list[RankRecord], sim: bool) -> list[str]:
    steps, per_bar = _bars(_job_steps(records))
    if not steps:
        return ['<p class="missing">No training step was recorded.</p>']
    limits = sorted(
        {s.power_limit_w[0] for s, _ in steps if s.power_limit_w and s.power_limit_w[0] is not None}
    )
    lo, hi = (limits[0], limits[-1]) if limits else (0.0, 1.0)

    def color(s: StepSpan) -> str:
        pl = s.power_limit_w[0] if s.power_limit_w else None
        return "#9aa3b2" if pl is None else color_scale(1 - (pl - lo) / (hi - lo) if hi > lo else 0.4)

    xs = [(s.first_step + s.last_step) / 2 for s, _ in steps]
    energy = [None if e is None else e / s.num_steps for s, e in steps]
    tips = [
        f"step {s.first_step}"
        + (f"-{s.last_step}" if s.num_steps > 1 else "")
        + (f": {fmt(e)} J/step" if e is not None else "")
        + (f" at {fmt(s.power_limit_w[0])} W" if s.power_limit_w and s.power_limit_w[0] is not None else "")
        for (s, _), e in zip(steps, energy, strict=True)
    ]
    e_chart = Chart(
        title=f"Energy per step, all GPUs, coloured by the power limit in force{sim_tag(sim)}",
        x_label="training step",
        y_label="energy per step (J)",
        simulated=sim,
        legend=False,
        css_class="chart steps",
        x_format=lambda v: f"{v:,.0f}",
    )
    e_chart.series.append(
        Series(
            "energy",
            xs,
            energy,
            PALETTE[0],
            kind="bars",
            tips=tips,
            colors=[color(s) for s, _ in steps],
            widths=[0.92 * s.num_steps for s, _ in steps],
        )
    )
    t_chart = Chart(
        title=f"Time per step{sim_tag(sim)}",
        x_label="training step",
        y_label="time per step (ms)",
        simulated=sim,
        height=200,
        legend=False,
        css_class="chart steps",
        x_format=lambda v: f"{v:,.0f}",
    )
    t_chart.series.append(Series("time", xs, [1000 * s.time_s / s.num_steps for s, _ in steps], PALETTE[0]))
    for chart in (e_chart, t_chart):
        chart.x_range = (steps[0][0].first_step - 0.5, steps[-1][0].last_step + 0.5)
    shown = limits if len(limits) <= 12 else limits[:: math.ceil(len(limits) / 12)]
    key = " ".join(
        f'<span style="display:inline-block;width:11px;height:11px;background:{color_scale(1 - (pl - lo) / (hi - lo) if hi > lo else 0.4)};'
        f'border:1px solid #8a93a3;vertical-align:-1px"></span> {fmt(pl)} W'
        for pl in shown
    )
    grouped = (
        f" Each bar averages up to {per_bar} consecutive steps at one limit (the energy counter moves every "
        "20-100 ms)."
        if per_bar > 1
        else ""
    )
    return [e_chart.render(), f'<p class="note">Power limit: {key}.{grouped}</p>', t_chart.render()]


def _power_limit(pl: PowerLimitSummary | None, records: list[RankRecord], sim: bool) -> list[str]:
    if pl is None:
        return ['<p class="note">No power-limit optimizer ran: not given.</p>']
    rows = sorted(pl.rows, key=lambda r: r.power_limit_w)
    if not rows:
        return [f'<p class="missing">The optimizer measured no power limit (phase {escape(pl.phase)}).</p>']
    xs = [r.power_limit_w for r in rows]
    tips = [f"{r.power_limit_w} W: {r.steps} steps{', pruned' if r.pruned else ''}" for r in rows]
    hollow = [r.pruned for r in rows]
    chosen = pl.optimal_power_limit_w
    markers = [(float(chosen), f"chosen {chosen} W", PALETTE[2])] if chosen is not None else []
    charts = []
    for title, ylab, ys in (
        ("Time per step at each power limit", "time per step (ms)", [1000 * r.time_per_step_s for r in rows]),
        ("Energy per step at each power limit", "energy per step (J)", [r.energy_per_step_j for r in rows]),
        (f"The selector's cost, {pl.selector} (lowest is chosen)", "cost", [r.cost for r in rows]),
    ):
        if all(y is None for y in ys):
            charts.append(
                f'<p class="note">{escape(pl.selector)} has no cost curve: it chooses by a rule.</p>'
            )
            continue
        c = Chart(
            title + sim_tag(sim),
            "power limit (W)",
            ylab,
            height=220,
            simulated=sim,
            legend=False,
            markers=markers,
            css_class="chart profile",
        )
        c.series.append(Series("", xs, ys, PALETTE[0], dashed=True))
        c.series.append(Series("measured", xs, ys, PALETTE[0], kind="points", hollow=hollow, tips=tips))
        span = max(xs) - min(xs) or 50
        c.x_range = (min(xs) - 0.04 * span, max(xs) + 0.04 * span)
        charts.append(c.render())
    spent: dict[float, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s, e in _job_steps(records):
        if s.power_limit_w and s.power_limit_w[0] is not None:
            spent[s.power_limit_w[0]][0] += s.time_s
            spent[s.power_limit_w[0]][1] += e or 0.0
    head = "<tr><th>power limit</th><th>time/step</th><th>energy/step</th><th>cost</th><th>steps measured</th><th>run time at it</th><th>run energy at it</th></tr>"
    body = []
    for r in sorted(pl.rows, key=lambda r: -r.power_limit_w):
        t, e = spent.get(float(r.power_limit_w), (0.0, 0.0))
        body.append(
            f'<tr class="{"chosen" if r.power_limit_w == chosen else ""}"><td>{r.power_limit_w} W{" (chosen)" if r.power_limit_w == chosen else ""}</td>'
            f"<td>{fmt(1000 * r.time_per_step_s)} ms</td><td>{fmt(r.energy_per_step_j)} J</td>"
            f"<td>{'n/a' if r.cost is None else fmt(r.cost, 4)}</td><td>{r.steps}{' (pruned)' if r.pruned else ''}</td>"
            f"<td>{_duration(t)}</td><td>{_energy(e)}</td></tr>"
        )
    if chosen is None:
        choice = f"No limit chosen (phase {escape(pl.phase)}{': ' + escape(pl.reason) if pl.reason else ''})."
    else:
        choice = f"Chosen: <b>{chosen} W</b>{'' if pl.applied else ' (not applied)'}"
        choice += f": {escape(saving_text(asdict(pl)))}"
        choice += f"{sim_tag(sim)}."
    note = (
        f"<p>{choice} Selector {escape(pl.selector)}, search {escape(pl.search)}; profiling took "
        f"{pl.profiling_steps} steps and {_energy(pl.profiling_energy_j)}. Hollow points: limits pruned "
        "early by the search.</p>"
    )
    return [note, *charts, f'<table class="profile">{head}{"".join(body)}</table>']


def _totals(records: list[RankRecord], sim: bool) -> str:
    rows = []
    for r in records:
        for g, e in zip(r.gpus, _energy_j(r), strict=True):
            power = "n/a" if e is None or r.duration_s <= 0 else f"{fmt(e / r.duration_s)} W"
            rows.append(
                f'<tr><td class="l">GPU {g.index}{f" (rank {r.rank})" if len(records) > 1 else ""}</td><td class="l">{escape(g.name)}</td>'
                f'<td class="l">{escape(g.uuid)}</td><td>{"unknown" if e is None else _energy(e)}</td><td>{power}</td></tr>'
            )
    energy = _run_energy(records)
    first = records[0]
    total = "unknown" if energy is None else _energy(energy)
    rows.append(
        f'<tr><td class="l" colspan="3"><b>All GPUs</b>{sim_tag(sim)}</td><td><b>{total}</b></td><td></td></tr>'
    )
    co2 = "unknown" if energy is None else _co2(energy, first)
    cost = "unknown" if energy is None else _cost(energy, first)
    intensity = first.carbon_intensity_gco2_per_kwh
    price = first.price_per_kwh
    lines = (
        f"<p>CO2eq: <b>{co2}</b>"
        + (f" at {intensity:g} gCO2eq/kWh" if intensity is not None else " (no carbon intensity given)")
        + _source(intensity, first.carbon_intensity_source)
        + f"{sim_tag(sim) if intensity is not None else ''}. "
        f"Cost: <b>{cost}</b>"
        + (
            f" at {price:g} {escape(first.currency)}/kWh"
            if price is not None
            else " (no electricity price given)"
        )
        + _source(price, first.price_source)
        + f"{sim_tag(sim) if price is not None else ''}. GPU energy only (CPU, memory and cooling not counted).</p>"
    )
    head = '<tr><th class="l">GPU</th><th class="l">model</th><th class="l">UUID</th><th>energy</th><th>average power</th></tr>'
    return f'<table class="totals">{head}{"".join(rows)}</table>{lines}'


def _source(value: float | None, source: str | None) -> str:
    return f" ({escape(source)})" if value is not None and source else ""


# -- units -----------------------------------------------------------------------------------------
def _thin(samples: list) -> list:
    step = math.ceil(len(samples) / _MAX_POINTS) if samples else 1
    return samples[::step] if step > 1 else samples


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s < 180:
        return 1.0, "s"
    if span_s < 3 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{fmt(seconds)} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _energy(joules: float) -> str:
    if joules < 1e4:
        return f"{fmt(joules)} J"
    if joules < 3.6e5:
        return f"{fmt(joules / 1000)} kJ"
    return f"{fmt(joules / _J_PER_KWH)} kWh"


def _co2(energy_j: float, r: RankRecord) -> str:
    if r.carbon_intensity_gco2_per_kwh is None:
        return "not given"
    grams = energy_j / _J_PER_KWH * r.carbon_intensity_gco2_per_kwh
    return f"{fmt(grams)} g" if grams < 1000 else f"{fmt(grams / 1000)} kg"


def _cost(energy_j: float, r: RankRecord) -> str:
    if r.price_per_kwh is None:
        return "not given"
    return f"{fmt(energy_j / _J_PER_KWH * r.price_per_kwh, 3)} {r.currency}"
