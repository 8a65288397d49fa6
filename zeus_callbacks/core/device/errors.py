"""The package's exceptions: each says what went wrong and what to do about it."""

from __future__ import annotations

__all__ = [
    "ZeusCallbacksError",
    "GPUError",
    "GPUNoPermissionError",
    "GPUNotSupportedError",
    "GPULostError",
    "NVMLUnavailableError",
    "MIGNotSupportedError",
]


class ZeusCallbacksError(Exception):
    """Base class of every error raised by zeus_callbacks."""


class GPUError(ZeusCallbacksError):
    """An NVML call failed."""


class GPUNoPermissionError(GPUError):
    """The process may not change this GPU setting (needs root or CAP_SYS_ADMIN)."""


class GPUNotSupportedError(GPUError):
    """The GPU or driver does not support this query or setting."""


class GPULostError(GPUError):
    """The GPU fell off the bus or stopped answering."""


class NVMLUnavailableError(GPUError):
    """The NVML library or the NVIDIA driver is missing, so no GPU can be reached."""


class MIGNotSupportedError(GPUError):
    """A MIG device or a GPU in MIG mode was selected; NVML cannot measure or control MIG instances."""
