"""The package's exceptions, each saying what went wrong and what to do (each vendor module translates its
library's errors into them: `nvidia.nvml_error`, `amd.py`)."""

from __future__ import annotations

__all__ = [
    "SIMULATION_HINT",
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
    """A call to a GPU vendor's library (NVML, amdsmi) failed."""


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
    """The GPU vendor's library or driver (NVML and the NVIDIA driver; amdsmi) is missing, so no GPU can be
    reached."""


class MIGNotSupportedError(GPUError):
    """A MIG device or a GPU in MIG mode was selected; NVML cannot measure or control MIG instances."""


class MixedVendorError(GPUError):
    """GPUs of two vendors are visible at once; this package drives one vendor's GPUs per process."""
