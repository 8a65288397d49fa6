"""GPU identity: CUDA devices tied to NVML handles by UUID, hidden GPUs skipped, permission from the capability."""

from __future__ import annotations

import logging
import sys
import types

import pynvml
import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.device.backend import cuda_visible_uuids
from zeus_callbacks.core.device.errors import GPUNoPermissionError, MIGNotSupportedError
from zeus_callbacks.core.device.gpus import get_gpus, reset
from zeus_callbacks.core.device.nvidia import NVIDIABackend, nvml_uuid
from zeus_callbacks.core.device.state_guard import guard


def _nvml_uuid(nvml_index: int) -> str:
    return pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(nvml_index))


def test_cuda_device_0_of_a_mixed_node_is_the_fastest(sim_gpus):
    sim_gpus("a10g,t4")
    gpus = get_gpus()
    assert [(g.index, g.nvml_index, g.name) for g in gpus] == [(0, 1, "NVIDIA A10G"), (1, 0, "Tesla T4")]
    assert [g.uuid for g in gpus] == [_nvml_uuid(1), _nvml_uuid(0)]
    assert gpus[0].label == "GPU 0 (NVIDIA A10G, simulated)"


def test_cuda_device_order_pci_bus_id_follows_nvml(sim_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    sim_gpus("a10g,t4")
    gpus = get_gpus()
    assert [(g.index, g.nvml_index, g.name) for g in gpus] == [(0, 0, "Tesla T4"), (1, 1, "NVIDIA A10G")]


def test_cuda_visible_devices_indices_are_cudas(sim_gpus, monkeypatch):
    system = sim_gpus("a10g,t4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    reset()
    (gpu,) = get_gpus()
    assert (gpu.index, gpu.nvml_index, gpu.name) == (0, 0, "Tesla T4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", system.gpus[1].uuid[:12])  # a UUID prefix: the A10G
    reset()
    (gpu,) = get_gpus()
    assert (gpu.index, gpu.nvml_index, gpu.name) == (0, 1, "NVIDIA A10G")


def test_per_gpu_work_follows_the_cuda_index(sim_gpus):
    system = sim_gpus("a10g,t4")
    gpus = get_gpus()
    sim.enqueue_work(1, 0.25)  # cuda:1, the T4
    assert system.gpus[gpus[1].nvml_index].spec.kind == "t4"
    assert system.gpus[gpus[1].nvml_index]._work.queued_s == 0.25


def test_hidden_gpu_is_skipped_with_a_message(sim_gpus, caplog):
    sim_gpus("2*a40", faults="hidden@0")
    with caplog.at_level(logging.INFO, logger="zeus_callbacks.core.device.nvidia"):
        gpus = get_gpus()
    assert [(g.index, g.nvml_index) for g in gpus] == [(0, 1)]
    (message,) = [r.getMessage() for r in caplog.records if "may not open" in r.getMessage()]
    assert "NVML index 0" in message and "skipped" in message


def test_root_without_cap_sys_admin_may_not_change_settings(sim_gpus):
    sim_gpus("a40", faults="no_cap_sys_admin")
    g = get_gpus()[0]
    assert not g.may_change_settings()
    with pytest.raises(GPUNoPermissionError):
        g.set_power_limit_mw(200_000)
    assert guard().entries == []  # a refused change leaves no journal entry
    assert g.power_limit_mw() == 300_000


def test_default_limit_below_maximum_and_empty_clocks_through_the_device_layer(sim_gpus):
    sim_gpus("a40", faults="default_limit_w=250;empty_clocks")
    g = get_gpus()[0]
    assert g.default_power_limit_mw() == g.power_limit_mw() == 250_000
    assert g.power_limit_constraints_mw() == (100_000, 300_000)
    assert g.supported_sm_clocks_mhz() == []


# -- the real backend's view of CUDA ----------------------------------------------------------------------
class _Props:
    def __init__(self, uuid: str) -> None:
        self.uuid = _Uuid(uuid)


class _Uuid:
    """Stands for torch's `_CUuuid`, whose str() has no `GPU-` prefix."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def test_real_backend_asks_torch_for_cudas_order(sim_gpus, monkeypatch):
    system = sim_gpus("a10g,t4")
    pynvml.nvmlInit()
    cuda = [system.gpus[1].uuid, system.gpus[0].uuid]  # what CUDA would say: the A10G first
    torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            is_available=lambda: True,
            device_count=lambda: 2,
            get_device_properties=lambda i: _Props(cuda[i].removeprefix("GPU-")),
        )
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert NVIDIABackend(pynvml).cuda_uuids() == cuda


def test_real_backend_without_cuda_assumes_pci_order_and_warns_on_mixed_nodes(sim_gpus, monkeypatch, caplog):
    system = sim_gpus("a10g,t4")
    pynvml.nvmlInit()
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch: import fails
    with caplog.at_level(logging.WARNING):
        assert NVIDIABackend(pynvml).cuda_uuids() == [g.uuid for g in system.gpus]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    NVIDIABackend(pynvml).cuda_uuids()
    assert caplog.text == ""


def test_cuda_visible_uuids():
    uuids = ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-abcd-3"]
    assert cuda_visible_uuids(None, uuids) == uuids
    assert cuda_visible_uuids("2,0", uuids) == ["GPU-abcd-3", "GPU-aaaa-1"]
    assert cuda_visible_uuids("1,7,0", uuids) == ["GPU-bbbb-2"]  # CUDA stops at an invalid entry
    assert cuda_visible_uuids("GPU-b", uuids) == ["GPU-bbbb-2"]
    assert cuda_visible_uuids("GPU-a", uuids) == []  # ambiguous prefix
    assert cuda_visible_uuids("", uuids) == []
    with pytest.raises(MIGNotSupportedError):
        cuda_visible_uuids("MIG-1234", uuids)
    with pytest.raises(ValueError, match="twice"):
        cuda_visible_uuids("0,GPU-aaaa", uuids)
    assert nvml_uuid("1234-abcd") == "GPU-1234-abcd" and nvml_uuid("GPU-1") == "GPU-1"
