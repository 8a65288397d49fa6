"""NVIDIA GPUs through NVML (NVIDIA's nvidia-ml-py): the only package of zeus_callbacks that calls NVML.

`NVIDIADevice` (`device.py`) is one GPU behind the `Device` boundary; `library.py` loads nvidia-ml-py and
translates its errors; `NVIDIABackend` (here) finds the GPUs (the GPUs NVML may open, CUDA's numbering). The
simulator sits beneath nvidia-ml-py, so simulated runs go through this package too (`zeus_callbacks.sim.backend` subclasses `NVIDIABackend`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from types import ModuleType

from zeus_callbacks.core.device.backend import Backend, cuda_visible_positions, has_cap_sys_admin
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.core.device.errors import MIGNotSupportedError
from zeus_callbacks.core.device.nvidia.device import ARCHITECTURES, NVIDIADevice
from zeus_callbacks.core.device.nvidia.library import (
    UNOFFICIAL_PYNVML_FIX,
    NVMLInventory,
    UnofficialPynvmlError,
    nvml_error,
    nvml_inventory,
    nvml_text,
    nvml_uuid,
    official_pynvml,
)

__all__ = [
    "NVIDIADevice",
    "NVIDIABackend",
    "real_backend",
    "nvml_error",
    "nvml_text",
    "nvml_uuid",
    "nvml_inventory",
    "NVMLInventory",
    "official_pynvml",
    "UnofficialPynvmlError",
    "UNOFFICIAL_PYNVML_FIX",
    "ARCHITECTURES",
]

logger = logging.getLogger(__name__)


class NVIDIABackend(Backend):
    """The real driver through nvidia-ml-py; the simulator subclasses it with its own CUDA numbering, clock
    and permissions (`zeus_callbacks.sim.backend`).

    Attributes:
        nvml: The module called exactly as `pynvml` (same function names, units and error classes).
    """

    vendor = "nvidia"
    library = "NVML"

    def __init__(
        self, nvml: ModuleType, clock: Callable[[], float] = time.time, virtual_clock: bool = False
    ) -> None:
        super().__init__(clock=clock, virtual_clock=virtual_clock)
        self.nvml = nvml

    def __repr__(self) -> str:
        return f"{type(self).__name__}(nvml={self.nvml.__name__!r})"

    def init(self) -> None:
        """`nvmlInit`.

        Raises:
            NVMLUnavailableError: no NVML library or driver.
        """
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as e:
            raise nvml_error(self.nvml, e, "Initialising NVML", "this machine") from None

    def devices(self) -> list[Device]:
        """The CUDA devices of this process, in CUDA's numbering, tied to NVML by UUID. GPUs NVML counts but
        the job may not open (a container's or cgroup's device list) are skipped with one log message.

        Raises:
            MIGNotSupportedError: a MIG device, or a GPU in MIG mode, is selected.
        """
        nvml = self.nvml
        try:
            _, denied, failed = nvml_inventory(nvml)
        except nvml.NVMLError as e:
            raise nvml_error(nvml, e, "Counting the GPUs", "this machine") from None
        if denied:
            logger.info(
                "NVML counts %d GPU(s) this process may not open (NVML index %s: no permission, e.g. not "
                "granted to this container or job); skipped.",
                len(denied),
                ", ".join(map(str, denied)),
            )
        uuids = self.cuda_uuids()
        for i, uuid in enumerate(uuids):
            if uuid.startswith("MIG-"):
                raise MIGNotSupportedError(
                    f"CUDA device {i} is the MIG device {uuid}; NVML cannot measure or control MIG instances. "
                    "Select whole GPUs (CUDA_VISIBLE_DEVICES) or disable MIG."
                )
        devices: list[Device] = [NVIDIADevice(nvml, uuid, i, self.simulated) for i, uuid in enumerate(uuids)]
        for d in devices:
            if d.mig_enabled():
                raise MIGNotSupportedError(
                    f"{d.label} is in MIG mode; NVML cannot measure or control MIG instances. Disable MIG "
                    f"(`nvidia-smi -i {d.vendor_index} -mig 0`) or use another GPU."
                )
        ours = {d.vendor_index for d in devices}
        for i, error in failed.items():
            if i not in ours:  # another job's GPU (e.g. lost) stops only the jobs that use it
                logger.warning(
                    "NVML GPU %d does not answer (%s); it is not one of this process's GPUs, so it is skipped.",
                    i,
                    error,
                )
        return devices

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

    def open_device(self, uuid: str, cuda_index: int) -> NVIDIADevice:
        """The GPU `uuid`, opened by UUID (neither torch nor CUDA's numbering needed)."""
        return NVIDIADevice(self.nvml, uuid, cuda_index, self.simulated)

    def gpu_count(self) -> int:
        """How many CUDA devices this process sees (`CUDA_VISIBLE_DEVICES` applied)."""
        return len(self.cuda_uuids())

    def may_change_settings(self, device: Device) -> bool:
        """Whether this process holds CAP_SYS_ADMIN, which NVML's setters need."""
        return has_cap_sys_admin()

    def driver_versions(self) -> tuple[str | None, str | None]:
        """(driver version, NVML library version); None where the library does not say."""
        out: list[str | None] = []
        for name in ("nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion"):
            fn = getattr(self.nvml, name, None)
            try:
                value = fn() if fn is not None else None
            except self.nvml.NVMLError:
                value = None
            out.append(None if value is None else nvml_text(value))
        return out[0], out[1]

    def node_gpu_names(self) -> list[str]:
        """The names of every GPU NVML counts, in NVML's order ([] where NVML cannot say)."""
        nvml = self.nvml
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            return [nvml_text(nvml.nvmlDeviceGetName(h)) for h in handles]
        except nvml.NVMLError:
            return []


def real_backend() -> NVIDIABackend:
    """The real driver's backend (NVML is initialised at discovery, where a missing driver is said).

    Raises:
        UnofficialPynvmlError: the unofficial `pynvml` shadows nvidia-ml-py.
    """
    return NVIDIABackend(official_pynvml())
