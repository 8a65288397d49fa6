"""Per-step cost of the HF adapters (HFGlobalPowerLimitOptimizer once Done, HFZeusMonitor) in one Trainer run.

What is measured: the tiny demo model (2-layer GPT-2 over bytes, batch 8 x 64) trains with HF Trainer on
the CPU against a simulated A40 (noise off). The optimizer profiles 300 and 100 W with the `Time()`
objective, so it settles on the maximum limit, where the simulated GPU's relative time is 1.0 and the
simulator never sleeps. Every hook of the two adapters is wrapped in a timer; after the optimizer is
Done, the time spent inside them (wall and this process's CPU time) is compared with the step time
(on_step_begin to the next on_step_begin, everything included) of the same run. The simulator's
synchronisation at each step end (`GPUs.step_boundary`, a no-op on a real GPU) is inside the optimizer's
`on_step_end` and is shown on its own. HFZeusMonitor works at log events only (every `--logging-steps`);
its cost is amortised over the steps.

Run: `python benchmarks/callback_overhead.py [--steps 300] [--logging-steps 10]`
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import transformers
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from zeus_callbacks import Time, sim
from zeus_callbacks.cli.demo import ToyCorpus, tiny_model
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer, HFZeusMonitor

HOOKS = ("on_train_begin", "on_step_begin", "on_step_end", "on_epoch_end", "on_log", "on_train_end")


class Timed:
    """Wall and CPU seconds spent in wrapped callables, per label, counted only while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[label] += time.perf_counter() - w
                self.cpu[label] += time.process_time() - c

        return timed


class StepClock(TrainerCallback):
    """Step times (on_step_begin to on_step_begin) once `plo` is Done; turns `timed` on from then."""

    def __init__(self, plo: HFGlobalPowerLimitOptimizer | None, timed: Timed) -> None:
        self.plo, self.timed = plo, timed
        self.steps_s: list[float] = []
        self._last: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._last is not None:
            self.steps_s.append(now - self._last)
        done = self.plo is None or self.plo.optimizer.phase == "done"
        self._last = now if done else None
        self.timed.on = done


def train(steps: int, logging_steps: int, with_adapters: bool, out: str) -> tuple[StepClock, Timed, object]:
    timed = Timed()
    monitor = ZeusMonitor([0])
    callbacks: list = []
    plo = None
    if with_adapters:
        plo = HFGlobalPowerLimitOptimizer(
            monitor, Time(), wait_steps=5, warmup_steps=1, profile_steps=4, pl_step=200
        )
        hfm = HFZeusMonitor(monitor)
        for label, cb in (("optimizer", plo), ("monitor", hfm)):
            for hook in HOOKS:
                setattr(cb, hook, timed.wrap(label, getattr(cb, hook)))
        gpus = monitor.gpus
        gpus.step_boundary = timed.wrap("sim_sync", gpus.step_boundary)
        callbacks = [hfm, plo]
    clock = StepClock(plo, timed)
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=logging_steps,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=tiny_model(0), args=args, train_dataset=ToyCorpus(0), callbacks=[clock, *callbacks]
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    if with_adapters:
        del monitor.gpus.step_boundary
    return clock, timed, plo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--logging-steps", type=int, default=10, help="HF logging_steps (default 10)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.getLogger("zeus_callbacks").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sim.simulate("a40", noise=0.0, state_dir=f"{tmp}/sim", export_env=False)
        try:
            clock, timed, plo = train(args.steps, args.logging_steps, True, f"{tmp}/with")
            base, _, _ = train(args.steps, args.logging_steps, False, f"{tmp}/without")
        finally:
            sim.disable()
    assert plo is not None
    n = len(clock.steps_s)
    step = statistics.mean(clock.steps_s)
    print("SIMULATED A40 (noise off), tiny GPT-2 on the CPU, 1 torch thread.")
    print(
        f"Optimizer: {plo.optimizer.phase} at {plo.optimizer.optimal_power_limit_w} W after "
        f"{plo.optimizer.profiling_steps} profiling steps; {n} steps timed after that."
    )
    print(
        f"Step time (everything included): mean {1000 * step:.2f} ms, median {1000 * statistics.median(clock.steps_s):.2f} ms"
    )
    print(f"{'per step':<44}{'wall us':>10}{'CPU us':>10}{'% of step':>11}")
    rows = [
        ("HFGlobalPowerLimitOptimizer hooks (all)", "optimizer"),
        ("  of which simulator sync (none on real GPU)", "sim_sync"),
        ("HFZeusMonitor hooks (on_log, amortised)", "monitor"),
    ]
    for title, key in rows:
        wall, cpu = timed.wall[key] / n, timed.cpu[key] / n
        print(f"{title:<44}{1e6 * wall:>10.1f}{1e6 * cpu:>10.1f}{100 * wall / step:>10.3f}%")
    adapter = (timed.wall["optimizer"] - timed.wall["sim_sync"] + timed.wall["monitor"]) / n
    print(
        f"{'both adapters, without the simulator sync':<44}{1e6 * adapter:>10.1f}{'':>10}{100 * adapter / step:>10.3f}%"
    )
    base_step = statistics.mean(base.steps_s)
    print(
        f"For scale, a second run without the adapters: mean step {1000 * base_step:.2f} ms "
        f"({100 * (step / base_step - 1):+.1f}%; run-to-run noise on a shared CPU is larger than the overhead)."
    )


if __name__ == "__main__":
    main()
