"""The pipeline-frequency optimizer's clocks on two simulated AMD MI300Xs, through core/device/amd.py and the real
`amdsmi` package over the simulated libamd_smi.so: the sweep locks one graphics clock at a time (amdgpu's
performance determinism, since amdsmi refuses a range whose min is not below its max), the plan is applied, and
the end of the run gives the clock back to the driver on both GPUs."""

from __future__ import annotations

import importlib.util

import pytest
from pipeline_steps import FAST, _kinds, run_steps

from zeus_callbacks.core.device import gpus as devices
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.pipeline_frequency.clock_sweep import clock_sweep
from zeus_callbacks.core.pipeline_frequency.controller import FrequencyController
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.sim.system import SimulatedSystem

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("amdsmi") is None, reason="the amd extra is not installed"
)

MI300X_LOWEST_MHZ = 500  # OD_SCLK's lowest level (MI300X_x4.rocm-smi-a.txt); determinism's soft min


@pytest.fixture
def node(sim_gpus) -> SimulatedSystem:
    return sim_gpus("2*mi300x")


@pytest.mark.system
def test_the_frequency_controller_locks_one_clock_on_an_mi300x(node):
    """FrequencyController's lock of one frequency (min == max) lands on the MI300X: the graphics clock is held
    at it (performance determinism: soft max at the clock, soft min at the lowest level, as amdgpu sets it),
    and closing gives the clock back (performance level AUTO)."""
    gpu = node.gpus[0]
    controller = FrequencyController(get_gpus()[0])
    controller.set_now(2100)
    controller.request(1300)
    assert controller.wait()
    assert gpu.locked_sm_clocks_mhz == (MI300X_LOWEST_MHZ, 1300)
    controller.close()
    devices.reset()  # what every end of a run does: restore what this process changed
    assert gpu.locked_sm_clocks_mhz is None
    assert node.gpus[1].locked_sm_clocks_mhz is None  # the other GPU untouched


@pytest.mark.system
def test_the_sweep_locks_each_clock_applies_the_plan_and_restores_both_gpus(node):
    gpu, other = node.gpus
    pfo = PipelineFrequencyOptimizer(device_id=0, **FAST)
    kinds = _kinds("1f1b", 4)
    run_steps(pfo, 80, kinds, until="applying")
    assert pfo.phase == "applying", pfo.phase
    sweep = clock_sweep(gpu.spec.supported_sm_clocks_mhz(), FAST["frequency_stride_mhz"])
    profiled = sorted({r.frequency_mhz for r in pfo.profile_rows()}, reverse=True)
    assert sweep[0] == 2100 and profiled == sweep[: len(profiled)] and len(profiled) >= 2
    assert pfo.report()["simulated"]
    assert set(pfo.plan_frequencies_mhz) <= set(profiled)
    run_steps(pfo, 2, kinds)
    assert pfo._clocks.controller.wait()
    locked = gpu.locked_sm_clocks_mhz
    assert locked is not None and locked[0] == MI300X_LOWEST_MHZ and locked[1] in pfo.plan_frequencies_mhz
    assert other.locked_sm_clocks_mhz is None
    pfo.on_train_end()
    assert gpu.locked_sm_clocks_mhz is None and other.locked_sm_clocks_mhz is None
    assert [g.power_limit_mw for g in node.gpus] == [750_000, 750_000]
