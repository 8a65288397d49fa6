"""Zeus 0.16's monitors as its documentation uses them (`zeus.monitor.power`, `.temperature`, `.carbon`,
`.price`), with only the imports changed, around a small training loop on the CPU.

    ZEUS_CALLBACKS_SIMULATE=a40 python examples/zeus/monitors.py

On a simulated GPU each step's GPU work is queued on it (no host CPU) and waited for, so the monitors see
the GPU busy for about 2 s whatever the host's speed and load; the model itself trains on the CPU.
"""

from __future__ import annotations

import os
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


def train(steps: int = 40, gpu_work_s: float = 0.05) -> None:
    """`steps` steps of a small MLP on random data, each with `gpu_work_s` of simulated GPU work."""
    torch.set_num_threads(1)  # the model is tiny: more threads only spin on a loaded host (0.5 ms a step)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        gpu_step(gpu_work_s)


def gpu_step(work_s: float) -> None:
    """On a simulated GPU, the step's GPU work: `work_s` at the maximum power limit, queued on GPU 0 and waited
    for, as `loss.item()` waits for a real GPU; nothing otherwise (the model trains on the CPU)."""
    if not os.environ.get("ZEUS_CALLBACKS_SIMULATE"):
        return  # a real GPU: the simulator is not imported
    from zeus_callbacks import sim

    system = sim.active()
    if system is not None:
        gpu = system.cuda_gpus()[0]
        gpu.enqueue(work_s)
        gpu.synchronize()


def main() -> None:
    # On a simulated GPU, say before the first window's synchronisation that this process's GPU work is queued
    # kernels: until its first kernel, another process (PowerMonitor's sampler) counts its host CPU time (the
    # first step's, torch warming up) as GPU work, as it does for a process that never queues kernels.
    gpu_step(0.0)
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
