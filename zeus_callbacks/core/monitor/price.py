"""EnergyCostMonitor and electricity price providers, with Zeus's `zeus.monitor.price` interface.

A provider answers Zeus's `get_current_electricity_prices()`: a utility tariff as OpenEI's Utility Rate
Database writes it (`energy_rate_structure`: tiers of `{"rate": price per kWh}`; `energy_weekday_schedule` /
`energy_weekend_schedule`: 12 months x 24 hours of tier indices). Offline first: `FixedElectricityPrice(p)`
(or a number) is one rate at every hour; `OpenEIClient` reads a tariff from OpenEI's API. A window's energy
is split at the hours by the energy counters (`periods.PeriodSplitter`), and each hour is priced by the
tier the schedule gives it (local time of the process, as Zeus does).
"""

from __future__ import annotations

import abc
import csv
import logging
import math
import os
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any, Literal

from zeus_callbacks.core.device.errors import InvalidInputError, ZeusCallbacksError
from zeus_callbacks.core.monitor.carbon import DATA, J_PER_KWH, get_json
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.periods import PeriodSplitter, weigh

__all__ = [
    "EnergyCostMonitor",
    "EnergyCostMeasurement",
    "ElectricityPriceProvider",
    "FixedElectricityPrice",
    "OpenEIClient",
    "RegionElectricityPrice",
    "ZeusElectricityPriceHTTPError",
    "ZeusElectricityPriceNotFoundError",
]

logger = logging.getLogger(__name__)

OPENEI_URL_ENV = "ZEUS_CALLBACKS_OPENEI_URL"
OPENEI_KEY_ENV = "OPENEI_API_KEY"
_OPENEI_URL = "https://api.openei.org/utility_rates"
_SECTORS = ("Residential", "Commercial", "Industrial", "Lighting")


class ZeusElectricityPriceHTTPError(ZeusCallbacksError):
    """The price provider could not be reached, or answered with an HTTP error."""


class ZeusElectricityPriceNotFoundError(ZeusCallbacksError):
    """The provider answered, but without a usable tariff for the place or label asked."""


class ElectricityPriceProvider(abc.ABC):
    """Where electricity prices come from (Zeus's interface: subclass it for your own)."""

    @abc.abstractmethod
    def get_current_electricity_prices(self) -> dict[str, list]:
        """The tariff: `energy_rate_structure`, `energy_weekday_schedule`, `energy_weekend_schedule`."""


class FixedElectricityPrice(ElectricityPriceProvider):
    """One price per kWh at every hour, given by you (in your currency): your contract's or cloud's figure.

    Example::

        monitor = EnergyCostMonitor(FixedElectricityPrice(0.15), gpu_indices=[0])
    """

    def __init__(self, price_per_kwh: float) -> None:
        value = price_per_kwh
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise InvalidInputError(
                f"`FixedElectricityPrice({value!r})`: expected a price per kWh, a number >= 0 (e.g. 0.15)."
            )
        self.price_per_kwh = float(value)

    def __repr__(self) -> str:
        return f"FixedElectricityPrice({self.price_per_kwh:g})"

    def get_current_electricity_prices(self) -> dict[str, list]:
        flat = [[0] * 24 for _ in range(12)]
        return {
            "energy_rate_structure": [[{"rate": self.price_per_kwh, "unit": "kWh"}]],
            "energy_weekday_schedule": flat,
            "energy_weekend_schedule": flat,
        }


@cache
def _state_prices() -> dict[str, dict[str, str]]:
    with (DATA / "electricity_price_us_states.csv").open() as f:
        return {row["region"]: row for row in csv.DictReader(line for line in f if not line.startswith("#"))}


class RegionElectricityPrice(FixedElectricityPrice):
    """A U.S. state's 2023 average retail price (USD per kWh), from the shipped table (offline).

    The table (`zeus_callbacks/core/monitor/data/electricity_price_us_states.csv`) is the U.S. EIA's Electric
    Power Annual 2023, average revenue per kWh by state and sector. `region`: `"US-CA"` (or `"CA"`);
    `sector`: "residential", "commercial", "industrial" or "total".

    Raises:
        InvalidInputError: the state or the sector is not in the table (the message lists those that are).
    """

    def __init__(self, region: str, sector: str = "commercial") -> None:
        table = _state_prices()
        key = str(region).upper()
        key = key if key.startswith("US-") else f"US-{key}"
        sectors = ("residential", "commercial", "industrial", "total")
        if key not in table:
            raise InvalidInputError(
                f"`RegionElectricityPrice({region!r})`: no shipped price for that state. Known: "
                f"{', '.join(sorted(table))}. Pass your own with FixedElectricityPrice(price_per_kwh)."
            )
        if sector not in sectors:
            raise InvalidInputError(
                f"`RegionElectricityPrice(sector={sector!r})`: one of {', '.join(sectors)}."
            )
        row = table[key]
        super().__init__(float(row[sector]) / 100)
        self.region, self.name, self.sector, self.year = key, row["name"], sector, int(row["year"])
        self.source = "U.S. EIA Electric Power Annual"

    def __repr__(self) -> str:
        return f"RegionElectricityPrice({self.region!r}, {self.sector}: {self.price_per_kwh:g} USD/kWh, {self.year})"


