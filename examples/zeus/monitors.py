"""Zeus 0.16's monitors as its documentation uses them (`zeus.monitor.power`, `.temperature`, `.carbon`,
`.price`), with only the imports changed, around a small training loop on the CPU.

    ZEUS_CALLBACKS_SIMULATE=a40 python examples/zeus/monitors.py
"""

from __future__ import annotations

import time

import torch

# --- Zeus (imports changed from zeus.monitor.power / .temperature / .carbon / .price) ---
from zeus_callbacks import (
    CarbonEmissionMonitor,
    EnergyCostMonitor,
    FixedCarbonIntensity,
    FixedElectricityPrice,
    PowerMonitor,
    TemperatureMonitor,
)

# --- end Zeus ---


def train(seconds: float = 2.0) -> None:
    """A few steps of a small MLP on random data."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.time() + seconds
    while time.time() < end:
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    # --- Zeus ---
    power_monitor = PowerMonitor(gpu_indices=[0], update_period=0.1)
    temperature_monitor = TemperatureMonitor(gpu_indices=[0], update_period=0.5)
    carbon_monitor = CarbonEmissionMonitor(FixedCarbonIntensity(380.0), gpu_indices=[0])
    cost_monitor = EnergyCostMonitor(FixedElectricityPrice(0.15), gpu_indices=[0])

    start = time.time()
    carbon_monitor.begin_window("train")
    cost_monitor.begin_window("train")
    train()
    carbon = carbon_monitor.end_window("train")
    cost = cost_monitor.end_window("train")
    end = time.time()

    energy = power_monitor.get_energy(start, end)
    timeline = power_monitor.get_power_timeline("device_instant", gpu_index=0, start_time=start, end_time=end)
    temperature = temperature_monitor.get_temperature()
    power_monitor.stop()
    temperature_monitor.stop()
    # --- end Zeus ---

    label = " (SIMULATED)" if power_monitor.simulated else ""
    print(
        f"power timeline{label}: {len(timeline[0])} samples, energy {energy[0]:.1f} J over {end - start:.1f} s"
    )
    print(f"temperature{label}: {temperature[0]} C")
    print(
        f"carbon{label}: {carbon.gpu_carbon_emission[0]:.4f} gCO2eq for {carbon.gpu_energy[0]:.1f} J at 380 g/kWh"
    )
    print(f"cost{label}: {cost.gpu_energy_cost[0]:.6f} for {cost.gpu_energy[0]:.1f} J at 0.15 per kWh")


if __name__ == "__main__":
    main()
