"""A40-like stage profiles built from the shipped A40 traces (SIMULATED): lower clocks as fast and cheaper.

Each stage replays one workload of `zeus_callbacks/sim/data/nsdi23/summary_power_a40.csv` (the Zeus NSDI'23
artifact: one epoch at each power limit, 100-300 W in 25 W steps). Its time and power at a power limit are
the trace's (`Trace.relative_time`, `Trace.power`, interpolated between traced limits, as measured: not made
monotone). The clocks of the profile are laid over the traced range, the highest clock at the highest limit
and the lowest at the lowest: a power-capped board runs at the clock its cap allows, and on these traces the
time stays within about 1 % of the maximum's from 300 W down to 225-250 W while the power falls by 15-25 %,
so over the top third of the clocks a lower clock is as fast as a higher one and cheaper: the power-capped
region the issue describes. (The simulator's own clock model, `sim/gpu.py`, reads the same trace through its
monotone time curve; this helper keeps the trace's flat top instead.) Every row also gets a seeded
measurement error of `noise` (relative, uniform) on time and power, as a profile measured over a few steps
has; it makes some lower clocks of the flat region measure faster than higher ones.

All figures are SIMULATED from real traces; they are no measurement of a pipeline.
"""

from __future__ import annotations

import random

from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow
from zeus_callbacks.sim.traces import shipped_trace

# A40: 1740 MHz maximum SM clock (zeus_callbacks/sim/specs.py, from nvidia-smi); its clocks are 15 MHz apart.
F_MAX_MHZ = 1740
# The four workloads traced on the A40 with a flat top (see the module docstring), one per stage in turn.
WORKLOADS = (
    "imagenet/resnet50/256",
    "cifar100/shufflenetv2/1024",
    "librispeech/deepspeech2/192",
    "squad/bert_base_uncased/32",
)
# Blocking power of a stage waiting on its neighbours (W): an assumption, well above the A40's idle 30 W.
P_BLK_W = 85.0


def a40_rows(
    num_stages: int = 8,
    step_mhz: int = 15,
    lowest_mhz: int = 630,
    noise: float = 0.003,
    seed: int = 0,
) -> list[ProfileRow]:
    """Profile rows of an A40-like pipeline: forward 40 ms and backward 80 ms at the maximum clock, the first
    and last stages 15 % heavier (embedding, output head), each clock from `F_MAX_MHZ` down to `lowest_mhz`
    every `step_mhz`, mapped linearly onto the traced power limits."""
    rng = random.Random(seed)
    clocks = list(range(F_MAX_MHZ, lowest_mhz - 1, -step_mhz))
    rows = []
    for stage in range(num_stages):
        trace = shipped_trace("a40", WORKLOADS[stage % len(WORKLOADS)])
        lo, hi = trace.min_power_limit_w, trace.max_power_limit_w
        scale = 1.15 if stage in (0, num_stages - 1) else 1.0
        for kind, time_s in (("forward", 0.040 * scale), ("backward", 0.080 * scale)):
            for f in clocks:
                limit_w = lo + (hi - lo) * (f - clocks[-1]) / (clocks[0] - clocks[-1])
                t = time_s * trace.relative_time(limit_w) * rng.uniform(1 - noise, 1 + noise)
                power_w = trace.power(limit_w) * rng.uniform(1 - noise, 1 + noise)
                rows.append(ProfileRow(stage, kind, f, t, power_w * t))
    return rows
