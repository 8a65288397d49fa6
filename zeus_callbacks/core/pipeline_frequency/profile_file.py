"""Read and write instruction profiles in Zeus/Perseus CSV format: `stage,instruction,frequency,time,energy`.

One row per (stage, instruction, SM frequency): `instruction` is `forward` or `backward`, `frequency` in MHz,
`time` in seconds and `energy` in joules for one instruction (one microbatch on one stage).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from zeus_callbacks.core.pipeline_frequency.frontier import FrequencyOption

__all__ = ["PROFILE_COLUMNS", "read_profile", "write_profile"]

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
_KINDS = ("forward", "backward")


def read_profile(
    path: str | Path, num_stages: int | None = None
) -> dict[tuple[int, str], list[FrequencyOption]]:
    """Options of each `(stage, kind)` from a profile CSV, ready for `solve`/`frontier`.

    Args:
        path: The CSV file.
        num_stages: If given, every stage `0..num_stages-1` must have both instructions profiled, and no
            other stage may appear. Otherwise stages must be `0..max` without gaps.

    Raises:
        ValueError: On a missing column, an unparsable or negative value, an unknown instruction, a
            duplicated (stage, instruction, frequency), or a stage/instruction with no rows.
    """
    path = Path(path)
    options: dict[tuple[int, str], list[FrequencyOption]] = {}
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in PROFILE_COLUMNS if c not in header]
        if missing:
            raise ValueError(
                f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(PROFILE_COLUMNS)}."
            )
        reader.fieldnames = header
        for line, row in enumerate(reader, start=2):
            stage, kind, freq, time_s, energy_j = _parse_row(path, line, row)
            key = (stage, kind)
            if any(o.frequency_mhz == freq for o in options.get(key, ())):
                raise ValueError(f"{path}:{line}: stage {stage} {kind} at {freq} MHz appears twice.")
            options.setdefault(key, []).append(FrequencyOption(freq, time_s, energy_j))
    if not options:
        raise ValueError(f"{path}: no profile rows.")

    stages = sorted({s for s, _ in options})
    expected = range(num_stages if num_stages is not None else stages[-1] + 1)
    extra = [s for s in stages if s not in expected]
    if extra:
        raise ValueError(f"{path}: stage(s) {extra} out of range for {len(expected)} stages.")
    for s in expected:
        for kind in _KINDS:
            if (s, kind) not in options:
                raise ValueError(f"{path}: stage {s} has no {kind} rows.")
    for opts in options.values():
        opts.sort(key=lambda o: -o.frequency_mhz)
    return options


def write_profile(path: str | Path, options: Mapping[tuple[int, str], Sequence[FrequencyOption]]) -> None:
    """Write options in the same CSV format (rows by stage, instruction, then decreasing frequency)."""
    with Path(path).open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(PROFILE_COLUMNS)
        for stage, kind in sorted(options, key=lambda k: (k[0], _KINDS.index(k[1]) if k[1] in _KINDS else 2)):
            for o in sorted(options[stage, kind], key=lambda o: -o.frequency_mhz):
                writer.writerow(
                    [stage, kind, o.frequency_mhz, repr(float(o.time_s)), repr(float(o.energy_j))]
                )


def _parse_row(path: Path, line: int, row: Mapping[str, str | None]) -> tuple[int, str, int, float, float]:
    try:
        stage = int(str(row["stage"]).strip())
        kind = str(row["instruction"]).strip().lower()
        freq_f = float(str(row["frequency"]).strip())
        time_s = float(str(row["time"]).strip())
        energy_j = float(str(row["energy"]).strip())
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}:{line}: cannot parse row {dict(row)}: {e}") from None
    if kind not in _KINDS:
        raise ValueError(f"{path}:{line}: instruction {kind!r} is not one of {_KINDS}.")
    if stage < 0 or freq_f <= 0 or freq_f != int(freq_f):
        raise ValueError(f"{path}:{line}: stage must be >= 0 and frequency a positive integer (MHz).")
    if not (math.isfinite(time_s) and time_s > 0):
        raise ValueError(f"{path}:{line}: time must be positive and finite, got {time_s}.")
    if not (math.isfinite(energy_j) and energy_j >= 0):
        raise ValueError(f"{path}:{line}: energy must be non-negative and finite, got {energy_j}.")
    return stage, kind, int(freq_f), time_s, energy_j
