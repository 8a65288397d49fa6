"""Running a pipeline-engine example (`examples/megatron`, `examples/deepspeed`) on 4 simulated A40s, for tests."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

WORLD = 4
MAX_MHZ = 1740  # the A40's highest SM clock
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# A sweep of 1740, 1650, ... 1200 MHz, one measured step each: a plan within about 20 steps.
FAST = ["--stride-mhz", "90", "--min-mhz", "1200", "--profile-steps", "1", "--patience", "1"]


def env(state: Path) -> dict[str, str]:
    """This environment without the caller's simulation settings, simulating 4 A40s kept in `state`."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_CALLBACKS_")}
    out.update(ZEUS_CALLBACKS_SIMULATE=f"{WORLD}*a40", ZEUS_CALLBACKS_SIM_STATE_DIR=str(state))
    return out


def locked_clocks(state: Path) -> list:
    """Each simulated GPU's locked SM clocks (None: not locked), read from the node's state."""
    from zeus_callbacks.sim.system import SimulatedSystem

    return [g.locked_sm_clocks_mhz for g in SimulatedSystem(f"{WORLD}*a40", state_dir=str(state)).gpus]


def run_example(
    script: Path, args: list[str], tmp: Path, timeout: float = 300
) -> tuple[list[list[dict]], str]:
    """Run `script` with `args`; (per rank, per schedule results of `--out`; stdout)."""
    out = tmp / "out"
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)],
        env=env(tmp / "sim-state"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)], proc.stdout


def check_planned_run(ranks: list[dict], schedule: str) -> None:
    """Every rank ran the engine's order, applied the plan; some clock lowered; energy lower than all-max."""
    for rank, r in enumerate(ranks):
        assert r["ran"] == r["expected"], (rank, r["ran"], r["expected"])
        report = r["report"]
        assert report["phase"] == "applying" and report["plan_applied"], (rank, report.get("reason"))
        assert report["simulated"] and report["schedule"] == schedule
        assert r["locked_mhz"] in report["plan_frequencies_mhz"][str(rank)]
    plans = ranks[0]["report"]["plan_frequencies_mhz"]
    assert any(min(clocks) < MAX_MHZ for clocks in plans.values())  # some instructions slowed down
    pred = ranks[0]["report"]["predicted"]
    assert pred["energy_j"] < pred["max_clock_energy_j"]

    def median_energy(phase: str) -> float:  # all GPUs, per iteration; the first step of a phase dropped
        per_rank = [[h[2] for h in r["history"] if h[0] == phase][1:] for r in ranks]
        return statistics.median(sum(step) for step in zip(*per_rank, strict=False))

    assert median_energy("applying") < median_energy("waiting")


def sigterm_one_rank(script: Path, args: list[str], state: Path, rank: int = 1) -> None:
    """Run `script --hold` until every rank holds its plan, then SIGTERM `rank`; wait for the job to end."""
    proc = subprocess.Popen(
        [sys.executable, str(script), *args, "--hold"],
        env=env(state),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    killer = threading.Timer(240, proc.kill)  # never wait longer for the ranks to say so
    killer.start()
    try:
        pids = {}
        for line in proc.stdout:  # type: ignore[union-attr]  # every rank says when it holds its plan
            # (the ranks share the pipe: a line may hold several ranks' messages, or an engine's log too)
            pids.update({int(r): int(pid) for r, pid in re.findall(r"holding rank (\d+) pid (\d+)", line)})
            if len(pids) == WORLD:
                break
        assert len(pids) == WORLD, "the ranks ended before holding the plan"
        assert any(mhz is not None for mhz in locked_clocks(state))
        os.kill(pids[rank], signal.SIGTERM)
        proc.wait(timeout=60)  # mp.spawn ends the other ranks once one has died
    finally:
        killer.cancel()
        proc.kill()
        proc.wait()
