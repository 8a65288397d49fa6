"""The power-limit optimizer on every node type of the shipped real `nvidia-smi -q` dumps (SIMULATED).

    python benchmarks/real_nodes.py            # a Markdown table, one row per dump
    python benchmarks/real_nodes.py --json

Each row runs `zeus-callbacks simulate --from DUMP --json` (the adaptive search, `ZeusCost(0.5)`, noise 0.02,
seed 0, on a virtual clock): the node as the dump describes it (boards, ranges, the limit in force), the
range profiled, the limit chosen and what it saves and costs by the trace against the limit in force. The
second run of each dump sets `ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT=1`, so the search starts at the
maximum as Zeus's does: where the limit in force is below the maximum, its choice and figures show what
starting at the maximum would have done (figures against the maximum). Timing is modelled from the nearest
traced GPU (A40, V100 or T4 traces scaled to each board's range), so every figure is a simulation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DUMPS = Path(__file__).resolve().parents[1] / "zeus_callbacks" / "sim" / "data" / "gpu_dumps"


def run(name: str, raising: bool) -> dict:
    """`zeus-callbacks simulate --from NAME --json`: its JSON, or {'error': its message}."""
    env = {**os.environ, "ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT": "1" if raising else "0"}
    done = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "simulate", "--from", name, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode != 0:
        return {"error": " ".join(done.stderr.split()).removeprefix("zeus-callbacks simulate: ")}
    return json.loads(done.stdout)


def _ranges(node: dict) -> str:
    by_range: dict[tuple[float, float], int] = {}
    for g in node["gpus"]:
        lo, hi = g["power_limit_range_w"] or (None, None)
        by_range[(lo, hi)] = by_range.get((lo, hi), 0) + 1
    parts = [
        ("N/A" if lo is None else f"{lo:g}-{hi:g}") + (f" x{n}" if len(by_range) > 1 else "")
        for (lo, hi), n in by_range.items()
    ]
    return ", ".join(parts)


def _in_force(node: dict) -> str:
    values = sorted(
        {g["power_limit_in_force_w"] for g in node["gpus"] if g["power_limit_in_force_w"] is not None}
    )
    return "/".join(f"{v:g}" for v in values) or "N/A"


def _choice(r: dict) -> str:
    if "error" in r:
        return f"stands down: {r['error'].removeprefix('the optimizer did not finish ').strip('()')}"
    lo, hi = r["power_limit_range_w"]
    return (
        f"{hi:g}->{lo:g}: {r['optimal_power_limit_w']:g} W, "
        f"-{r['energy_saved_pct_true']:.1f}% energy, +{r['time_lost_pct_true']:.1f}% time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for path in sorted(DUMPS.glob("*.nvidia-smi-a.txt")):
        name = path.name.removesuffix(".nvidia-smi-a.txt")
        ours, raised = run(name, raising=False), run(name, raising=True)
        rows.append({"dump": name, "default": ours, "from_maximum": raised})
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return
    print(
        "SIMULATED: nodes from real nvidia-smi dumps, timing modelled from traces (ZeusCost(0.5), noise 0.02)."
    )
    print(
        "| dump | GPUs | range W | in force W | profiled: chosen (by the trace) | with allow_raising_limit (from the maximum, as Zeus starts) |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        ours, raised = row["default"], row["from_maximum"]
        node = ours.get("node") or raised.get("node")
        if node is None:
            print(f"| {row['dump']} | | | | {ours.get('error', '')} | |")
            continue
        gpus = f"{len(node['gpus'])} x {node['gpus'][0]['name'].removeprefix('NVIDIA ')}"
        same = (
            "error" not in raised
            and "error" not in ours
            and raised["power_limit_range_w"] == ours["power_limit_range_w"]
        )
        print(
            f"| {row['dump']} | {gpus} | {_ranges(node)} | {_in_force(node)} | {_choice(ours)} | "
            f"{'same' if same else _choice(raised)} |"
        )


if __name__ == "__main__":
    main()
