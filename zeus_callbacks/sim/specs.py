"""Static properties of the simulated GPU models (what NVML reports that no trace measures)."""

from __future__ import annotations

from dataclasses import dataclass

import pynvml

__all__ = ["GPUSpec", "SPECS", "spec_for"]


@dataclass(frozen=True)
class GPUSpec:
    """Name, architecture, memory, clocks and idle power of one GPU model, and how its driver answers.

    `fp32_tflops` orders GPUs the way CUDA's default `CUDA_DEVICE_ORDER=FASTEST_FIRST` does;
    `energy_refresh_ms` is how often the driver refreshes the energy counter; `power_usage_averaged` says
    whether `nvmlDeviceGetPowerUsage` is a 1-second moving average (Ampere and newer except the A100
    class) rather than the instantaneous draw.
    """

    kind: str
    name: str
    architecture: int  # pynvml.NVML_DEVICE_ARCH_*
    memory_bytes: int
    max_sm_clock_mhz: int
    min_sm_clock_mhz: int
    memory_clocks_mhz: tuple[int, ...]
    idle_power_w: float
    fp32_tflops: float
    energy_refresh_ms: float
    power_usage_averaged: bool
    sm_clock_step_mhz: int = 15

    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported graphics clocks, highest first, as NVML lists them."""
        return list(range(self.max_sm_clock_mhz, self.min_sm_clock_mhz - 1, -self.sm_clock_step_mhz))


_GiB = 1024**3
# Energy-counter refresh periods are representative figures for each generation within the 20-100 ms that
# current boards show, not a measurement of every board; override them with ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS.
SPECS: dict[str, GPUSpec] = {
    "a40": GPUSpec(
        "a40",
        "NVIDIA A40",
        pynvml.NVML_DEVICE_ARCH_AMPERE,
        48 * _GiB,
        1740,
        210,
        (7251, 405),
        30.0,
        fp32_tflops=37.4,
        energy_refresh_ms=100,
        power_usage_averaged=True,
    ),
    "v100": GPUSpec(
        "v100",
        "Tesla V100-PCIE-32GB",
        pynvml.NVML_DEVICE_ARCH_VOLTA,
        32 * _GiB,
        1380,
        135,
        (877,),
        25.0,
        fp32_tflops=14.0,
        energy_refresh_ms=20,
        power_usage_averaged=False,
    ),
    "a10g": GPUSpec(
        "a10g",
        "NVIDIA A10G",
        pynvml.NVML_DEVICE_ARCH_AMPERE,
        24 * _GiB,
        1710,
        210,
        (6251, 405),
        25.0,
        fp32_tflops=31.2,
        energy_refresh_ms=100,
        power_usage_averaged=True,
    ),
    "t4": GPUSpec(
        "t4",
        "Tesla T4",
        pynvml.NVML_DEVICE_ARCH_TURING,
        16 * _GiB,
        1590,
        300,
        (5001, 405),
        10.0,
        fp32_tflops=8.1,
        energy_refresh_ms=50,
        power_usage_averaged=False,
    ),
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
