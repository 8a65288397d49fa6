"""The PyTorch Ignite adapter with a real `ignite.engine.Engine` on CPU and simulated GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zeus_callbacks import ZeusMonitor
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.sim import SimulatedKernels

ignite_engine = pytest.importorskip("ignite.engine")
ignite_handlers = pytest.importorskip("ignite.handlers")
from zeus_callbacks.ignite import IgnitePowerLimitOptimizer, IgniteZeusMonitor  # noqa: E402

pytestmark = pytest.mark.system  # other processes or the real clock (tests/tiers.py)

MAX_W = 300  # the simulated A40's maximum power limit
FAST = dict(wait_steps=1, warmup_steps=1, profile_steps=6)
P = "power_limit_optimizer/"


@pytest.fixture
def a40(sim_gpus) -> None:
    # A counter refreshed every 10 ms lets the small profiles finish in a few dozen toy steps.
    sim_gpus("a40", energy_refresh_ms=10)


def _trainer(burn, seen: list[int], fail_below_w: int | None = None):
    """An Ignite trainer of a tiny model whose step's GPU work is simulated (4 ms forward, 8 ms backward)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 1), SimulatedKernels(0, 0.004))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def update(engine, batch):
        burn(0.003)  # what the simulated GPU counts as work queued on it
        limit_w = get_gpus()[0].power_limit_mw() // 1000
        if fail_below_w is not None and limit_w < fail_below_w:
            raise RuntimeError("training failed while profiling")
        seen.append(limit_w)
        loss = model(batch[0]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return ignite_engine.Engine(update)


def _loader(batches: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(4 * batches, 8)), batch_size=4)


def _until_done(trainer, plo: IgnitePowerLimitOptimizer) -> None:
    """Stop three steps after the choice (they run at it)."""
    done_steps = []

    @trainer.on(ignite_engine.Events.ITERATION_COMPLETED)
    def stop_when_done(engine):
        if plo.optimizer.phase == "done":
            done_steps.append(engine.state.iteration)
        if len(done_steps) > 3:
            engine.terminate()


def test_chooses_applies_restores_and_puts_the_figures_in_the_metrics(a40, burn_cpu, tmp_path: Path) -> None:
    from zeus_callbacks.core.report import load_run, run_dir_for

    seen: list[int] = []
    trainer = _trainer(burn_cpu, seen)
    report = tmp_path / "run.html"
    plo = IgnitePowerLimitOptimizer(
        ZeusMonitor(gpu_indices=[0]), **FAST, report_path=report, log_every_n_steps=5
    )
    plo.attach(trainer)
    _until_done(trainer, plo)
    trainer.run(_loader(200), max_epochs=1)
    optimal = plo.optimizer.optimal_power_limit_w
    assert plo.optimizer.phase == "done" and optimal is not None
    assert min(seen) < MAX_W and seen[-1] == optimal
    metrics = trainer.state.metrics
    assert metrics[f"{P}optimal_power_limit_w"] == optimal
    assert metrics[f"{P}run_energy_j"] > 0 and metrics[f"{P}simulated"] == 1.0
    assert f"{P}energy_interval_j" in metrics  # the interval's energy, as under HF, Lightning, Accelerate
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000
    assert guard().entries == [] and plo.optimizer.monitor.open_windows == []
    (record,) = load_run(run_dir_for(report))
    assert (
        record.finished
        and record.power_limit.optimal_power_limit_w == optimal
        and "SIMULATED" in report.read_text()
    )
    plo.detach()
    assert not trainer.has_event_handler(plo._completed)


def test_an_exception_propagates_and_the_gpu_is_restored(a40, burn_cpu) -> None:
    trainer = _trainer(burn_cpu, [], fail_below_w=MAX_W)
    plo = IgnitePowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), **FAST)
    plo.attach(trainer)
    with pytest.raises(RuntimeError, match="training failed while profiling"):
        trainer.run(_loader(200), max_epochs=1)
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000
    assert guard().entries == [] and plo.optimizer.monitor.open_windows == []


def test_a_users_exception_handler_still_decides_whether_the_error_propagates(a40, burn_cpu) -> None:
    """Ignite re-raises only without EXCEPTION_RAISED handlers; the adapter does not change that."""
    trainer = _trainer(burn_cpu, [], fail_below_w=MAX_W)
    handled: list[BaseException] = []
    trainer.add_event_handler(ignite_engine.Events.EXCEPTION_RAISED, lambda engine, e: handled.append(e))
    plo = IgnitePowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), **FAST)
    plo.attach(trainer)
    trainer.run(_loader(200), max_epochs=1)  # the user's handler swallowed it, as without the adapter
    assert len(handled) == 1
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000


def test_an_ignite_checkpoint_resumes_without_profiling(a40, burn_cpu, tmp_path: Path) -> None:
    trainer = _trainer(burn_cpu, [])
    plo = IgnitePowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), **FAST)
    plo.attach(trainer)
    _until_done(trainer, plo)
    trainer.run(_loader(200), max_epochs=1)
    checkpoint = ignite_handlers.Checkpoint({"power_limit": plo}, ignite_handlers.DiskSaver(tmp_path))
    checkpoint(trainer)
    optimal = plo.optimizer.optimal_power_limit_w

    seen: list[int] = []
    again = _trainer(burn_cpu, seen)
    resumed = IgnitePowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), **FAST)
    resumed.attach(again)
    (saved,) = tmp_path.glob("*.pt")
    ignite_handlers.Checkpoint.load_objects({"power_limit": resumed}, torch.load(saved, weights_only=False))
    again.run(_loader(10), max_epochs=1)
    assert resumed.optimizer.optimal_power_limit_w == optimal
    assert seen == [optimal] * 10  # applied from the first step
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000


def test_energy_monitor_puts_intervals_and_the_run_energy_in_the_metrics(a40, burn_cpu) -> None:
    trainer = _trainer(burn_cpu, [])
    energy = IgniteZeusMonitor(ZeusMonitor(gpu_indices=[0]), log_every_n_steps=5)
    energy.attach(trainer)
    seen: list[float] = []
    trainer.add_event_handler(
        ignite_engine.Events.ITERATION_COMPLETED(every=5),
        lambda e: seen.append(e.state.metrics["energy/interval_j"]),
    )
    trainer.run(_loader(20), max_epochs=1)
    metrics = trainer.state.metrics
    assert len(seen) == 4 and all(j >= 0 for j in seen)
    assert metrics["energy/total_j"] > 0 and metrics["energy/simulated"] == 1.0
    assert energy._session.monitor.open_windows == []
