"""The package's exceptions, each saying what went wrong and what to do, and their translation from NVML's."""

from __future__ import annotations

from types import ModuleType

__all__ = [
    "SIMULATION_HINT",
    "nvml_error",
    "ZeusCallbacksError",
    "InvalidInputError",
    "GPUError",
    "GPUNoPermissionError",
    "GPUNotSupportedError",
    "GPULostError",
    "GPUBusyError",
    "GPUStateJournalError",
    "NVMLUnavailableError",
    "MIGNotSupportedError",
    "MixedVendorError",
]

SIMULATION_HINT = (
    "To run on simulated GPUs instead, set ZEUS_CALLBACKS_SIMULATE=a40 (or a10g, t4, v100; "
    "see `zeus_callbacks.sim`)."
)


class ZeusCallbacksError(Exception):
    """Base class of every error raised by zeus_callbacks."""


class InvalidInputError(ZeusCallbacksError, ValueError):
    """An argument, environment variable or file holds a value this package cannot use; the message names
    the input (and the file and line) and says what to do."""


class GPUError(ZeusCallbacksError):
    """An NVML call failed."""


class GPUNoPermissionError(GPUError):
    """The process may not change this GPU setting (needs CAP_SYS_ADMIN, which root has unless dropped)."""


class GPUNotSupportedError(GPUError):
    """The GPU or driver does not support this query or setting."""


class GPULostError(GPUError):
    """The GPU fell off the bus or stopped answering."""


class GPUBusyError(GPUError):
    """Another live process owns this GPU's settings (it changed them first); this one may only measure."""


class GPUStateJournalError(GPUError):
    """The GPU-state journal cannot be written, so the GPU is not changed (nothing could restore it)."""


class NVMLUnavailableError(GPUError):
    """The NVML library or the NVIDIA driver is missing, so no GPU can be reached."""


class MIGNotSupportedError(GPUError):
    """A MIG device or a GPU in MIG mode was selected; NVML cannot measure or control MIG instances."""


class MixedVendorError(GPUError):
    """GPUs of two vendors are visible at once; this package drives one vendor's GPUs per process."""


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
