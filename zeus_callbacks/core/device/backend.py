"""Backends: how the device layer reaches one vendor's GPUs, and the discovery that picks one.

A `Backend` finds `Device`s (`device.py`) and says what the vendor's library cannot (CUDA's numbering,
synchronisation, permissions, journals' place). Another package (the simulator) offers its own with
`register_backend(factory, when)`: at the first discovery the registered factories whose `when()` holds are
asked in order (a factory named by a string is imported only then), and the first one that returns a
backend is used. Otherwise the real vendors' backends (`REAL_BACKENDS`: NVIDIA, then AMD) are tried, each
imported only then; a vendor whose library is absent is skipped, and GPUs of two vendors visible at once are
refused (`MixedVendorError`). The device layer never asks what a backend is beyond `vendor` and `simulated`
(labels).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from zeus_callbacks.core.device.errors import (
    SIMULATION_HINT,
    GPUError,
    InvalidInputError,
    MIGNotSupportedError,
    MixedVendorError,
    NVMLUnavailableError,
)
from zeus_callbacks.core.device.journal import default_journal_dir

if TYPE_CHECKING:
    from zeus_callbacks.core.device.device import Device

__all__ = [
    "Backend",
    "BackendFactory",
    "REAL_BACKENDS",
    "register_backend",
    "active_backend",
    "reset_backend",
    "has_cap_sys_admin",
    "cuda_visible_uuids",
    "cuda_visible_positions",
]

logger = logging.getLogger(__name__)

CAP_SYS_ADMIN = 21  # bit of CAP_SYS_ADMIN in /proc/<pid>/status's capability masks


def has_cap_sys_admin(status_path: str = "/proc/self/status") -> bool:
    """Whether this process holds CAP_SYS_ADMIN, which NVML needs to change power limits and clocks.

    Decided from the effective capability set (`CapEff` in `status_path`), not from the user id: root
    in a container without the capability may not change them, and a non-root process granted it may.
    """
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def cuda_visible_uuids(visible: str | None, uuids: list[str]) -> list[str]:
    """The devices `CUDA_VISIBLE_DEVICES=visible` selects from `uuids` (CUDA's numbering), in its order.

    Entries are indices into `uuids` or unique UUID prefixes; as CUDA does, the list ends at the first
    entry that names no device.

    Raises:
        MIGNotSupportedError: an entry selects a MIG device.
        InvalidInputError: (a ValueError) an entry names a GPU twice.
    """
    return [uuids[i] for i in cuda_visible_positions(visible, uuids)]


def cuda_visible_positions(visible: str | None, uuids: Sequence[str | None]) -> list[int]:
    """`cuda_visible_uuids`, as positions in `uuids`; a None in `uuids` (a GPU whose UUID NVML could not
    read) can be selected by index, never by UUID prefix."""
    if visible is None:
        return list(range(len(uuids)))
    out: list[int] = []
    for raw in (v.strip() for v in visible.split(",")):
        if not raw:
            break
        if raw.startswith("MIG-"):
            raise MIGNotSupportedError(
                f"CUDA_VISIBLE_DEVICES={visible!r} selects a MIG device; NVML cannot measure or control MIG "
                "instances. Select whole GPUs by index or GPU-<uuid>."
            )
        if raw.lstrip("-").isdigit():
            if not 0 <= int(raw) < len(uuids):
                break  # CUDA ignores the rest of the list after an invalid entry
            out.append(int(raw))
            continue
        matches = [i for i, u in enumerate(uuids) if u is not None and u.startswith(raw)]
        if len(matches) != 1:
            break
        out.append(matches[0])
    if len(set(out)) != len(out):
        raise InvalidInputError(
            f"CUDA_VISIBLE_DEVICES={visible!r} names a GPU twice (CUDA then sees none): name each GPU once, "
            "e.g. CUDA_VISIBLE_DEVICES=0,1."
        )
    return out


class Backend:
    """How the device layer reaches one vendor's GPUs (real or simulated): discovery, plus what the vendor's
    library itself cannot tell. Each vendor module subclasses it (`nvidia.NVIDIABackend`, `amd.AMDBackend`);
    the simulator subclasses those.

    Attributes:
        vendor: "nvidia" or "amd".
        library: The vendor library's name as reports print it ("NVML", "amdsmi").
        clock: The clock windows are timed with (s); `time.time` unless the backend keeps its own.
        virtual_clock: Whether `clock` is a virtual clock that moves only when simulated work runs.
        simulated: Whether what the GPUs report is a simulation (used only to label figures).
        sync_at_step_boundary: Whether the end of a training step must synchronise the GPUs (see
            `GPUs.step_boundary`).
    """

    vendor: str = ""
    library: str = "GPU library"
    simulated: bool = False
    sync_at_step_boundary: bool = False

    def __init__(self, clock: Callable[[], float] = time.time, virtual_clock: bool = False) -> None:
        self.clock = clock
        self.virtual_clock = virtual_clock

    def init(self) -> None:
        """Initialise the vendor's library (in this process; a child process calls it again)."""

    def devices(self) -> list[Device]:
        """The GPUs this process may use, in CUDA's (HIP's) numbering."""
        raise NotImplementedError

    def open_device(self, uuid: str, cuda_index: int) -> Device:
        """The GPU `uuid` alone, as CUDA device `cuda_index` (a child process that was told its GPUs)."""
        return next(d for d in self.devices() if d.uuid == uuid)

    def gpu_count(self) -> int:
        """How many GPUs this process sees (used by discovery to refuse mixed-vendor nodes)."""
        return len(self.devices())

    @property
    def reachable_from_other_processes(self) -> bool:
        """Whether a process this one starts (with its environment) reads the same GPUs: always, for a
        driver; a simulation only where its state is shared and exported."""
        return True

    def synchronize(self, index: int, device: Device) -> None:
        """Wait for the work queued on GPU `index` (framework numbering)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize(index)

    def settle(self, device: Device) -> None:
        """Called before another process (zeusd) changes `device`'s settings for this one.

        A backend that accounts work at synchronisation (the simulator) accounts the work so far under the
        settings it ran at, as an in-process change does; a real GPU needs nothing.
        """

    def may_change_settings(self, device: Device) -> bool:
        """Whether this process may change the power limit and clocks of `device` itself (CAP_SYS_ADMIN)."""
        return has_cap_sys_admin()

    def known_energy_refresh_s(self, device: Device) -> float | None:
        """The energy counter's refresh period where the backend knows it without measuring (None: measure
        it by polling, as on real GPUs, whose drivers do not report it)."""
        return None

    def provenance(self, uuid: str) -> str | None:
        """Where the figures of the GPU `uuid` come from, for labels, when `simulated` does not say enough (a
        simulated board modelled rather than traced); None for real GPUs and traced simulated ones."""
        return None

    def journal_dir(self) -> Path | None:
        """Default directory of the state guard's journals (None: keep them in memory only).

        One that lives as long as the GPU settings it records: see `journal.default_journal_dir`.
        """
        return default_journal_dir()

    def driver_versions(self) -> tuple[str | None, str | None]:
        """(driver version, vendor library version); None where the library does not say."""
        return None, None

    def node_gpu_names(self) -> list[str]:
        """The names of every GPU the vendor's library counts on the node, in its order (what zeusd's
        indices are compared with); [] where it cannot say."""
        return [d.name for d in self.devices()]


REAL_BACKENDS = [
    "zeus_callbacks.core.device.nvidia:real_backend",
    "zeus_callbacks.core.device.amd:real_backend",
]
"""The real vendors' backend factories, tried in order after the registered ones (each imported only then)."""


