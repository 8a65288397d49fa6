"""CarbonEmissionMonitor and carbon intensity providers, with Zeus's `zeus.monitor.carbon` interface.

Offline first: a fixed intensity (`FixedCarbonIntensity`, or a number), a shipped yearly average by region
(`RegionCarbonIntensity`, `data/carbon_intensity.csv`: Ember / Energy Institute via Our World in Data, Ember
and the U.S. EIA, year 2023), or ElectricityMaps' live hourly figures (`ElectrictyMapsClient`, Zeus's
spelling; `ElectricityMapsClient` too). A window's GPU energy is split at the provider's period boundaries
(hours) by the energy counters, and each part is weighted by that period's intensity.
"""

from __future__ import annotations

import abc
import csv
import json
import logging
import math
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any, Literal

from zeus_callbacks.core.device.errors import InvalidInputError, ZeusCallbacksError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.periods import Part, PeriodSplitter, weigh

__all__ = [
    "CarbonEmissionMonitor",
    "CarbonEmissionMeasurement",
    "CarbonIntensityProvider",
    "FixedCarbonIntensity",
    "RegionCarbonIntensity",
    "ElectrictyMapsClient",
    "ElectricityMapsClient",
    "ZeusCarbonIntensityHTTPError",
    "ZeusCarbonIntensityNotFoundError",
    "carbon_intensity_regions",
]

logger = logging.getLogger(__name__)

J_PER_KWH = 3.6e6
DATA = Path(__file__).with_name("data")
ELECTRICITYMAPS_URL_ENV = "ZEUS_CALLBACKS_ELECTRICITYMAPS_URL"
ELECTRICITYMAPS_KEY_ENV = "ELECTRICITYMAPS_API_KEY"
_ELECTRICITYMAPS_URL = "https://api.electricitymap.org/v3"


class ZeusCarbonIntensityHTTPError(ZeusCallbacksError):
    """The carbon intensity provider could not be reached, or answered with an HTTP error."""


class ZeusCarbonIntensityNotFoundError(ZeusCallbacksError):
    """The provider answered, but without a carbon intensity for the place or time asked."""


def get_json(url: str, headers: dict[str, str], timeout_s: float, error: type[Exception], what: str) -> Any:
    """GET `url` and parse its JSON body; any failure is `error` with the URL (query removed) and the reason."""
    shown = url.split("?")[0]
    request = urllib.request.Request(url, headers={"Accept": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - http(s) only
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:300]
        raise error(f"{what}: {shown} answered HTTP {e.code} ({body.strip() or e.reason}).") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise error(f"{what}: could not read {shown} ({e}).") from None


class CarbonIntensityProvider(abc.ABC):
    """Where carbon intensity (gCO2eq/kWh) comes from (Zeus's interface: subclass it for your own)."""

    @abc.abstractmethod
    def get_current_carbon_intensity(self) -> float:
        """The intensity now (gCO2eq/kWh)."""

    @abc.abstractmethod
    def get_recent_carbon_intensity(self) -> dict[datetime, float]:
        """Recent intensities by the start of their period (timezone-aware datetimes)."""

    @property
    @abc.abstractmethod
    def update_period(self) -> timedelta:
        """How long one intensity value holds."""

    @property
    @abc.abstractmethod
    def history_length(self) -> int:
        """How many periods `get_recent_carbon_intensity` covers."""


class _Hourly:
    """A provider whose intensity holds for an hour, with a day of history (ElectricityMaps' granularity)."""

    @property
    def update_period(self) -> timedelta:
        return timedelta(hours=1)

    @property
    def history_length(self) -> int:
        return 24


def _intensity(owner: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidInputError(
            f"`{owner}({value!r})`: expected a carbon intensity in gCO2eq/kWh, a number >= 0 (e.g. 380)."
        )
    return float(value)


class FixedCarbonIntensity(_Hourly, CarbonIntensityProvider):
    """One intensity for every hour, given by you (gCO2eq/kWh): your utility's or your cloud region's figure.

    Example::

        monitor = CarbonEmissionMonitor(FixedCarbonIntensity(380.0), gpu_indices=[0])
    """

    constant = True  # the same at every time: no per-period lookup needed

    def __init__(self, g_per_kwh: float) -> None:
        self.g_per_kwh = _intensity(type(self).__name__, g_per_kwh)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.g_per_kwh:g})"

    def get_current_carbon_intensity(self) -> float:
        return self.g_per_kwh

    def get_recent_carbon_intensity(self) -> dict[datetime, float]:
        return {}


