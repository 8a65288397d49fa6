"""Which power limit a GPU's settings act on (issue 36), on nodes built from real `nvidia-smi -q` dumps: the
GPU's own (nearly every board), its module's where the GPU scope is N/A (nvml.h `NVML_POWER_SCOPE_MODULE`,
set with nvmlDeviceSetPowerManagementLimit_v2), or none (GTX 680: N/A); and the limit in force beside the
one set (`Current` and `Requested Power Limit`)."""

from __future__ import annotations

import pynvml
import pytest

from zeus_callbacks.core.device import setters
from zeus_callbacks.core.device.errors import GPUNotSupportedError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.monitor.monitor import ZeusMonitor


def test_the_limit_set_and_the_limit_in_force(sim_gpus) -> None:
    """GH200.nvidia-smi-a.txt lines 175-179: Current 700.00 W, Requested 900.00 W, Default 900.00 W, 100-900 W.
    Fails if the enforced limit (nvmlDeviceGetEnforcedPowerLimit) cannot be read apart from the one set."""
    sim_gpus("nvidia-smi:GH200", virtual_clock=True)
    g = get_gpus()[0]
    assert g.power_limit_scope == "gpu"
    assert (g.power_limit_mw(), g.enforced_power_limit_mw(), g.default_power_limit_mw()) == (
        900_000,
        700_000,
        900_000,
    )
    assert g.power_limit_constraints_mw() == (100_000, 900_000)


def test_a_module_scoped_limit_is_read_set_and_restored(sim_gpus) -> None:
    """GH200.nvidia-smi-a.txt lines 182-188 (`Module Power Readings`: 200-1000 W, 1000.00 W set), its GPU scope
    N/A (the fault `not_supported=power`). Fails on today's main (the GPU scope's NOT_SUPPORTED is final) or if
    the change is not journaled and undone."""
    system = sim_gpus("nvidia-smi:GH200", virtual_clock=True, faults="not_supported=power")
    g = get_gpus()[0]
    assert g.power_limit_scope == "module"
    assert g.power_limit_constraints_mw() == (200_000, 1_000_000)
    assert (g.power_limit_mw(), g.default_power_limit_mw(), g.enforced_power_limit_mw()) == (1_000_000,) * 3
    g.set_power_limit_mw(500_000)
    assert system.gpus[0].module_limit_mw == 500_000 == g.power_limit_mw()
    assert [(e.knob, e.original) for e in guard().entries] == [("power_limit", 1_000_000)]
    with pytest.raises(ValueError, match=r"outside GPU 0 .* range \[200, 1000\] W"):
        g.set_power_limit_mw(150_000)
    guard().restore()
    assert system.gpus[0].module_limit_mw == 1_000_000 and guard().entries == []


def test_a_module_limit_the_driver_did_not_apply_is_an_error(sim_gpus, monkeypatch) -> None:
    """nvidia-ml-py's nvmlDeviceSetPowerManagementLimit_v2 drops NVML's return code (pynvml.py: `ret = fn(...)`,
    `return NVML_SUCCESS`): a refused change returns as if made. Fails if such a change is taken as made, or
    leaves a journal entry for a change that never happened."""
    system = sim_gpus("nvidia-smi:GH200", virtual_clock=True, faults="not_supported=power")
    g = get_gpus()[0]
    monkeypatch.setattr(pynvml, "nvmlDeviceSetPowerManagementLimit_v2", lambda *args: None)
    with pytest.raises(GPUNotSupportedError, match="did not apply 500 W .* reads 1000 W"):
        g.set_power_limit_mw(500_000)
    assert system.gpus[0].module_limit_mw == 1_000_000 and guard().entries == []


def test_zeusd_cannot_set_a_module_limit(sim_gpus, monkeypatch, tmp_path) -> None:
    """zeusd's API sets a GPU's own limit only (`POST /gpu/set_power_limit`). Fails if a module-scoped change is
    sent to it (it would set the wrong limit) rather than refused with what to do."""
    sim_gpus("nvidia-smi:GH200", virtual_clock=True, faults="not_supported=power")
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(tmp_path / "zeusd.sock"))
    monkeypatch.setenv(setters.SETTERS_ENV, "zeusd")
    with pytest.raises(GPUNotSupportedError, match="ZEUS_CALLBACKS_SETTERS=direct"):
        get_gpus()[0].set_power_limit_mw(500_000)
    assert guard().entries == []


def test_a_board_without_a_settable_limit_says_so(sim_gpus) -> None:
    """GTX680.nvidia-smi-a.txt lines 145-152: `Power Management : N/A`, every limit N/A. Fails if the error does
    not say that the board has no settable limit, or if a monitor cannot be built on it."""
    sim_gpus("nvidia-smi:GTX680", virtual_clock=True)
    g = get_gpus()[0]
    with pytest.raises(GPUNotSupportedError, match="Power-limit control is not supported on GPU 0 .* N/A"):
        g.power_limit_scope  # noqa: B018
    with pytest.raises(GPUNotSupportedError):
        g.set_power_limit_mw(100_000)
    assert guard().entries == []
    assert ZeusMonitor().gpu_indices == [0]
