"""Read a node's description from a saved `nvidia-smi -q` (`-a`) dump: its driver and each GPU's identity and
power-limit, clock, memory and mode fields, as typed records.

The format is nvidia-smi's indented `Key : Value` tree, one `GPU <bus id>` block per board (nvidia-smi's man
page, "GPU ATTRIBUTES"). Its field names changed between drivers; both spellings are read:
- drivers up to 52x print a `Power Readings` section with `Power Limit` (the limit software requested, NVML's
  `nvmlDeviceGetPowerManagementLimit`) and `Enforced Power Limit` (the limit in force after every limiter,
  `nvmlDeviceGetEnforcedPowerLimit`), e.g. `GTX680.nvidia-smi-a.txt` (driver 470);
- later drivers print `GPU Power Readings` with `Requested Power Limit` and `Current Power Limit` (the same two
  limits: nvml.h's `NVML_FI_DEV_POWER_REQUESTED_LIMIT`, "requested by NVML or any other userspace client", and
  `NVML_FI_DEV_POWER_CURRENT_LIMIT`, "currently enforced ... includes other limits set elsewhere"), plus
  `GPU Memory Power Readings` and `Module Power Readings` (module = GPU + CPU, e.g. `GH200.nvidia-smi-a.txt`);
- driver 570 splits `Power Draw` into `Average Power Draw` and `Instantaneous Power Draw`
  (`RTX5090.nvidia-smi-a.txt`).
A value nvidia-smi could not read is `N/A` (or `[N/A]`, `[Not Supported]`, ...): it is None here.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from zeus_callbacks.core.device.errors import InvalidInputError

__all__ = ["PowerReadings", "DumpBoard", "NvidiaSmiDump", "parse_nvidia_smi", "read_nvidia_smi", "DUMP_HELP"]

DUMP_HELP = (
    "An nvidia-smi: node needs the full query of a node saved as text: `nvidia-smi -q > node.txt` "
    "(or `nvidia-smi -a`), then ZEUS_CALLBACKS_SIMULATE=nvidia-smi:node.txt."
)


@dataclass(frozen=True)
class PowerReadings:
    """One power scope's fields (W; None where the dump says N/A)."""

    draw_w: float | None = None  # `Power Draw` (driver 570: `Instantaneous Power Draw`)
    current_limit_w: float | None = (
        None  # in force after every limiter (older drivers: `Enforced Power Limit`)
    )
    requested_limit_w: float | None = None  # set by software (older drivers: `Power Limit`)
    default_limit_w: float | None = None
    min_limit_w: float | None = None
    max_limit_w: float | None = None

    @property
    def settable(self) -> bool:
        """Whether the dump gives the scope a settable range (min and max)."""
        return self.min_limit_w is not None and self.max_limit_w is not None


@dataclass(frozen=True)
class DumpBoard:
    """One `GPU <bus id>` block of the dump."""

    line: int  # where the block begins (1-based), for messages
    bus_id: str
    name: str
    uuid: str
    architecture: str | None  # `Product Architecture`, e.g. "Ampere" (absent before driver 5xx)
    persistence: bool | None
    mig: bool | None  # `MIG Mode` / `Current`; None: N/A (the board has no MIG)
    memory_mib: int | None
    max_sm_clock_mhz: int | None
    max_memory_clock_mhz: int | None
    utilization_pct: float | None
    gpu: PowerReadings
    module: PowerReadings  # all None on boards without a module scope
    memory_draw_w: float | None  # `GPU Memory Power Readings` / `Power Draw`


@dataclass(frozen=True)
class NvidiaSmiDump:
    """A whole dump: where it came from, a digest of its text, the driver, and the boards in bus order."""

    source: str
    digest: str  # sha1 of the text: two dumps never share a simulated node's state
    driver_version: str
    cuda_version: str | None
    boards: tuple[DumpBoard, ...]


