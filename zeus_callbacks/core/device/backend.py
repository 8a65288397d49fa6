"""NVML backends: the NVML-shaped module the device layer calls, and the registry that picks one.

The device layer calls NVML through one `NVMLBackend`. The default backend is the real driver through
`pynvml` (NVIDIA's nvidia-ml-py; the unofficial PyPI `pynvml` that can shadow it is refused with the fix).
Another package (the simulator) offers its own with `register_backend(factory, when)`: at the first
discovery the registered factories whose `when()` holds are asked in order (a factory named by a string is
imported only then), the first one that returns a backend is used, and the real one is the fallback. The
device layer never asks what a backend is beyond `simulated` (a label).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from zeus_callbacks.core.device.errors import (
    SIMULATION_HINT,
    InvalidInputError,
    MIGNotSupportedError,
    NVMLUnavailableError,
    nvml_error,
)
from zeus_callbacks.core.device.journal import default_journal_dir

__all__ = [
    "NVMLBackend",
    "BackendFactory",
    "register_backend",
    "active_backend",
    "reset_backend",
    "has_cap_sys_admin",
    "cuda_visible_uuids",
    "cuda_visible_positions",
    "nvml_uuid",
    "nvml_text",
    "nvml_inventory",
    "NVMLInventory",
    "UnofficialPynvmlError",
    "official_pynvml",
    "UNOFFICIAL_PYNVML_FIX",
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


def nvml_text(value: str | bytes) -> str:
    """NVML's text (a UUID, a name) as `str`: nvidia-ml-py before 11.515 and the unofficial `pynvml` return
    bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def nvml_uuid(cuda_uuid: object) -> str:
    """A CUDA device's UUID (e.g. torch's `get_device_properties(i).uuid`) in NVML's `GPU-...` form."""
    text = str(cuda_uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


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


class NVMLInventory(NamedTuple):
    """The GPUs NVML counts on the node, by NVML index."""

    opened: dict[int, str]
    """{index: UUID} of the GPUs this process may open."""
    denied: list[int]
    """Those it may not (NO_PERMISSION): not granted to this container or job, so CUDA does not see them."""
    failed: dict[int, Exception]
    """Those that answered another error (a lost GPU: GPU_IS_LOST), with the `NVMLError`. CUDA may still
    count them, so they keep their place in CUDA's numbering."""


def nvml_inventory(nvml: ModuleType) -> NVMLInventory:
    """The GPUs NVML counts, by what opening each one answered.

    Under cgroups (containers, Slurm, Kubernetes) NVML counts every GPU of the node, but opening one the
    job was not granted raises NO_PERMISSION; one GPU lost anywhere on the node fails only itself here, so
    that it stops only the jobs that use it.

    Raises:
        NVMLError: counting the GPUs failed.
    """
    inventory = NVMLInventory({}, [], {})
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            inventory.opened[i] = nvml_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
        except nvml.NVMLError as e:
            if e.value == nvml.NVML_ERROR_NO_PERMISSION:
                inventory.denied.append(i)
            else:
                inventory.failed[i] = e
    return inventory


class NVMLBackend:
    """How the device layer reaches GPUs: an NVML-shaped module, plus what NVML itself cannot tell.

    The base class is the real driver. A backend for something else (the simulator) subclasses it,
    passes its own NVML-shaped module, and overrides what differs.

    Attributes:
        nvml: The module called exactly as `pynvml` (same function names, units and error classes).
        clock: The clock windows are timed with (s); `time.time` unless the backend keeps its own.
        virtual_clock: Whether `clock` is a virtual clock that moves only when simulated work runs.
        simulated: Whether what the GPUs report is a simulation (used only to label figures).
        sync_at_step_boundary: Whether the end of a training step must synchronise the GPUs (see
            `GPUs.step_boundary`).
    """

    simulated: bool = False
    sync_at_step_boundary: bool = False

    def __init__(
        self, nvml: ModuleType, clock: Callable[[], float] = time.time, virtual_clock: bool = False
    ) -> None:
        self.nvml = nvml
        self.clock = clock
        self.virtual_clock = virtual_clock

    def __repr__(self) -> str:
        return f"{type(self).__name__}(nvml={self.nvml.__name__!r})"

    @property
    def reachable_from_other_processes(self) -> bool:
        """Whether a process this one starts (with its environment) reads the same GPUs: always, for a
        driver; a simulation only where its state is shared and exported."""
        return True

    def synchronize(self, index: int, handle: Any) -> None:
        """Wait for the work queued on GPU `index` (framework numbering; `handle` is its NVML handle)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize(index)

    def settle(self, handle: Any) -> None:
        """Called before another process (zeusd) changes the settings of the GPU behind `handle` for this one.

        A backend that accounts work at synchronisation (the simulator) accounts the work so far under the
        settings it ran at, as an in-process change does; a real GPU needs nothing.
        """

    def may_change_settings(self, handle: Any) -> bool:
        """Whether this process may change the power limit and clocks of the GPU behind `handle`."""
        return has_cap_sys_admin()

    def cuda_uuids(self) -> list[str]:
        """The NVML UUIDs of the CUDA devices this process sees: element i is CUDA device i (`cuda:i`).

        From torch's device properties when CUDA is available to torch. Otherwise CUDA's numbering is
        assumed to be NVML's (PCI bus order), exact only with `CUDA_DEVICE_ORDER=PCI_BUS_ID` or identical
        GPUs; a mixed node without it is warned about.
        """
        try:
            import torch

            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                return [nvml_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
        except ImportError:
            pass
        nvml = self.nvml
        opened, _, failed = nvml_inventory(nvml)
        if os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(opened) > 1:
            names = {
                nvml_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByUUID(u))) for u in opened.values()
            }
            if len(names) > 1:
                logger.warning(
                    "CUDA numbers mixed GPUs (%s) fastest first, and without torch's CUDA this process cannot "
                    "ask CUDA for its order; assuming PCI bus order. Set CUDA_DEVICE_ORDER=PCI_BUS_ID so that "
                    "GPU i is the same device for every library.",
                    ", ".join(sorted(names)),
                )
        # A GPU that failed keeps its place (CUDA may count it); one this job selects is reported, not skipped.
        order = sorted({*opened, *failed})
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        selected = [order[p] for p in cuda_visible_positions(visible, [opened.get(i) for i in order])]
        for cuda_index, i in enumerate(selected):
            if i in failed:
                raise nvml_error(
                    nvml, failed[i], "Opening the GPU", f"CUDA device {cuda_index} (NVML index {i})"
                )
        return [opened[i] for i in selected]

    def known_energy_refresh_s(self, handle: Any) -> float | None:
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


UNOFFICIAL_PYNVML_FIX = "pip uninstall pynvml && pip install nvidia-ml-py"


class UnofficialPynvmlError(NVMLUnavailableError):
    """The `pynvml` that imports is the unofficial PyPI package, not NVIDIA's nvidia-ml-py."""


def official_pynvml() -> ModuleType:
    """The `pynvml` module, checked to be NVIDIA's nvidia-ml-py.

    Raises:
        UnofficialPynvmlError: (an NVMLUnavailableError) the unofficial PyPI `pynvml` shadows it; the message
            names the fix, `pip uninstall pynvml && pip install nvidia-ml-py`.
        NVMLUnavailableError: no `pynvml` at all.
    """
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NVMLUnavailableError(f"nvidia-ml-py is not installed. {SIMULATION_HINT}") from e
    # NVIDIA's bindings are one module defining `_nvmlGetFunctionPointer`; the unofficial `pynvml` package
    # (PyPI, before 12) re-exports its `pynvml.nvml` with `import *`, which leaves it out. Zeus tells them
    # apart the same way (zeus/device/gpu/nvidia.py, `nvml_is_available`).
    if not hasattr(pynvml, "_nvmlGetFunctionPointer"):
        raise UnofficialPynvmlError(
            f"The unofficial `pynvml` package ({getattr(pynvml, '__file__', None) or 'pynvml'}) shadows NVIDIA's "
            f"nvidia-ml-py, whose answers this package reads: `{UNOFFICIAL_PYNVML_FIX}`."
        )
    return pynvml


BackendFactory = Callable[[], "NVMLBackend | None"]
"""Returns a backend when it is selected (e.g. by an environment variable), else None."""

_factories: list[BackendFactory | str] = []
_conditions: dict[BackendFactory | str, Callable[[], bool]] = {}
_active: NVMLBackend | None = None
_lock = threading.Lock()


def register_backend(factory: BackendFactory | str, when: Callable[[], bool] | None = None) -> None:
    """Offer a backend to discovery: `factory()` returns one when it is selected, else None.

    A `"package.module:function"` string names a factory imported at the first discovery whose `when()`
    holds (always, without `when`): a cheap check, e.g. of an environment variable, so that neither
    registering a factory nor a discovery that does not want it imports it. Factories are asked in the
    order they were registered.
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


def active_backend() -> NVMLBackend:
    """The backend of this process: the first registered factory's, else the real driver's (chosen once).

    Raises:
        NVMLUnavailableError: `pynvml` is missing, or is the unofficial package (`UnofficialPynvmlError`).
    """
    global _active
    with _lock:
        if _active is None:
            # Checked first: every backend, the simulator's beneath it included, runs nvidia-ml-py's functions.
            nvml = official_pynvml()
            for factory in _factories:
                when = _conditions.get(factory)
                if when is not None and not when():
                    continue
                backend = _load(factory)()
                if backend is not None:
                    logger.debug("NVML backend: %r (from %r).", backend, factory)
                    _active = backend
                    break
            else:
                _active = NVMLBackend(nvml)
        return _active


def reset_backend() -> None:
    """Choose the backend again at the next discovery (a registered backend was selected or dropped)."""
    global _active
    with _lock:
        _active = None
