"""A made-up Perseus profile (the rows of a profile CSV), for tests."""

from __future__ import annotations

from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow


def _profile(num_stages: int = 2) -> list[ProfileRow]:
    rows = []
    for s in range(num_stages):
        scale = 1.0 + 0.3 * s
        for kind, mult in (("forward", 0.02), ("backward", 0.04)):
            for f in range(1740, 1100, -90):
                t = scale * mult * (0.2 + 0.8 * 1740 / f)
                rows.append(ProfileRow(s, kind, f, t, (80 + 200 * (f / 1740) ** 3) * t))
    return rows
