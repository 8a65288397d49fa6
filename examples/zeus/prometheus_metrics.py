"""Zeus's Prometheus example (`examples/prometheus/train_single.py`: `zeus.metric` pushed to a Pushgateway) on
synthetic data (CPU); the Zeus part is Zeus's, import changed.

    prometheus-pushgateway &   # http://localhost:9091
    ZEUS_CALLBACKS_SIMULATE=a40 python examples/zeus/prometheus_metrics.py
"""

import argparse
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# ZEUS (was: from zeus.metric import EnergyHistogram, EnergyCumulativeCounter, PowerGauge)
from zeus_callbacks import EnergyCumulativeCounter, EnergyHistogram, PowerGauge, sim


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Zeus's Prometheus example on synthetic data")
    parser.add_argument("--epochs", default=3, type=int)
    parser.add_argument("--steps_per_epoch", default=20, type=int)
    parser.add_argument("-b", "--batch_size", default=32, type=int)
    parser.add_argument("--pushgateway", default="http://localhost:9091")
    parser.add_argument("--update_period", default=2.0, type=float, help="Zeus's example: 2 s")
    parser.add_argument("--linger", default=10.0, type=float, help="Zeus's example sleeps 10 s at the end")
    return parser.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    data = TensorDataset(
        torch.randn(args.steps_per_epoch * args.batch_size, 64),
        torch.randint(0, 10, (args.steps_per_epoch * args.batch_size,)),
    )
    train_loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)

    ################################## The important part (Zeus's) ###########################
    # Histogram to track energy consumption over time
    energy_histogram = EnergyHistogram(
        cpu_indices=[0, 1], gpu_indices=[0], pushgateway_url=args.pushgateway, job="training_energy_histogram"
    )
    # Gauge to track power consumption over time
    power_gauge = PowerGauge(
        gpu_indices=[0],
        update_period=args.update_period,
        pushgateway_url=args.pushgateway,
        job="training_power_gauge",
    )
    # Counter to track energy consumption over time
    energy_counter = EnergyCumulativeCounter(
        cpu_indices=[0, 1],
        gpu_indices=[0],
        update_period=args.update_period,
        pushgateway_url=args.pushgateway,
        job="training_energy_counter",
    )

    power_gauge.begin_window("epoch_power")
    energy_counter.begin_window("epoch_energy")

    for epoch in range(args.epochs):
        energy_histogram.begin_window("training_energy")
        train(train_loader, model, criterion, optimizer)
        energy_histogram.end_window("training_energy")
        print(f"Epoch {epoch} done.")

    # Allow metrics to capture remaining data before shutting down monitoring.
    time.sleep(args.linger)

    energy_counter.end_window("epoch_energy")
    power_gauge.end_window("epoch_power")
    ################################## The important part ####################################


def train(train_loader, model, criterion, optimizer):
    model.train()
    for images, target in train_loader:
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sim.enqueue_if_simulated(0, 0.02)  # the GPU work this step stands for, on a simulated GPU


if __name__ == "__main__":
    main()