def read_nvidia_smi(path: str | Path) -> NvidiaSmiDump:
    """Parse the dump in the file `path`.

    Raises:
        InvalidInputError: the file cannot be read, or is not an `nvidia-smi -q` dump (says what it is, and
            what to give instead).
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode()
    except UnicodeDecodeError:
        raise InvalidInputError(f"{path} is not a text file. {DUMP_HELP}") from None
    except OSError as e:
        raise InvalidInputError(f"{path}: {e.strerror or e}. {DUMP_HELP}") from None
    return parse_nvidia_smi(text, str(path))


_GPU_BLOCK = re.compile(r"GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_nvidia_smi(text: str, source: str = "<text>") -> NvidiaSmiDump:
    """Parse the text of an `nvidia-smi -q` dump.

    Raises:
        InvalidInputError: the text is not such a dump, or a GPU block lacks its name or UUID.
    """
    _refuse_other_formats(text, source)
    header: dict[str, str] = {}
    blocks: list[tuple[int, str, dict[str, str]]] = []
    stack: list[tuple[int, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        block = _GPU_BLOCK.match(line) if indent == 0 else None
        if block:
            blocks.append((number, block.group(1), {}))
            stack = []
            continue
        key, colon, value = line.strip().partition(":")
        key = key.strip()
        if indent == 0 or not blocks:
            if colon:
                header[key] = value.strip()
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([name for _, name in stack] + [key])
        if colon:
            blocks[-1][2].setdefault(path, value.strip())
        else:
            stack.append((indent, key))
    if "Driver Version" not in header or not blocks:
        raise InvalidInputError(
            f"{source} is not an nvidia-smi -q dump (no `Driver Version` line and `GPU <bus id>` blocks). {DUMP_HELP}"
        )
    attached = _number(header.get("Attached GPUs"))
    if attached is not None and attached != len(blocks):
        raise InvalidInputError(
            f"{source}: `Attached GPUs : {attached:g}` but {len(blocks)} `GPU <bus id>` block(s): the file looks "
            f"truncated. Save the whole output again (`nvidia-smi -q > FILE`)."
        )
    boards = tuple(_board(source, line, bus_id, fields) for line, bus_id, fields in blocks)
    return NvidiaSmiDump(
        source=source,
        digest=hashlib.sha1(text.encode()).hexdigest(),
        driver_version=header["Driver Version"],
        cuda_version=_text(header.get("CUDA Version")),
        boards=boards,
    )


def _refuse_other_formats(text: str, source: str) -> None:
    """A clear error for what is not a query dump: empty, rocm-smi's, nvidia-smi's summary table."""
    if not text.strip():
        raise InvalidInputError(f"{source} is empty. {DUMP_HELP}")
    if "ROCm System Management Interface" in text or re.search(r"^GPU\[\d+\]\s*:", text, re.M):
        raise InvalidInputError(
            f"{source} is a rocm-smi dump (AMD GPUs): nvidia-smi: builds NVIDIA nodes only; for simulated AMD GPUs "
            f"give it as ZEUS_CALLBACKS_SIMULATE=rocm-smi:{source} (`sim/rocm_dump.py`). {DUMP_HELP}"
        )
    if re.search(r"^\|\s*NVIDIA-SMI \S+", text, re.M) and "NVSMI LOG" not in text:
        raise InvalidInputError(
            f"{source} is nvidia-smi's summary table, which lacks the power-limit ranges and UUIDs. {DUMP_HELP}"
        )


def _board(source: str, line: int, bus_id: str, fields: dict[str, str]) -> DumpBoard:
    name, uuid = _text(fields.get("Product Name")), _text(fields.get("GPU UUID"))
    if name is None or uuid is None:
        raise InvalidInputError(
            f"{source}, line {line}: the block of GPU {bus_id} has no `Product Name` or `GPU UUID`. "
            f"Save the whole output again (`nvidia-smi -q > FILE`)."
        )
    old = "Power Readings/Power Draw" in fields  # drivers up to 52x (see the module's docstring)
    mig = _text(fields.get("MIG Mode/Current"))
    return DumpBoard(
        line=line,
        bus_id=bus_id.upper() if len(bus_id) > 12 else f"0000{bus_id}".upper(),
        name=name,
        uuid=uuid,
        architecture=_text(fields.get("Product Architecture")),
        persistence=_enabled(fields.get("Persistence Mode")),
        mig=None if mig is None else mig == "Enabled",
        memory_mib=_int(fields.get("FB Memory Usage/Total")),
        max_sm_clock_mhz=_int(fields.get("Max Clocks/SM")),
        max_memory_clock_mhz=_int(fields.get("Max Clocks/Memory")),
        utilization_pct=_number(fields.get("Utilization/Gpu", fields.get("Utilization/GPU"))),
        gpu=_readings(fields, "Power Readings" if old else "GPU Power Readings"),
        module=_readings(fields, "Module Power Readings"),
        memory_draw_w=_draw(fields, "GPU Memory Power Readings"),
    )


def _readings(fields: dict[str, str], section: str) -> PowerReadings:
    def get(*keys: str) -> float | None:
        return next((v for k in keys if (v := _number(fields.get(f"{section}/{k}"))) is not None), None)

    return PowerReadings(
        draw_w=_draw(fields, section),
        current_limit_w=get("Current Power Limit", "Enforced Power Limit"),
        requested_limit_w=get("Requested Power Limit", "Power Limit"),
        default_limit_w=get("Default Power Limit"),
        min_limit_w=get("Min Power Limit"),
        max_limit_w=get("Max Power Limit"),
    )


def _draw(fields: dict[str, str], section: str) -> float | None:
    keys = ("Power Draw", "Instantaneous Power Draw", "Average Power Draw")
    return next((v for k in keys if (v := _number(fields.get(f"{section}/{k}"))) is not None), None)


def _text(value: str | None) -> str | None:
    """None for nvidia-smi's unreadable values: `N/A`, `[N/A]`, `[Not Supported]`, `[Unknown Error]`, ..."""
    if value is None or not value or value == "N/A" or value.startswith("["):
        return None
    return value


def _number(value: str | None) -> float | None:
    text = _text(value)
    match = None if text is None else _NUMBER.match(text)
    return None if match is None else float(match.group())


def _int(value: str | None) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _enabled(value: str | None) -> bool | None:
    text = _text(value)
    return None if text is None else text == "Enabled"
