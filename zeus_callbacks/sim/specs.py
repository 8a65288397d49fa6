"""Static properties of the simulated GPU models (what NVML reports that no trace measures)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TypedDict

import pynvml

__all__ = [
    "GPUSpec",
    "SPECS",
    "spec_for",
    "PART_TIME_POWER",
    "UPDATE_TIMING",
    "UpdateTiming",
    "SENSOR_GAIN_ERROR",
    "sensor_gain",
]

PART_TIME_POWER = (
    'Yang, Adamek, Armour, "Accurate and Convenient Energy Measurements for GPUs: A Detailed Study of NVIDIA '
    "GPU's Built-in Power Sensor\", SC'24 (preprint: \"Part-time Power Measurements: nvidia-smi's Lack of "
    'Attention", arXiv:2312.02741)'
)
"""The measurements the power update periods and windows below come from (over 70 GPUs, 12 generations)."""

SENSOR_GAIN_ERROR = 0.05
"""Steady-state error of a board's power sensor against an external meter, as a gain within 1 +/- this.

PART_TIME_POWER compares nvidia-smi's power with an external power meter; its text, as public READMEs quote
and link it (arXiv:2312.02741v2, HTML, "The error in nvidia-smi's power draw is +/- 5%"), gives +/- 5%; nvml.h
says the same of Fermi and Kepler (nvmlDeviceGetPowerUsage: "accurate to within +/- 5% of current power draw").
Issue 41's "-9% to +11%" could not be traced to a source and is not used. The core's bound uses the same
figure (`core/monitor/uncertainty.py`)."""


def sensor_gain(uuid: str) -> float:
    """The gain of a board's power sensor: what NVML reads (power and the energy counter) over the truth,
    uniform within 1 +/- `SENSOR_GAIN_ERROR`, fixed for the board (seeded from its UUID)."""
    fraction = int(hashlib.sha1(f"sensor-gain/{uuid}".encode()).hexdigest()[:8], 16) / 16**8
    return 1.0 - SENSOR_GAIN_ERROR + 2 * SENSOR_GAIN_ERROR * fraction


@dataclass(frozen=True)
class GPUSpec:
    """Name, architecture, memory, clocks and idle power of one GPU model, and how its driver answers.

    `fp32_tflops` orders GPUs the way CUDA's default `CUDA_DEVICE_ORDER=FASTEST_FIRST` does.
    `power_update_ms` is how often the driver updates its power reading and `power_window_ms` the part of
    each update period that reading averages over (the rest of the period is unseen); `energy_refresh_ms`
    is how often the driver refreshes the energy counter. `has_power_average_field` says whether NVML
    offers `NVML_FI_DEV_POWER_AVERAGE` (Ampere and newer except GA100, the A100). `scaled_from` names the
    traced GPU whose power-limit behaviour a modelled board borrows (None: the board itself is traced);
    `origin` says where a board described elsewhere comes from (e.g. "an nvidia-smi dump", `sim/dump_node.py`).
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
    has_power_average_field: bool
    power_update_ms: float
    power_window_ms: float
    sm_clock_step_mhz: int = 15
    scaled_from: str | None = None
    min_power_limit_w: float | None = None  # modelled boards: the settable range the traces are scaled to
    max_power_limit_w: float | None = None
    origin: str | None = None
    vendor: str = "nvidia"  # whose library answers: "nvidia" (NVML) or "amd" (amdsmi, `sim/amd_specs.py`)

    @property
    def power_usage_averaged(self) -> bool:
        """Whether `nvmlDeviceGetPowerUsage` is a 1-second average rather than the instantaneous draw.

        The same boards as `has_power_average_field`: nvml.h documents both with the same words, "On Ampere
        (except GA100) or newer GPUs, the API returns power averaged over 1 sec interval. On GA100 and older
        architectures, instantaneous power is returned" (nvmlDeviceGetPowerUsage) and "supported on Ampere
        (except GA100) or newer architectures" (NVML_FI_DEV_POWER_AVERAGE).
        """
        return self.has_power_average_field

    @property
    def provenance(self) -> str | None:
        """How a modelled board's figures arise, for labels (None for a board whose traces it replays)."""
        if self.scaled_from is None:
            return None
        if self.origin is not None:
            return f"{self.name} from {self.origin}; timing modelled from {self.scaled_from.upper()} traces"
        return f"modelled {self.kind.upper()}, scaled from the {self.scaled_from.upper()} traces"

    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported graphics clocks, highest first, as NVML lists them."""
        return list(range(self.max_sm_clock_mhz, self.min_sm_clock_mhz - 1, -self.sm_clock_step_mhz))


class UpdateTiming(TypedDict):
    """A generation's power update period and window and energy refresh: `GPUSpec`'s fields of that name."""

    power_update_ms: float
    power_window_ms: float
    energy_refresh_ms: float


_GiB = 1024**3
_MiB = 1024**2
# Power update period and window per generation, from PART_TIME_POWER (its measurements of nvidia-smi's
# power reading, i.e. NVML's power query): Volta updates every 20 ms over a 10 ms window; Turing and GA102
# (A40, A10G) every 100 ms over the whole 100 ms; A100 and H100 every 100 ms over a 25 ms window, so 75% of
# the run is never seen by the power reading.
# The energy counter's refresh period is ASSUMED equal to the power update period: the paper times power
# updates, not counter refreshes, and the simulator's counter integrates all the energy drawn (bursts
# between power windows included), refreshing its visible value once per update period. Override it with
# ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS.
_VOLTA = UpdateTiming(power_update_ms=20.0, power_window_ms=10.0, energy_refresh_ms=20.0)
_TURING_GA102 = UpdateTiming(power_update_ms=100.0, power_window_ms=100.0, energy_refresh_ms=100.0)
_GA100_GH100 = UpdateTiming(power_update_ms=100.0, power_window_ms=25.0, energy_refresh_ms=100.0)
UPDATE_TIMING: dict[str, UpdateTiming] = {
    "volta": _VOLTA,
    "turing_ga102": _TURING_GA102,
    "ga100_gh100": _GA100_GH100,
}
"""The power update period and window and the energy refresh of each family PART_TIME_POWER measured."""
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
        has_power_average_field=True,  # GA102
        **_TURING_GA102,
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
        has_power_average_field=False,
        **_VOLTA,
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
        has_power_average_field=True,  # GA102
        **_TURING_GA102,
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
        has_power_average_field=False,
        **_TURING_GA102,  # the energy refresh was an unsourced 50 ms before
    ),
    # Modelled boards: NVML's static answers from NVIDIA's published specifications; their time and power
    # under power limits are the A40's traces (the closest traced GPU: a data-centre Ampere board, with the
    # most traced workloads) stretched over their own settable range (`traces.scaled_trace`). Everything
    # they report is labelled modelled, never traced. Their idle powers are assumptions.
    "a100": GPUSpec(
        "a100",
        # A100 SXM4 80GB, NVIDIA A100 Tensor Core GPU datasheet: 400 W maximum TDP, 80 GB HBM2e, FP32 19.5
        # TFLOPS, boost clock 1410 MHz; HBM2e at 1593 MHz and 210 MHz lowest graphics clock as nvidia-smi
        # lists its supported clocks; power limits 100-400 W as nvidia-smi -q reports (Min/Max Power Limit).
        "NVIDIA A100-SXM4-80GB",
        pynvml.NVML_DEVICE_ARCH_AMPERE,
        80 * _GiB,
        1410,
        210,
        (1593,),
        50.0,
        fp32_tflops=19.5,
        has_power_average_field=False,  # GA100: nvml.h's "except GA100"
        **_GA100_GH100,
        scaled_from="a40",
        min_power_limit_w=100.0,
        max_power_limit_w=400.0,
    ),
    "h100": GPUSpec(
        "h100",
        # H100 SXM5 80GB, NVIDIA H100 Tensor Core GPU datasheet: up to 700 W, 80 GB HBM3, FP32 67 TFLOPS,
        # boost clock 1980 MHz; HBM3 at 2619 MHz and 345 MHz lowest graphics clock as nvidia-smi lists its
        # supported clocks; power limits 200-700 W as nvidia-smi -q reports.
        "NVIDIA H100 80GB HBM3",
        pynvml.NVML_DEVICE_ARCH_HOPPER,
        80 * _GiB,
        1980,
        345,
        (2619,),
        70.0,
        fp32_tflops=67.0,
        has_power_average_field=True,  # Hopper is newer than Ampere
        **_GA100_GH100,
        scaled_from="a40",
        min_power_limit_w=200.0,
        max_power_limit_w=700.0,
    ),
    "h200": GPUSpec(
        "h200",
        # H200 SXM, NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e (GB = 10^9 bytes), up to 700 W, the
        # H100's GH100 compute (FP32 67 TFLOPS); HBM3e at 3201 MHz. PART_TIME_POWER did not measure an H200:
        # its power update period and window are ASSUMED to be the H100's (same GH100 chip).
        "NVIDIA H200",
        pynvml.NVML_DEVICE_ARCH_HOPPER,
        141 * 10**9 // _MiB * _MiB,
        1980,
        345,
        (3201,),
        70.0,
        fp32_tflops=67.0,
        has_power_average_field=True,
        **_GA100_GH100,
        scaled_from="a40",
        min_power_limit_w=200.0,
        max_power_limit_w=700.0,
    ),
    "mi300x": GPUSpec(
        "mi300x",
        # AMD Instinct MI300X (OAM), AMD's MI300X data sheet: 750 W typical board power, 192 GB HBM3 (eight 24 GiB
        # stacks), 2100 MHz peak engine clock, FP32 vector 81.7 TFLOPS. From MI300X_x4.rocm-smi-a.txt: the name
        # (`Card series`), the 750 W cap (`Max Graphics Package Power`), the 500-2100 MHz settable graphics clock
        # (`OD_SCLK`), the 900/1100/1300 MHz memory clock levels and the idle socket power (121-137 W).
        # MODELLED, labelled so: its time and power under a cap are the A40's traces stretched over 250-750 W;
        # the lowest cap (250 W, the A40's 1/3 of its maximum) and the counter's refresh timing (the A40's) are
        # ASSUMED, as AMD publishes neither. amdsmi answers for it (`sim/amdsmi_library.py`), not NVML.
        "AMD Instinct MI300X",
        pynvml.NVML_DEVICE_ARCH_UNKNOWN,
        192 * _GiB,
        2100,
        500,
        (1300, 1100, 900),
        130.0,
        fp32_tflops=81.7,
        has_power_average_field=False,
        **_TURING_GA102,
        sm_clock_step_mhz=100,
        scaled_from="a40",
        min_power_limit_w=250.0,
        max_power_limit_w=750.0,
        vendor="amd",
    ),
}
_ALIASES = {"a10": "a10g"}


def spec_for(kind: str) -> GPUSpec:
    """The spec of a simulated GPU kind (`a40`, `v100`, `a10g`/`a10`, `t4`; modelled: `a100`, `h100`, `h200`,
    and AMD's `mi300x`)."""
    key = _ALIASES.get(kind.lower(), kind.lower())
    if key not in SPECS:
        raise ValueError(
            f"Unknown simulated GPU {kind!r}. Choose one of: {', '.join(sorted(SPECS))} (or a10)."
        )
    return SPECS[key]
