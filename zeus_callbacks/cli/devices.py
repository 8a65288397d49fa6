"""`zeus-callbacks devices`: the GPUs this process sees (real or simulated) and what it may do with them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zeus_callbacks.core.device.errors import MIGNotSupportedError, MixedVendorError, NVMLUnavailableError
from zeus_callbacks.core.device.gpus import GPU, GPUs, get_gpus
from zeus_callbacks.core.device.node_info import safe_call

NO_VISIBLE_GPU = "No GPU is visible to this process (check CUDA_VISIBLE_DEVICES; AMD: HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES)."
NO_GPU_MESSAGE = (
    "No NVIDIA or AMD GPU or driver found. To use simulated GPUs, set ZEUS_CALLBACKS_SIMULATE=a40 "
    "(or v100, a10g, t4; e.g. ZEUS_CALLBACKS_SIMULATE='4*a40')."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `devices` subcommand."""
    parser = subparsers.add_parser(
        "devices",
        help="list the GPUs (real or simulated) and their power limits, clocks and permissions",
        description="List the GPUs this process sees (after CUDA_VISIBLE_DEVICES), real or simulated.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per GPU")
    parser.set_defaults(func=run)


def describe(gpu: GPU) -> dict[str, Any]:
    """What `devices` reports about one GPU, in plain numbers (W, MHz)."""
    constraints = safe_call(gpu.power_limit_constraints_mw)
    current = safe_call(
        gpu.enforced_power_limit_mw
    )  # in force; below the one set where another limiter holds it
    requested = safe_call(gpu.power_limit_mw)
    default = safe_call(gpu.default_power_limit_mw)
    clocks = safe_call(gpu.supported_sm_clocks_mhz)
    # A modelled simulated board (not traced) says so; other GPUs' rows keep their keys.
    modelled = {} if gpu.provenance is None else {"provenance": gpu.provenance}
    return {
        "index": gpu.index,
        "nvml_index": gpu.vendor_index,  # the vendor library's index (the key predates other vendors)
        "name": gpu.name,
        "uuid": gpu.uuid,
        "simulated": gpu.simulated,
        "energy_counter": gpu.supports_energy_counter,
        "power_limit_w": None if current is None else current / 1000,
        "requested_power_limit_w": None if requested is None else requested / 1000,
        "min_power_limit_w": None if constraints is None else constraints[0] / 1000,
        "max_power_limit_w": None if constraints is None else constraints[1] / 1000,
        "default_power_limit_w": None if default is None else default / 1000,
        "min_sm_clock_mhz": min(clocks) if clocks else None,
        "max_sm_clock_mhz": max(clocks) if clocks else None,
        "may_change_settings": gpu.may_change_settings(),
        **modelled,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _table(rows: list[dict[str, Any]], library: str) -> str:
    header = [
        "GPU",
        library,
        "name",
        "kind",
        "energy counter",
        "power limit W (set)",
        "min-max W",
        "default W",
        "SM clock MHz",
        "may change",
    ]
    lines = [header]
    for r in rows:
        lines.append(
            [
                _fmt(r["index"]),
                _fmt(r["nvml_index"]),
                r["name"],
                ("SIMULATED" if r["simulated"] else "real")
                + (f" ({r['provenance']})" if r.get("provenance") else ""),
                _fmt(r["energy_counter"]),
                _fmt(r["power_limit_w"])
                + (
                    ""
                    if r["requested_power_limit_w"] in (None, r["power_limit_w"])
                    else f" ({_fmt(r['requested_power_limit_w'])})"
                ),
                f"{_fmt(r['min_power_limit_w'])}-{_fmt(r['max_power_limit_w'])}",
                _fmt(r["default_power_limit_w"]),
                f"{_fmt(r['min_sm_clock_mhz'])}-{_fmt(r['max_sm_clock_mhz'])}",
                _fmt(r["may_change_settings"]),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def discover(repair: bool = True) -> GPUs | None:
    """The GPUs, or None after saying on stderr why there are none (no vendor library and no simulation, the
    unofficial `pynvml` in place of nvidia-ml-py, MIG, or GPUs of two vendors)."""
    try:
        return get_gpus(repair=repair)
    except NVMLUnavailableError as e:
        # A subclass names its own cause and fix (the unofficial pynvml); the base class means no GPU at all.
        print(NO_GPU_MESSAGE if type(e) is NVMLUnavailableError else e, file=sys.stderr)
    except (MIGNotSupportedError, MixedVendorError) as e:
        print(e, file=sys.stderr)
    return None


def run(args: argparse.Namespace) -> int:
    """Print the GPUs; 1 when there is no GPU and no simulation (or a MIG device is selected)."""
    gpus = discover()
    if gpus is None:
        return 1
    rows = [describe(g) for g in gpus]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if gpus.simulated:
        print("SIMULATED GPUs (ZEUS_CALLBACKS_SIMULATE): every figure they report is a simulation.")
    if not rows:
        print(NO_VISIBLE_GPU)
        return 0
    print(_table(rows, gpus.backend.library))
    for r in rows:
        if r["max_sm_clock_mhz"] is None:
            print(
                f"GPU {r['index']} ({r['name']}): no supported SM clocks are listed, so its clocks cannot "
                "be locked; the pipeline-frequency optimizer only measures there."
            )
    if not all(r["may_change_settings"] for r in rows):
        print(
            "Changing power limits or clocks needs CAP_SYS_ADMIN (root has it unless a container drops it); "
            "measuring works without."
        )
    return 0
