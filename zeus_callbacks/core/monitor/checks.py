"""Checks of the monitoring options (ZeusMonitor, ReplayZeusMonitor, ProfileDataLoader, EpochLog): one clear
line each that names the input (argument, variable, file and line) and says what to pass."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO, cast

from zeus_callbacks.core import files
from zeus_callbacks.core.device.errors import InvalidInputError

__all__ = [
    "cpu_indices",
    "log_columns",
    "flag",
    "open_log",
    "window_key",
    "read_log_lines",
    "log_cells",
    "sleep_ms",
    "require_zeus_monitor",
]


def cpu_indices(value: Any) -> list[int] | None:
    """`ZeusMonitor(cpu_indices=...)` as a list of package indices (None: the default, every package)."""
    if value is None:
        return None
    call = f"`ZeusMonitor(cpu_indices={value!r})`"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence | set | frozenset | range):
        raise InvalidInputError(f"{call}: expected a list of CPU package indices, e.g. [0] or [0, 1].")
    out = []
    for i in value:
        try:
            if isinstance(i, bool):
                raise TypeError
            index = operator.index(i)
        except TypeError:
            index = -1
        if index < 0:
            raise InvalidInputError(
                f"{call}: {i!r} is not a CPU package index; expected whole numbers >= 0 (RAPL's "
                "intel-rapl:<i>), e.g. [0]."
            )
        out.append(index)
    return out


def flag(owner: str, name: str, value: Any) -> bool:
    """A True/False option (not a string: `bool("no")` is True)."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"`{owner}({name}={value!r})`: pass True or False.")
    return value


def open_log(owner: str, value: Any) -> TextIO:
    """Open the CSV log `value` for writing (its folder created), or a clear error."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidInputError(f"`{owner}(log_file={value!r})`: expected a file path (str or Path).")
    path = Path(value)
    if path.is_dir():
        raise InvalidInputError(f"`{owner}(log_file={str(path)!r})`: is a directory; pass a file path in it.")
    try:  # a new file (a link at the name never followed); a full disk later ends the log with a warning
        return cast(TextIO, files.open_log(path, f"{owner} log"))
    except OSError as e:
        raise InvalidInputError(
            f"`{owner}(log_file={str(path)!r})`: cannot be created ({e.strerror or e}); pass a path in a "
            "folder you may write."
        ) from None


def window_key(key: Any) -> None:
    """A window name is a string (Zeus's too); anything else is refused before it is opened."""
    if not isinstance(key, str):
        raise InvalidInputError(
            f"`begin_window({key!r})`: a window name is a string, e.g. begin_window('epoch')."
        )


def read_log_lines(owner: str, path: Path) -> list[str]:
    """The lines of the monitor log `path` to replay, or a clear error (missing, a folder, binary)."""
    where = f"`{owner}(log_file={str(path)!r})`"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InvalidInputError(
            f"{where}: the file does not exist; pass the CSV a ZeusMonitor logged."
        ) from None
    except IsADirectoryError:
        raise InvalidInputError(f"{where}: is a directory; pass the CSV file in it.") from None
    except OSError as e:
        raise InvalidInputError(f"{where}: cannot be read ({e.strerror or e}).") from None
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise InvalidInputError(
            f"{where}: is not a text file; pass the CSV a ZeusMonitor(log_file=...) wrote."
        ) from None


def log_cells(owner: str, path: Path, line_no: int, header: list[str], cells: list[str]) -> None:
    """Check one data line of a monitor log: as many fields as the header, a time and energies >= 0 (an
    empty energy cell is a GPU lost when recorded)."""
    where = f"`{owner}(log_file={str(path)!r})`, line {line_no}"
    if len(cells) != len(header):
        raise InvalidInputError(
            f"{where}: {len(cells)} fields where the header has {len(header)}; fix or drop the line."
        )
    for name, text in zip(header[2:], cells[2:], strict=True):
        if name != "elapsed_time" and not text.strip():
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            want = "a number of seconds >= 0" if name == "elapsed_time" else "a number of joules >= 0"
            raise InvalidInputError(f"{where}: {name} is {text!r}; expected {want}.")


def log_columns(owner: str, path: Path, header: list[str], gpu_indices: Any) -> list[int]:
    """The GPU indices of a monitor log's `gpu<i>_energy` columns, or `gpu_indices` if given (as many)."""
    where = f"`{owner}(log_file={str(path)!r})`, line 1"
    columns = []
    for name in (c for c in header[3:] if c):
        index = name[3:-7] if name.startswith("gpu") and name.endswith("_energy") else ""
        if not index.isdigit():
            raise InvalidInputError(
                f"{where}: column {name!r} is not gpu<i>_energy; the header must be "
                "start_time,window_name,elapsed_time,gpu<i>_energy,... as ZeusMonitor(log_file=...) writes it."
            )
        columns.append(int(index))
    if gpu_indices is None:
        return columns
    call = f"`{owner}(gpu_indices={gpu_indices!r})`"
    if isinstance(gpu_indices, (str, bytes)) or not isinstance(gpu_indices, Sequence | range):
        raise InvalidInputError(
            f"{call}: expected a list of GPU indices, e.g. [0], or None to read the log's."
        )
    if len(gpu_indices) != len(columns):
        raise InvalidInputError(
            f"{call}: {str(path)!r} has {len(columns)} GPU column(s) {columns}; pass as many indices, or None."
        )
    return list(gpu_indices)


def sleep_ms(env: str, value: Any, from_env: bool) -> int:
    """The power-log period in whole milliseconds >= 0 (0: no power log), from `EpochLog(sleep_ms=)` or `env`."""
    if from_env:
        try:
            number = int(str(value).strip())
        except ValueError:
            number = -1
        if number < 0:
            raise InvalidInputError(
                f"{env}={value!r}: expected whole milliseconds between power samples (default 100), or "
                "0 for no power log."
            )
        return number
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(
            f"`EpochLog(sleep_ms={value!r})`: expected whole milliseconds >= 0 (0: no power log)."
        )
    return value


def require_zeus_monitor(owner: str, monitor: Any) -> None:
    """`monitor` is None (the default) or a ZeusMonitor."""
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor

    if monitor is not None and not isinstance(monitor, ZeusMonitor):
        raise InvalidInputError(
            f"`{owner}(monitor={monitor!r:.60})`: pass a zeus_callbacks.ZeusMonitor, e.g. "
            "`ZeusMonitor(gpu_indices=[0])`, or leave it out."
        )
