"""Static properties of the simulated GPU models (what NVML reports that no trace measures)."""

from __future__ import annotations

from dataclasses import dataclass

import pynvml

__all__ = ["GPUSpec", "SPECS", "spec_for"]


@dataclass(frozen=True)
class GPUSpec:
    """Name, architecture, memory, clocks and idle power of one GPU model."""

    kind: str
    name: str
    architecture: int  # pynvml.NVML_DEVICE_ARCH_*
    memory_bytes: int
    max_sm_clock_mhz: int
    min_sm_clock_mhz: int
    memory_clocks_mhz: tuple[int, ...]
    idle_power_w: float
    sm_clock_step_mhz: int = 15

    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported graphics clocks, highest first, as NVML lists them."""
        return list(range(self.max_sm_clock_mhz, self.min_sm_clock_mhz - 1, -self.sm_clock_step_mhz))


_GiB = 1024**3
SPECS: dict[str, GPUSpec] = {
    "a40": GPUSpec(
        "a40", "NVIDIA A40", pynvml.NVML_DEVICE_ARCH_AMPERE, 48 * _GiB, 1740, 210, (7251, 405), 30.0
    ),
    "v100": GPUSpec(
        "v100", "Tesla V100-PCIE-32GB", pynvml.NVML_DEVICE_ARCH_VOLTA, 32 * _GiB, 1380, 135, (877,), 25.0
    ),
    "a10g": GPUSpec(
        "a10g", "NVIDIA A10G", pynvml.NVML_DEVICE_ARCH_AMPERE, 24 * _GiB, 1710, 210, (6251, 405), 25.0
    ),
    "t4": GPUSpec("t4", "Tesla T4", pynvml.NVML_DEVICE_ARCH_TURING, 16 * _GiB, 1590, 300, (5001, 405), 10.0),
}
_ALIASES = {"a10": "a10g"}


def spec_for(kind: str) -> GPUSpec:
    """The spec of a simulated GPU kind (`a40`, `v100`, `a10g`/`a10`, `t4`)."""
    key = _ALIASES.get(kind.lower(), kind.lower())
    if key not in SPECS:
        raise ValueError(
            f"Unknown simulated GPU {kind!r}. Choose one of: {', '.join(sorted(SPECS))} (or a10)."
        )
    return SPECS[key]
