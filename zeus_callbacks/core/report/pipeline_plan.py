"""The pipeline plan as the report draws it: every instruction's planned clock, start and length over one
iteration, and which of them lie on the critical path."""

from __future__ import annotations

from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    build_dag,
    build_schedule,
)
from zeus_callbacks.core.pipeline_frequency.edge_delays import EdgeDelays
from zeus_callbacks.core.pipeline_frequency.energy_model import options_of
from zeus_callbacks.core.pipeline_frequency.planning import options_from_rows
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
from zeus_callbacks.core.report.records import PipelinePlan, PlannedInstruction

__all__ = ["pipeline_plan", "planned_instructions"]

_TIGHT = 1e-9  # relative: an edge binds when its successor starts as soon as it may


def pipeline_plan(report: dict[str, Any]) -> PipelinePlan | None:
    """The record of `PipelineFrequencyOptimizer.report()`; None while it has no plan."""
    if "plan_frequencies_mhz" not in report or "predicted" not in report:
        return None
    freqs = report["plan_frequencies_mhz"]
    stage_freqs = tuple(tuple(int(f) for f in freqs[k]) for k in sorted(freqs, key=int))
    predicted = report["predicted"]
    rows = [ProfileRow(**r) for r in report.get("profile", [])]
    try:
        instructions = planned_instructions(
            report["schedule"],
            int(report["num_stages"]),
            int(report["num_microbatches"]),
            int(report.get("num_virtual_stages", report["num_stages"])),
            stage_freqs,
            rows,
            report.get("edge_delays", []),
        )
    except (KeyError, ValueError):  # a custom schedule, or a profile short of a planned clock: no chart
        instructions = ()
    return PipelinePlan(
        phase=str(report.get("phase", "")),
        schedule=str(report["schedule"]),
        num_stages=int(report["num_stages"]),
        num_microbatches=int(report["num_microbatches"]),
        stage_frequencies_mhz=stage_freqs,
        instructions=instructions,
        max_clock_iteration_time_s=float(predicted["max_clock_iteration_time_s"]),
        iteration_time_s=float(predicted["iteration_time_s"]),
        max_clock_energy_j=float(predicted["max_clock_energy_j"]),
        energy_j=float(predicted["energy_j"]),
        applied=bool(report.get("plan_applied")),
        reason=report.get("reason"),
    )


def planned_instructions(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    num_virtual_stages: int,
    stage_frequencies_mhz: tuple[tuple[int, ...], ...],
    rows: list[ProfileRow],
    edge_delay_rows: list[Any],
) -> tuple[PlannedInstruction, ...]:
    """Each instruction at its planned clock, started as early as the DAG allows (as the planner predicts).

    Raises:
        ValueError: `schedule` is not one this package builds, or the plan does not fit it.
        KeyError: the profile has no measurement of a planned clock.
    """
    if schedule not in SCHEDULES + MULTI_STAGE_SCHEDULES:
        raise ValueError(f"schedule {schedule!r} cannot be rebuilt")
    order = build_schedule(schedule, num_stages, num_microbatches, max(1, num_virtual_stages // num_stages))
    if [len(o) for o in order] != [len(f) for f in stage_frequencies_mhz]:
        raise ValueError("the plan's clocks do not match the schedule")
    dag = EdgeDelays.from_rows(edge_delay_rows).apply(build_dag(order))
    options = options_from_rows(rows)
    times = {key: {o.frequency_mhz: o.time_s for o in opts} for key, opts in options.items()}
    freq = {
        inst: f
        for o, fs in zip(order, stage_frequencies_mhz, strict=True)
        for inst, f in zip(o, fs, strict=True)
    }
    durations = [options_of(times, i)[freq[i]] for i in dag.instructions]
    starts = dag.earliest_start(durations)
    critical = _critical_path(dag, starts, durations)
    return tuple(
        PlannedInstruction(
            i.stage, i.kind, i.microbatch, i.virtual_stage, freq[i], starts[n], durations[n], n in critical
        )
        for n, i in enumerate(dag.instructions)
    )


def _critical_path(dag: Any, starts: list[float], durations: list[float]) -> set[int]:
    """Nodes of one longest path: back from the last to end, each time through a predecessor that binds."""
    ends = [s + d for s, d in zip(starts, durations, strict=True)]
    makespan = max(ends)
    tol = _TIGHT * max(makespan, 1e-12)
    node = max(range(len(ends)), key=lambda n: ends[n])
    path = {node}
    delays = dag.predecessor_delays()
    while True:
        binding = [
            u
            for u, x in zip(dag.predecessors(node), delays[node], strict=True)
            if abs(ends[u] + x - starts[node]) <= tol
        ]
        if not binding:
            return path
        node = max(binding, key=lambda u: ends[u])
        path.add(node)
