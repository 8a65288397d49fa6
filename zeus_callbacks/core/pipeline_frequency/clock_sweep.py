"""Online profiling of pipeline instructions: the clock sweep, its early stop, merging replicas, the CSV."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from zeus_callbacks.core.pipeline_frequency.dag import SCHEDULES, build_schedule
from zeus_callbacks.core.pipeline_frequency.frontier import FrequencyOption
from zeus_callbacks.core.pipeline_frequency.profile_file import PROFILE_COLUMNS, read_profile, write_profile

__all__ = [
    "FORWARD",
    "BACKWARD",
    "KINDS",
    "ProfileRow",
    "StageSample",
    "instruction_kind",
    "clock_sweep",
    "undisturbed_estimate",
    "passed_valley",
    "merge_replicas",
    "match_schedule",
    "options_from_rows",
    "save_profile_csv",
    "load_profile_csv",
    "PROFILE_COLUMNS",
]

FORWARD = "forward"
BACKWARD = "backward"
KINDS = (FORWARD, BACKWARD)

# Instruction names accepted by the hooks -> (kind, part of a split backward or None). Schedules that split
# the backward (zero-bubble) report its input- and weight-gradient halves; a weight half that directly
# follows an input half is the same backward instruction.
_NAMES: dict[str, tuple[str, str | None]] = {
    "forward": (FORWARD, None),
    "fwd": (FORWARD, None),
    "f": (FORWARD, None),
    "backward": (BACKWARD, None),
    "bwd": (BACKWARD, None),
    "b": (BACKWARD, None),
    "full_backward": (BACKWARD, None),
    "backward_input": (BACKWARD, "input"),
    "bwd_input": (BACKWARD, "input"),
    "i": (BACKWARD, "input"),
    "backward_weight": (BACKWARD, "weight"),
    "bwd_weight": (BACKWARD, "weight"),
    "w": (BACKWARD, "weight"),
}


def instruction_kind(name: str) -> tuple[str, str | None]:
    """`(kind, part)` of an instruction name: kind `"forward"` or `"backward"`, part `"input"`/`"weight"`
    for the halves of a split backward, else None.

    Raises:
        ValueError: an unknown name.
    """
    try:
        return _NAMES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(
            f"Unknown pipeline instruction {name!r}. Expected 'forward' or 'backward' (or, for a split "
            "backward, 'backward_input' and 'backward_weight')."
        ) from None


@dataclass(frozen=True)
class ProfileRow:
    """Mean time and energy of one instruction type of one stage at one SM clock (replicas merged)."""

    stage: int
    instruction: str
    frequency_mhz: int
    time_s: float
    energy_j: float


@dataclass
class StageSample:
    """What one rank measured at one clock: the per-instruction means, the blocking time and energy."""

    stage: int
    frequency_mhz: int
    # kind -> (mean time s, mean energy J, number of instructions measured)
    kinds: dict[str, tuple[float, float, int]]
    blocked_time_s: float
    blocked_energy_j: float
    sequence: tuple[str, ...]


def undisturbed_estimate(values: Sequence[float], quantile: float = 0.1) -> float:
    """An instruction's own time (or energy) from repeated measurements: their `quantile` (linear
    interpolation between order statistics; 0 is the minimum).

    Interference (preemption by other processes, the host scheduling other ranks on shared cores) only
    ever adds time, and idle energy with it, so the median drifts with the load of the moment while a low
    quantile tracks what the instruction itself takes; a quantile above the minimum keeps one lucky
    measurement from deciding.

    Raises:
        ValueError: no values, or a quantile outside [0, 1].
    """
    if not values:
        raise ValueError("undisturbed_estimate() needs at least one measurement.")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"`undisturbed_estimate(quantile={quantile!r})`: must be in [0, 1].")
    ordered = sorted(values)
    position = quantile * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def clock_sweep(supported_mhz: Iterable[int], stride_mhz: int, min_mhz: int | None = None) -> list[int]:
    """Clocks to profile, highest first: the maximum, then each supported clock at least `stride_mhz` below
    the previous one chosen, down to `min_mhz` (default: the lowest supported)."""
    clocks = sorted({int(c) for c in supported_mhz}, reverse=True)
    if min_mhz is not None:
        clocks = [c for c in clocks if c >= min_mhz] or clocks[:1]
    out: list[int] = []
    for c in clocks:
        if not out or out[-1] - c >= stride_mhz:
            out.append(c)
    return out


def passed_valley(points: Sequence[tuple[float, float]], p_blk_w: float, patience: int) -> bool:
    """Whether a sweep may stop: the last `patience` clocks each cost at least as much effective energy
    (`energy - p_blk_w * time`) as the best clock before them.

    `points` are `(time_s, energy_j)` in sweep order (highest clock first). A slower clock is only worth
    planning with if it lowers the effective energy: the time it adds would otherwise be spent blocked at
    `p_blk_w`.
    """
    if patience < 1 or len(points) <= patience:
        return False
    effective = [e - p_blk_w * t for t, e in points]
    best = min(effective[:-patience])
    return all(x >= best for x in effective[-patience:])


def merge_replicas(samples: Iterable[StageSample]) -> dict[int, StageSample]:
    """One sample per stage from the samples of its tensor/data-parallel replicas.

    Replicas run each instruction together: its time is the slowest replica's, its energy the sum. Blocking
    power adds up too, so the merged blocking energy is scaled to the merged (longest) blocking time.

    Raises:
        ValueError: replicas of a stage ran different instruction sequences.
    """
    by_stage: dict[int, list[StageSample]] = {}
    for s in samples:
        by_stage.setdefault(s.stage, []).append(s)
    out: dict[int, StageSample] = {}
    for stage, group in sorted(by_stage.items()):
        if len({g.sequence for g in group}) > 1:
            raise ValueError(f"The replicas of pipeline stage {stage} ran different instruction sequences.")
        kinds: dict[str, tuple[float, float, int]] = {}
        for kind in sorted({k for g in group for k in g.kinds}):
            vals = [g.kinds[kind] for g in group if kind in g.kinds]
            kinds[kind] = (max(v[0] for v in vals), sum(v[1] for v in vals), min(v[2] for v in vals))
        blocked_t = max(g.blocked_time_s for g in group)
        power = sum(g.blocked_energy_j / g.blocked_time_s for g in group if g.blocked_time_s > 0)
        out[stage] = StageSample(
            stage, group[0].frequency_mhz, kinds, blocked_t, power * blocked_t, group[0].sequence
        )
    return out


def match_schedule(sequences: Mapping[int, Sequence[str]], preferred: str | None = None) -> tuple[str, int]:
    """`(schedule, num_microbatches)` whose per-stage order of instruction kinds is the one observed.

    Args:
        sequences: Stage -> kinds of its instructions in one iteration, in execution order.
        preferred: The schedule the user named; only it is tried when given.

    Raises:
        ValueError: stages are not numbered 0..S-1, or no known schedule runs the observed sequences.
    """
    num_stages = len(sequences)
    if sorted(sequences) != list(range(num_stages)):
        raise ValueError(f"Pipeline stages {sorted(sequences)} are not numbered 0..{num_stages - 1}.")
    num_microbatches = sum(k == FORWARD for k in sequences[0])
    candidates = (preferred,) if preferred else SCHEDULES
    if num_microbatches >= 1:
        for kind in candidates:
            schedule = build_schedule(kind, num_stages, num_microbatches)
            if all([i.kind for i in schedule[s]] == list(sequences[s]) for s in range(num_stages)):
                return kind, num_microbatches
    shown = {s: "".join("F" if k == FORWARD else "B" for k in seq) for s, seq in sorted(sequences.items())}
    raise ValueError(
        f"The observed instruction order {shown} is not a {' or '.join(candidates)} schedule of "
        f"{num_stages} stages and {num_microbatches} microbatches."
    )


def options_from_rows(rows: Iterable[ProfileRow]) -> dict[tuple[int, str], list[FrequencyOption]]:
    """The planner's options table from profile rows.

    A lower clock never makes an instruction faster, so a measured time shorter than at a higher clock
    (noise) is raised to it: otherwise the plan would slow the critical path for a speed-up that is not real.
    """
    out: dict[tuple[int, str], list[FrequencyOption]] = {}
    for r in sorted(rows, key=lambda r: (r.stage, r.instruction, -r.frequency_mhz)):
        opts = out.setdefault((r.stage, r.instruction), [])
        time_s = max(r.time_s, opts[-1].time_s) if opts else r.time_s
        opts.append(FrequencyOption(r.frequency_mhz, time_s, r.energy_j))
    return out


def save_profile_csv(path: str | Path, rows: Iterable[ProfileRow]) -> None:
    """Write rows as `stage,instruction,frequency,time,energy` (MHz, s, J per instruction), the format that
    `zeus-callbacks pipeline-plan` reads (by `pipeline_frequency.profile_file`)."""
    options: dict[tuple[int, str], list[FrequencyOption]] = {}
    for r in rows:
        options.setdefault((r.stage, r.instruction), []).append(
            FrequencyOption(r.frequency_mhz, r.time_s, r.energy_j)
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    write_profile(tmp, options)
    tmp.replace(path)


def load_profile_csv(path: str | Path) -> list[ProfileRow]:
    """Read a `stage,instruction,frequency,time,energy` profile.

    Raises:
        ValueError: a missing column, a malformed row, or a stage without both instructions.
    """
    return [
        ProfileRow(stage, kind, o.frequency_mhz, o.time_s, o.energy_j)
        for (stage, kind), opts in sorted(read_profile(path).items())
        for o in opts
    ]
