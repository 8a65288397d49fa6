"""CPU energy through RAPL (a powercap tree written by the test), and what the monitor says without it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from zeus_callbacks.core.monitor import rapl
from zeus_callbacks.core.monitor.monitor import ZeusMonitor


def _zone(path: Path, name: str, energy_uj: int, max_uj: int = 1_000_000) -> Path:
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


@pytest.fixture
def powercap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "powercap"
    _zone(root / "intel-rapl:0", "package-0", 900_000)
    _zone(root / "intel-rapl:0" / "intel-rapl:0:0", "dram", 100)
    _zone(root / "intel-rapl:1", "package-1", 5_000)
    monkeypatch.setattr(rapl, "POWERCAP_DIR", root)
    return root


@pytest.mark.system
def test_cpu_and_dram_energy_with_wraparound(sim_gpus, powercap: Path):
    sim_gpus("a40")
    monitor = ZeusMonitor(gpu_indices=[0])
    assert monitor.cpu_indices == [0, 1]
    monitor.begin_window("w")
    assert monitor.measurement_states["w"].cpu_energy == {0: 0.9, 1: 0.005}
    (powercap / "intel-rapl:0" / "energy_uj").write_text("200000\n")  # wrapped at 1 J
    (powercap / "intel-rapl:0" / "intel-rapl:0:0" / "energy_uj").write_text("50100\n")
    (powercap / "intel-rapl:1" / "energy_uj").write_text("255000\n")
    m = monitor.end_window("w")
    assert m.cpu_energy == pytest.approx({0: 0.3, 1: 0.25})
    assert m.dram_energy == pytest.approx({0: 0.05})
    assert ZeusMonitor(cpu_indices=[1]).cpu_indices == [1]
    assert ZeusMonitor(cpu_indices=[]).cpu_indices == []


@pytest.mark.system
def test_cpu_indices_without_rapl_said_once(sim_gpus, tmp_path: Path, monkeypatch, caplog):
    sim_gpus("a40")
    monkeypatch.setattr(rapl, "POWERCAP_DIR", tmp_path / "absent")
    monkeypatch.setattr(rapl, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
        assert ZeusMonitor().cpu_indices == []  # by default: quietly none
        for _ in range(3):
            monitor = ZeusMonitor(cpu_indices=[0])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "CPU energy is not measured" in warnings[0] and "no RAPL" in warnings[0]
    monitor.begin_window("w")
    assert monitor.end_window("w").cpu_energy is None


def test_root_only_rapl_is_reported(tmp_path: Path, monkeypatch):
    root = tmp_path / "powercap"
    zone = _zone(root / "intel-rapl:0", "package-0", 1)
    (zone / "energy_uj").chmod(0)
    try:
        if (zone / "energy_uj").stat() and _readable(zone / "energy_uj"):
            pytest.skip("running as root: the counter is readable anyway")
        with pytest.raises(rapl.RaplUnavailable, match="root only"):
            rapl.rapl_packages(root)
    finally:
        (zone / "energy_uj").chmod(0o644)


def _readable(path: Path) -> bool:
    try:
        path.read_text()
        return True
    except PermissionError:
        return False
