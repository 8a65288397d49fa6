"""NVML backends: the registry, the real backend's permission check, and the simulator as a backend."""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
import pytest

import zeus_callbacks
from zeus_callbacks import sim
from zeus_callbacks.core.device import backend as backends
from zeus_callbacks.core.device.backend import active_backend, has_cap_sys_admin
from zeus_callbacks.core.device.gpus import get_gpus, reset
from zeus_callbacks.core.device.nvidia import NVIDIABackend
from zeus_callbacks.core.device.state_guard import journal_dir
from zeus_callbacks.sim.backend import SimulatedBackend


def _status(tmp_path: Path, cap_eff: str) -> str:
    path = tmp_path / "status"
    path.write_text(f"Name:\tpython\nUid:\t0\t0\t0\t0\nCapEff:\t{cap_eff}\n")
    return str(path)


@pytest.mark.parametrize(
    ("cap_eff", "expected"),
    [
        ("000001ffffffffff", True),  # root with every capability
        ("00000000a80425fb", False),  # root in a default Docker container: no CAP_SYS_ADMIN
        ("0000000000200000", True),  # a non-root process granted only CAP_SYS_ADMIN
        ("0000000000000000", False),
    ],
)
def test_permission_comes_from_the_capability_not_the_user_id(tmp_path, cap_eff, expected):
    assert has_cap_sys_admin(_status(tmp_path, cap_eff)) is expected


def test_unreadable_status_means_no_permission(tmp_path):
    assert not has_cap_sys_admin(str(tmp_path / "missing"))


def test_the_simulator_is_registered_lazily_and_selected_when_asked(sim_gpus):
    assert "zeus_callbacks.sim.backend:simulated_backend" in backends._factories
    system = sim_gpus("2*a40")
    b = active_backend()
    assert isinstance(b, SimulatedBackend) and b.simulated and b.nvml is pynvml
    assert b.system is system and get_gpus().backend is b
    assert journal_dir() == Path(system.state_path()) / "journal"


def test_sim_disable_drops_the_backend(sim_gpus):
    sim_gpus("a40")
    assert active_backend().simulated
    sim.disable()
    assert not isinstance(active_backend(), SimulatedBackend)


def test_virtual_clock_comes_from_the_backend(sim_gpus):
    system = sim_gpus("a40", virtual_clock=True)
    gpus = get_gpus()
    assert gpus.virtual_clock and gpus.clock() == system.clock.now()
    system.run_step(0.5)
    assert gpus.clock() == system.clock.now()


class _Labelled(NVIDIABackend):
    """A third-party backend: pynvml (the simulator beneath it) under another name."""

    sync_at_step_boundary = True

    def may_change_settings(self, handle) -> bool:
        return False


def test_registered_factories_come_first_and_none_falls_through(sim_gpus, monkeypatch):
    sim_gpus("a40")  # selects the simulator's backend too; the factories are asked in order
    asked = []

    def not_selected():
        asked.append("not_selected")
        return None

    def selected():
        asked.append("selected")
        return _Labelled(pynvml)

    monkeypatch.setattr(backends, "_factories", [not_selected, selected, *backends._factories])
    reset()
    gpus = get_gpus()
    assert asked == ["not_selected", "selected"]
    assert isinstance(gpus.backend, _Labelled) and not gpus.simulated
    assert gpus[0].label == "GPU 0 (NVIDIA A40)"
    assert not gpus[0].may_change_settings()
    monkeypatch.undo()
    reset()


def test_the_core_never_imports_the_simulator():
    core = Path(zeus_callbacks.__file__).parent / "core"
    pattern = re.compile(
        r"^\s*(from zeus_callbacks\.sim\b|import zeus_callbacks\.sim\b|from zeus_callbacks import .*\bsim\b)"
        r"|import_module\(.zeus_callbacks\.sim"
    )
    offenders = [
        f"{path.relative_to(core)}:{n}"
        for path in sorted(core.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
