"""The Perseus instruction profile CSV (`stage,instruction,frequency,time,energy`): its row, reader and writer.

One row per (stage, instruction, SM frequency), as Zeus/Perseus write it: `instruction` is `forward` or
`backward`, `frequency` in MHz, `time` in seconds and `energy` in joules for one instruction (one microbatch
on one stage). `PipelineFrequencyOptimizer(profile_path=...)` writes and reads it; so does
`zeus-callbacks pipeline-plan`. A profile of an interleaved schedule (several model chunks per stage) is
measured per chunk and has a sixth column, `virtual_stage` (the chunk's place in the model); a file without
it prices every chunk of a stage alike.

The time measured between instructions (the DAG's edge delays, `edge_delays`) travels beside it, so that the
profile itself stays what Perseus reads: `profile.csv` -> `profile.edges.csv`, one row per kind of edge,
`from_stage,from_instruction,to_stage,to_instruction,delay` (seconds), and the row `0,step,0,step,<s>` for
the step's time outside the DAG. A profile without that file has no delays (all 0).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.files import ForeignFileError, read_regular, write_atomic

__all__ = [
    "PROFILE_COLUMNS",
    "EDGE_COLUMNS",
    "INSTRUCTIONS",
    "ProfileRow",
    "read_profile",
    "write_profile",
    "edge_delays_path",
    "read_edge_delays",
    "write_edge_delays",
]

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
VIRTUAL_STAGE_COLUMN = "virtual_stage"  # optional: profiles measured per model chunk
INSTRUCTIONS = ("forward", "backward")
EDGE_COLUMNS = ("from_stage", "from_instruction", "to_stage", "to_instruction", "delay")
EdgeRow = tuple[int, str, int, str, float]


@dataclass(frozen=True)
class ProfileRow:
    """Time and energy of one instruction (one microbatch) of one type on one stage at one SM clock.

    In `PipelineFrequencyOptimizer.report()`, 0 MHz stands for the clock the GPU chose itself (measured
    without permission to lock clocks); a file holds locked clocks only. `virtual_stage` is the model chunk
    measured, in a profile measured per chunk (interleaved schedules); None: every chunk of the stage.
    """

    stage: int
    instruction: str
    frequency_mhz: int
    time_s: float
    energy_j: float
    virtual_stage: int | None = None

    @property
    def key(self) -> tuple[int, str] | tuple[int, str, int]:
        """The planner's key of the instruction type measured (`energy_model.OptionKey`)."""
        if self.virtual_stage is None:
            return (self.stage, self.instruction)
        return (self.stage, self.instruction, self.virtual_stage)


def read_profile(path: str | Path, num_stages: int | None = None) -> list[ProfileRow]:
    """The rows of a profile CSV, in file order.

    Args:
        path: The CSV file (UTF-8 text).
        num_stages: If given, every stage `0..num_stages-1` must have both instructions profiled, and no
            other stage may appear. Otherwise stages must be `0..max` without gaps.

    Raises:
        InvalidInputError: (a `ValueError`) naming the file, and the line where there is one: not a text
            file, a missing column, a row without 5 fields, an unparsable, negative or non-finite value,
            an unknown instruction, a duplicated (stage, instruction, virtual stage, frequency), or a
            stage/instruction with no rows.
        OSError: The file cannot be opened.
    """
    path = Path(path)
    rows: list[ProfileRow] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        text = _read_text(path)
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path}: not a text file (not UTF-8); {_EXPECTED}") from None
    for line, fields in _csv_lines(path, io.StringIO(text, newline="")):
        row = _parse_row(path, line, fields)
        key = (*row.key, row.frequency_mhz)
        if key in seen:
            chunk = "" if row.virtual_stage is None else f" of virtual stage {row.virtual_stage}"
            raise InvalidInputError(
                f"{path}:{line}: stage {row.stage} {row.instruction}{chunk} at {row.frequency_mhz} MHz "
                "appears twice."
            )
        seen.add(key)
        rows.append(row)
    _check_stages(path, {(r.stage, r.instruction) for r in rows}, num_stages)
    return rows


_EXPECTED = f"pass a Perseus profile CSV with the header {','.join(PROFILE_COLUMNS)}."


