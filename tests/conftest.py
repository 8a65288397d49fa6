"""Shared fixtures: every test gets its own simulated node state and leaves the simulator off."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zeus_callbacks import sim

# Variables that select or shape a simulation or a GPU set; no test may inherit them from the shell.
_ISOLATED_ENV = (
    "ZEUS_CALLBACKS_SIMULATE",
    "ZEUS_CALLBACKS_SIM_NOISE",
    "ZEUS_CALLBACKS_SIM_SEED",
    "ZEUS_CALLBACKS_SIM_FAULTS",
    "ZEUS_CALLBACKS_SIM_STATE_DIR",
    "ZEUS_CALLBACKS_SIM_IDEAL",
    "ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS",
    "ZEUS_CALLBACKS_JOURNAL_DIR",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
)


@pytest.fixture(autouse=True)
def sim_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh `ZEUS_CALLBACKS_SIM_STATE_DIR` for this test; the simulator is disabled afterwards."""
    for name in _ISOLATED_ENV:
        monkeypatch.delenv(name, raising=False)
    sim.disable()  # forget a node or GPU set left by code that ran outside a test
    state_dir = tmp_path / "sim-state"
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_STATE_DIR", str(state_dir))
    yield state_dir
    sim.disable()


@pytest.fixture
def sim_gpus(sim_state_dir: Path) -> Callable[..., sim.SimulatedSystem]:
    """Factory: `sim_gpus(spec="a40", **kw)` simulates a node in this test's state directory.

    Keyword arguments go to `zeus_callbacks.sim.simulate` (noise, seed, faults, virtual_clock, ...). A
    real-clock node is exported to the environment, so subprocesses started with `os.environ` share it.
    """

    def make(spec: str = "a40", **kw) -> sim.SimulatedSystem:
        if not kw.get("virtual_clock"):  # a virtual-clock node keeps its state in memory
            kw.setdefault("state_dir", str(sim_state_dir))
        return sim.simulate(spec, **kw)

    return make


@pytest.fixture
def run_python() -> Callable[..., subprocess.CompletedProcess]:
    """Run `python -c CODE` in a child with this process's environment (plus `env`); output captured."""

    def run(
        code: str, env: dict[str, str] | None = None, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    return run


def _burn_cpu(seconds: float) -> float:
    """Keep the CPU busy for `seconds` of process CPU time (simulated GPU work); returns the wall time."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    x = 0
    while time.process_time() - start_cpu < seconds:
        x += 1
    return time.perf_counter() - start_wall


@pytest.fixture
def burn_cpu() -> Callable[[float], float]:
    """`burn_cpu(seconds)`: busy host work that a simulated GPU counts as work issued to it."""
    return _burn_cpu
