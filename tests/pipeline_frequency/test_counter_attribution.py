"""The pipeline optimizer on a realistic energy counter (refreshed every 100 ms on the A40) with 10-50 ms
instructions: per-kind energies by attribution agree with those measured on an ideal counter, and so does
the plan."""

from __future__ import annotations

import pytest
from pipeline_steps import _kinds, run_steps

from zeus_callbacks import sim
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

pytestmark = pytest.mark.slow  # two profiles of 20-40 ms instructions on the real clock

# Profiled steps per clock. The instructions' work is queued on the simulated GPU (no host CPU), so both
# profiles run the same work whatever the host's load: with the work as host CPU time their per-kind
# energies carried the host's jitter (6% apart once in a loaded full-suite run, 9% once in CI).
_PROFILE_STEPS = 8


def _profile(tmp_path, ideal: str) -> tuple[dict[tuple[str, int], float], list[int]]:
    sim.simulate("a40", state_dir=str(tmp_path / (ideal or "strict")), ideal=ideal)
    pfo = PipelineFrequencyOptimizer(
        device_id=0, target_time_s=10.0, wait_steps=1, warmup_steps=1, profile_steps=_PROFILE_STEPS,
        frequency_stride_mhz=300, patience=2,
    )  # fmt: skip
    try:
        run_steps(pfo, 400, _kinds("1f1b", 4), until="applying", work_s=0.02)
        assert pfo.phase == "applying"
        rows = {(r.instruction, r.frequency_mhz): r.energy_j for r in pfo.profile_rows()}
        return rows, list(pfo.plan_frequencies_mhz)
    finally:
        pfo.close()
        sim.disable()


def test_short_instructions_on_a_slow_counter_match_the_ideal_counter(sim_state_dir, tmp_path):
    ideal, ideal_plan = _profile(tmp_path, "energy_counter")
    strict, strict_plan = _profile(tmp_path, "")
    common = sorted(set(ideal) & set(strict))
    assert len(common) >= 4
    # The outcome: the same plan, from energies of the same size (half to twice). How close they are depends on
    # the host: within 5% alone, 5.8% apart in a loaded full-suite run with four workers. The virtual clock
    # cannot carry the figure: its work runs whole inside `run_step`, so the power read before an
    # instruction's end (while its work runs, on a GPU) falls after it there (15-28% low, session of
    # 2026-12-04; see tests/RULES.md).
    for key in common:
        assert ideal[key] / 2 < strict[key] < 2 * ideal[key], key
    assert strict_plan == ideal_plan
