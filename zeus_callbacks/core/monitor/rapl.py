"""CPU package and DRAM energy from Linux RAPL counters (`/sys/class/powercap/intel-rapl:*`).

Each package zone `intel-rapl:<i>` (name `package-<i>`) has a cumulative `energy_uj` counter that wraps
at `max_energy_range_uj`; its `dram` subzone, where present, counts the package's DRAM. Many kernels let
only root read `energy_uj` (a side channel otherwise); then CPU energy cannot be measured here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "POWERCAP_DIR",
    "RaplPackage",
    "RaplUnavailable",
    "energy_delta_j",
    "rapl_packages",
    "monitored_packages",
]

logger = logging.getLogger(__name__)

POWERCAP_DIR = Path("/sys/class/powercap")


class RaplUnavailable(Exception):
    """RAPL cannot be read on this machine; the message says why."""


@dataclass(frozen=True)
class _Counter:
    path: Path
    max_uj: int

    def read_uj(self) -> int:
        return int(self.path.read_text())


@dataclass(frozen=True)
class RaplPackage:
    """One CPU package: its energy counter and, where RAPL offers it, its DRAM counter."""

    index: int
    cpu: _Counter
    dram: _Counter | None

    def read_uj(self) -> tuple[int, int | None]:
        """(package, DRAM or None) counters in µJ."""
        return self.cpu.read_uj(), self.dram.read_uj() if self.dram is not None else None


def _counter(zone: Path) -> _Counter:
    energy = zone / "energy_uj"
    try:
        max_uj = int((zone / "max_energy_range_uj").read_text())
        int(energy.read_text())
    except PermissionError:
        raise RaplUnavailable(
            f"{energy} is readable by root only on this machine (run as root, or `chmod a+r` it)"
        ) from None
    except (OSError, ValueError) as e:
        raise RaplUnavailable(f"cannot read {energy}: {e}") from None
    return _Counter(energy, max_uj)


def rapl_packages(root: Path | None = None) -> list[RaplPackage]:
    """The CPU packages RAPL exposes under `root` (default `POWERCAP_DIR`), by package index.

    Raises:
        RaplUnavailable: no RAPL zones, or their counters cannot be read.
    """
    root = POWERCAP_DIR if root is None else root
    zones = sorted(root.glob("intel-rapl:*")) if root.is_dir() else []
    packages: list[RaplPackage] = []
    for zone in zones:
        if zone.name.count(":") != 1:
            continue  # a subzone
        try:
            name = (zone / "name").read_text().strip()
        except OSError:
            continue
        if not name.startswith("package-"):
            continue
        dram = None
        for sub in sorted(zone.glob(f"{zone.name}:*")):
            try:
                if (sub / "name").read_text().strip() == "dram":
                    dram = _counter(sub)
            except OSError:
                continue
        packages.append(RaplPackage(int(name.split("-", 1)[1]), _counter(zone), dram))
    if not packages:
        raise RaplUnavailable(
            f"no RAPL package zones under {root} (not an Intel/AMD Linux host, or no powercap)"
        )
    return sorted(packages, key=lambda p: p.index)


def energy_delta_j(before_uj: int, after_uj: int, max_uj: int) -> float:
    """Energy between two readings of a counter that wraps at `max_uj` (J)."""
    delta = after_uj - before_uj
    if delta < 0:
        delta += max_uj
    return delta / 1e6


_warned = False


def monitored_packages(cpu_indices: Sequence[int] | None) -> list[RaplPackage]:
    """The RAPL packages a `ZeusMonitor(cpu_indices=...)` measures: every readable one by default (none,
    quietly, where RAPL is absent); those asked for, and the ones missing said once per process."""
    global _warned
    if cpu_indices is not None and not list(cpu_indices):
        return []
    try:
        packages = rapl_packages()
    except RaplUnavailable as e:
        if cpu_indices is not None and not _warned:
            _warned = True
            logger.warning(
                "ZeusMonitor(cpu_indices=%s): CPU energy is not measured: %s. GPU energy is. (Said once.)",
                list(cpu_indices),
                e,
            )
        else:
            logger.info("CPU energy is not measured: %s.", e)
        return []
    if cpu_indices is None:
        return packages
    by_index = {p.index: p for p in packages}
    missing = [i for i in cpu_indices if i not in by_index]
    if missing and not _warned:
        _warned = True
        logger.warning(
            "ZeusMonitor(cpu_indices=%s): RAPL has no CPU package %s (it has %s); those are not measured. "
            "(Said once.)",
            list(cpu_indices),
            missing,
            sorted(by_index),
        )
    return [by_index[i] for i in cpu_indices if i in by_index]
