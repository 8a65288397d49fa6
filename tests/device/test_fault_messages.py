"""What a fault is called: "not supported" is never reported as "no permission", and no doubled periods."""

from __future__ import annotations

import logging
import time

import pytest

from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _run_pipeline(steps: int = 4) -> None:
    pfo = PipelineFrequencyOptimizer(
        rank=0, pp_rank=0, pp_degree=1, world_size=1, wait_steps=1, warmup_steps=0, profile_steps=1,
        frequency_stride_mhz=180,
    )  # fmt: skip
    for _ in range(steps):
        pfo.on_step_begin()
        for kind in ("forward", "backward"):
            pfo.on_instruction_begin(kind)
            _burn(0.001)
            pfo.on_instruction_end(kind)
        pfo.on_step_end()
    pfo.on_train_end()


@pytest.mark.parametrize(
    ("faults", "said", "not_said"),
    [
        ("not_supported=clocks", "does not support", "permission"),
        ("empty_clocks", "does not support", "permission"),
        ("no_cap_sys_admin", "no permission", "support"),
    ],
)
def test_pipeline_optimizer_names_the_real_reason(sim_gpus, caplog, faults, said, not_said):
    sim_gpus("a40", faults=faults)
    with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
        _run_pipeline()
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("zeus_callbacks"))
    stand_down = [line for line in text.splitlines() if "no per-clock profile" in line]
    assert stand_down, text
    assert all(said in line and not_said not in line for line in stand_down), text
    assert ".." not in text


def test_lost_gpu_message_has_one_period(sim_gpus, caplog, monkeypatch):
    monkeypatch.setenv("ZEUS_CALLBACKS_WATCHDOG", "0")  # the lost GPU stays lost to this process only
    sim_gpus("a40", faults="lost_after=40")
    plo = GlobalPowerLimitOptimizer(
        ZeusMonitor([0], approx_instant_energy=True),
        wait_steps=1,
        warmup_steps=1,
        profile_steps=2,
        pl_step=100,
    )
    with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
        for _ in range(30):
            plo.on_step_begin()
            _burn(0.002)
            plo.on_step_end()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "the GPU is lost" in text and "Restoring the GPU and training on without it" in text, text
    assert ".." not in text, text
