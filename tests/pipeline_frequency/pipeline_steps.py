"""A fake single-stage pipeline schedule driven through a `PipelineFrequencyOptimizer`, for tests (and their
child processes): `run_steps`, the instruction kinds of a schedule (`_kinds`), fast optimizer settings (`FAST`)."""

from __future__ import annotations

import time

from zeus_callbacks import sim
from zeus_callbacks.core.pipeline_frequency.dag import Instruction, build_schedule
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

FAST = dict(wait_steps=1, warmup_steps=0, profile_steps=1, frequency_stride_mhz=180, patience=2)


def _kinds(schedule: str, microbatches: int) -> list[str]:
    return [i.kind for i in build_schedule(schedule, 1, microbatches)[0]]


def run_steps(
    pfo: PipelineFrequencyOptimizer,
    steps: int,
    kinds: list[str] | list[Instruction],
    until: str | None = None,
    work_s: float = 0.002,
) -> int:
    """A fake single-stage schedule: each forward queues `work_s` of work on simulated GPU 0, a backward twice
    (`sim.enqueue_work`: no host CPU, so a loaded host does not change how much work each clock measures; with
    the work burnt on the host, a loaded run once measured every lower clock dearer than the maximum and
    planned none), and between instructions the stage waits for its peers without computing (a sleep, as a
    blocking recv). Instructions (rather than kinds) are reported with their virtual stage."""
    for n in range(steps):
        pfo.on_step_begin()
        for item in kinds:
            kind, virtual = (item.kind, item.virtual_stage) if isinstance(item, Instruction) else (item, None)
            pfo.on_instruction_begin(kind, virtual_stage=virtual)
            work = work_s if kind == "forward" else 2 * work_s
            sim.enqueue_work(0, work)
            pfo.on_instruction_end(kind, virtual_stage=virtual)
            time.sleep(work_s / 2)
        pfo.on_step_end()
        if until is not None and pfo.phase == until:
            return n + 1
    return steps
