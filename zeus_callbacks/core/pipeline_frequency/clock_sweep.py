"""The in-job clock sweep: which clocks each stage profiles, when it stops, replicas merged, blocking power."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
from zeus_callbacks.core.pipeline_frequency.recorder import StageSample, StepTimeline, split_trace_key

__all__ = ["ClockSweep", "clock_sweep", "passed_valley", "merge_replicas", "stage_clocks"]

logger = logging.getLogger(__name__)


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


def stage_clocks(sweeps: Iterable[tuple[int, Sequence[int]]]) -> dict[int, list[int]]:
    """Each stage's sweep, highest first, from every rank's `(stage, sweep)`: the clocks all its replicas
    support (empty when they share none).

    Raises:
        ValueError: stages not numbered 0..S-1.
    """
    common: dict[int, set[int]] = {}
    for stage, sweep in sweeps:
        common[stage] = common[stage] & set(sweep) if stage in common else set(sweep)
    stages = sorted(common)
    if stages != list(range(len(stages))):
        raise ValueError(
            f"PipelineFrequencyOptimizer: pipeline stages {stages} are not numbered 0..{len(stages) - 1}."
        )
    return {s: sorted(common[s], reverse=True) for s in stages}


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
        kinds: dict[str | tuple[str, int], tuple[float, float, int]] = {}
        for kind in sorted({k for g in group for k in g.kinds}, key=_key_order):
            vals = [g.kinds[kind] for g in group if kind in g.kinds]
            kinds[kind] = (max(v[0] for v in vals), sum(v[1] for v in vals), min(v[2] for v in vals))
        blocked_t = max(g.blocked_time_s for g in group)
        power = sum(g.blocked_energy_j / g.blocked_time_s for g in group if g.blocked_time_s > 0)
        out[stage] = StageSample(
            stage, group[0].frequency_mhz, kinds, blocked_t, power * blocked_t, group[0].sequence
        )
    return out


def _key_order(key: str | tuple[str, int]) -> tuple[int, str]:
    """Trace keys in order: by model chunk, then kind."""
    kind, chunk = split_trace_key(key)
    return (-1 if chunk is None else chunk, kind)


class ClockSweep:
    """The profile of every stage, built one clock at a time; the same on every rank.

    Each stage walks down its clocks, highest first. After every clock the samples of all ranks are
    added (`add`): a stage is done once its last `patience` clocks saved no effective energy for any
    instruction type, or its clocks ran out; a stage that is done runs at its maximum clock until every
    stage is done (`finished`).

    Args:
        clocks: Stage -> its clocks, highest first (`stage_clocks`).
        patience: Clocks without an effective-energy gain before a stage stops.
    """

    def __init__(self, clocks: Mapping[int, Sequence[int]], patience: int) -> None:
        self.clocks = {s: list(c) for s, c in clocks.items()}
        self.patience = patience
        # stage -> its instructions' kinds (with their virtual stages, if any: `Instruction.trace_key`), in order
        self.sequences: dict[int, tuple[str | tuple[str, int], ...]] = {}
        self._position = dict.fromkeys(self.clocks, 0)
        self._done = dict.fromkeys(self.clocks, False)
        # stage -> trace key (kind, or (kind, virtual stage)) -> [(clock MHz, time s, energy J)] in sweep order
        self._points: dict[int, dict[str | tuple[str, int], list[tuple[int, float, float]]]] = {}
        self._blocked: dict[int, list[float]] = {}  # stage -> [time s, energy J] over the sweep
        # Per profiled step, stage -> when its instructions ran (for the DAG's edge delays).
        self.timelines: list[dict[int, StepTimeline]] = []

    @property
    def finished(self) -> bool:
        """Every stage is done."""
        return all(self._done.values())

    def done(self, stage: int) -> bool:
        """`stage` needs no more clocks."""
        return self._done[stage]

    def max_clock(self, stage: int) -> int:
        """The highest clock of `stage`."""
        return self.clocks[stage][0]

    def clock(self, stage: int) -> int:
        """The clock `stage` runs next: its next clock to profile, or its maximum once done."""
        if self._done[stage]:
            return self.max_clock(stage)
        return self.clocks[stage][self._position[stage]]

    def add(
        self,
        samples: Iterable[StageSample],
        sequences: Mapping[int, tuple[str | tuple[str, int], ...]],
        timelines: Mapping[int, Sequence[StepTimeline]] | None = None,
    ) -> None:
        """Add one clock's samples of every rank (replicas merged), the order of instructions each stage
        ran, and each stage's timelines of the profiled steps (one replica's); move each sampled stage to
        its next clock or mark it done.

        Raises:
            ValueError: replicas of a stage ran different instruction sequences.
        """
        self.sequences.update(sequences)
        if timelines:
            steps = min(len(t) for t in timelines.values())
            self.timelines += [{s: t[i] for s, t in timelines.items()} for i in range(steps)]
        for stage, s in merge_replicas(samples).items():
            kinds = self._points.setdefault(stage, {})
            for kind, (t, e, _) in s.kinds.items():
                kinds.setdefault(kind, []).append((s.frequency_mhz, t, e))
            blocked = self._blocked.setdefault(stage, [0.0, 0.0])
            blocked[0] += s.blocked_time_s
            blocked[1] += s.blocked_energy_j
            self._position[stage] += 1
            if self._stops(stage):
                self._done[stage] = True
                logger.info("Stage %d: sweep done after %d clocks.", stage, self._position[stage])

    def _stops(self, stage: int) -> bool:
        kinds = self._points.get(stage, {})
        p_blk = self.blocking_power_w().get(stage, 0.0)
        valley = bool(kinds) and all(
            passed_valley([(t, e) for _, t, e in pts], p_blk, self.patience) for pts in kinds.values()
        )
        return valley or self._position[stage] >= len(self.clocks[stage])

    def profile_rows(self) -> list[ProfileRow]:
        """The profile measured so far (every stage, replicas merged; per model chunk where a stage ran
        several)."""
        rows = []
        for stage, kinds in sorted(self._points.items()):
            for key, pts in sorted(kinds.items(), key=lambda kv: _key_order(kv[0])):
                kind, chunk = split_trace_key(key)
                rows += [ProfileRow(stage, kind, f, t, e, virtual_stage=chunk) for f, t, e in pts]
        return rows

    def blocking_power_w(self) -> dict[int, float]:
        """Measured power (W) of each stage while blocked between instructions (replicas summed).

        A blocked GPU draws no more than a computing one: when the gaps are too short for the energy
        counter's millijoule resolution, the figure is capped at the stage's lowest computing power.
        """
        out = {}
        for s, (t, e) in sorted(self._blocked.items()):
            computing = [pe / pt for pts in self._points.get(s, {}).values() for _, pt, pe in pts if pt > 0]
            out[s] = min([e / t if t > 0 else 0.0, *computing])
        return out
