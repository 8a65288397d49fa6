"""The energy model of one pipeline iteration: profiled options, plans, and a plan's time and energy.

Energy model of one iteration of length `T`: the energy of every instruction plus, on every stage `s`, the
blocking power `P_blk[s]` for the time that stage is not computing, `P_blk[s] * (T - busy[s])`. At a fixed
`T` this is `sum(e_i - P_blk[s_i] * t_i) + T * sum(P_blk)`, so each instruction only needs its *effective
energy* `e - P_blk * t`, and options that are slower without a lower effective energy are never useful.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction, PipelineDAG, build_dag

__all__ = [
    "FrequencyOption",
    "Plan",
    "Frontier",
    "pareto_options",
    "evaluate",
    "max_frequency_plan",
    "OptionKey",
    "OptionTable",
    "options_of",
]

OptionKey = tuple[int, str] | tuple[int, str, int]
"""`(stage, kind)` of a stage's instructions of one kind (`"forward"`/`"backward"`), or `(stage, kind,
virtual stage)` of one model chunk's, where the profile was measured per chunk (interleaved schedules)."""

OptionTable = Mapping[OptionKey, Sequence["FrequencyOption"]]
"""Profiled options of each instruction type (`OptionKey`); read through `options_of`."""

# Relative tolerance on the target time, to absorb floating-point rounding of sums of durations.
REL_TOL = 1e-9


@dataclass(frozen=True)
class FrequencyOption:
    """One profiled operating point of an instruction type."""

    frequency_mhz: int
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class Plan:
    """An SM frequency for every instruction of the iteration, with its predicted time and energy.

    `proven_gap` is how far above the optimum under the plan's target its energy can be at most, relative
    (0.001: within 0.1 %), proven by the LP relaxation or branch and bound; None when not proven (no scipy,
    or a plan not made by the planner).
    """

    frequencies_mhz: Mapping[Instruction, int]
    iteration_time_s: float
    energy_j: float
    schedule: tuple[tuple[Instruction, ...], ...] = field(repr=False, compare=False)
    proven_gap: float | None = field(default=None, compare=False)

    def stage_frequencies(self) -> list[list[int]]:
        """Frequency (MHz) of each stage's instructions, in the stage's execution order."""
        return [[self.frequencies_mhz[inst] for inst in order] for order in self.schedule]


@dataclass(frozen=True)
class Frontier:
    """Time-energy Pareto frontier of an iteration, with the all-max-frequency reference point.

    `plans` are sorted by increasing time and strictly decreasing energy.
    """

    plans: tuple[Plan, ...]
    max_frequency: Plan

    def choose(self, target_time_s: float | None = None) -> Plan:
        """The least-energy plan whose iteration time is at most `target_time_s`.

        `target_time_s` defaults to the iteration time with every instruction at its maximum frequency.

        Raises:
            ValueError: If no plan meets the target.
        """
        target = self.max_frequency.iteration_time_s if target_time_s is None else target_time_s
        feasible = [p for p in self.plans if p.iteration_time_s <= target * (1 + REL_TOL)]
        if not feasible:
            fastest = self.plans[0].iteration_time_s
            raise ValueError(
                f"No plan meets the target of {target:.6g} s; the fastest takes {fastest:.6g} s."
            )
        return min(feasible, key=lambda p: p.energy_j)


def options_of(options: Mapping[OptionKey, Any], inst: Instruction) -> Any:
    """`inst`'s entry of a table keyed by `OptionKey`: its model chunk's where the table has one, else its
    stage's of its kind (a profile measured per rank prices each chunk at the rank's cost).

    Raises:
        KeyError: neither is in the table.
    """
    if inst.virtual_stage is not None:
        chunk = options.get((inst.stage, inst.kind, inst.virtual_stage))
        if chunk is not None:
            return chunk
    return options[inst.stage, inst.kind]


def pareto_options(options: Sequence[FrequencyOption], p_blk_w: float) -> list[FrequencyOption]:
    """Options worth choosing, sorted by increasing time (so by decreasing effective energy).

    An option is dropped when another is at least as fast with no more effective energy `e - p_blk_w * t`.
    """
    kept: list[FrequencyOption] = []
    best_cost = float("inf")
    for opt in sorted(options, key=lambda o: (o.time_s, o.energy_j - p_blk_w * o.time_s, -o.frequency_mhz)):
        cost = opt.energy_j - p_blk_w * opt.time_s
        if cost < best_cost:
            kept.append(opt)
            best_cost = cost
    return kept


def evaluate(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
    frequencies_mhz: Mapping[Instruction, int],
) -> Plan:
    """Iteration time and energy of running each instruction at the given frequency.

    Raises:
        ValueError: If an instruction's frequency has no profiled option.
    """
    dag = as_dag(dag)
    p_blk = per_stage(p_blk_w, dag.num_stages)
    lookup = {key: {o.frequency_mhz: o for o in opts} for key, opts in options.items()}
    chosen = []
    for inst in dag.instructions:
        try:
            chosen.append(options_of(lookup, inst)[frequencies_mhz[inst]])
        except KeyError:
            raise ValueError(f"No profiled option for {inst} at {frequencies_mhz.get(inst)} MHz.") from None
    return make_plan(dag, p_blk, chosen)


def max_frequency_plan(
    dag: PipelineDAG | Sequence[Sequence[Instruction]],
    options: OptionTable,
    p_blk_w: float | Sequence[float],
) -> Plan:
    """The reference plan: every instruction at the highest profiled frequency of its type."""
    dag = as_dag(dag)
    check_options(dag, options)
    top = {key: max(opts, key=lambda o: o.frequency_mhz) for key, opts in options.items()}
    return make_plan(dag, per_stage(p_blk_w, dag.num_stages), [options_of(top, i) for i in dag.instructions])


def as_dag(dag: PipelineDAG | Sequence[Sequence[Instruction]]) -> PipelineDAG:
    """`dag` itself, or the DAG of a per-stage schedule."""
    return dag if isinstance(dag, PipelineDAG) else build_dag(dag)


def per_stage(p_blk_w: float | Sequence[float], num_stages: int) -> list[float]:
    """Blocking power (W) of each stage: `p_blk_w` repeated, or checked against the stage count."""
    values = (
        [float(p_blk_w)] * num_stages if isinstance(p_blk_w, int | float) else [float(p) for p in p_blk_w]
    )
    if len(values) != num_stages:
        raise ValueError(f"`p_blk_w` has {len(values)} values for {num_stages} stages.")
    if any(not p >= 0 for p in values):
        raise ValueError(f"`p_blk_w={p_blk_w!r}` must be non-negative.")
    return values


def check_options(dag: PipelineDAG, options: OptionTable) -> None:
    """Raises ValueError unless every instruction type of `dag` has options, all with time > 0, energy >= 0."""
    for inst in dag.instructions:
        try:
            opts = options_of(options, inst)
        except KeyError:
            opts = None
        if not opts:
            raise ValueError(f"No profiled options for {_type_of(inst)}.")
        for o in opts:
            if not (o.time_s > 0 and o.energy_j >= 0):
                raise ValueError(
                    f"{_type_of(inst).capitalize()}: invalid option {o} (needs time > 0, energy >= 0)."
                )


def _type_of(inst: Instruction) -> str:
    """The instruction type of `inst` in words: stage and kind, and its model chunk where there is one."""
    chunk = "" if inst.virtual_stage is None else f" of virtual stage {inst.virtual_stage}"
    return f"stage {inst.stage} {inst.kind}{chunk}"


def make_plan(dag: PipelineDAG, p_blk: Sequence[float], chosen: Sequence[FrequencyOption]) -> Plan:
    """The plan running each instruction of `dag` at its `chosen` option, with its time and energy."""
    durations = [o.time_s for o in chosen]
    time_s = dag.iteration_time(durations)
    busy = [0.0] * dag.num_stages
    for inst, t in zip(dag.instructions, durations, strict=True):
        busy[inst.stage] += t
    energy = sum(o.energy_j for o in chosen) + sum(p * (time_s - b) for p, b in zip(p_blk, busy, strict=True))
    return Plan(
        frequencies_mhz={inst: o.frequency_mhz for inst, o in zip(dag.instructions, chosen, strict=True)},
        iteration_time_s=time_s,
        energy_j=energy,
        schedule=dag.schedule,
    )
