"""An HF `Trainer` run on two simulated AMD MI300Xs, reached through the real `amdsmi` package
(core/device/amd.py over sim/amdsmi_library.py): the power-limit optimizer chooses a cap, its metrics reach
the trackers, and both GPUs are left as found."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("transformers")
if importlib.util.find_spec("amdsmi") is None:
    pytest.skip("the amd extra (amdsmi) is not installed", allow_module_level=True)

from hf_trainers import Recorder, ZeusTrainer, make_trainer, torch_node  # noqa: E402

from zeus_callbacks.core.monitor.monitor import ZeusMonitor  # noqa: E402
from zeus_callbacks.core.monitor.reporting import POWER_LIMIT_PREFIX  # noqa: E402
from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer, HFZeusMonitor  # noqa: E402
from zeus_callbacks.sim import HFSimulatedGPUWork  # noqa: E402

MI300X_W = 750


@pytest.fixture
def mi300x_node(tmp_path, monkeypatch):
    """Two simulated MI300Xs (250-750 W, MODELLED) with a 10 ms counter, as the A40 node of hf_trainers.py."""
    for name in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    yield from torch_node("2*mi300x", tmp_path, monkeypatch)


@pytest.mark.system
def test_hf_run_on_two_mi300x_chooses_a_cap_logs_energy_and_leaves_both_as_found(mi300x_node, tmp_path):
    system = mi300x_node
    found = [(g.power_limit_mw, g.locked_sm_clocks_mhz) for g in system.gpus]
    monitor = ZeusMonitor([0, 1])
    plo = HFGlobalPowerLimitOptimizer(monitor, wait_steps=1, warmup_steps=1, profile_steps=8, pl_step=250)
    tracker = Recorder(system)
    callbacks = [tracker, HFZeusMonitor(monitor), plo, HFSimulatedGPUWork(1, 0.012)]
    make_trainer(tmp_path, callbacks, max_steps=60, logging_steps=15, trainer_cls=ZeusTrainer).train()

    opt = plo.optimizer
    assert opt.phase == "done"
    chosen = opt.optimal_power_limit_w
    assert chosen in (750, 500, 250)  # the grid at pl_step=250 over 250-750 W
    assert {750, 500, 250} <= set(tracker.limits_w)  # every cap was applied through amdsmi
    train_logs = [e for e in tracker.logs if "loss" in e]
    assert train_logs and all(e["energy/interval_j"] > 0 and e["energy/simulated"] == 1.0 for e in train_logs)
    assert tracker.logs[-1][f"{POWER_LIMIT_PREFIX}optimal_power_limit_w"] == float(chosen)
    assert (
        [(g.power_limit_mw, g.locked_sm_clocks_mhz) for g in system.gpus]
        == found
        == [(MI300X_W * 1000, None)] * 2
    )
