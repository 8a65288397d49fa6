"""Measure a training step at each power limit, as `zeus-callbacks profile` asks a profiled script to.

The protocol between `zeus-callbacks profile` and the script it runs is environment variables (`PROFILE_ENV`):
the script trains at `profile_batch_size(default)` and calls `profile_power_limits(step_fn)`, which reads the
rest, measures one window per power limit and writes a `BatchSizeRun` where the CLI asked.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from zeus_callbacks.core.device.gpus import GPU
from zeus_callbacks.core.device.power import energy_refresh_period_s
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.heterogeneous.profile_file import BatchSizeRun, PowerLimitWindow, write_run
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.grid import ALLOW_RAISING_ENV, power_limit_grid, raising_allowed

__all__ = ["PROFILE_ENV", "PowerLimitWindow", "profile_batch_size", "profile_power_limits"]

logger = logging.getLogger(__name__)

# A window spans at least this many refreshes of the energy counter, which moves only when the driver
# refreshes it: then its energy is off by at most 1/20 of the window, and by much less on average.
MIN_REFRESHES_PER_WINDOW = 20

PROFILE_ENV = {
    "batch_size": "ZEUS_CALLBACKS_PROFILE_BATCH_SIZE",
    "out": "ZEUS_CALLBACKS_PROFILE_OUT",
    "power_limits": "ZEUS_CALLBACKS_PROFILE_POWER_LIMITS",
    "pl_step": "ZEUS_CALLBACKS_PROFILE_PL_STEP",
    "warmup_steps": "ZEUS_CALLBACKS_PROFILE_WARMUP_STEPS",
    "steps_per_window": "ZEUS_CALLBACKS_PROFILE_STEPS_PER_WINDOW",
    "gpu_index": "ZEUS_CALLBACKS_PROFILE_GPU_INDEX",
}
"""The environment variables `zeus-callbacks profile` sets for the script, by what they carry."""

_WINDOW = "__profile_power_limits"


def profile_batch_size(default: int) -> int:
    """The batch size `zeus-callbacks profile` asks this run for, or `default` outside a profile run."""
    return _env_int("batch_size") or default


def _env_int(name: str) -> int | None:
    value = os.environ.get(PROFILE_ENV[name])
    return int(value) if value else None


def _env_limits() -> list[int] | None:
    value = os.environ.get(PROFILE_ENV["power_limits"])
    return [int(p) for p in value.split(",")] if value else None


def profile_power_limits(
    step_fn: Callable[[], Any],
    power_limits: Sequence[int] | None = None,
    warmup_steps: int | None = None,
    steps_per_window: int | None = None,
    *,
    gpu_index: int | None = None,
    pl_step: int | None = None,
    monitor: ZeusMonitor | None = None,
    output: str | os.PathLike[str] | None = None,
) -> list[PowerLimitWindow]:
    """Measure one window of training steps at each power limit, highest first; restore the limit after.

    At each limit `step_fn()` (one training step) runs `warmup_steps` times unmeasured, then
    `steps_per_window` times inside one monitor window. Arguments left `None` come from the environment
    `zeus-callbacks profile` sets (`PROFILE_ENV`), else defaults: every limit of the GPU from the maximum down
    by `pl_step` (25 W), 5 warm-up steps, 10 steps per window, GPU 0. With `output` (or
    `ZEUS_CALLBACKS_PROFILE_OUT`) the run is written there (`write_run`) for the CLI.

    Raises:
        ValueError: a limit outside the GPU's range, or non-positive step counts.
        GPUNoPermissionError: this process may not change power limits (root or CAP_SYS_ADMIN needed).

    Example::

        model, opt = ...
        batch = make_batch(profile_batch_size(default=64))
        def step():
            opt.zero_grad(); model(batch).sum().backward(); opt.step()
        profile_power_limits(step)    # under `zeus-callbacks profile`, settings come from it
    """
    gpu_index = gpu_index if gpu_index is not None else _env_int("gpu_index") or 0
    warmup_steps = warmup_steps if warmup_steps is not None else _env_int("warmup_steps")
    warmup_steps = 5 if warmup_steps is None else warmup_steps
    steps_per_window = steps_per_window or _env_int("steps_per_window") or 10
    if warmup_steps < 0 or steps_per_window < 1:
        raise ValueError(
            f"`profile_power_limits(warmup_steps={warmup_steps!r}, steps_per_window={steps_per_window!r})`: "
            "need warmup_steps >= 0 and steps_per_window >= 1."
        )
    monitor = monitor or ZeusMonitor(gpu_indices=[gpu_index])
    gpu = monitor.gpus[gpu_index]
    limits = _limits(gpu, power_limits or _env_limits(), pl_step or _env_int("pl_step") or 25)
    out_path = output if output is not None else os.environ.get(PROFILE_ENV["out"])

    def run(windows: list[PowerLimitWindow], peak: int | None, oom: bool) -> BatchSizeRun:
        return BatchSizeRun(
            batch_size=_env_int("batch_size"),
            gpu_model=gpu.name,
            gpu_index=gpu.index,
            simulated=gpu.simulated,
            warmup_steps=warmup_steps,
            steps_per_window=steps_per_window,
            memory_peak_bytes=peak,
            oom=oom,
            windows=tuple(windows),
        )

    cuda = _cuda_peak_start(gpu_index) if not gpu.simulated else False
    windows: list[PowerLimitWindow] = []
    try:
        for pl in limits:
            windows.append(_measure(step_fn, monitor, gpu, pl, warmup_steps, steps_per_window))
    except Exception as e:
        if out_path is not None and _is_oom(e):
            write_run(out_path, run(windows, None, oom=True))
        raise
    finally:
        if _WINDOW in monitor.open_windows:
            monitor.end_window(_WINDOW, sync_execution=False, cancel=True)
        guard().restore()
    if out_path is not None:
        write_run(out_path, run(windows, _cuda_peak_bytes(gpu_index) if cuda else None, oom=False))
    return windows


def _limits(gpu: GPU, power_limits: Sequence[int] | None, pl_step: int) -> list[int]:
    lo, hi = (v / 1000 for v in gpu.power_limit_constraints_mw())
    if power_limits is None:
        # From the limit in force down (a site's cap is not raised) unless the user allows raising it, as the
        # power-limit optimizer does. Whole watts inside a fractional range: the Zeus² format keeps integers.
        top = hi if raising_allowed() else max(lo, min(hi, gpu.starting_power_limit_mw() / 1000))
        if top < hi:
            logger.info(
                "%s: profiling from the limit in force, %g W, down (set %s=1 to profile up to %g W).",
                gpu.label,
                top,
                ALLOW_RAISING_ENV,
                hi,
            )
        power_limits = [int(p) for p in power_limit_grid(math.ceil(lo), math.floor(top), pl_step)]
    limits = sorted({int(p) for p in power_limits}, reverse=True)
    outside = [p for p in limits if not lo <= p <= hi]
    if outside:
        raise ValueError(f"Power limits {outside} W are outside {gpu.label}'s range [{lo:g}, {hi:g}] W.")
    return limits


def _measure(
    step_fn: Callable[[], Any], monitor: ZeusMonitor, gpu: GPU, pl: int, warmup_steps: int, steps: int
) -> PowerLimitWindow:
    """One window at `pl`: at least `steps` steps, and as many more as the GPU's energy counter needs to be
    read to within a few percent (it moves only at each refresh); figures are scaled back to `steps`."""
    boundary = monitor.gpus.step_boundary
    gpu.set_power_limit_mw(pl * 1000)
    for _ in range(warmup_steps):
        step_fn()
        boundary(monitor.gpu_indices)
    period = energy_refresh_period_s(gpu)
    min_window_s = 0.0 if period is None else MIN_REFRESHES_PER_WINDOW * period
    clock = monitor.gpus.clock
    monitor.begin_window(_WINDOW)
    start, done = clock(), 0
    while done < steps or clock() - start < min_window_s:
        step_fn()
        boundary(monitor.gpu_indices)
        done += 1
    m = monitor.end_window(_WINDOW)
    scale = steps / done
    window = PowerLimitWindow(pl, m.time * scale, m.gpu_energy[gpu.index] * scale, steps)
    logger.info(
        "%d W: %.4f s, %.2f J per %d steps (measured over %d steps)",
        pl,
        window.time_s,
        window.energy_j,
        steps,
        done,
    )
    return window


def _cuda_peak_start(gpu_index: int) -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.reset_peak_memory_stats(gpu_index)
    return True


def _cuda_peak_bytes(gpu_index: int) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated(gpu_index))


def _is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()
