"""The simulator as an AMD backend: simulated AMD GPUs reached through the real `amdsmi` package.

`attach(system)` puts a simulated AMD node beneath amdsmi: the simulated `libamd_smi.so`
(`sim/amdsmi_library.py`). amdsmi binds its C functions when it is imported (`amdsmi_wrapper.py` 7.0.2, lines
185-213: `find_smi_library()` calls `ctypes.CDLL` on `libamd_smi.so`, then every function is an attribute of
what it returned), so there is no later moment to put a library beneath it, as `pynvml.nvmlLib` offers for
NVML. The narrowest way found: while `attach` imports `amdsmi` (under a lock, never without a simulated AMD
node), `ctypes.CDLL` answers the simulated library for the name `libamd_smi.so` and loads any other name as
before; it is put back as soon as the import returns. The simulated `amdsmi` modules stay in `sys.modules`
only while the node is attached: `attach(None)` takes them out and puts back any `amdsmi` imported before
(bound to the real library), and the simulated library then answers as a host without the amdgpu driver.
`SimulatedAMDBackend` is the device layer's AMD backend (`core/device/amd.py`) with what amdsmi cannot say
taken from the simulator, as `sim/backend.py`'s NVIDIA one does.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from zeus_callbacks.core.device.amd import AMDBackend, AMDDevice
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.sim.amdsmi_library import LIBRARY_NAME, SimulatedAMDSMILibrary
from zeus_callbacks.sim.node_backend import SimulatedNodeBackend, node_clock
from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem

__all__ = ["SimulatedAMDBackend", "attach", "ensure", "installed"]

logger = logging.getLogger(__name__)

_library: SimulatedAMDSMILibrary | None = None
_module: ModuleType | None = None  # amdsmi, bound to `_library`
_saved: dict[str, ModuleType] = {}  # amdsmi modules imported before (bound to the real library)
_import_lock = threading.Lock()


@contextlib.contextmanager
def _cdll_answering(library: SimulatedAMDSMILibrary) -> Iterator[None]:
    """`ctypes.CDLL` returns `library` for `libamd_smi.so` (any directory) and loads any other name as before."""
    real = ctypes.CDLL

    def cdll(name: Any, *args: Any, **kwargs: Any) -> Any:
        if str(name).rsplit("/", 1)[-1] == LIBRARY_NAME:
            return library
        return real(name, *args, **kwargs)

    ctypes.CDLL = cdll  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        ctypes.CDLL = real  # type: ignore[misc]


def _import_amdsmi(library: SimulatedAMDSMILibrary) -> ModuleType:
    """The real `amdsmi` package imported afresh, bound to `library`."""
    with _import_lock, _cdll_answering(library):
        module = importlib.import_module("amdsmi")
    library.wrapper = sys.modules["amdsmi.amdsmi_wrapper"]
    return module


def _take_modules() -> dict[str, ModuleType]:
    """Remove and return the `amdsmi` modules in `sys.modules`."""
    names = [n for n in sys.modules if n == "amdsmi" or n.startswith("amdsmi.")]
    return {n: sys.modules.pop(n) for n in names}


def attach(system: SimulatedSystem | None) -> ModuleType | None:
    """Make `system` the node beneath amdsmi and return the `amdsmi` module bound to it (None: detach).

    Raises:
        ImportError: the `amdsmi` package is not installed (`pip install zeus-callbacks[amd]`).
    """
    global _library, _module, _saved
    if system is None:
        if _library is not None:
            _library.system, _library._initialized = None, 0
        if _module is not None:
            _take_modules()
            sys.modules.update(_saved)
            _module, _saved = None, {}
        return None
    if _library is None:
        _library = SimulatedAMDSMILibrary()
    if _library.system is not system:
        _library.system, _library._initialized = system, 0
    if _module is None or sys.modules.get("amdsmi") is not _module:
        taken = _take_modules()
        if _module is None:
            _saved = taken
        _module = _import_amdsmi(_library)
    logger.debug("libamd_smi.so beneath amdsmi: %r.", _library)
    return _module


def ensure(system: SimulatedSystem) -> ModuleType:
    """The amdsmi module answering for `system`, attaching it first when another (or none) is."""
    if _library is None or _library.system is not system or sys.modules.get("amdsmi") is not _module:
        attach(system)
    return _module  # type: ignore[return-value]


def installed() -> SimulatedAMDSMILibrary | None:
    """The simulated library beneath amdsmi, None when no simulated AMD node is attached."""
    return _library if _library is not None and _library.system is not None else None


class SimulatedAMDBackend(SimulatedNodeBackend, AMDBackend):
    """Simulated AMD GPUs of one `SimulatedSystem`, reached through the real `amdsmi` package; what amdsmi cannot
    say comes from the simulator, as for the NVIDIA one (`SimulatedNodeBackend`)."""

    def __init__(self, system: SimulatedSystem) -> None:
        super().__init__(ensure(system), **node_clock(system))
        self.system = system

    def gpu(self, device: Device | Any) -> SimulatedGPU:
        """The simulated GPU behind an AMD device (or an amdsmi processor handle)."""
        handle: Any = device.handle if isinstance(device, AMDDevice) else device
        address: int | None = getattr(handle, "value", handle)
        ensure(self.system)
        assert _library is not None
        return _library.gpu(address)


def simulated_amd_backend() -> SimulatedAMDBackend | None:
    """The backend factory for an active simulated AMD node, else None."""
    from zeus_callbacks import sim

    system = sim.active()
    return None if system is None or system.vendor != "amd" else SimulatedAMDBackend(system)
