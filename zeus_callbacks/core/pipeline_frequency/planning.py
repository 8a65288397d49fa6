"""Planning from a profile: find the schedule that ran, solve its DAG, and each stage's clock per instruction."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    Instruction,
    build_dag,
    build_schedule,
)
from zeus_callbacks.core.pipeline_frequency.edge_delays import EdgeDelays, measure_edge_delays
from zeus_callbacks.core.pipeline_frequency.energy_model import OptionKey, check_options
from zeus_callbacks.core.pipeline_frequency.frontier import (
    FrequencyOption,
    evaluate,
    max_frequency_plan,
    solve,
)
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
from zeus_callbacks.core.pipeline_frequency.recorder import StepTimeline, split_trace_key

__all__ = [
    "match_schedule",
    "resolve_schedule",
    "options_from_rows",
    "fit_clock_times",
    "with_margin",
    "plan_pipeline",
]

# Fewer profiled clocks than this per instruction type: its times are kept as measured (`fit_clock_times`).
_MIN_FIT_CLOCKS = 3
# A flat top spans at least this many clocks, and leaves at least as many below it to fit the slope on.
_MIN_FLAT_CLOCKS = 2
# A flat top is read only where it cuts the curve's absolute error at least by this factor (`_fit_curve`).
_FLAT_TOP_GAIN = 0.5

# What a stage records of an instruction: its kind, or (kind, virtual stage) with several chunks per rank.
TraceKey = str | tuple[str, int]


def match_schedule(
    sequences: Mapping[int, Sequence[TraceKey]], preferred: str | None = None
) -> tuple[str, int]:
    """`(schedule, num_microbatches)` whose per-stage order of instructions is the one observed.

    Stages that recorded virtual stages (several model chunks per rank) are matched against the
    `MULTI_STAGE_SCHEDULES` with as many chunks per rank as stage 0 ran; others against `SCHEDULES`.

    Args:
        sequences: Stage -> its instructions in one iteration, in execution order (`Instruction.trace_key`).
        preferred: The schedule the user named; only it is tried when given.

    Raises:
        ValueError: stages are not numbered 0..S-1, or no known schedule runs the observed sequences.
    """
    name, order = _match(sequences, preferred)
    return name, 1 + max(i.microbatch for i in order[0])


def resolve_schedule(
    sequences: Mapping[int, Sequence[TraceKey]],
    schedule: str | None = None,
    order: Sequence[Sequence[Instruction]] | None = None,
) -> tuple[str, list[list[Instruction]]]:
    """`(name, order)`: every stage's instructions of the schedule that ran the observed sequences.

    Args:
        sequences: Stage -> its instructions in one iteration, in execution order (`Instruction.trace_key`).
        schedule: The schedule's name (the user's, or torch's class name with `order`), else None.
        order: The schedule's own order of every stage's instructions (`pipelining.schedule_order`), checked
            against the observed sequences (kinds only where the stages recorded no virtual stages).

    Raises:
        ValueError: the observed sequences are not the given order, or no known schedule runs them.
    """
    if order is None:
        return _match(sequences, schedule)
    _check_numbering(sequences)
    if len(order) != len(sequences) or any(
        _observed(order[s], sequences[s]) != list(sequences[s]) for s in range(len(order))
    ):
        raise ValueError(
            f"The observed instruction order {_shown(sequences)} is not the order of "
            f"{schedule or 'the schedule'}: {_shown({s: [i.trace_key for i in o] for s, o in enumerate(order)})}."
        )
    return schedule or "custom", [list(o) for o in order]


def _match(
    sequences: Mapping[int, Sequence[TraceKey]], preferred: str | None
) -> tuple[str, list[list[Instruction]]]:
    num_stages = _check_numbering(sequences)
    first = list(sequences[0])
    chunks = len({k[1] for k in first if isinstance(k, tuple)})
    multi = chunks > 0
    forwards = sum(_kind(k) == "forward" for k in first)
    num_microbatches = forwards // max(chunks, 1)
    candidates = (preferred,) if preferred else MULTI_STAGE_SCHEDULES if multi else SCHEDULES
    if num_microbatches >= 1 and forwards == num_microbatches * max(chunks, 1):
        for kind in candidates:
            if (kind in MULTI_STAGE_SCHEDULES) != multi:
                continue
            try:
                order = build_schedule(kind, num_stages, num_microbatches, max(chunks, 1))
            except ValueError:  # e.g. microbatches interleaved 1F1B does not accept
                continue
            if all(_observed(order[s], sequences[s]) == list(sequences[s]) for s in range(num_stages)):
                return kind, order
    chunked = f", {chunks} chunks per stage" if multi else ""
    raise ValueError(
        f"The observed instruction order {_shown(sequences)} is not a {' or '.join(candidates)} schedule of "
        f"{num_stages} stages and {num_microbatches} microbatches{chunked}."
    )


def _check_numbering(sequences: Mapping[int, Sequence[TraceKey]]) -> int:
    num_stages = len(sequences)
    if sorted(sequences) != list(range(num_stages)):
        raise ValueError(f"Pipeline stages {sorted(sequences)} are not numbered 0..{num_stages - 1}.")
    return num_stages


def _kind(key: TraceKey) -> str:
    return split_trace_key(key)[0]


def _observed(order: Sequence[Instruction], observed: Sequence[TraceKey]) -> list[TraceKey]:
    """`order` as a stage records it: with virtual stages only if the stage recorded them."""
    with_virtual = any(isinstance(k, tuple) for k in observed)
    return [i.trace_key if with_virtual else i.kind for i in order]


def _shown(sequences: Mapping[int, Sequence[TraceKey]]) -> dict[int, str]:
    """Sequences in short: `FFB...`, each with its virtual stage when recorded (`F4F4B4...`)."""

    def short(key: TraceKey) -> str:
        letter = "F" if _kind(key) == "forward" else "B"
        return f"{letter}{key[1]}" if isinstance(key, tuple) else letter

    return {s: "".join(short(k) for k in seq) for s, seq in sorted(sequences.items())}


def options_from_rows(rows: Iterable[ProfileRow]) -> dict[OptionKey, list[FrequencyOption]]:
    """The planner's options table from profile rows (keyed by `ProfileRow.key`: per stage and kind, or per
    model chunk where measured so), each type's options from the highest clock down, as measured.

    No time is rewritten. A lower clock can really be as fast as a higher one and cheaper (on A40s, every
    clock of the power-capped region runs at the speed the cap allows, at less power), so raising its time
    to a faster clock's would hide a saving. The planner itself drops options that are slower than another
    of their type with no less effective energy (`energy_model.pareto_options`), and a clock measured
    faster than a higher one by noise simply replaces it; the highest clock stays the all-max reference.
    """
    out: dict[OptionKey, list[FrequencyOption]] = {}
    for r in sorted(rows, key=lambda r: -r.frequency_mhz):  # each key's options from the highest clock
        out.setdefault(r.key, []).append(FrequencyOption(r.frequency_mhz, r.time_s, r.energy_j))
    return out


def fit_clock_times(rows: Iterable[ProfileRow]) -> list[ProfileRow]:
    """The profile with each instruction type's times read off one curve across its clocks, for planning.

    The curve is `time(f) = max(c, a + b * f_top / f)` (`f_top`: the type's highest profiled clock; `a, b >= 0`:
    a part the SM clock does not stretch, such as memory-bound kernels or host time, and a part it stretches
    in proportion; `c`: a flat top, the time no clock goes below). The slope is fitted robustly (Theil-Sen:
    `b` the median of the pairwise slopes, `a` the median intercept; `a = 0` and `b` the median ratio when the
    intercept would be negative). A flat top is read where the measurements say so: the top 2 or more clocks
    measured alike (their median is `c`) and the slope fitted on 2 or more clocks below them, kept only where
    it halves the curve's absolute error; otherwise `c = 0`. On a power-capped GPU, every clock above the one
    the cap allows runs at that clock (the A40 capped at 200 W: from about 1620 MHz up, by the NSDI'23 A40
    trace `sim/data/nsdi23/summary_power_a40.csv` as `sim/traces.operating_point` reads it), and a
    memory-bound stage stops speeding up alike. Each row keeps its measured power: its energy is scaled with
    its time. Types with fewer than 3 clocks are kept as measured.

    Why: a clock's instructions are measured over a few consecutive steps, so a change of the host's load
    (on simulated GPUs, the host's CPU time is part of each instruction) moves all of them alike, by more
    than one step of the sweep changes the time (45 MHz at 1740 MHz: 2.6%). Read clock by clock
    (`options_from_rows`), a lucky clock or an unlucky maximum makes a lower clock look as fast as the
    maximum, and the plan lowers instructions on the critical path for a saving that costs time; one curve
    through the whole sweep prices every step. A real flat top is kept: there a lower clock is as fast.
    """
    groups: dict[OptionKey, list[ProfileRow]] = {}
    for r in rows:
        groups.setdefault(r.key, []).append(r)
    out = []
    for group in groups.values():
        if len({r.frequency_mhz for r in group}) < _MIN_FIT_CLOCKS or any(
            r.frequency_mhz <= 0 for r in group
        ):
            out += group
            continue
        top = max(r.frequency_mhz for r in group)
        points = [(top / r.frequency_mhz, r.time_s) for r in group]
        a, b, flat_s = _fit_curve(points)
        for r, (x, _) in zip(group, points, strict=True):
            time_s = max(flat_s, a + b * x)
            energy_j = r.energy_j * time_s / r.time_s if r.time_s > 0 else r.energy_j
            out.append(dataclasses.replace(r, time_s=time_s, energy_j=energy_j))
    return out


def _fit_curve(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """`(a, b, c)` of the curve `t = max(c, a + b x)` through `(x, t)` points (`x = f_top / f >= 1`): the
    Theil-Sen line, or, where it cuts the sum of absolute errors at least by `_FLAT_TOP_GAIN`, a flat top `c`
    (the median of the top clocks, binding at `x = 1`) over the line of the clocks below it; `c = 0`: none."""
    a, b = _theil_sen(points)
    best, best_err = (a, b, 0.0), _FLAT_TOP_GAIN * _abs_error(points, a, b, 0.0)
    xs = sorted({x for x, _ in points})
    for n_flat in range(_MIN_FLAT_CLOCKS, len(xs) - _MIN_FLAT_CLOCKS + 1):
        below = xs[n_flat]
        flat_s = statistics.median(t for x, t in points if x < below)
        fa, fb = _theil_sen([(x, t) for x, t in points if x >= below])
        if flat_s <= fa + fb:  # not a flat top: the line is slower at the top clock already
            continue
        err = _abs_error(points, fa, fb, flat_s)
        if err < best_err:
            best, best_err = (fa, fb, flat_s), err
    return best


def _abs_error(points: Sequence[tuple[float, float]], a: float, b: float, flat_s: float) -> float:
    """Sum of the absolute errors of `t = max(flat_s, a + b x)` at the points."""
    return sum(abs(t - max(flat_s, a + b * x)) for x, t in points)


def _theil_sen(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """`(a, b) >= 0` of the line `t = a + b x` through `(x, t)` points: the median pairwise slope and intercept."""
    slopes = [(t2 - t1) / (x2 - x1) for (x1, t1), (x2, t2) in combinations(points, 2) if x2 != x1]
    b = max(0.0, statistics.median(slopes)) if slopes else 0.0
    a = statistics.median(t - b * x for x, t in points)
    if a < 0:
        return 0.0, statistics.median(t / x for x, t in points)
    return a, b


def with_margin(
    options: dict[OptionKey, list[FrequencyOption]], margin: float, p_blk_w: Sequence[float]
) -> dict[OptionKey, list[FrequencyOption]]:
    """Every option but the fastest of its type taken `margin` longer, for planning only. The added time is
    charged at the stage's blocking power, so an option's effective energy (`e - P_blk * t`) is unchanged."""
    if margin == 0:
        return options
    out = {}
    for key, opts in options.items():
        stage = key[0]
        top = max(o.frequency_mhz for o in opts)
        out[key] = [
            o
            if o.frequency_mhz == top
            else FrequencyOption(
                o.frequency_mhz, o.time_s * (1 + margin), o.energy_j + p_blk_w[stage] * o.time_s * margin
            )
            for o in opts
        ]
    return out


def plan_pipeline(
    sequences: Mapping[int, Sequence[TraceKey]],
    rows: Iterable[ProfileRow],
    blocking_power_w: Mapping[int, float],
    schedule: str | None = None,
    target_time_s: float | None = None,
    slack_margin: float = 0.0,
    order: Sequence[Sequence[Instruction]] | None = None,
    timelines: Sequence[Mapping[int, StepTimeline]] = (),
    edge_delays: EdgeDelays | None = None,
    fit_times: bool = False,
) -> dict[str, Any]:
    """Every stage's clock of each instruction, planned on the schedule the stages ran; plain data.

    The plan takes the least energy within `target_time_s` (default: the iteration time with every
    instruction at its highest clock), on the DAG with the time between instructions measured from
    `timelines` (`measure_edge_delays`), or `edge_delays` when given. Its step time and energy are
    predicted from the profile (as measured, or fitted with `fit_times`), the step's overhead outside the
    DAG included.

    With several model chunks per stage (interleaved schedules) the optimizer profiles each chunk's
    forwards and backwards apart (`ProfileRow.virtual_stage`), since real splits do not weigh alike (an
    embedding, an output head); a profile measured per stage and kind (e.g. read from a Perseus file) prices
    each of the stage's chunks at what its instructions cost over all its chunks.

    Args:
        sequences: Stage -> its instructions in one iteration, in execution order (`Instruction.trace_key`).
        rows: The profile of every stage and instruction type.
        blocking_power_w: Stage -> its power while blocked (W); 0 when missing.
        schedule: The schedule the user named (`match_schedule`), or the name of `order`; else None.
        target_time_s: Iteration-time target (s), the step's overhead included.
        slack_margin: Extra planning margin on lowered clocks (`with_margin`).
        order: The schedule's own per-stage order (`resolve_schedule`), e.g. read from torch.
        timelines: Per profiled step, stage -> when its instructions ran.
        edge_delays: Delays measured before (e.g. read from a profile); overrides `timelines`.
        fit_times: Plan on each instruction type's times fitted across its clocks (`fit_clock_times`), as
            the optimizer does with the profile it measured itself.

    Returns:
        `schedule`, `num_stages`, `num_virtual_stages`, `num_microbatches`, `stage_plans` (stage ->
        [(trace key, MHz)] in execution order: the kind, with the virtual stage where recorded),
        `plan_frequencies_mhz` (stage -> [MHz]), `edge_delays` (`EdgeDelays.to_rows`) and `predicted`
        (times, energies, changes).

    Raises:
        ValueError: no known schedule ran the sequences, or the profile misses an instruction type.
    """
    schedule_kind, order = resolve_schedule(sequences, schedule, order)
    dag = build_dag(order)
    delays = edge_delays if edge_delays is not None else measure_edge_delays(dag, timelines)
    dag = delays.apply(dag)
    options = options_from_rows(fit_clock_times(rows) if fit_times else rows)
    try:
        check_options(dag, options)
    except ValueError as e:
        raise ValueError(f"the profile does not fit the schedule: {e}") from None
    p_blk = [blocking_power_w.get(s, 0.0) for s in range(dag.num_stages)]
    overhead_s = delays.step_overhead_s
    target = None if target_time_s is None else max(0.0, target_time_s - overhead_s)
    reference = max_frequency_plan(dag, options, p_blk)
    # Every rank waits for the plan: a program that takes minutes to prove keeps the LP's bound here.
    planned = solve(dag, with_margin(options, slack_margin, p_blk), p_blk, target, slow_proof=False)
    plan = evaluate(dag, options, p_blk, planned.frequencies_mhz)
    stage_plans = {
        s: list(zip(sequences[s], freqs, strict=True)) for s, freqs in enumerate(plan.stage_frequencies())
    }
    # The step's time outside the DAG is spent blocked on every stage.
    t_ref, t_plan = reference.iteration_time_s + overhead_s, plan.iteration_time_s + overhead_s
    e_ref, e_plan = (p.energy_j + sum(p_blk) * overhead_s for p in (reference, plan))
    return {
        "schedule": schedule_kind,
        "num_stages": dag.num_stages,
        "num_virtual_stages": 1 + max(i.model_stage for i in dag.instructions),
        "num_microbatches": 1 + max(i.microbatch for i in dag.instructions),
        "stage_plans": stage_plans,
        "plan_frequencies_mhz": {s: [f for _, f in p] for s, p in stage_plans.items()},
        "edge_delays": delays.to_rows(),
        "predicted": {
            "max_clock_iteration_time_s": t_ref,
            "max_clock_energy_j": e_ref,
            "iteration_time_s": t_plan,
            "energy_j": e_plan,
            "energy_saved_pct": 100 * (1 - e_plan / e_ref),
            "time_change_pct": 100 * (t_plan / t_ref - 1),
            "step_overhead_s": overhead_s,
        },
    }
