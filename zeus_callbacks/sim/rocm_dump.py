"""Simulated AMD boards built from a saved `rocm-smi -a` (`--showallinfo`) output: `ZEUS_CALLBACKS_SIMULATE=
rocm-smi:FILE[:WORKLOAD]`, the AMD twin of `nvidia-smi:` (`sim/dump_node.py`).

The format is rocm-smi's sections (`==== Power Cap ====`, ...) of `GPU[i]<tabs>: Key: Value` lines
(`MI300X_x4.rocm-smi-a.txt`, ROCm SMI with driver 6.7.0). From the dump, board by board: name (`Card series`),
the unique id (the `GPU-<hex>` UUID HIP and ROCr use), PCI bus id, the power cap in force (`Max Graphics Package
Power`), idle socket power, the settable graphics clock range (`OD_SCLK`), compute partition and the driver
version. A rocm-smi dump shows no lowest cap and no timing: those are the MI300X model's (`sim/specs.py`,
ASSUMED and MODELLED, labelled so), as are memory, clock levels and the energy counter's resolution
(`sim/amd_specs.py`, from the same dump). Only MI300X boards are modelled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.sim.dump import NvidiaSmiDump
from zeus_callbacks.sim.dump_files import DumpFiles
from zeus_callbacks.sim.dump_node import DumpBoardModel, DumpNode, LimitScope
from zeus_callbacks.sim.node_spec import SPEC_INPUT
from zeus_callbacks.sim.specs import spec_for
from zeus_callbacks.sim.traces import scaled_trace, shipped_trace

__all__ = [
    "ROCM_PREFIX",
    "ROCM_HELP",
    "ROCM_DUMPS",
    "rocm_node",
    "shipped_rocm_dumps",
]

ROCM_PREFIX = "rocm-smi:"
ORIGIN = "a rocm-smi dump"
ROCM_HELP = (
    "A rocm-smi: node needs the full listing of a node saved as text: `rocm-smi -a > node.txt` (or "
    "`rocm-smi --showallinfo`), then ZEUS_CALLBACKS_SIMULATE=rocm-smi:node.txt."
)
_LINE = re.compile(r"^GPU\[(\d+)\]\s*:\s*(.*?)\s*$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


ROCM_DUMPS = DumpFiles(ROCM_PREFIX, ".rocm-smi-a.txt", "rocm-smi dump", "rocm-smi -a", "MI300X_x4")


def shipped_rocm_dumps() -> list[str]:
    """The rocm-smi dumps shipped with the package (`rocm-smi:NAME`), e.g. `MI300X_x4`."""
    return ROCM_DUMPS.shipped()


def parse_rocm_smi(text: str, source: str) -> tuple[str, dict[int, dict[str, str]]]:
    """(driver version, each GPU's `Key: Value` fields) of a `rocm-smi -a` text; a key seen twice keeps the first.

    Raises:
        InvalidInputError: the text is not a `rocm-smi -a` dump (the concise table, nvidia-smi's, empty).
    """
    if "ROCm System Management Interface" not in text:
        raise InvalidInputError(f"{source} is not a rocm-smi dump. {ROCM_HELP}")
    if "Concise Info" in text and "Power Cap" not in text:
        raise InvalidInputError(
            f"{source} is rocm-smi's concise table, which lacks the unique ids and PCI bus ids. {ROCM_HELP}"
        )
    driver = re.search(r"^Driver version:\s*(\S+)", text, re.M)
    fields: dict[int, dict[str, str]] = {}
    od_sclk: dict[int, list[int]] = {}  # the `OD_SCLK:` header's level lines, until the next header
    for raw in text.splitlines():
        match = _LINE.match(raw)
        if not match:
            continue
        index, rest = int(match.group(1)), match.group(2)
        key, colon, value = (t.strip() for t in rest.partition(":"))
        if key.startswith("OD_"):
            od_sclk[index] = od_sclk.get(index, []) if key != "OD_SCLK" else []
            reading = key == "OD_SCLK"
            fields.setdefault(index, {})["_od"] = "sclk" if reading else "other"
        elif key.isdigit() and fields.get(index, {}).get("_od") == "sclk":
            od_sclk[index].extend(int(m) for m in re.findall(r"(\d+)Mhz", value))
        elif colon:
            fields.setdefault(index, {}).setdefault(key, value)
            fields[index]["_od"] = "other"
    for index, mhz in od_sclk.items():
        if mhz:
            fields[index]["OD_SCLK"] = f"{min(mhz)}-{max(mhz)}"
    if not fields:
        raise InvalidInputError(f"{source} lists no `GPU[i] : ...` lines. {ROCM_HELP}")
    return (driver.group(1) if driver else "simulated"), fields


def _number(fields: dict[str, str], key: str) -> float | None:
    match = _NUMBER.search(fields.get(key, ""))
    return None if match is None else float(match.group())


def rocm_node(spec: str) -> DumpNode:
    """The simulated boards of `rocm-smi:FILE[:WORKLOAD]`, in the dump's order.

    Raises:
        InvalidInputError: the file is missing or not a `rocm-smi -a` dump, or a board is not an MI300X or lacks
            its unique id or PCI bus id.
    """
    path, workload = ROCM_DUMPS.target(spec)
    try:
        text = path.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"{path}: {e}. {ROCM_HELP}") from None
    driver, boards = parse_rocm_smi(text, str(path))
    model = spec_for("mi300x")
    assert model.min_power_limit_w is not None and model.max_power_limit_w is not None
    caps = [_number(f, "Max Graphics Package Power (W)") for f in boards.values()]
    high = max([model.max_power_limit_w, *(c for c in caps if c)])
    try:
        trace = scaled_trace(shipped_trace("a40", workload), "mi300x", model.min_power_limit_w, high)
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"{SPEC_INPUT} {spec!r}: {e}") from None
    dump = NvidiaSmiDump(str(path), hashlib.sha1(text.encode()).hexdigest(), driver, None, ())
    models = tuple(_board(str(path), i, f, trace, high) for i, f in sorted(boards.items()))
    return DumpNode(dump, models, workload)


def _board(source: str, index: int, f: dict[str, str], trace: object, high_w: float) -> DumpBoardModel:
    name, unique, bus = f.get("Card series"), f.get("Unique ID"), f.get("PCI Bus")
    if not name or not unique or not bus:
        raise InvalidInputError(
            f"{source}, GPU[{index}]: no `Card series`, `Unique ID` or `PCI Bus` line. Save the whole output again "
            "(`rocm-smi -a > FILE`)."
        )
    if "MI300X" not in name:
        raise InvalidInputError(
            f"{source}, GPU[{index}] is an {name}; only MI300X boards are modelled (rocm-smi:)."
        )
    model = spec_for("mi300x")
    cap_w = _number(f, "Max Graphics Package Power (W)") or high_w
    idle_w = _number(f, "Current Socket Graphics Package Power (W)") or model.idle_power_w
    lo, hi = (
        int(x) for x in f.get("OD_SCLK", f"{model.min_sm_clock_mhz}-{model.max_sm_clock_mhz}").split("-")
    )
    spec = dataclasses.replace(
        model, name=name, idle_power_w=idle_w, max_sm_clock_mhz=hi, min_sm_clock_mhz=lo, origin=ORIGIN
    )
    low_mw = round(trace.min_power_limit_w * 1000)  # type: ignore[attr-defined]
    limits = LimitScope(low_mw, round(high_w * 1000), round(high_w * 1000), round(cap_w * 1000))
    return DumpBoardModel(
        spec=spec,
        trace=trace,  # type: ignore[arg-type]
        uuid=f"GPU-{int(unique, 16):016x}",
        pci_bus_id=bus.upper(),
        gpu_limits=limits,
        module_limits=None,
        module_other_w=0.0,
        persistence=False,
        mig=f.get("Compute Partition", "SPX") != "SPX",
        memory_power=False,
        energy_counter=True,
        not_supported=frozenset(),
    )