BackendFactory = Callable[[], "Backend | None"]
"""Returns a backend when it is selected (e.g. by an environment variable), else None."""

_factories: list[BackendFactory | str] = []
_conditions: dict[BackendFactory | str, Callable[[], bool]] = {}
_active: Backend | None = None
_lock = threading.Lock()


def register_backend(factory: BackendFactory | str, when: Callable[[], bool] | None = None) -> None:
    """Offer a backend to discovery: `factory()` returns one when it is selected, else None.

    A `"package.module:function"` string names a factory imported at the first discovery whose `when()`
    holds (always, without `when`): a cheap check, e.g. of an environment variable, so that neither
    registering a factory nor a discovery that does not want it imports it. Factories are asked in the
    order they were registered, before the real vendors'.
    """
    with _lock:
        if factory not in _factories:
            _factories.append(factory)
        if when is not None:
            _conditions[factory] = when


def _load(factory: BackendFactory | str) -> BackendFactory:
    if not isinstance(factory, str):
        return factory
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)


def _registered() -> Backend | None:
    for factory in _factories:
        when = _conditions.get(factory)
        if when is not None and not when():
            continue
        backend = _load(factory)()
        if backend is not None:
            logger.debug("Backend: %r (from %r).", backend, factory)
            return backend
    return None


def _sees_gpus(backend: Backend) -> bool:
    try:
        backend.init()
        return backend.gpu_count() > 0
    except NVMLUnavailableError:
        return False  # its library loads but finds no driver
    except GPUError:
        return True  # it has GPUs, one of which fails: said by the discovery that opens them


def real_backend(factories: Sequence[str] | None = None) -> Backend:
    """The real vendor whose GPUs this process sees, from `factories` (`REAL_BACKENDS`) in order.

    A vendor whose module or Python package cannot be imported, or whose factory returns None, is skipped.
    Where one vendor is left it is used (its library's errors, e.g. no driver, come at discovery); where
    several are, the one that sees GPUs (or the first).

    Raises:
        MixedVendorError: GPUs of two vendors are visible.
        NVMLUnavailableError: no vendor's Python package at all.
    """
    found: list[Backend] = []
    for ref in REAL_BACKENDS if factories is None else factories:
        try:
            factory = _load(ref)
        except ImportError as e:  # the vendor's module or Python package is absent
            logger.debug("No backend %s: %s", ref, e)
            continue
        backend = factory()
        if backend is not None:
            found.append(backend)
    if not found:
        raise NVMLUnavailableError(f"No GPU library (nvidia-ml-py, amdsmi) is installed. {SIMULATION_HINT}")
    if len(found) == 1:
        return found[0]
    with_gpus = [b for b in found if _sees_gpus(b)]
    if len(with_gpus) > 1:
        vendors = " and ".join(b.vendor for b in with_gpus)
        raise MixedVendorError(
            f"GPUs of two vendors ({vendors}) are visible; this package drives one vendor's GPUs per process: "
            "select one vendor's with CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES (e.g. HIP_VISIBLE_DEVICES= "
            "to hide the AMD ones)."
        )
    return (with_gpus or found)[0]


def active_backend() -> Backend:
    """The backend of this process: the first registered factory's, else the real vendor's (chosen once).

    Raises:
        NVMLUnavailableError: no vendor's library, or the unofficial `pynvml` (`UnofficialPynvmlError`).
        MixedVendorError: GPUs of two vendors are visible.
    """
    global _active
    with _lock:
        if _active is None:
            _active = _registered() or real_backend()
        return _active


def reset_backend() -> None:
    """Choose the backend again at the next discovery (a registered backend was selected or dropped)."""
    global _active
    with _lock:
        _active = None
