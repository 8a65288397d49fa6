"""Plain test helpers that child processes can import too (`from helpers import burn_cpu`); fixtures wrap them
in conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def burn_cpu(seconds: float) -> float:
    """Keep the CPU busy for `seconds` of process CPU time (simulated GPU work); returns the wall time."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    x = 0
    while time.process_time() - start_cpu < seconds:
        x += 1
    return time.perf_counter() - start_wall


def profile_to_the_end(opt: Any, system: Any, step_s: float = 0.2, most_steps: int = 200) -> None:
    """Train `opt` (a `GlobalPowerLimitOptimizer`) on the simulated `system`, a step of `step_s` at a time, until
    it is done (at most `most_steps` steps), then end training (`on_train_end`)."""
    for _ in range(most_steps):
        if opt.phase == "done":
            break
        opt.on_step_begin()
        system.run_step(step_s)
        opt.on_step_end()
    opt.on_train_end()


def real_driver_present() -> bool:
    """Whether a real NVIDIA driver answers NVML on this machine."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def run_example(
    script: str,
    *args: str,
    launcher: Sequence[str] = (),
    spec: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> str:
    """Run `examples/<script> ARGS` as a user would, under `python -m LAUNCHER...` when given, on the simulated
    GPUs `spec` (else as the environment says); returns its stdout, failing with the output's tail."""
    full_env = {**os.environ, **(env or {})}
    if spec is not None:
        full_env["ZEUS_CALLBACKS_SIMULATE"] = spec
    proc = subprocess.run(
        [sys.executable, *launcher, str(EXAMPLES / script), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# The toy training steps of the examples and adapter tests last a few ms: on the A40's 100 ms energy counter
# a sample needs dozens of them; a 10 ms counter (a fast board's) lets the profile fit in a short test.
TOY_STEPS_COUNTER = {"ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS": "10"}


# -- bad inputs: one clear line from the CLI, one clear message from the API ---------------------------------
def run_cli(capsys: Any, argv: list[str]) -> tuple[int, str, str]:
    """Run `zeus-callbacks ARGV` in this process; its exit code (argparse's usage errors too), stdout, stderr."""
    from zeus_callbacks import cli

    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_clear_line(rc: int, err: str, command: str, *words: str | tuple[str, ...]) -> None:
    """Exit code 2 and one line `zeus-callbacks COMMAND: ...` on stderr holding every word (a tuple: any one of
    its words), never a traceback."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"zeus-callbacks {command}: "), err
    for w in words:
        assert any(x in lines[0] for x in ((w,) if isinstance(w, str) else w)), (w, err)


def assert_clear(error: BaseException, *words: str) -> None:
    """An API error for a bad input: a ValueError or TypeError whose one-line message holds every word."""
    message = str(error)
    assert isinstance(error, (ValueError, TypeError)), repr(error)
    assert "\n" not in message, message
    for w in words:
        assert w in message, (w, message)


def alternating_stats(pl: int, mean_t: float, mean_e: float, steps: int, rel_sd: float = 0.02):
    """A power limit's `PowerLimitStats` of `steps` one-step samples alternating around the means by
    `rel_sd` (sample SD about `rel_sd`)."""
    from zeus_callbacks.core.power_limit.search import PowerLimitStats

    s = PowerLimitStats(pl)
    for i in range(steps):
        d = rel_sd if i % 2 else -rel_sd
        s.add(mean_t * (1 + d), mean_e * (1 + d))
    return s