@dataclass(frozen=True, slots=True)
class RegionIntensity:
    """One row of the shipped table."""

    region: str
    name: str
    g_per_kwh: float
    year: int
    source: str


@cache
def carbon_intensity_regions() -> dict[str, RegionIntensity]:
    """The shipped yearly averages by region code (ISO 3166-1 alpha-2, and `WORLD`); see the data file's header
    for each source."""
    with (DATA / "carbon_intensity.csv").open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {
            r["region"]: RegionIntensity(
                r["region"], r["name"], float(r["g_per_kwh"]), int(r["year"]), r["source"]
            )
            for r in rows
        }


class RegionCarbonIntensity(FixedCarbonIntensity):
    """A region's yearly average carbon intensity of electricity generation, from the shipped table (offline).

    The table (`zeus_callbacks/core/monitor/data/carbon_intensity.csv`) holds 2023 averages: Ember and Energy
    Institute via Our World in Data (lifecycle gCO2eq/kWh), Ember's 2023 world and Norway figures, and the U.S.
    EIA's 2023 U.S. average (direct CO2). `region` is an ISO 3166-1 alpha-2 code (`"DE"`, `"US"`) or
    `"WORLD"`; `year`, `source` and `name` say where the number comes from.

    Raises:
        InvalidInputError: the region is not in the table (the message lists those that are).
    """

    def __init__(self, region: str) -> None:
        table = carbon_intensity_regions()
        key = str(region).upper()
        if key not in table:
            raise InvalidInputError(
                f"`RegionCarbonIntensity({region!r})`: no shipped figure for that region. Known: "
                f"{', '.join(sorted(table))}. Pass your own with FixedCarbonIntensity(g_per_kwh)."
            )
        row = table[key]
        super().__init__(row.g_per_kwh)
        self.region, self.name, self.year, self.source = row.region, row.name, row.year, row.source

    def __repr__(self) -> str:
        return f"RegionCarbonIntensity({self.region!r}: {self.g_per_kwh:g} g/kWh, {self.year}, {self.source})"


