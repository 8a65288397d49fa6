"""The pipeline plan's part of the run report: a Gantt chart of one planned iteration (stages as rows,
instructions coloured by SM clock, the critical path outlined) and the clocks per stage."""

from __future__ import annotations

import math
from html import escape

from zeus_callbacks.core.report.records import PipelinePlan
from zeus_callbacks.core.report.svg import color_scale, fmt, nice_ticks, sim_tag, tick_text

__all__ = ["pipeline_section"]


def pipeline_section(plan: PipelinePlan, sim: bool) -> list[str]:
    """The section's HTML: the plan in words, its Gantt chart (when the schedule can be rebuilt), the clocks."""
    out = [
        f"<p>{escape(plan.schedule)} schedule, {plan.num_stages} stages, {plan.num_microbatches} microbatches; "
        f"predicted iteration {fmt(1000 * plan.iteration_time_s)} ms (all clocks at maximum: "
        f"{fmt(1000 * plan.max_clock_iteration_time_s)} ms), energy {fmt(plan.energy_j)} J "
        f"({fmt(plan.max_clock_energy_j)} J){sim_tag(sim)}; "
        + ("applied." if plan.applied else f"not applied{': ' + escape(plan.reason) if plan.reason else ''}.")
        + "</p>"
    ]
    if plan.instructions:
        out.append(_gantt(plan, sim))
    else:
        out.append('<p class="note">This schedule cannot be redrawn; its clocks per stage follow.</p>')
    rows = "".join(
        f'<tr><td>stage {s}</td><td class="l">{" ".join(str(f) for f in fs)}</td></tr>'
        for s, fs in enumerate(plan.stage_frequencies_mhz)
    )
    out.append(
        f'<table class="pipeline"><tr><th>stage</th><th class="l">SM clock of each instruction, in order (MHz)</th></tr>{rows}</table>'
    )
    return out


def _gantt(plan: PipelinePlan, sim: bool) -> str:
    """Stages as rows, instructions as boxes over the iteration, coloured by clock; the critical path outlined."""
    insts = plan.instructions
    end = max(i.start_s + i.duration_s for i in insts)
    freqs = sorted({i.frequency_mhz for i in insts})
    flo, fhi = freqs[0], freqs[-1]
    w, left, right, top, row = 920, 70, 16, 40, 34
    h = top + row * plan.num_stages + 70
    pw = w - left - right

    def px(t: float) -> float:
        return left + t / end * pw

    out = [
        f'<svg class="gantt" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="pipeline plan">',
        f'<text class="title" x="{left}" y="18">One iteration as planned: SM clock per instruction; thick outline = critical path{sim_tag(sim)}</text>',
    ]
    if sim:
        out.append(f'<text class="sim-tag" x="{w - right}" y="18" text-anchor="end">SIMULATED</text>')
    for i in insts:
        y = top + row * i.stage
        fill = color_scale((i.frequency_mhz - flo) / (fhi - flo) if fhi > flo else 1.0)
        stroke = ' stroke="#111" stroke-width="2.6"' if i.critical else ' stroke="#fff" stroke-width="1"'
        label = ("F" if i.kind == "forward" else "B") + str(i.microbatch)
        tip = f"stage {i.stage} {i.kind} of microbatch {i.microbatch}: {i.frequency_mhz} MHz, {fmt(1000 * i.duration_s)} ms{' (critical)' if i.critical else ''}"
        x0, x1 = px(i.start_s), px(i.start_s + i.duration_s)
        out.append(
            f'<rect class="inst{" critical" if i.critical else ""}" x="{x0:.1f}" y="{y + 3}" width="{max(1.0, x1 - x0):.1f}" height="{row - 6}" '
            f'fill="{fill}"{stroke}><title>{escape(tip)}</title></rect>'
        )
        if x1 - x0 > 18:
            dark = (i.frequency_mhz - flo) / (fhi - flo) > 0.55 if fhi > flo else True
            out.append(
                f'<text x="{(x0 + x1) / 2:.1f}" y="{y + row / 2 + 4}" text-anchor="middle" font-size="11" '
                f'fill="{"#fff" if dark else "#1d2433"}">{label}</text>'
            )
    for s in range(plan.num_stages):
        out.append(
            f'<text class="label" x="{left - 8}" y="{top + row * s + row / 2 + 4}" text-anchor="end">stage {s}</text>'
        )
    base = top + row * plan.num_stages
    ticks = nice_ticks(0, 1000 * end, 8)
    text = tick_text(ticks)
    for t in ticks:
        if t <= 1000 * end:
            x = px(t / 1000)
            out.append(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{base}" y2="{base + 4}"/>')
            out.append(
                f'<text class="tick" x="{x:.1f}" y="{base + 17}" text-anchor="middle">{text(t)}</text>'
            )
    out.append(
        f'<text class="label" x="{left + pw / 2}" y="{base + 34}" text-anchor="middle">time within the iteration (ms)</text>'
    )
    x = left
    for f in freqs if len(freqs) <= 10 else freqs[:: math.ceil(len(freqs) / 10)]:
        fill = color_scale((f - flo) / (fhi - flo) if fhi > flo else 1.0)
        out.append(
            f'<rect x="{x}" y="{h - 16}" width="12" height="12" fill="{fill}" stroke="#8a93a3"/><text class="legend" x="{x + 16}" y="{h - 6}">{f} MHz</text>'
        )
        x += 86
    out.append("</svg>")
    return "\n".join(out)
