"""zeusd's answers as released, read without a server: discovery per generation, the GPU mapping, errors."""

from __future__ import annotations

import pytest

from zeus_callbacks.core.device.zeusd_api import MappingRefused, classify, match_gpu, parse_discovery

COMMON = {"enabled_api_groups": ["gpu-control", "gpu-read", "cpu-read"], "auth_required": False}
V04 = {"gpu_ids": [0, 1], "cpu_ids": [], "dram_available": [], **COMMON}
V05 = {"gpus": [{"id": 0, "name": "NVIDIA T4"}, {"id": 1, "name": "NVIDIA A10G"}], "cpus": [], **COMMON}
MASTER = {
    "gpus": [
        {"id": 0, "name": "NVIDIA T4", "pci_address": "0000:17:00.0", "cumulative_energy_available": True},
        {"id": 1, "name": "NVIDIA A10G", "pci_address": "0000:27:00.0", "cumulative_energy_available": True},
    ],
    "cpus": [],
    **COMMON,
}


def test_each_generation_is_recognised_by_its_discovery_document():
    assert [parse_discovery(b).generation for b in (V04, V05, MASTER)] == ["0.4", "0.5", "master"]
    assert parse_discovery(V04).gpus[1].name is None
    with pytest.raises(ValueError):
        parse_discovery({"gpus": "none"})


def test_pci_addresses_match_whatever_this_job_sees():
    found = parse_discovery(MASTER)
    hit = match_gpu(found, pci=(0, 0x27, 0), nvml_index=0, node_names=["NVIDIA A10G"])  # a container's view
    assert (hit.zeusd_id, hit.how) == (1, "PCI address 0000:27:00.0")


@pytest.mark.parametrize("body", [V04, V05])
def test_an_index_is_used_only_where_the_job_sees_the_node_as_zeusd_does(body):
    found = parse_discovery(body)
    node = ["NVIDIA T4", "NVIDIA A10G"]
    assert match_gpu(found, pci=(0, 0x27, 0), nvml_index=1, node_names=node).zeusd_id == 1
    assert match_gpu(found, pci=None, nvml_index=1, node_names=node, cuda_visible="1,0").zeusd_id == 1
    with pytest.raises(MappingRefused, match="sees 1 GPU.* where zeusd serves 2.*upgrade zeusd"):
        match_gpu(found, pci=None, nvml_index=0, node_names=["NVIDIA A10G"])
    with pytest.raises(MappingRefused, match="CUDA_VISIBLE_DEVICES='1' gives this job part of the node"):
        match_gpu(found, pci=None, nvml_index=1, node_names=node, cuda_visible="1")
    if body is V05:  # 0.4 gives no names to compare
        with pytest.raises(MappingRefused, match="not this job's NVML GPUs"):
            match_gpu(found, pci=None, nvml_index=1, node_names=list(reversed(node)))


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (
            400,
            {"errors": {"0": "NVML error: the requested operation is not available on the target device"}},
            "not_supported",
        ),
        (
            500,
            {"errors": {"0": "NVML error: the requested operation is not available on the target device"}},
            "not_supported",
        ),
        (
            500,
            {"errors": {"0": "NVML error: device fell off the bus or has otherwise become inacessible"}},
            "gpu_lost",
        ),
        (
            403,
            {
                "errors": {
                    "0": "NVML error: the current user does not have permission to perform this operation"
                }
            },
            "no_permission",
        ),
        (
            500,
            {
                "errors": {
                    "0": "NVML error: the current user does not have permission to perform this operation"
                }
            },
            "no_permission",
        ),
        (400, {"errors": {"0": "NVML error: a supplied argument was invalid"}}, "invalid_arg"),
        (400, {"errors": {"0": "Persistence mode cannot be disabled on this platform."}}, "not_supported"),
        (400, "Query deserialize error: missing field `block`", "bad_query"),
        (400, "GPU index 3 does not exist.", "unknown_gpu"),
        (401, {"error": "Token has expired."}, "auth"),
        (
            403,
            {"error": "Token for user 'bob' lacks required scope 'gpu-control'. Token scopes: ['gpu-read']"},
            "scope",
        ),
        (404, {"error": "API group 'gpu-control' is not enabled on this server."}, "group_disabled"),
        (404, None, "no_endpoint"),
        (500, {"errors": {"0": "NVML error: an internal driver error occured"}}, "failed"),
    ],
)
def test_errors_are_read_by_status_first_and_zeusd_texts_second(status, body, kind):
    assert classify(status, body).kind == kind
