"""What amdsmi reports of a simulated AMD board that `GPUSpec` does not hold (ids, counter resolution, levels).

Sources: the rocm-smi dumps under `sim/data/gpu_dumps` (`MI300X_x4.rocm-smi-a.txt`, `MI300X.rocm-smi.txt`, a real
4-GPU MI300X node) and AMD's MI300X datasheet (AMD Instinct MI300X Accelerator data sheet: 750 W typical board
power, 192 GB HBM3, 304 compute units, 2100 MHz peak engine clock).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AMDBoardFacts", "AMD_FACTS", "amd_facts"]


@dataclass(frozen=True)
class AMDBoardFacts:
    """One AMD model's identity and amdsmi answers (what the rocm-smi dump and the datasheet show).

    `energy_resolution_uj` is amdsmi_get_energy_count's `counter_resolution` (µJ per accumulator tick);
    `gfx_version` the `target_graphics_version` amdsmi_get_gpu_asic_info fills (0x942 prints as "gfx942");
    `mclk_levels_mhz` the memory clock's DPM levels, lowest first, as rocm-smi lists them.
    """

    device_id: int
    gfx_version: int
    architecture: str
    compute_units: int
    energy_resolution_uj: float
    mclk_levels_mhz: tuple[int, ...]
    idle_sclk_mhz: int
    junction_c: int
    compute_partition: str = "SPX"
    memory_partition: str = "NPS1"
    vendor_name: str = "Advanced Micro Devices Inc. [AMD/ATI]"


AMD_FACTS: dict[str, AMDBoardFacts] = {
    "mi300x": AMDBoardFacts(
        device_id=0x74A1,  # MI300X_x4.rocm-smi-a.txt, "Device ID: 0x74a1" (lines 6-13)
        gfx_version=0x942,  # CDNA3's gfx942 (AMD's LLVM AMDGPU target list: MI300X is gfx942)
        architecture="cdna3",
        compute_units=304,  # MI300X data sheet
        # MI300X_x4.rocm-smi-a.txt, "Consumed Energy": 78098902297472.05 uJ over a counter of 5104503354501 is
        # 15.3 uJ (as float32: 15.300000190734863) per tick.
        energy_resolution_uj=15.3,
        mclk_levels_mhz=(
            900,
            1100,
            1300,
        ),  # "Supported mclk frequencies", "Valid mclk range: 900Mhz - 1300Mhz"
        idle_sclk_mhz=132,  # "Current clock frequencies", sclk at idle: 132-141 MHz
        junction_c=36,  # "Temperature (Sensor junction)": 34-39 C at idle
    ),
}


def amd_facts(kind: str) -> AMDBoardFacts:
    """The facts of an AMD kind (`mi300x`).

    Raises:
        KeyError: not an AMD kind.
    """
    return AMD_FACTS[kind]
