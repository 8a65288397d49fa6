"""CarbonEmissionMonitor and EnergyCostMonitor (Zeus's `zeus.monitor.carbon` / `.price` interfaces) on
simulated GPUs: emission and cost are the window's energy times the rate in force, offline providers need
no network, and the online clients are checked against local HTTP doubles that answer with the documented
shapes of ElectricityMaps' v3 `carbon-intensity/{latest,history}` and OpenEI's `utility_rates` (the shapes
Zeus's own clients read: zeus/monitor/carbon.py, zeus/monitor/price.py in Zeus 0.16), never the network."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from zeus_callbacks import (
    CarbonEmissionMonitor,
    ElectricityMapsClient,
    EnergyCostMonitor,
    FixedElectricityPrice,
    OpenEIClient,
    RegionCarbonIntensity,
    RegionElectricityPrice,
)
from zeus_callbacks.core.monitor import price as price_module
from zeus_callbacks.core.monitor.carbon import ZeusCarbonIntensityHTTPError
from zeus_callbacks.core.monitor.price import ZeusElectricityPriceHTTPError, ZeusElectricityPriceNotFoundError

J_PER_KWH = 3.6e6


class _Double:
    """A loopback HTTP server answering GETs from a table of path -> (status, JSON); it records requests."""

    def __init__(self, answers: dict[str, tuple[int, object]]) -> None:
        self.answers, self.requests = answers, []
        double = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urllib.parse.urlparse(self.path)
                double.requests.append(
                    (
                        url.path,
                        dict(urllib.parse.parse_qsl(url.query)),
                        {k.lower(): v for k, v in self.headers.items()},
                    )
                )
                status, body = double.answers.get(url.path, (404, {"error": "no such path"}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def double() -> Iterator[callable]:
    made: list[_Double] = []

    def make(answers: dict[str, tuple[int, object]]) -> _Double:
        made.append(_Double(answers))
        return made[-1]

    yield make
    for d in made:
        d.close()


def _run_window(monitor, system, seconds: float = 30.0):
    monitor.begin_window("train")
    system.clock.advance(seconds)
    return monitor.end_window("train")


def test_fixed_price_costs_the_window_energy_at_that_price(sim_gpus):
    system = sim_gpus("2*a40", virtual_clock=True)
    m = _run_window(EnergyCostMonitor(FixedElectricityPrice(0.15)), system)
    assert m.simulated and set(m.gpu_energy) == {0, 1} and all(e > 0 for e in m.gpu_energy.values())
    for i, energy in m.gpu_energy.items():
        assert m.gpu_energy_cost[i] == pytest.approx(energy / J_PER_KWH * 0.15, rel=1e-9)
    assert m.total_energy_cost == pytest.approx(sum(m.gpu_energy_cost.values()))


def test_a_number_is_a_fixed_price_and_a_fixed_intensity(sim_gpus):
    system = sim_gpus("a40", virtual_clock=True)
    cost = _run_window(EnergyCostMonitor(0.2, gpu_indices=[0]), system)
    carbon = _run_window(CarbonEmissionMonitor(400.0, gpu_indices=[0]), system)
    assert cost.gpu_energy_cost[0] == pytest.approx(cost.gpu_energy[0] / J_PER_KWH * 0.2, rel=1e-9)
    assert carbon.gpu_carbon_emission[0] == pytest.approx(carbon.gpu_energy[0] / J_PER_KWH * 400.0, rel=1e-9)


def test_a_region_uses_its_shipped_yearly_intensity(sim_gpus):
    system = sim_gpus("a40", virtual_clock=True)
    region = RegionCarbonIntensity("DE")
    m = _run_window(CarbonEmissionMonitor(region), system)
    assert m.gpu_carbon_emission[0] == pytest.approx(
        m.gpu_energy[0] / J_PER_KWH * region.get_current_carbon_intensity(), rel=1e-9
    )


def test_a_state_uses_its_shipped_yearly_price():
    price = RegionElectricityPrice("ca", sector="industrial")
    assert price.region == "US-CA" and price.year == 2023 and 0 < price.price_per_kwh < 1
    assert RegionElectricityPrice("US-CA", "residential").price_per_kwh > price.price_per_kwh
    with pytest.raises(ValueError, match="Known: .*US-AL"):
        RegionElectricityPrice("Atlantis")


def test_windows_keep_zeus_window_errors(sim_gpus):
    sim_gpus("a40", virtual_clock=True)
    monitor = EnergyCostMonitor(0.1)
    monitor.begin_window("a")
    with pytest.raises(ValueError, match="already exists"):
        monitor.begin_window("a")
    with pytest.raises(ValueError, match="does not exist"):
        monitor.end_window("b")


def test_a_tariff_prices_each_hour_by_its_tier():
    weekday = [[0] * 24 for _ in range(12)]
    weekday[6][14] = 1  # July, 14:00-15:00 on weekdays: peak
    weekend = [[2] * 24 for _ in range(12)]
    tariff = {
        "energy_rate_structure": [[{"rate": 0.10}], [{"rate": 0.30}], [{"rate": 0.05}]],
        "energy_weekday_schedule": weekday,
        "energy_weekend_schedule": weekend,
    }
    assert price_module.rate_at(tariff, datetime(2026, 7, 1, 14, 30)) == 0.30  # a Wednesday
    assert price_module.rate_at(tariff, datetime(2026, 7, 1, 15, 0)) == 0.10
    assert price_module.rate_at(tariff, datetime(2026, 7, 4, 14, 30)) == 0.05  # a Saturday
    with pytest.raises(ZeusElectricityPriceNotFoundError, match="12x24"):
        price_module.rate_at({**tariff, "energy_weekday_schedule": [[0] * 24]}, datetime(2026, 7, 1, 14))


def _openei_answer(label: str, rate: float) -> dict:
    # The shape of OpenEI's utility_rates (version latest, detail=full): `items`, each a rate with its label,
    # tiers of rates and 12x24 tier schedules (what Zeus's OpenEIClient reads).
    flat = [[0] * 24 for _ in range(12)]
    return {
        "items": [
            {"label": "other", "name": "Another rate", "energyratestructure": [[{"rate": 9.9}]]},
            {
                "label": label,
                "name": "Commercial TOU",
                "sector": "Commercial",
                "energyratestructure": [[{"rate": rate, "unit": "kWh"}]],
                "energyweekdayschedule": flat,
                "energyweekendschedule": flat,
            },
        ]
    }


def test_openei_client_reads_the_labelled_tariff_from_its_api(sim_gpus, double):
    server = double({"/utility_rates": (200, _openei_answer("539f6a23ec4f024411ec8bf9", 0.21))})
    client = OpenEIClient(
        (37.77, -122.42),
        "539f6a23ec4f024411ec8bf9",
        "Commercial",
        api_key="key",
        base_url=f"{server.url}/utility_rates",
    )
    system = sim_gpus("a40", virtual_clock=True)
    m = _run_window(EnergyCostMonitor(client), system)
    assert m.gpu_energy_cost[0] == pytest.approx(m.gpu_energy[0] / J_PER_KWH * 0.21, rel=1e-9)
    ((path, query, _),) = server.requests  # the tariff is read once
    assert query["api_key"] == "key" and query["sector"] == "Commercial" and query["detail"] == "full"
    assert float(query["lat"]) == 37.77 and float(query["lon"]) == -122.42


def test_openei_failures_are_clear(double, monkeypatch):
    monkeypatch.delenv(price_module.OPENEI_KEY_ENV, raising=False)
    server = double({"/missing": (200, {"items": []}), "/broken": (500, {"error": "down"})})
    with pytest.raises(ZeusElectricityPriceHTTPError, match="OPENEI_API_KEY"):
        OpenEIClient((0, 0), "x").get_current_electricity_prices()
    with pytest.raises(ZeusElectricityPriceNotFoundError, match="labelled 'x'"):
        OpenEIClient(
            (0, 0), "x", api_key="k", base_url=f"{server.url}/missing"
        ).get_current_electricity_prices()
    with pytest.raises(ZeusElectricityPriceHTTPError, match="HTTP 500"):
        OpenEIClient(
            (0, 0), "x", api_key="k", base_url=f"{server.url}/broken"
        ).get_current_electricity_prices()


def test_electricitymaps_client_prices_a_window_by_the_latest_intensity(sim_gpus, double):
    # ElectricityMaps v3: `latest` {zone, carbonIntensity, datetime, ...}; `history` {zone, history: [...]}.
    server = double(
        {
            "/v3/carbon-intensity/latest": (
                200,
                {"zone": "DE", "carbonIntensity": 302, "datetime": "2026-12-03T08:00:00.000Z"},
            ),
            "/v3/carbon-intensity/history": (
                200,
                {"zone": "DE", "history": [{"carbonIntensity": 280, "datetime": "2020-01-01T00:00:00.000Z"}]},
            ),
        }
    )
    client = ElectricityMapsClient(zone="DE", api_key="token", base_url=f"{server.url}/v3")
    system = sim_gpus("a40", virtual_clock=True)
    m = _run_window(CarbonEmissionMonitor(client), system)
    # The window's hour is not in the history yet: the latest figure stands for it.
    assert m.gpu_carbon_emission[0] == pytest.approx(m.gpu_energy[0] / J_PER_KWH * 302, rel=1e-9)
    assert all(headers.get("auth-token") == "token" for _, _, headers in server.requests)
    assert all(query["zone"] == "DE" for _, query, _ in server.requests)


def test_electricitymaps_http_error_is_raised_with_its_answer(sim_gpus, double):
    server = double({"/v3/carbon-intensity/latest": (401, {"message": "bad token"})})
    client = ElectricityMapsClient(zone="DE", api_key="wrong", base_url=f"{server.url}/v3")
    with pytest.raises(ZeusCarbonIntensityHTTPError, match="HTTP 401.*bad token"):
        client.get_current_carbon_intensity()
