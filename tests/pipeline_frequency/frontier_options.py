"""Random Perseus solver inputs, for tests: per-(stage, kind) frequency options of a made-up pipeline."""

from __future__ import annotations

import random

from zeus_callbacks.core.pipeline_frequency.frontier import FrequencyOption


def _options(seed: int, num_stages: int, num_freqs: int) -> dict:
    """Unequal stages, backward ~2x forward, a few frequencies with a noisy time/power curve."""
    rng = random.Random(seed)
    options = {}
    for s in range(num_stages):
        base = rng.uniform(0.7, 1.3)
        for kind, mult in (("forward", 1.0), ("backward", 2.0)):
            freqs = sorted(rng.sample(range(900, 1741, 30), num_freqs), reverse=True)
            opts = []
            for f in freqs:
                t = base * mult * (0.3 + 0.7 * 1740 / f) * rng.uniform(0.97, 1.03)
                p = 60 + 240 * (f / 1740) ** 3 * rng.uniform(0.9, 1.1)
                opts.append(FrequencyOption(f, t, p * t))
            options[s, kind] = opts
    return options
