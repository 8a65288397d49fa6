"""The bound of a window's GPU energy: how far the true energy may lie from the figure the GPU's sensor gives.

Three sources add up (docs/energy-uncertainty.md derives each):

- the sensor: its steady-state error against an external meter, a gain of 1 +/- `GAIN_ERROR` per board, and
  nvidia-smi's +/- `ABSOLUTE_ERROR_W`, whichever is larger;
- the energy counter's refresh: a window reads the counter at both ends, each read stale by up to one refresh
  period, so the figure is off by at most the energy of one refresh at the power around the window's ends;
- power read instead of the counter: power sampled in the background (GPUs without a counter) is off by what
  changes between and within the sensor's updates; a window approximated by instantaneous power x time
  (`approx_instant_energy`) knows the power only as one reading.

The bound holds the sensor's figures per board generation (`PowerSensor`) and, per GPU, the little state the
monitor's hot path needs (`EnergyBound`): a few float operations per GPU and window, no GPU call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zeus_callbacks.core.device.power import energy_refresh_period_s

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = [
    "GAIN_ERROR",
    "ABSOLUTE_ERROR_W",
    "PART_TIME_POWER",
    "PowerSensor",
    "power_sensor",
    "EnergyBound",
    "sensor_error_j",
    "run_energy_bound_j",
]

PART_TIME_POWER = (
    'Yang, Adamek, Armour, "Accurate and Convenient Energy Measurements for GPUs: A Detailed Study of NVIDIA '
    "GPU's Built-in Power Sensor\", SC'24 (arXiv:2312.02741, \"Part-time Power Measurements: nvidia-smi's Lack "
    'of Attention")'
)
"""The study of NVML's power sensor on over 70 GPUs of 12 generations that the figures below come from."""

GAIN_ERROR = 0.05
"""The sensor's steady-state error against an external meter, as a gain within 1 +/- this per board:
PART_TIME_POWER, "The error in nvidia-smi's power draw is +/- 5%" (its HTML version 2, as public READMEs quote
and link it); nvml.h says the same of Fermi and Kepler boards (nvmlDeviceGetPowerUsage: "accurate to within
+/- 5% of current power draw"). The study's per-board data (its code's `plotting/figure_plotting.py`, 19 boards)
hold 16 boards within it; docs/energy-uncertainty.md says what the three outside it (-9.5% to +6.4%) would
change."""

ABSOLUTE_ERROR_W = 5.0
"""nvidia-smi's stated accuracy of every power reading (`nvidia-smi --help-query-gpu`, power.draw,
power.draw.average, power.draw.instant: "This reading is accurate to within +/- 5 watts")."""

# The true energy is the reading over the gain; with a gain within 1 +/- GAIN_ERROR it lies within the
# reading times 1/(1 + GAIN_ERROR) .. 1/(1 - GAIN_ERROR), at most this share of the reading away.
_GAIN_SHARE = GAIN_ERROR / (1.0 - GAIN_ERROR)
_GROW = 1.0 + _GAIN_SHARE  # the other errors are read through the same gain


@dataclass(frozen=True, slots=True)
class PowerSensor:
    """How a board generation's power reading is taken (PART_TIME_POWER).

    Attributes:
        update_s: How often the reading updates.
        window_s: The part of each update period the reading averages over; the rest is never seen.
        source: Where the figures come from ("ASSUMED" where no measurement of the generation is known).
    """

    update_s: float
    window_s: float
    source: str

    @property
    def coverage(self) -> float:
        """The share of the run the power reading sees (0.25 on A100 and H100)."""
        return self.window_s / self.update_s

    @property
    def lag_s(self) -> float:
        """The most a reading lags behind the power it reports: up to one update, plus half its window."""
        return self.update_s + self.window_s / 2


