"""Benchmark: planning on the options as measured against the old monotone rewrite, on A40-like profiles (issue 36).

The profile (SIMULATED) is `tests/pipeline_frequency/a40_profiles.a40_rows`: every stage replays a workload of
the shipped A40 traces (Zeus NSDI'23 artifact), its clocks laid over the traced power limits, so that over the
power-capped top of the range lower clocks are as fast as higher ones and cheaper, with a seeded 0.3 %
measurement error per row. For each target slowdown (against every instruction at its highest clock), it
plans with `solve`:

- *as measured*: the options as `options_from_rows` gives them now (no time rewritten; the planner drops
  dominated options);
- *rewrite*: each lower clock's time raised to the slowest time of the clocks above it, as
  `options_from_rows` did before issue 36. Its plan is priced on the measured options (what it really does);
  its time may then come out below the target, since the rewrite only ever lengthened times.

Printed per target: energy saving against the all-max plan, the plan's time change, and the proven gap (how
far above the optimum on its options the plan can be at most), with the gap the LP relaxation alone proves
(the planner before issue 36 stopped there on programs this size). All figures are SIMULATED.

Run: `PYTHONPATH=. python benchmarks/pipeline_measured_options.py [--stages 8] [--microbatches 12]
[--step-mhz 15] [--noise 0.003]`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "pipeline_frequency"))

from a40_profiles import P_BLK_W, a40_rows  # noqa: E402

from zeus_callbacks.core.pipeline_frequency.dag import build_dag, build_schedule  # noqa: E402
from zeus_callbacks.core.pipeline_frequency.exact import lower_bound  # noqa: E402
from zeus_callbacks.core.pipeline_frequency.frontier import (  # noqa: E402
    FrequencyOption,
    OptionTable,
    evaluate,
    max_frequency_plan,
    solve,
)
from zeus_callbacks.core.pipeline_frequency.planning import options_from_rows  # noqa: E402

SLOWDOWNS = (0.0, 0.01, 0.02, 0.04, 0.06, 0.08)


def monotone_rewrite(options: OptionTable) -> dict:
    """The rule `options_from_rows` applied before issue 36: from the highest clock down, a time shorter than
    a higher clock's is raised to it."""
    out = {}
    for key, opts in options.items():
        rewritten: list[FrequencyOption] = []
        for o in sorted(opts, key=lambda o: -o.frequency_mhz):
            time_s = max(o.time_s, rewritten[-1].time_s) if rewritten else o.time_s
            rewritten.append(FrequencyOption(o.frequency_mhz, time_s, o.energy_j))
        out[key] = rewritten
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=12)
    parser.add_argument("--step-mhz", type=int, default=15)
    parser.add_argument("--noise", type=float, default=0.003)
    args = parser.parse_args()
    measured = options_from_rows(a40_rows(args.stages, args.step_mhz, noise=args.noise))
    rewrite = monotone_rewrite(measured)
    dag = build_dag(build_schedule("1f1b", args.stages, args.microbatches))
    ref = max_frequency_plan(dag, measured, P_BLK_W)
    clocks = len(next(iter(measured.values())))
    print(
        f"SIMULATED A40-like profile (shipped A40 traces), 1f1b, {args.stages} stages x {args.microbatches} "
        f"microbatches, {clocks} clocks per type ({args.step_mhz} MHz apart), noise {100 * args.noise:g} %, "
        f"P_blk {P_BLK_W:g} W"
    )
    print(f"all at max clock: {ref.iteration_time_s:.4f} s, {ref.energy_j:.1f} J")
    print(
        f"{'target':>7} | {'as measured: saving':>19} {'time':>7} {'gap':>7} {'LP-only gap':>11} | "
        f"{'rewrite: saving':>15} {'time':>7} {'gap':>7} | {'s':>5}"
    )
    for slowdown in SLOWDOWNS:
        started = time.process_time()
        target = ref.iteration_time_s * (1 + slowdown)
        ours = solve(dag, measured, P_BLK_W, target)
        lp_gap = ours.energy_j / lower_bound(dag, measured, P_BLK_W, target) - 1
        old = solve(dag, rewrite, P_BLK_W, target)
        old_real = evaluate(dag, measured, P_BLK_W, old.frequencies_mhz)
        cells = []
        for plan, gap in ((ours, ours.proven_gap), (old_real, old.proven_gap)):
            cells.append(
                f"{100 * (1 - plan.energy_j / ref.energy_j):>6.2f} % "
                f"{100 * (plan.iteration_time_s / ref.iteration_time_s - 1):>+6.2f}% {100 * gap:>6.3f}%"
            )
        print(
            f"{100 * slowdown:>5.1f} % | {cells[0]:>35} {100 * lp_gap:>10.3f}% | {cells[1]:>31} | "
            f"{time.process_time() - started:>5.1f}"
        )


if __name__ == "__main__":
    main()