def _find(data: Any, label: str) -> dict | None:
    """The rate entry whose `label` is `label`, anywhere in OpenEI's answer."""
    children: Iterable[Any]
    if isinstance(data, dict):
        if data.get("label") == label:
            return data
        children = data.values()
    elif isinstance(data, list):
        children = data
    else:
        return None
    for child in children:
        found = _find(child, label)
        if found is not None:
            return found
    return None


class OpenEIClient(ElectricityPriceProvider):
    """A tariff from OpenEI's Utility Rate Database (Zeus's signature; `api_key` or `$OPENEI_API_KEY`).

    Args:
        location: (latitude, longitude).
        label: The rate's unique label in the database (the tariff's page on openei.org shows it).
        sector: "Residential", "Commercial", "Industrial" or "Lighting".
        radius: Search radius (miles) around `location`.
        api_key: Your OpenEI key (https://openei.org/services/api/signup).
        base_url: The API's address; default `$ZEUS_CALLBACKS_OPENEI_URL` or OpenEI's own.
        timeout_s: Seconds to wait for an answer.
    """

    def __init__(
        self,
        location: tuple[float, float],
        label: str,
        sector: Literal["Residential", "Commercial", "Industrial", "Lighting"] = "Residential",
        radius: int = 0,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        try:
            self.lat, self.long = (float(x) for x in location)
        except (TypeError, ValueError):
            raise InvalidInputError(
                f"`OpenEIClient(location={location!r})`: expected (latitude, longitude)."
            ) from None
        if not (-90 <= self.lat <= 90 and -180 <= self.long <= 180):
            raise InvalidInputError(
                f"`OpenEIClient(location={location!r})`: latitude in [-90, 90], longitude in [-180, 180]."
            )
        if not isinstance(label, str) or not label.strip():
            raise InvalidInputError(
                f"`OpenEIClient(label={label!r})`: give the rate's label from OpenEI's Utility Rate Database."
            )
        if sector not in _SECTORS:
            raise InvalidInputError(
                f"`OpenEIClient(sector={sector!r})`: one of {', '.join(map(repr, _SECTORS))}."
            )
        if isinstance(radius, bool) or not isinstance(radius, int) or not 0 <= radius <= 200:
            raise InvalidInputError(f"`OpenEIClient(radius={radius!r})`: miles, an integer in [0, 200].")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 3600:
            raise InvalidInputError(
                f"`OpenEIClient(timeout_s={timeout_s!r})`: expected seconds in (0, 3600)."
            )
        self.label, self.sector, self.radius, self.timeout_s = label, sector, radius, float(timeout_s)
        self.api_key = api_key if api_key is not None else os.environ.get(OPENEI_KEY_ENV)
        self.base_url = (base_url or os.environ.get(OPENEI_URL_ENV) or _OPENEI_URL).rstrip("/")

    def get_current_electricity_prices(self) -> dict[str, list]:
        if not self.api_key:
            raise ZeusElectricityPriceHTTPError(
                f"OpenEIClient needs an API key: pass api_key= or set {OPENEI_KEY_ENV} "
                "(https://openei.org/services/api/signup), or use FixedElectricityPrice(price_per_kwh)."
            )
        query = urllib.parse.urlencode(
            {
                "version": "latest",
                "format": "json",
                "api_key": self.api_key,
                "lat": self.lat,
                "lon": self.long,
                "radius": self.radius,
                "detail": "full",
                "sector": self.sector,
            }
        )
        data = get_json(
            f"{self.base_url}?{query}",
            {},
            self.timeout_s,
            ZeusElectricityPriceHTTPError,
            "Reading the tariff",
        )
        entry = _find(data, self.label)
        keys = ("energyratestructure", "energyweekdayschedule", "energyweekendschedule")
        if entry is None or any(not isinstance(entry.get(k), list) for k in keys):
            raise ZeusElectricityPriceNotFoundError(
                f"OpenEI has no energy tariff labelled {self.label!r} within {self.radius} miles of "
                f"({self.lat}, {self.long}) in sector {self.sector!r}: check the label, or widen radius."
            )
        return dict(
            zip(
                ("energy_rate_structure", "energy_weekday_schedule", "energy_weekend_schedule"),
                (entry[k] for k in keys),
                strict=True,
            )
        )


def rate_at(tariff: dict[str, list], when: datetime) -> float:
    """The price per kWh `tariff` charges in the hour that holds `when` (its tier's first rate, as Zeus).

    Raises:
        ZeusElectricityPriceNotFoundError: the tariff does not have that month, hour or tier.
    """
    try:
        schedule = tariff["energy_weekday_schedule" if when.weekday() < 5 else "energy_weekend_schedule"]
        tier = schedule[when.month - 1][when.hour]
        rate = tariff["energy_rate_structure"][tier][0]["rate"]
    except (KeyError, IndexError, TypeError) as e:
        raise ZeusElectricityPriceNotFoundError(
            f"The tariff has no rate for {when:%A %B, hour %H} ({type(e).__name__}: {e}): it needs 12x24 "
            "schedules whose tiers are in energy_rate_structure."
        ) from None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < math.inf:
        raise ZeusElectricityPriceNotFoundError(
            f"The tariff's rate for {when:%B, hour %H} is {rate!r}, not a price."
        )
    return float(rate)


@dataclass
class EnergyCostMeasurement:
    """Time, energy (J) and electricity cost (per kWh's currency) of one window, by GPU / CPU index.

    `simulated`: the energies (and so the costs) are a simulation, not a measurement.
    """

    time: float
    gpu_energy: dict[int, float]
    gpu_energy_cost: dict[int, float]
    cpu_energy: dict[int, float] | None = None
    cpu_energy_cost: dict[int, float] | None = None
    dram_energy: dict[int, float] | None = None
    dram_energy_cost: dict[int, float] | None = None
    simulated: bool = False

    @property
    def total_energy_cost(self) -> float:
        """Every cost summed."""
        parts = (self.gpu_energy_cost, self.cpu_energy_cost, self.dram_energy_cost)
        return sum(sum(p.values()) for p in parts if p)


class EnergyCostMonitor:
    """Time, energy and electricity cost of named, overlapping windows (Zeus's `EnergyCostMonitor`).

    Zeus polls in a spawned process; here one thread splits the windows at the hours, and the tariff is read
    once, at the first window (a failure is raised there, not logged and lost).

    Args:
        electricity_price_provider: An `ElectricityPriceProvider`, or a price per kWh.
        gpu_indices: As `ZeusMonitor`'s.
        cpu_indices: As `ZeusMonitor`'s.
        sync_execution_with: As `ZeusMonitor`'s.

    Example::

        monitor = EnergyCostMonitor(FixedElectricityPrice(0.15), gpu_indices=[0])
        monitor.begin_window("train")
        train()
        cost = monitor.end_window("train").gpu_energy_cost[0]
    """

    def __init__(
        self,
        electricity_price_provider: ElectricityPriceProvider | float,
        gpu_indices: list[int] | None = None,
        cpu_indices: list[int] | None = None,
        sync_execution_with: Literal["torch", "jax", "cupy"] = "torch",
    ) -> None:
        provider = electricity_price_provider
        if isinstance(provider, (int, float)) and not isinstance(provider, bool):
            provider = FixedElectricityPrice(provider)
        if isinstance(provider, bool) or not callable(
            getattr(provider, "get_current_electricity_prices", None)
        ):
            raise InvalidInputError(
                f"`EnergyCostMonitor(electricity_price_provider={provider!r})`: expected an "
                "ElectricityPriceProvider (FixedElectricityPrice(0.15), OpenEIClient(...)) or a price per kWh."
            )
        self.electricity_price_provider = provider
        self.zeus_monitor = ZeusMonitor(
            gpu_indices=gpu_indices, cpu_indices=cpu_indices, sync_execution_with=sync_execution_with
        )
        self._splitter = PeriodSplitter(self.zeus_monitor, timedelta(hours=1))
        self._tariff: dict[str, list] | None = None
        self.current_keys: set[str] = set()

    def begin_window(self, key: str, sync_execution: bool = True) -> None:
        """Begin the window `key` (Zeus's signature).

        Raises:
            ValueError: a window named `key` is already open.
            ZeusElectricityPriceHTTPError, ZeusElectricityPriceNotFoundError: the tariff could not be read.
        """
        if key in self.current_keys:
            raise ValueError(f"Measurement window {key!r} already exists; end it first.")
        if self._tariff is None:
            self._tariff = self.electricity_price_provider.get_current_electricity_prices()
        self.zeus_monitor.begin_window(key, sync_execution=sync_execution)
        self._splitter.begin(key)
        self.current_keys.add(key)

    def end_window(self, key: str, sync_execution: bool = True) -> EnergyCostMeasurement:
        """End the window `key`: its time, energy and cost.

        Raises:
            ValueError: no window named `key` is open.
        """
        if key not in self.current_keys:
            raise ValueError(f"Measurement window {key!r} does not exist: it was not begun.")
        self.current_keys.remove(key)
        parts = self._splitter.end(key)
        m = self.zeus_monitor.end_window(key, sync_execution=sync_execution)
        assert self._tariff is not None  # read by begin_window
        rates = [rate_at(self._tariff, p.start.astimezone()) / J_PER_KWH for p in parts]
        gpu, cpu, dram = weigh(m, parts, rates)
        return EnergyCostMeasurement(
            time=m.time,
            gpu_energy=m.gpu_energy,
            gpu_energy_cost=gpu,
            cpu_energy=m.cpu_energy,
            cpu_energy_cost=cpu,
            dram_energy=m.dram_energy,
            dram_energy_cost=dram,
            simulated=m.simulated,
        )
