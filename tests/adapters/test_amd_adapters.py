"""The Lightning and Accelerate power-limit optimizers on two simulated AMD MI300Xs (250-750 W, MODELLED), reached
through core/device/amd.py and the real `amdsmi` package over the simulated libamd_smi.so: each chooses a cap on
the grid, applies it through amdsmi, and leaves both GPUs as found (caps and clocks)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("amdsmi") is None:
    pytest.skip("the amd extra (amdsmi) is not installed", allow_module_level=True)

from zeus_callbacks import ZeusMonitor  # noqa: E402
from zeus_callbacks.core.device.gpus import get_gpus  # noqa: E402
from zeus_callbacks.core.device.state_guard import guard  # noqa: E402
from zeus_callbacks.sim.system import SimulatedSystem  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

MI300X_W = 750
GRID_W = {750, 500, 250}  # pl_step=250 over the MI300X's 250-750 W
FAST = dict(wait_steps=1, warmup_steps=1, profile_steps=6, pl_step=250)


@pytest.fixture
def mi300x_node(sim_gpus, monkeypatch) -> Iterator[SimulatedSystem]:
    """Two simulated MI300Xs with a 10 ms counter (as the A40 nodes of test_lightning.py/test_accelerate.py)."""
    for name in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    system = sim_gpus("2*mi300x", energy_refresh_ms=10)
    assert [g.device.vendor for g in get_gpus()] == ["amd", "amd"]
    yield system


def _as_found(system: SimulatedSystem) -> list[tuple[int, tuple[int, int] | None]]:
    return [(g.power_limit_mw, g.locked_sm_clocks_mhz) for g in system.gpus]


@pytest.mark.system
def test_lightning_optimizer_on_two_mi300x_chooses_a_cap_and_leaves_both_as_found(
    mi300x_node: SimulatedSystem, tmp_path, burn_cpu
) -> None:
    from test_lightning import Flavour, _data

    found = _as_found(mi300x_node)
    flavour = Flavour("lightning.pytorch", "zeus_callbacks.lightning")
    plo = flavour.zeus.LightningGlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0, 1]), **FAST)
    model = flavour.module(burn_cpu, plo)
    flavour.trainer(tmp_path, [plo], max_steps=150).fit(model, _data())

    chosen = plo.optimizer.optimal_power_limit_w
    assert plo.optimizer.phase == "done" and chosen in GRID_W
    assert {w for _, w, _ in model.seen} >= GRID_W  # every cap was applied through amdsmi
    assert model.seen[-1][1:] == (chosen, "done")  # the choice was in force at the end of training
    assert _as_found(mi300x_node) == found == [(MI300X_W * 1000, None)] * 2
    assert guard().entries == []


@pytest.fixture
def accelerator(mi300x_node: SimulatedSystem) -> Iterator:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.system
def test_accelerate_helper_on_two_mi300x_chooses_a_cap_and_leaves_both_as_found(
    mi300x_node: SimulatedSystem, accelerator, burn_cpu
) -> None:
    from test_accelerate import _train

    from zeus_callbacks.accelerate import PowerLimitOptimizerHelper

    found = _as_found(mi300x_node)
    with PowerLimitOptimizerHelper(accelerator, **FAST) as plo:
        seen = _train(accelerator, plo, burn_cpu, batches=150)
        chosen = plo.optimizer.optimal_power_limit_w
        assert plo.optimizer.phase == "done" and chosen in GRID_W
        assert {w for *_, w in seen} >= GRID_W and seen[-1][1:] == ("done", chosen)
        assert mi300x_node.gpus[1].power_limit_mw == MI300X_W * 1000  # this process's GPU only
    assert _as_found(mi300x_node) == found == [(MI300X_W * 1000, None)] * 2
    assert guard().entries == []
