"""The Perseus instruction profile CSV (`stage,instruction,frequency,time,energy`): its row, reader and writer.

One row per (stage, instruction, SM frequency), as Zeus/Perseus write it: `instruction` is `forward` or
`backward`, `frequency` in MHz, `time` in seconds and `energy` in joules for one instruction (one microbatch
on one stage). `PipelineFrequencyOptimizer(profile_path=...)` writes and reads it; so does
`zeus-callbacks pipeline-plan`.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROFILE_COLUMNS", "INSTRUCTIONS", "ProfileRow", "read_profile", "write_profile"]

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
INSTRUCTIONS = ("forward", "backward")


@dataclass(frozen=True)
class ProfileRow:
    """Time and energy of one instruction (one microbatch) of one type on one stage at one SM clock.

    In `PipelineFrequencyOptimizer.report()`, 0 MHz stands for the clock the GPU chose itself (measured
    without permission to lock clocks); a file holds locked clocks only.
    """

    stage: int
    instruction: str
    frequency_mhz: int
    time_s: float
    energy_j: float


def read_profile(path: str | Path, num_stages: int | None = None) -> list[ProfileRow]:
    """The rows of a profile CSV, in file order.

    Args:
        path: The CSV file.
        num_stages: If given, every stage `0..num_stages-1` must have both instructions profiled, and no
            other stage may appear. Otherwise stages must be `0..max` without gaps.

    Raises:
        ValueError: On a missing column, an unparsable or negative value, an unknown instruction, a
            duplicated (stage, instruction, frequency), or a stage/instruction with no rows.
    """
    path = Path(path)
    rows: list[ProfileRow] = []
    seen: set[tuple[int, str, int]] = set()
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in PROFILE_COLUMNS if c not in header]
        if missing:
            raise ValueError(
                f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(PROFILE_COLUMNS)}."
            )
        reader.fieldnames = header
        for line, fields in enumerate(reader, start=2):
            row = _parse_row(path, line, fields)
            key = (row.stage, row.instruction, row.frequency_mhz)
            if key in seen:
                raise ValueError(f"{path}:{line}: stage {key[0]} {key[1]} at {key[2]} MHz appears twice.")
            seen.add(key)
            rows.append(row)
    _check_stages(path, {(r.stage, r.instruction) for r in rows}, num_stages)
    return rows


def write_profile(path: str | Path, rows: Iterable[ProfileRow]) -> None:
    """Write rows as a profile CSV (by stage, forward before backward, then decreasing frequency).

    The parent folder is created; the file is replaced at once, so a reader never sees half of it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    order = {kind: i for i, kind in enumerate(INSTRUCTIONS)}
    ordered = sorted(
        rows, key=lambda r: (r.stage, order.get(r.instruction, len(order)), r.instruction, -r.frequency_mhz)
    )
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(PROFILE_COLUMNS)
        for r in ordered:
            writer.writerow(
                [r.stage, r.instruction, r.frequency_mhz, repr(float(r.time_s)), repr(float(r.energy_j))]
            )
    tmp.replace(path)


def _parse_row(path: Path, line: int, row: Mapping[str, str | None]) -> ProfileRow:
    try:
        stage = int(str(row["stage"]).strip())
        kind = str(row["instruction"]).strip().lower()
        freq_f = float(str(row["frequency"]).strip())
        time_s = float(str(row["time"]).strip())
        energy_j = float(str(row["energy"]).strip())
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}:{line}: cannot parse row {dict(row)}: {e}") from None
    if kind not in INSTRUCTIONS:
        raise ValueError(f"{path}:{line}: instruction {kind!r} is not one of {INSTRUCTIONS}.")
    if stage < 0 or freq_f <= 0 or freq_f != int(freq_f):
        raise ValueError(f"{path}:{line}: stage must be >= 0 and frequency a positive integer (MHz).")
    if not (math.isfinite(time_s) and time_s > 0):
        raise ValueError(f"{path}:{line}: time must be positive and finite, got {time_s}.")
    if not (math.isfinite(energy_j) and energy_j >= 0):
        raise ValueError(f"{path}:{line}: energy must be non-negative and finite, got {energy_j}.")
    return ProfileRow(stage, kind, int(freq_f), time_s, energy_j)


def _check_stages(path: Path, profiled: set[tuple[int, str]], num_stages: int | None) -> None:
    """Every expected stage has both instructions; no other stage appears."""
    if not profiled:
        raise ValueError(f"{path}: no profile rows.")
    stages = sorted({s for s, _ in profiled})
    expected = range(num_stages if num_stages is not None else stages[-1] + 1)
    extra = [s for s in stages if s not in expected]
    if extra:
        raise ValueError(f"{path}: stage(s) {extra} out of range for {len(expected)} stages.")
    for s in expected:
        for kind in INSTRUCTIONS:
            if (s, kind) not in profiled:
                raise ValueError(f"{path}: stage {s} has no {kind} rows.")
