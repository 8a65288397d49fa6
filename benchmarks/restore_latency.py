"""How soon the restore watchdog puts a GPU back after its process dies hard (SIGKILL), on a simulated A40.

tests/device/test_restore_watchdog.py asserts that it does (an outcome, on any host); this prints how soon,
a figure that depends on the machine's load (issue 37: no test asserts a duration).

Run: `PYTHONPATH=. python benchmarks/restore_latency.py [--runs N]`
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zeus_callbacks import sim

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import time
from zeus_callbacks.core.device.gpus import get_gpus
get_gpus()[0].set_power_limit_mw(150_000)
print("ready", flush=True)
time.sleep(60)
"""


def one_death(system: sim.SimulatedSystem) -> float:
    """Seconds from a SIGKILL of a process that set 150 W to the GPU back at 300 W."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    assert system.gpus[0].power_limit_mw == 150_000
    killed = time.monotonic()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    while system.gpus[0].power_limit_mw != 300_000:
        if time.monotonic() - killed > 60:
            raise RuntimeError("the GPU was not put back within 60 s")
        time.sleep(0.005)
    return time.monotonic() - killed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="restore-latency-") as state_dir:
        system = sim.simulate("a40", state_dir=state_dir)  # exported: the child drives the same GPU
        try:
            times = [one_death(system) for _ in range(args.runs)]
        finally:
            sim.disable()
    load = os.getloadavg()[0]
    print(f"SIMULATED A40, {platform.node()}, {os.cpu_count()} CPUs, load {load:.1f}, {args.runs} runs")
    print(
        f"SIGKILL -> GPU back at its limit: median {statistics.median(times) * 1000:.0f} ms, "
        f"max {max(times) * 1000:.0f} ms (5 ms polling)"
    )


if __name__ == "__main__":
    main()