# PART_TIME_POWER's measurements of nvidia-smi's power reading (NVML's power query): Volta updates every
# 20 ms over a 10 ms window; Turing and GA102 (A40, A10G) every 100 ms over the whole 100 ms; GA100 (A100) and
# GH100 (H100) every 100 ms over a 25 ms window. The same figures drive the simulator (sim/specs.py).
VOLTA = PowerSensor(0.020, 0.010, f"{PART_TIME_POWER}: Volta")
TURING_GA102 = PowerSensor(0.100, 0.100, f"{PART_TIME_POWER}: Turing, GA102")
GA100_GH100 = PowerSensor(0.100, 0.025, f"{PART_TIME_POWER}: GA100, GH100")
# Boards the study's figures above do not cover: ASSUMED. Before Volta (no energy counter; these are the boards
# whose power is sampled): a 100 ms update seen whole. Ada, Blackwell and newer: GH100's part-time window, the
# worse of the measured data-centre cases.
OLDER = PowerSensor(0.100, 0.100, "ASSUMED (before Volta: a 100 ms update seen whole)")
NEWER = PowerSensor(0.100, 0.025, "ASSUMED (after Hopper: as GH100)")
# AMD Instinct (CDNA): amdsmi.h documents units and which field each generation fills (`current_socket_power`
# on MI300 and newer, `average_socket_power` before; the energy accumulator in 15.259 µJ ticks) but neither
# the update period nor the window of either; AMD publishes none. ASSUMED, and said to be so: GH100's
# part-time figures, the worse measured data-centre case. (arXiv:2604.06056 measures MI250X and MI300A
# update intervals from outside AMD; not the MI300X, not used here.)
AMD_INSTINCT = PowerSensor(0.100, 0.025, "ASSUMED (AMD publishes no update period for Instinct: as GH100)")


_BEFORE_VOLTA = ("kepler", "maxwell", "pascal")


def power_sensor(gpu: GPU) -> PowerSensor:
    """The power sensor of `gpu`'s generation (`gpu.architecture`). Ampere's two sensors are told apart by the
    standard power reading: the 1-second average on GA102 (A40, A10G), the instant one on GA100 (A100, A30), as
    nvml.h says of `NVML_FI_DEV_POWER_AVERAGE` ("Ampere (except GA100) or newer")."""
    arch = gpu.architecture
    if gpu.vendor == "amd":
        return AMD_INSTINCT
    if arch is None or arch in _BEFORE_VOLTA:
        return OLDER
    if arch == "volta":
        return VOLTA
    ga102 = arch == "ampere" and gpu.device.power_usage_domain == "device_average"
    if arch == "turing" or ga102:
        return TURING_GA102
    if arch in ("ampere", "hopper"):
        return GA100_GH100
    return NEWER


def sensor_error_j(energy_j: float, elapsed_s: float) -> float:
    """The sensor's own error on `energy_j` read over `elapsed_s` (J): the gain's share, or nvidia-smi's
    +/- 5 W over the window, whichever is larger."""
    gain = _GAIN_SHARE * abs(energy_j)
    offset = ABSOLUTE_ERROR_W * elapsed_s
    return gain if gain > offset else offset