def _read_text(path: Path) -> str:
    """The file's text; a file of another user is refused, as it chooses clocks (`files.read_regular`).

    Raises:
        InvalidInputError: another user's file. OSError: unreadable. UnicodeDecodeError: not UTF-8.
    """
    try:
        return read_regular(path, chooses="the GPUs' clocks").decode("utf-8-sig")
    except ForeignFileError as e:
        raise InvalidInputError(f"{e.filename}: {e.strerror}.") from None


def _text_lines(path: Path, f: Iterable[str]) -> Iterator[str]:
    for text in f:
        if "\x00" in text:
            raise InvalidInputError(f"{path}: not a text file (it holds NUL bytes); {_EXPECTED}")
        yield text


def _csv_lines(path: Path, f: Iterable[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, {column: field}) of each data row, after checking the header."""
    reader = csv.reader(_text_lines(path, f))
    try:
        header = [c.strip() for c in next(reader, [])]
        missing = [c for c in PROFILE_COLUMNS if c not in header]
        if missing:
            first = f"the first line is {','.join(header)[:80]!r}" if header else "the file is empty"
            raise InvalidInputError(
                f"{path}:1: missing column(s) {', '.join(missing)} ({first}); {_EXPECTED}"
            )
        for fields in reader:
            if not fields:
                continue  # a blank line
            if len(fields) != len(header):
                raise InvalidInputError(
                    f"{path}:{reader.line_num}: {len(fields)} field(s) where the header has {len(header)} "
                    f"({','.join(header)})."
                )
            yield reader.line_num, dict(zip(header, fields, strict=True))
    except csv.Error as e:
        raise InvalidInputError(f"{path}:{reader.line_num}: not valid CSV ({e}).") from None


def write_profile(path: str | Path, rows: Iterable[ProfileRow]) -> None:
    """Write rows as a profile CSV (by stage, forward before backward, then decreasing frequency).

    The parent folder is created; the file is replaced at once, so a reader never sees half of it
    (`files.write_atomic`).

    Raises:
        OSError: it cannot be written (the last complete file is kept).
    """
    order = {kind: i for i, kind in enumerate(INSTRUCTIONS)}
    ordered = sorted(
        rows,
        key=lambda r: (
            r.stage,
            -1 if r.virtual_stage is None else r.virtual_stage,
            order.get(r.instruction, len(order)),
            r.instruction,
            -r.frequency_mhz,
        ),
    )
    per_chunk = any(r.virtual_stage is not None for r in ordered)
    f = io.StringIO(newline="")
    writer = csv.writer(f)
    writer.writerow((*PROFILE_COLUMNS, VIRTUAL_STAGE_COLUMN) if per_chunk else PROFILE_COLUMNS)
    for r in ordered:
        fields = [r.stage, r.instruction, r.frequency_mhz, repr(float(r.time_s)), repr(float(r.energy_j))]
        writer.writerow(
            [*fields, "" if r.virtual_stage is None else r.virtual_stage] if per_chunk else fields
        )
    write_atomic(path, f.getvalue())


def edge_delays_path(profile_path: str | Path) -> Path:
    """Where the edge delays of the profile `profile_path` are kept: `name.csv` -> `name.edges.csv`."""
    path = Path(profile_path)
    return path.with_name(f"{path.stem}.edges{path.suffix or '.csv'}")


def write_edge_delays(path: str | Path, rows: Iterable[EdgeRow]) -> None:
    """Write edge-delay rows `(from stage, from instruction, to stage, to instruction, delay s)` (at once)."""
    f = io.StringIO(newline="")
    writer = csv.writer(f)
    writer.writerow(EDGE_COLUMNS)
    for a, ka, b, kb, d in rows:
        writer.writerow([a, ka, b, kb, repr(float(d))])
    write_atomic(path, f.getvalue())


def read_edge_delays(path: str | Path) -> list[EdgeRow]:
    """The rows of an edge-delay file; none when it does not exist (a profile without delays).

    Raises:
        InvalidInputError: (a `ValueError`) naming the file and line: a missing column, an unparsable,
            negative or non-finite value, an unknown instruction.
    """
    path = Path(path)
    if not path.exists():
        return []
    rows: list[EdgeRow] = []
    kinds = (*INSTRUCTIONS, "step")
    try:
        text = _read_text(path)
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path}: not a text file (not UTF-8); expected edge delays.") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    header = [c.strip() for c in next(reader, [])]
    if tuple(header[: len(EDGE_COLUMNS)]) != EDGE_COLUMNS:
        raise InvalidInputError(f"{path}:1: expected the header {','.join(EDGE_COLUMNS)}.")
    for fields in reader:
        if not fields:
            continue
        where = f"{path}:{reader.line_num}:"
        try:
            a, ka, b, kb, d = fields[:5]
            row = (int(a), ka.strip().lower(), int(b), kb.strip().lower(), float(d))
        except ValueError:
            raise InvalidInputError(f"{where} expected {','.join(EDGE_COLUMNS)}, got {fields}.") from None
        if row[1] not in kinds or row[3] not in kinds:
            raise InvalidInputError(f"{where} instructions must be one of {kinds}.")
        if row[0] < 0 or row[2] < 0 or not (math.isfinite(row[4]) and row[4] >= 0):
            raise InvalidInputError(f"{where} stages must be >= 0 and the delay finite and >= 0 s.")
        rows.append(row)
    return rows


def _field(path: Path, line: int, fields: Mapping[str, str], name: str, kind: type, what: str) -> Any:
    """Column `name` of a row as `kind`, or the error that names the file, line and column."""
    text = fields[name].strip()
    try:
        value = kind(text)
    except ValueError:
        raise InvalidInputError(f"{path}:{line}: cannot parse {name} {text!r}: {what}.") from None
    return value


def _parse_row(path: Path, line: int, fields: Mapping[str, str]) -> ProfileRow:
    stage = _field(path, line, fields, "stage", int, "pass the stage index (an integer >= 0)")
    kind = fields["instruction"].strip().lower()
    freq = _field(path, line, fields, "frequency", float, "pass the SM clock in MHz")
    time_s = _field(path, line, fields, "time", float, "pass seconds per instruction")
    energy_j = _field(path, line, fields, "energy", float, "pass joules per instruction")
    where = f"{path}:{line}:"
    if kind not in INSTRUCTIONS:
        raise InvalidInputError(f"{where} instruction {kind!r} is not one of {INSTRUCTIONS}.")
    if stage < 0:
        raise InvalidInputError(f"{where} stage must be >= 0, got {stage}.")
    if not (math.isfinite(freq) and freq > 0 and freq == int(freq)):
        raise InvalidInputError(f"{where} frequency must be a positive integer (MHz), got {freq:g}.")
    if not (math.isfinite(time_s) and time_s > 0):
        raise InvalidInputError(f"{where} time must be positive and finite (seconds), got {time_s}.")
    if not (math.isfinite(energy_j) and energy_j >= 0):
        raise InvalidInputError(f"{where} energy must be non-negative and finite (joules), got {energy_j}.")
    chunk = fields.get(VIRTUAL_STAGE_COLUMN, "").strip()
    virtual_stage = None
    if chunk:
        virtual_stage = _field(path, line, fields, VIRTUAL_STAGE_COLUMN, int, "pass the model chunk's index")
        if virtual_stage < 0:
            raise InvalidInputError(f"{where} virtual_stage must be >= 0 or empty, got {virtual_stage}.")
    return ProfileRow(stage, kind, int(freq), time_s, energy_j, virtual_stage)


def _check_stages(path: Path, profiled: set[tuple[int, str]], num_stages: int | None) -> None:
    """Every expected stage has both instructions; no other stage appears."""
    if not profiled:
        raise InvalidInputError(f"{path}: no profile rows.")
    stages = sorted({s for s, _ in profiled})
    expected = range(num_stages if num_stages is not None else stages[-1] + 1)
    extra = [s for s in stages if s not in expected]
    if extra:
        raise InvalidInputError(f"{path}: stage(s) {extra} out of range for {len(expected)} stages.")
    for s in expected:
        for kind in INSTRUCTIONS:
            if (s, kind) not in profiled:
                raise InvalidInputError(f"{path}: stage {s} has no {kind} rows.")