class ElectrictyMapsClient(_Hourly, CarbonIntensityProvider):
    """ElectricityMaps' live carbon intensity (Zeus's class, spelling included).

    Calls `GET /v3/carbon-intensity/latest` and `/history` of the ElectricityMaps API
    (https://static.electricitymaps.com/api/docs/index.html), by latitude and longitude or by `zone`, with
    the API key in the `auth-token` header (Zeus sends none; the API asks for one).

    Args:
        location: (latitude, longitude).
        estimate: Accept estimated intensities (`disableEstimations=false`).
        emission_factor_type: `"direct"` or `"lifecycle"`.
        api_key: The API key; default `$ELECTRICITYMAPS_API_KEY`.
        zone: A zone code (e.g. `"DE"`) instead of `location`.
        base_url: The API root; default `$ZEUS_CALLBACKS_ELECTRICITYMAPS_URL` or ElectricityMaps' own.
        timeout_s: Seconds to wait for an answer.
    """

    def __init__(
        self,
        location: tuple[float, float] | None = None,
        estimate: bool = False,
        emission_factor_type: Literal["direct", "lifecycle"] = "direct",
        *,
        api_key: str | None = None,
        zone: str | None = None,
        base_url: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if (location is None) == (zone is None):
            raise InvalidInputError(
                "`ElectrictyMapsClient(...)`: give either location=(latitude, longitude) or zone='DE'."
            )
        if location is not None:
            try:
                self.lat, self.long = (float(x) for x in location)
            except (TypeError, ValueError):
                raise InvalidInputError(
                    f"`ElectrictyMapsClient(location={location!r})`: expected (latitude, longitude)."
                ) from None
            if not (-90 <= self.lat <= 90 and -180 <= self.long <= 180):
                raise InvalidInputError(
                    f"`ElectrictyMapsClient(location={location!r})`: expected (latitude, longitude) in degrees, "
                    "latitude in [-90, 90] and longitude in [-180, 180]."
                )
        if emission_factor_type not in ("direct", "lifecycle"):
            raise InvalidInputError(
                f"`ElectrictyMapsClient(emission_factor_type={emission_factor_type!r})`: 'direct' or 'lifecycle'."
            )
        self.zone, self.estimate, self.emission_factor_type = zone, bool(estimate), emission_factor_type
        self.api_key = api_key if api_key is not None else os.environ.get(ELECTRICITYMAPS_KEY_ENV)
        self.base_url = (base_url or os.environ.get(ELECTRICITYMAPS_URL_ENV) or _ELECTRICITYMAPS_URL).rstrip(
            "/"
        )
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 3600:
            raise InvalidInputError(
                f"`ElectrictyMapsClient(timeout_s={timeout_s!r})`: expected seconds in (0, 3600)."
            )
        self.timeout_s = float(timeout_s)

    def _url(self, path: str) -> str:
        where = {"zone": self.zone} if self.zone is not None else {"lat": self.lat, "lon": self.long}
        query = {
            **where,
            "disableEstimations": str(not self.estimate).lower(),
            "emissionFactorType": self.emission_factor_type,
        }
        return f"{self.base_url}/carbon-intensity/{path}?{urllib.parse.urlencode(query)}"

    def _get(self, path: str, what: str) -> Any:
        headers = {"auth-token": self.api_key} if self.api_key else {}
        return get_json(self._url(path), headers, self.timeout_s, ZeusCarbonIntensityHTTPError, what)

    def _where(self) -> str:
        return f"zone {self.zone}" if self.zone is not None else f"({self.lat}, {self.long})"

    def get_current_carbon_intensity(self) -> float:
        data = self._get("latest", "Reading the current carbon intensity")
        value = data.get("carbonIntensity") if isinstance(data, dict) else None
        if not isinstance(value, (int, float)):
            raise ZeusCarbonIntensityNotFoundError(
                f"ElectricityMaps has no current carbon intensity for {self._where()} (estimate={self.estimate}, "
                f"emission_factor_type={self.emission_factor_type!r}); it answered {json.dumps(data)[:300]}. Try "
                "estimate=True."
            )
        return float(value)

    def get_recent_carbon_intensity(self) -> dict[datetime, float]:
        data = self._get("history", "Reading the recent carbon intensity")
        history = data.get("history") if isinstance(data, dict) else None
        if not isinstance(history, list):
            raise ZeusCarbonIntensityNotFoundError(
                f"ElectricityMaps has no recent carbon intensity for {self._where()}; it answered "
                f"{json.dumps(data)[:300]}."
            )
        out = {}
        for entry in history:
            value = entry.get("carbonIntensity") if isinstance(entry, dict) else None
            if isinstance(value, (int, float)) and isinstance(entry.get("datetime"), str):
                out[datetime.fromisoformat(entry["datetime"].replace("Z", "+00:00"))] = float(value)
        return out


ElectricityMapsClient = ElectrictyMapsClient


@dataclass
class CarbonEmissionMeasurement:
    """Time, energy (J) and carbon emission (gCO2eq) of one window (Zeus's fields), by GPU / CPU index.

    `simulated`: the energies (and so the emissions) are a simulation, not a measurement.
    """

    time: float
    gpu_energy: dict[int, float]
    gpu_carbon_emission: dict[int, float]
    cpu_energy: dict[int, float] | None = None
    cpu_carbon_emission: dict[int, float] | None = None
    dram_energy: dict[int, float] | None = None
    dram_carbon_emission: dict[int, float] | None = None
    simulated: bool = False

    @property
    def total_carbon_emission(self) -> float:
        """Every emission summed (gCO2eq)."""
        parts = (self.gpu_carbon_emission, self.cpu_carbon_emission, self.dram_carbon_emission)
        return sum(sum(p.values()) for p in parts if p)


def _provider(value: object) -> CarbonIntensityProvider:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return FixedCarbonIntensity(value)
    needed = ("get_current_carbon_intensity", "get_recent_carbon_intensity", "update_period")
    if not all(hasattr(value, n) for n in needed):
        raise InvalidInputError(
            f"`CarbonEmissionMonitor(carbon_intensity_provider={value!r})`: expected a CarbonIntensityProvider "
            "(FixedCarbonIntensity(g_per_kwh), RegionCarbonIntensity('DE'), ElectrictyMapsClient(...)) or a "
            "number of gCO2eq/kWh."
        )
    return value  # type: ignore[return-value]


class CarbonEmissionMonitor:
    """Measure the time, energy and carbon emission of named windows (Zeus's `CarbonEmissionMonitor`).

    A `ZeusMonitor` measures each window; the window's GPU energy is split at the provider's period
    boundaries (hours) by the energy counters (CPU and DRAM energy by time), and each part is multiplied by
    that period's intensity. No process is spawned: one thread records the boundaries.

    Args:
        carbon_intensity_provider: A `CarbonIntensityProvider`, or a fixed intensity in gCO2eq/kWh.
        gpu_indices: GPUs to measure (framework numbering); None: every visible GPU.
        cpu_indices: CPU packages (RAPL) to measure; None: every readable one.
        sync_execution_with: "torch", as `ZeusMonitor`.

    Example::

        monitor = CarbonEmissionMonitor(RegionCarbonIntensity("DE"), gpu_indices=[0])
        monitor.begin_window("train")
        train()
        grams = monitor.end_window("train").gpu_carbon_emission[0]
    """

    def __init__(
        self,
        carbon_intensity_provider: CarbonIntensityProvider | float,
        gpu_indices: list[int] | None = None,
        cpu_indices: list[int] | None = None,
        sync_execution_with: Literal["torch", "jax", "cupy"] = "torch",
    ) -> None:
        self.carbon_intensity_provider = _provider(carbon_intensity_provider)
        self.zeus_monitor = ZeusMonitor(
            gpu_indices=gpu_indices, cpu_indices=cpu_indices, sync_execution_with=sync_execution_with
        )
        self._splitter = PeriodSplitter(
            self.zeus_monitor, self.carbon_intensity_provider.update_period, self._remember
        )
        self._known: dict[datetime, float] = {}  # period start -> intensity, as resolved
        self.current_keys: set[str] = set()

    def _remember(self, start: datetime) -> None:
        """A period just ended: take its intensity now, while it is still in the provider's history."""
        provider = self.carbon_intensity_provider
        if getattr(provider, "constant", False):
            return
        try:
            self._known.update(provider.get_recent_carbon_intensity())
        except ZeusCallbacksError as e:  # retried when the window ends
            logger.warning("Could not read the recent carbon intensity: %s", e)

    def _rates(self, parts: list[Part]) -> list[float]:
        provider = self.carbon_intensity_provider
        if getattr(provider, "constant", False):
            return [provider.get_current_carbon_intensity()] * len(parts)
        if any(p.start not in self._known for p in parts):
            self._known.update(provider.get_recent_carbon_intensity())
        current: float | None = None
        rates = []
        for p in parts:
            rate = self._known.get(p.start)
            if rate is None:  # the running hour is not in the history yet: its latest figure stands for it
                current = provider.get_current_carbon_intensity() if current is None else current
                rate = current
            rates.append(rate)
        return rates

    def begin_window(self, key: str, sync_execution: bool = True) -> None:
        """Begin the window `key` (Zeus's signature).

        Raises:
            ValueError: a window named `key` is already open.
        """
        if key in self.current_keys:
            raise ValueError(f"Measurement window {key!r} already exists; end it first.")
        self.zeus_monitor.begin_window(key, sync_execution=sync_execution)
        self._splitter.begin(key)
        self.current_keys.add(key)

    def end_window(self, key: str, sync_execution: bool = True) -> CarbonEmissionMeasurement:
        """End the window `key`: its time, energy and carbon emission.

        Raises:
            ValueError: no window named `key` is open.
            ZeusCarbonIntensityHTTPError, ZeusCarbonIntensityNotFoundError: the provider did not answer.
        """
        if key not in self.current_keys:
            raise ValueError(f"Measurement window {key!r} does not exist: it was not begun.")
        self.current_keys.remove(key)
        parts = self._splitter.end(key)
        m = self.zeus_monitor.end_window(key, sync_execution=sync_execution)
        rates = [r / J_PER_KWH for r in self._rates(parts)]
        gpu, cpu, dram = weigh(m, parts, rates)
        return CarbonEmissionMeasurement(
            time=m.time,
            gpu_energy=m.gpu_energy,
            gpu_carbon_emission=gpu,
            cpu_energy=m.cpu_energy,
            cpu_carbon_emission=cpu,
            dram_energy=m.dram_energy,
            dram_carbon_emission=dram,
            simulated=m.simulated,
        )