class EnergyBound:
    """The bound of one GPU's windows (J), and what it remembers between them: the highest average power
    measured on the GPU over a window of at least two counter refreshes (`peak_w`).

    Args:
        sensor: The board generation's power sensor.
        refresh_s: How often the energy counter refreshes (0: always current).
        top_w: The board's highest settable power limit (W; 0 where unknown): the power assumed in a window too
            short for its own figure to tell.
    """

    __slots__ = ("sensor", "refresh_s", "top_w", "peak_w")

    def __init__(self, sensor: PowerSensor, refresh_s: float, top_w: float = 0.0) -> None:
        self.sensor = sensor
        self.refresh_s = refresh_s
        self.top_w = top_w
        self.peak_w = 0.0

    def __repr__(self) -> str:
        return f"EnergyBound(refresh_s={self.refresh_s!r}, peak_w={self.peak_w:.1f}, {self.sensor.source})"

    def edge_power_w(self, energy_j: float, elapsed_s: float) -> float:
        """The power to assume at a window's ends (W): over two refreshes or more, the window's own average or
        the highest seen before, if higher (and the window is recorded as seen); in a shorter window, whose
        figure is mostly the counter's steps, the board's top power too."""
        refresh = self.refresh_s
        if elapsed_s >= 2 * refresh and elapsed_s > 0:
            power = energy_j / elapsed_s
            if power > self.peak_w:
                self.peak_w = power
            return self.peak_w
        span = elapsed_s if elapsed_s > refresh else refresh
        return max(energy_j / span if span > 0 else 0.0, self.peak_w, self.top_w)

    def held_error_w(self, power_w: float) -> float:
        """How far a held reading `power_w` may be from the power meanwhile (W): to nothing, or to the most the
        GPU may draw (its top power, or the highest average seen)."""
        top = self.top_w if self.top_w > self.peak_w else self.peak_w
        return power_w if power_w > top - power_w else top - power_w

    def counter(self, energy_j: float, elapsed_s: float) -> float | None:
        """The bound of a window measured with the energy counter (J); None when it cannot be known: a window
        shorter than one refresh whose counter did not move, on a GPU whose power was never measured and whose
        top power NVML does not give.

        Each end's read may be stale by up to one refresh; both stale slices count with opposite signs, so the
        figure is off by at most one refresh's energy at `edge_power_w`. (The monitor's hot path: the usual case,
        a window of two refreshes or more, is written out here rather than through `edge_power_w`.)"""
        gain = _GAIN_SHARE * (energy_j if energy_j >= 0.0 else -energy_j)
        offset = ABSOLUTE_ERROR_W * elapsed_s
        sensor = gain if gain > offset else offset
        refresh = self.refresh_s
        if not refresh:
            return sensor
        if elapsed_s >= 2 * refresh:
            power = energy_j / elapsed_s
            if power > self.peak_w:
                self.peak_w = power
            else:
                power = self.peak_w
        else:
            power = self.edge_power_w(energy_j, elapsed_s)
            if power <= 0.0 and elapsed_s < refresh:
                return None
        return sensor + _GROW * power * refresh

    def instant(self, power_w: float, elapsed_s: float, counter_j: float) -> float:
        """The bound of a window approximated by one instantaneous reading, `power_w` x `elapsed_s` (J).

        The reading is one update's average, so the window's true power may be anything from nothing to the
        highest power known (`edge_power_w` of the counter's figure `counter_j`): it is at most the larger of
        the reading and the distance from it to that highest power away."""
        top = self.edge_power_w(counter_j, elapsed_s)
        spread = power_w if power_w > top - power_w else top - power_w
        return sensor_error_j(power_w * elapsed_s, elapsed_s) + _GROW * spread * elapsed_s

    def sampled(self, energy_j: float, elapsed_s: float, variation_j: float) -> float:
        """The bound of a window integrated from sampled power (J). `variation_j` is what the readings may miss
        between them (`PowerSampler.energy_j`). Every reading lags the power it reports by up to the sensor's
        `lag_s`, so the readings of a window tell the energy of the window shifted that much earlier: off by at
        most that long at the power around its ends, as the counter's refresh is."""
        edge = self.edge_power_w(energy_j, elapsed_s)
        return sensor_error_j(energy_j, elapsed_s) + _GROW * (variation_j + edge * self.sensor.lag_s)


def run_energy_bound_j(gpu: GPU, energy_j: float, elapsed_s: float) -> float | None:
    """The bound of `energy_j` read off `gpu`'s energy counter over `elapsed_s` (a whole run, read outside a
    monitor window: the run report's)."""
    refresh = energy_refresh_period_s(gpu) or 0.0
    return EnergyBound(power_sensor(gpu), refresh).counter(energy_j, elapsed_s)
