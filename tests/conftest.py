"""Shared fixtures: every test gets its own simulated node state and leaves the simulator off; the helpers
behind them live in helpers.py."""

from __future__ import annotations

import os

# One intra-op thread for every test and the processes it starts (they inherit the variable; torch reads it
# when it loads). The models are tiny, and several OpenMP threads per process on a loaded 2-core host spin
# while waiting for each other: Zeus's train_single.py example took 228 s beside two CPU burners with two
# threads, 53 s with one (18 s alone). What the tests check does not depend on the thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import helpers
import pytest

from zeus_callbacks import sim
from zeus_callbacks.sim.host import HOST_CLOCK

pytest_plugins = ["tiers"]  # the deterministic and system tiers (tiers.py)

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
    "ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT",
    "ZEUS_CALLBACKS_LEDGER",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "HIP_VISIBLE_DEVICES",  # HIP's and ROCr's selections of AMD GPUs (core/device/amd.py)
    "ROCR_VISIBLE_DEVICES",
)


def pytest_configure(config: pytest.Config) -> None:
    _children_start_with_default_signals()
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch loaded before this file


def _children_start_with_default_signals() -> None:
    """Tests send SIGINT and SIGHUP to their children on purpose. `nohup` starts the suite with SIGHUP ignored,
    and a shell without job control starts a background job with SIGINT ignored; an ignored signal is
    inherited through `exec`, so the children would ignore them too and the tests wait for nothing. A Python
    handler is not inherited: one that does nothing keeps this process ignoring them, as it was asked to,
    and its children start with the default, as from a terminal."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, lambda *_: None)


@pytest.fixture(autouse=True)
def sim_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh `ZEUS_CALLBACKS_SIM_STATE_DIR` for this test; the simulator is disabled afterwards."""
    for name in _ISOLATED_ENV:
        monkeypatch.delenv(name, raising=False)
    sim.disable()  # forget a node or GPU set left by code that ran outside a test
    # The node's clock as a fresh process has it: no lag, alone on its node until this test says otherwise (an
    # earlier test's distributed group or other process on a GPU would leave it shared: sim/host.py).
    HOST_CLOCK.reset()
    state_dir = tmp_path / "sim-state"
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_STATE_DIR", str(state_dir))
    # No cross-user lock directory unless a test makes one: never the machine's /var/lock/zeus_callbacks.
    monkeypatch.setenv("ZEUS_CALLBACKS_LOCK_DIR", "/nonexistent/zeus_callbacks-lock")
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


@pytest.fixture
def burn_cpu() -> Callable[[float], float]:
    """`burn_cpu(seconds)`: busy host work that a simulated GPU counts as work issued to it."""
    return helpers.burn_cpu


@pytest.fixture
def sim_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The catch-up waits (s) the real-clock simulator's synchronisations make, on the node's clock (sim/host.py's
    `HOST_CLOCK`), recorded as they happen.

    On a loaded host a sleeper wakes late, so a wall-clock wait has no useful upper bound; the node's clock
    leaves the lateness out (the host's next sleep catches it up), so what the simulator waits depends on
    process CPU time and the queued work only. Tests check that exactly, and time on the node's clock.
    """
    from zeus_callbacks.sim.host import HOST_CLOCK

    requested: list[float] = []
    wait_until = HOST_CLOCK.wait_until

    def recorded(end_s: float, defer_signals: bool) -> float:
        requested.append(end_s - HOST_CLOCK.now())
        return wait_until(end_s, defer_signals)

    monkeypatch.setattr(HOST_CLOCK, "wait_until", recorded)
    return requested


@pytest.fixture
def run_example(tmp_path: Path) -> Callable[..., str]:
    """`run_example(script, *args, launcher=(), spec=None, env=None)`: run `examples/<script>` in this test's
    directory and simulated node (see `helpers.run_example`); returns its stdout."""

    def run(script: str, *args: str, **kw) -> str:
        kw.setdefault("cwd", tmp_path)
        return helpers.run_example(script, *args, **kw)

    return run


@pytest.fixture
def no_nvidia_driver() -> None:
    """Skip the test where a real NVIDIA driver is present (it checks what happens without one)."""
    if helpers.real_driver_present():
        pytest.skip("a real NVIDIA driver is present")
