# ruff: noqa: F811 - the fixture imported from zeusd_daemon is named by each test
"""AMD GPUs through zeusd master's AMD backend: the client speaks its routes on two simulated MI300Xs.

The daemon is `zeusd_double.py` at `--generation master` on a `2*mi300x` node, which serves the GPUs as zeusd
master's `devices/gpu/amdsmi/mod.rs` does (`zeusd_double_amd.py`), calling the simulated `libamd_smi.so` beneath
amdsmi's bindings. The client process carries the `no_cap_sys_admin` fault: amdsmi refuses it every change
(AMDSMI_STATUS_NO_PERM), so whatever changes, zeusd changed.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest
from zeusd_daemon import Daemon, no_zeusd_from_the_shell, start_zeusd  # noqa: F401 - the fixtures

from zeus_callbacks.core.device import zeusd
from zeus_callbacks.core.device.errors import GPUNoPermissionError, GPUNotSupportedError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.journal import read_journal
from zeus_callbacks.core.device.state_guard import guard, journal_dir
from zeus_callbacks.core.device.zeusd_api import classify

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("amdsmi") is None, reason="the amd extra is not installed"
)


def _point_at(monkeypatch: pytest.MonkeyPatch, daemon: Daemon) -> None:
    for k, v in daemon.env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.system
def test_power_cap_and_clocks_through_zeusd_on_two_mi300xs(sim_gpus, start_zeusd, monkeypatch):
    """A job given the second MI300X only (HIP_VISIBLE_DEVICES=1): its GPU 0 is zeusd's GPU 1 (zeusd numbers
    amdsmi's processors, all of the node's, and the two are matched by PCI address). The cap is set and the
    clock locked through zeusd, and put back through it: the clocks with `reset_locked_clocks`, zeusd master's
    only AMD clock reset. Fails if the client POSTs `reset_gpu_locked_clocks`, which master refuses on AMD."""
    system = sim_gpus("2*mi300x", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix")  # before HIP_VISIBLE_DEVICES: zeusd reads no HIP variable anyway
    _point_at(monkeypatch, daemon)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    [gpu] = get_gpus()
    assert gpu.vendor == "amd" and not gpu.backend.may_change_settings(
        gpu.device
    )  # amdsmi refuses this process
    assert gpu.may_change_settings()  # zeusd changes them
    gpu.set_power_limit_mw(500_000)
    gpu.lock_sm_clocks(1200, 1500)
    theirs, other = system.gpus[1], system.gpus[0]
    assert gpu.power_limit_mw() == 500_000  # read through amdsmi in this process, as every read is
    assert theirs.power_limit_mw == 500_000 and theirs.locked_sm_clocks_mhz == (1200, 1500)
    assert other.power_limit_mw == 750_000 and other.locked_sm_clocks_mhz is None
    [journal] = [read_journal(p) for p in journal_dir().glob("*.json")]
    assert {(e["knob"], e["route"]) for e in journal["entries"]} == {
        ("power_limit", "zeusd"),
        ("sm_clocks", "zeusd"),
    }
    assert guard().restore()
    assert theirs.power_limit_mw == 750_000 and theirs.locked_sm_clocks_mhz is None
    assert sorted(daemon.writes()) == sorted(
        [
            'POST /gpu/set_power_limit {"block": "true", "gpu_ids": "1", "power_limit_mw": "500000"}',
            'POST /gpu/set_gpu_locked_clocks {"block": "true", "gpu_ids": "1", "max_clock_mhz": "1500", "min_clock_mhz": "1200"}',
            'POST /gpu/reset_locked_clocks {"block": "true", "gpu_ids": "1"}',
            'POST /gpu/set_power_limit {"block": "true", "gpu_ids": "1", "power_limit_mw": "750000"}',
        ]
    )
    assert not [r for r in daemon.requests() if r.startswith("RAN") and not r.endswith(": ok")]


@pytest.mark.system
def test_a_lock_above_the_last_one_is_written_max_first_as_zeusd_does(sim_gpus, start_zeusd, monkeypatch):
    """zeusd writes a lock's two ends one at a time (amdsmi_set_gpu_clk_limit), the max first where the new min is
    above the cached max (mod.rs `clk_write_order`); amdgpu refuses an end that crosses the other. A lock moved
    up past the last one lands whole."""
    system = sim_gpus("2*mi300x", faults="no_cap_sys_admin")
    _point_at(monkeypatch, start_zeusd("unix"))
    gpu = get_gpus()[0]
    gpu.lock_sm_clocks(900, 1000)
    gpu.lock_sm_clocks(1800, 1900)
    assert system.gpus[0].locked_sm_clocks_mhz == (1800, 1900)
    assert guard().restore() and system.gpus[0].locked_sm_clocks_mhz is None


@pytest.mark.system
def test_zeusds_amd_refusals_become_this_packages_errors(sim_gpus, start_zeusd, monkeypatch):
    """master answers amdsmi's NO_PERM 403 (`AMDSMI error 10: ...`) and a cap amdsmi refuses 400 (INVAL): each
    a GPU error with zeusd's text and what to do, nothing journaled as applied. Persistence mode is refused
    here, before anything is sent (master answers 400: AMD GPUs have none)."""
    sim_gpus("2*mi300x", faults="no_cap_sys_admin")
    daemon = start_zeusd("unix", "--faults", "no_cap_sys_admin")  # the daemon itself may not change them
    _point_at(monkeypatch, daemon)
    gpu = get_gpus()[0]
    with pytest.raises(GPUNoPermissionError, match=re.escape("HTTP 403 (GPU 0: AMDSMI error 10:")) as err:
        gpu.set_power_limit_mw(500_000)
    assert "zeusd itself may not change the GPU" in str(err.value)
    assert guard().entries == []
    with pytest.raises(GPUNotSupportedError, match="AMD GPUs have no persistence mode"):
        zeusd.client_for(zeusd.ZeusdEndpoint.from_env()).set_persistence_mode(gpu, True)  # type: ignore[arg-type]
    assert [w for w in daemon.writes() if "persistence" in w] == []


# -- deterministic: zeusd master's AMD answers and generations, without a daemon ----------------------------
@pytest.mark.parametrize(
    ("status", "text", "kind"),
    [
        # error.rs: AmdSmiError `AMDSMI error {status}: {msg}`, 403 NO_PERM, 400 INVAL and NOT_SUPPORTED, 500 else.
        (403, {"errors": {"0": "AMDSMI error 10: AMDSMI_STATUS_NO_PERM"}}, "no_permission"),
        (400, {"errors": {"0": "AMDSMI error 1: AMDSMI_STATUS_INVAL"}}, "invalid_arg"),
        (400, {"errors": {"0": "AMDSMI error 2: AMDSMI_STATUS_NOT_SUPPORTED"}}, "not_supported"),
        (500, {"errors": {"1": "AMDSMI error 31: AMDSMI_STATUS_NOT_FOUND"}}, "gpu_lost"),
        (500, {"errors": {"0": "AMDSMI error 32: AMDSMI_STATUS_NOT_INIT"}}, "failed"),
        # amdsmi/mod.rs 968-978 and 1009-1029: InvalidRequest, 400.
        (
            400,
            {"errors": {"0": "Invalid request: persistence mode is not supported on AMD GPUs"}},
            "not_supported",
        ),
        (
            400,
            {
                "errors": {
                    "0": "Invalid request: AMD GPUs cannot reset a single clock domain; use reset_locked_clocks "
                    "to reset all domains"
                }
            },
            "not_supported",
        ),
    ],
)
def test_master_amd_answers_are_classified(status, text, kind):
    assert classify(status, text).kind == kind


class _Canned(zeusd.ZeusdClient):
    """A client whose daemon answers `/discover` with `body` and every write with 200 (what it asked is kept)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(zeusd.ZeusdEndpoint(socket_path="/nonexistent/zeusd.sock"))
        self.body, self.asked = body, []

    def request(self, method: str, path: str, params: dict[str, Any] | None = None) -> tuple[int, Any]:
        self.asked.append((method, path))
        return 200, self.body if path == "/discover" else None


def test_amd_gpus_need_zeusd_master(sim_gpus):
    """zeusd 0.5 drives NVML alone (its `devices/gpu/` has `nvml.rs` only): an AMD GPU is refused with the way out,
    and nothing is written; master is asked `reset_locked_clocks`."""
    sim_gpus("2*mi300x", virtual_clock=True)
    gpu = get_gpus()[0]
    groups = {"enabled_api_groups": ["gpu-control"], "auth_required": False}
    old = _Canned({"gpus": [{"id": 0, "name": "AMD Instinct MI300X"}], "cpus": [], **groups})
    with pytest.raises(GPUNoPermissionError, match="has no AMD backend .* run zeusd master"):
        old.reset_sm_clocks(gpu)
    assert old.asked == [("GET", "/discover")]
    pci = gpu.device.pci_bus_id()
    master = _Canned({"gpus": [{"id": 0, "name": gpu.name, "pci_address": pci}], "cpus": [], **groups})
    master.reset_sm_clocks(gpu)
    assert master.asked == [("GET", "/discover"), ("POST", "/gpu/reset_locked_clocks")]
