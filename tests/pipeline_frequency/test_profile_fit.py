"""Planning on a noisy profile: each instruction type's times read off one curve across its clocks.

A clock's instructions are measured over a few consecutive steps, so a change of the host's load moves them
alike; measured on simulated GPUs under a shared host, clocks 45 MHz apart (2.6% slower each) came out 5-15%
apart in either direction. Planned clock by clock, such a profile makes a lower clock look as fast as the
maximum and the plan lowers the critical path. Here a profile is made from a known curve with that kind of
per-clock error (seeded, deterministic), planned with and without `fit_clock_times`, and each plan's
iteration time judged on the true curve. A curve with a flat top (a power-capped GPU: every clock above the
one its cap allows runs at that one) is read as such where the measurements say so, and not read into noise.
"""

from __future__ import annotations

import random

from zeus_callbacks.core.pipeline_frequency.dag import build_dag, build_schedule
from zeus_callbacks.core.pipeline_frequency.frontier import evaluate, max_frequency_plan
from zeus_callbacks.core.pipeline_frequency.planning import fit_clock_times, options_from_rows, plan_pipeline
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
from zeus_callbacks.sim.system import SimulatedSystem

CLOCKS = list(range(1740, 1469, -45))  # the examples' sweep: 1740, 1695, ... 1470 MHz
STAGES = (2, 2, 2, 3)  # layers' worth of work per stage: the last one also holds the head
P_BLK = {s: 35.0 for s in range(4)}


def true_rows(power_limit_w: int = 300) -> list[ProfileRow]:
    """The A40's curve at `power_limit_w`: 5 ms of each instruction that the clock does not stretch, 10 ms per
    layer it does. Below 300 W the cap binds over the top clocks: they run at the clock it allows, as the
    simulator reads the NSDI'23 A40 trace (`sim/data/nsdi23/summary_power_a40.csv`, its default workload
    imagenet/resnet50/256/adadelta; `sim/traces.operating_point`): at 200 W, 1.072x the maximum's time, the clock
    1624 MHz, so 1740, 1695 and 1650 MHz take one time."""
    gpu = SimulatedSystem("a40", state_dir="").gpus[0]
    rows = []
    for stage, layers in enumerate(STAGES):
        for kind, per_layer in (("forward", 0.010), ("backward", 0.020)):
            for f in CLOCKS:
                rel, power = gpu._compute_operating_point(power_limit_w, (f, f))
                t = 0.005 + layers * per_layer * rel
                rows.append(ProfileRow(stage, kind, f, t, t * power))
    return rows


def measured(rows: list[ProfileRow], seed: int, error: float = 0.06) -> list[ProfileRow]:
    """Each (stage, type, clock) measured `error` off in either direction, time and energy alike."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        k = 1 + rng.uniform(-error, error)
        out.append(ProfileRow(r.stage, r.instruction, r.frequency_mhz, r.time_s * k, r.energy_j * k))
    return out


def judged(rows: list[ProfileRow], fit: bool) -> tuple[float, float]:
    """(iteration time change %, energy saved %) of the plan made from `rows`, on the true curve."""
    order = build_schedule("1f1b", 4, 8)
    dag = build_dag(order)
    sequences = {s: [i.kind for i in o] for s, o in enumerate(order)}
    out = plan_pipeline(sequences, rows, P_BLK, "1f1b", fit_times=fit)
    planned = {
        inst: f
        for s, o in enumerate(order)
        for inst, f in zip(o, out["plan_frequencies_mhz"][s], strict=True)
    }
    truth = options_from_rows(true_rows())
    p_blk = [P_BLK[s] for s in range(4)]
    ref = max_frequency_plan(dag, truth, p_blk)
    plan = evaluate(dag, truth, p_blk, planned)
    return 100 * (plan.iteration_time_s / ref.iteration_time_s - 1), 100 * (1 - plan.energy_j / ref.energy_j)


def test_fit_recovers_a_curve_of_its_form():
    rows = true_rows()
    fitted = {(r.stage, r.instruction, r.frequency_mhz): r for r in fit_clock_times(rows)}
    for r in rows:
        f = fitted[r.stage, r.instruction, r.frequency_mhz]
        assert abs(f.time_s - r.time_s) < 1e-9 * r.time_s
        assert abs(f.energy_j - r.energy_j) < 1e-9 * r.energy_j  # power kept, time the same


def test_fit_keeps_types_with_too_few_clocks_as_measured():
    rows = [ProfileRow(0, "forward", 1740, 0.03, 6.0), ProfileRow(0, "forward", 1650, 0.029, 5.0)]
    assert fit_clock_times(rows) == rows
    noisy = [*rows, ProfileRow(0, "forward", 1560, 0.040, 5.5)]
    fitted = sorted(fit_clock_times(noisy), key=lambda r: -r.frequency_mhz)
    assert [r.time_s for r in fitted] == sorted(r.time_s for r in fitted)  # slower at every lower clock


def test_noisy_profile_planned_on_one_curve_keeps_the_iteration_time():
    raw = [judged(measured(true_rows(), seed), fit=False) for seed in range(8)]
    fitted = [judged(measured(true_rows(), seed), fit=True) for seed in range(8)]
    # Clock by clock, some profiles cost iteration time: the critical path planned below its maximum.
    assert max(t for t, _ in raw) > 1.0
    # On one curve per type, none does, and each still saves energy.
    assert max(t for t, _ in fitted) <= 1.0
    assert min(e for _, e in fitted) >= 8.0


def _by_type(rows: list[ProfileRow]) -> dict:
    out: dict = {}
    for r in sorted(rows, key=lambda r: -r.frequency_mhz):
        out.setdefault(r.key, []).append(r.time_s)
    return out


def test_fit_keeps_the_flat_top_of_a_power_capped_gpu():
    """Fails if the curve has no flat top: a line through 1740-1470 MHz prices 1740 MHz 2.6-3% faster than 1650
    MHz, where the capped GPU runs both alike (and lowering to 1650 MHz costs no time)."""
    rows = true_rows(200)
    times = _by_type(rows)
    assert all(t[0] == t[1] == t[2] < t[3] for t in times.values())  # the data: a flat top over 3 clocks
    fitted = {(r.stage, r.instruction, r.frequency_mhz): r for r in fit_clock_times(rows)}
    for r in rows:
        f = fitted[r.stage, r.instruction, r.frequency_mhz]
        assert abs(f.time_s - r.time_s) < 1e-9 * r.time_s
        assert abs(f.energy_j - r.energy_j) < 1e-9 * r.energy_j


def test_a_flat_top_is_read_through_careful_measurements_and_not_into_noise():
    """Measured 0.3% off (a profile taken with care), the capped GPU's flat top is kept in every type and
    seed; measured 6% off (the optimizer's own sweep on a loaded host), a GPU with no flat top gets one in at
    most 1 of 240 types (30 seeds x 8). Fails if the flat top is taken wherever it fits a little better (then
    noise passes for free clocks: 76 of 240 with any gain, 40 with a 10% gain), or never."""
    careful = [_by_type(fit_clock_times(measured(true_rows(200), seed, error=0.003))) for seed in range(10)]
    assert all(t[0] == t[1] == t[2] for times in careful for t in times.values())
    noisy = [_by_type(fit_clock_times(measured(true_rows(), seed))) for seed in range(30)]
    assert sum(t[0] == t[1] for times in noisy for t in times.values()) <= 1
