"""nvidia-ml-py as this package loads it: the official bindings checked, NVML's errors translated, text decoded,
and the GPUs NVML counts."""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from zeus_callbacks.core.device.errors import (
    SIMULATION_HINT,
    GPUError,
    GPULostError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    NVMLUnavailableError,
)

__all__ = [
    "UNOFFICIAL_PYNVML_FIX",
    "UnofficialPynvmlError",
    "official_pynvml",
    "nvml_error",
    "nvml_text",
    "nvml_uuid",
    "NVMLInventory",
    "nvml_inventory",
]

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


def nvml_error(nvml: ModuleType, err: Exception, what: str, gpu: str) -> GPUError:
    """The package's exception for an `NVMLError` raised by `nvml`, with a message that says what to do.

    Args:
        nvml: The NVML-shaped module that raised `err` (its error codes are compared).
        err: The `NVMLError`.
        what: What was being done, e.g. "Setting the power limit".
        gpu: Which GPU, e.g. its label.
    """
    code = getattr(err, "value", None)
    if code == nvml.NVML_ERROR_NO_PERMISSION:
        return GPUNoPermissionError(
            f"{what} on {gpu}: no permission. Changing power limits and clocks needs the CAP_SYS_ADMIN "
            "capability (root has it unless a container drops it; e.g. `docker run --cap-add SYS_ADMIN`), or "
            "Zeus's daemon zeusd (set ZEUSD_SOCK_PATH or ZEUSD_HOST_PORT); measuring still works."
        )
    if code == nvml.NVML_ERROR_NOT_SUPPORTED:
        return GPUNotSupportedError(f"{what} is not supported on {gpu} by this GPU or driver.")
    if code in (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED):
        return GPULostError(
            f"{what} on {gpu}: the GPU is lost (fell off the bus or needs a reset). Check `nvidia-smi` and "
            "the kernel log; the settings changed by this process are restored when the GPU is back."
        )
    if code in (
        nvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        nvml.NVML_ERROR_DRIVER_NOT_LOADED,
        nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    ):
        return NVMLUnavailableError(f"{what}: NVML is unavailable ({err}). {SIMULATION_HINT}")
    return GPUError(f"{what} on {gpu} failed: {err}")


def nvml_text(value: str | bytes) -> str:
    """NVML's text (a UUID, a name) as `str`: nvidia-ml-py before 11.515 and the unofficial `pynvml` return
    bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def nvml_uuid(cuda_uuid: object) -> str:
    """A CUDA device's UUID (e.g. torch's `get_device_properties(i).uuid`) in NVML's `GPU-...` form."""
    text = str(cuda_uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


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
