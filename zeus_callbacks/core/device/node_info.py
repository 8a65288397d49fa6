"""Read-only facts about the node for `zeus-callbacks doctor`: driver, clocks, permissions, journal safety."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from zeus_callbacks.core.device import setters
from zeus_callbacks.core.device.backend import has_cap_sys_admin
from zeus_callbacks.core.device.errors import GPUError, InvalidInputError
from zeus_callbacks.core.device.gpus import GPU, GPUs

__all__ = [
    "driver_versions",
    "current_sm_clock_mhz",
    "Permission",
    "permission",
    "JournalDirCheck",
    "check_journal_dir",
    "safe_call",
]


def driver_versions(gpus: GPUs) -> tuple[str | None, str | None]:
    """(driver version, vendor library version: NVML's, amdsmi's); None where the library does not say."""
    return gpus.backend.driver_versions()


def current_sm_clock_mhz(gpu: GPU) -> int:
    """The SM (graphics) clock now (MHz)."""
    return gpu.device.clocks_mhz()[0]


@dataclass(frozen=True)
class Permission:
    """Whether this process may change GPU settings, and why (not)."""

    may_change: bool
    euid: int
    cap_sys_admin: bool
    container: str | None  # "docker", "podman", "kubernetes", ... when detected
    reason: str


def _container() -> str | None:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if Path("/.dockerenv").exists():
        return "docker"
    if Path("/run/.containerenv").exists():
        return "podman"
    try:
        cgroup = Path("/proc/1/cgroup").read_text()
    except OSError:
        return None
    for word in ("kubepods", "docker", "containerd", "lxc"):
        if word in cgroup:
            return word
    return None


def permission(gpus: GPUs) -> Permission:
    """What decides whether the optimizers may change power limits and clocks here."""
    cap = has_cap_sys_admin()
    container = _container()
    try:
        via = setters.route()
    except InvalidInputError as e:
        return Permission(False, os.geteuid(), cap, container, str(e))
    may = all(g.may_change_settings() for g in gpus) if len(gpus) else cap or via.name == "zeusd"
    if via.name == "zeusd":
        reason = f"zeusd at {getattr(via, 'endpoint', '?')} changes them for this process"
    elif may:
        reason = "this process holds CAP_SYS_ADMIN" if not gpus.simulated else "the simulated GPUs allow it"
    elif gpus.simulated:
        reason = (
            "the simulated GPUs refuse it (ZEUS_CALLBACKS_SIM_FAULTS); as on real GPUs, grant CAP_SYS_ADMIN or "
            "use Zeus's daemon zeusd (set ZEUSD_SOCK_PATH or ZEUSD_HOST_PORT)"
        )
    elif os.geteuid() == 0:
        reason = "root without CAP_SYS_ADMIN" + (
            f" (a {container} container drops it: add `--cap-add SYS_ADMIN` or the pod's securityContext "
            "capability)"
            if container
            else ""
        )
    else:
        reason = (
            "not root and no CAP_SYS_ADMIN: run as root, grant the capability, or use Zeus's daemon zeusd "
            "(set ZEUSD_SOCK_PATH or ZEUSD_HOST_PORT)"
        )
    return Permission(may, os.geteuid(), cap, container, reason)


@dataclass(frozen=True)
class JournalDirCheck:
    """The GPU-state journal directory and whether this process can trust and use it."""

    path: str | None
    exists: bool
    safe: bool
    problem: str | None


def check_journal_dir(path: Path | None) -> JournalDirCheck:
    """Is `path` a directory owned by this user (or root), not writable by others and not a symlink?"""
    if path is None:
        return JournalDirCheck(None, False, True, "journals are kept in memory only")
    if not os.path.lexists(path):
        parent = _nearest_existing(path)
        writable = os.access(parent, os.W_OK)
        problem = None if writable else f"{parent} is not writable: the journal cannot be created"
        return JournalDirCheck(str(path), False, writable, problem)
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid not in (os.geteuid(), 0):
        problem = f"is owned by uid {info.st_uid}, not by this user or root"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = "is writable by other users"
    elif not os.access(path, os.W_OK):
        problem = "is not writable by this process"
    return JournalDirCheck(str(path), True, problem is None, problem)


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path("/")


def safe_call(fn, *args):
    """`fn(*args)`, or None where the GPU or driver does not support the query."""
    try:
        return fn(*args)
    except GPUError:
        return None
