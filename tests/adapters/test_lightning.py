"""The Lightning adapters under real lightning.pytorch and pytorch_lightning trainers, on simulated GPUs."""

from __future__ import annotations

import csv
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import EXAMPLES, TOY_STEPS_COUNTER
from torch.utils.data import DataLoader, TensorDataset

from zeus_callbacks import ZeusMonitor
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.sim import SimulatedKernels

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

MAX_W = 300  # the simulated A40's maximum power limit
FAST = dict(wait_steps=1, warmup_steps=1, profile_steps=6)


class Flavour:
    """One Lightning package: its trainer and loggers, and our callbacks built on its `Callback`."""

    def __init__(self, package: str, adapters: str) -> None:
        self.L: ModuleType = importlib.import_module(package)
        self.loggers: ModuleType = importlib.import_module(f"{package}.loggers")
        self.callbacks: ModuleType = importlib.import_module(f"{package}.callbacks")
        self.zeus: ModuleType = importlib.import_module(adapters)

    def module(
        self, burn: Callable[[float], float], plo=None, fail_below_w: int | None = None, stop_when_done=True
    ):
        """A tiny LightningModule whose steps are `burn`ed host work (what a simulated GPU counts as work) and
        simulated GPU work (`SimulatedKernels`).

        Records `(global_step, power limit W, optimizer phase)` after every batch; stops training once the
        optimizer is done (with `stop_when_done`).
        """

        class Tiny(self.L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                # The step's GPU work (12 ms, simulated): its pace is the GPU's, whatever the host's speed.
                self.layer = torch.nn.Sequential(torch.nn.Linear(8, 1), SimulatedKernels(0, 0.004))
                self.seen: list[tuple[int, int, str | None]] = []

            def training_step(self, batch, batch_idx):
                burn(0.003)
                if fail_below_w is not None and get_gpus()[0].power_limit_mw() < fail_below_w * 1000:
                    raise RuntimeError("training failed while profiling")
                return self.layer(batch[0]).pow(2).mean()

            def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
                limit_w = get_gpus()[0].power_limit_mw() // 1000
                self.seen.append((self.trainer.global_step, limit_w, plo.optimizer.phase if plo else None))
                if stop_when_done and plo is not None and plo.optimizer.phase == "done":
                    self.trainer.should_stop = True

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        return Tiny()

    def trainer(self, tmp_path: Path, callbacks: list, max_steps: int, logger: bool = False, **kw):
        return self.L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            callbacks=callbacks,
            logger=self.loggers.CSVLogger(tmp_path, name="csv") if logger else False,
            log_every_n_steps=1,
            enable_checkpointing=kw.pop("enable_checkpointing", False),
            enable_progress_bar=False,
            enable_model_summary=False,
            **kw,
        )


def _data(n: int = 64) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 8)), batch_size=4)


@pytest.fixture(params=["lightning.pytorch", "pytorch_lightning"])
def flavour(request) -> Flavour:
    adapters = (
        "zeus_callbacks.lightning" if request.param == "lightning.pytorch" else "zeus_callbacks.lightning.pl"
    )
    return Flavour(request.param, adapters)


@pytest.fixture
def gpu0(sim_gpus) -> ZeusMonitor:
    # Toy steps of a few ms: a counter refreshed every 10 ms (a fast board's) lets the small profiles
    # finish in a few dozen steps; the A40's 100 ms would need as many steps as 100 ms takes.
    sim_gpus("2*a40", energy_refresh_ms=10)
    return ZeusMonitor(gpu_indices=[0])


def _csv_rows(tmp_path: Path) -> list[dict[str, str]]:
    (path,) = tmp_path.glob("csv/version_*/metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


ALL_CALLBACKS = [
    "LightningZeusMonitor",
    "LightningGlobalPowerLimitOptimizer",
    "LightningPipelineFrequencyOptimizer",
    "LightningHeterogeneous",
    "LightningEpochLog",
]


def test_callbacks_subclass_their_packages_callback(flavour: Flavour) -> None:
    assert sorted(flavour.zeus.__all__) == sorted(ALL_CALLBACKS)
    for name in ALL_CALLBACKS:
        cls = getattr(flavour.zeus, name)
        assert issubclass(cls, flavour.callbacks.Callback), name
        assert cls.__qualname__ == name  # module-level: the checkpoint state key is the same in both packages


@pytest.mark.system
def test_standalone_package_gets_every_callback_without_lightning(run_python) -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'lightning':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pytorch_lightning\n"
        "from zeus_callbacks.lightning import pl\n"
        f"names = {ALL_CALLBACKS!r}\n"
        "print(all(issubclass(getattr(pl, n), pytorch_lightning.Callback) for n in names))\n"
    )
    out = run_python(code)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.system
def test_import_does_not_import_lightning(run_python) -> None:
    code = "import sys, zeus_callbacks, zeus_callbacks.lightning; print('lightning' in sys.modules)"
    assert run_python(code).stdout.strip() == "False"


@pytest.mark.system
def test_optimizer_chooses_applies_and_restores(
    flavour: Flavour, gpu0: ZeusMonitor, tmp_path: Path, burn_cpu
) -> None:
    from zeus_callbacks.core.report import load_run, run_dir_for

    report = tmp_path / "run.html"
    plo = flavour.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST, report_path=report)
    model = flavour.module(burn_cpu, plo)
    flavour.trainer(tmp_path, [plo], max_steps=150, logger=True).fit(model, _data())

    optimal = plo.optimizer.optimal_power_limit_w
    assert plo.optimizer.phase == "done" and optimal is not None
    assert min(w for _, w, _ in model.seen) < MAX_W  # lower limits were profiled
    assert model.seen[-1][1:] == (optimal, "done")  # the choice was in force at the end of training
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000  # and restored after it
    assert guard().entries == []

    rows = _csv_rows(tmp_path)
    assert _column(rows, "power_limit_optimizer/optimal_power_limit_w")[-1] == optimal
    limits = _column(rows, "power_limit_optimizer/power_limit_w")
    assert MAX_W in limits and min(limits) < MAX_W
    assert _column(rows, "power_limit_optimizer/profiling_energy_j")[-1] > 0
    # The end-of-training summary: the run's totals, the same names as HF's and Accelerate's.
    run_j = _column(rows, "power_limit_optimizer/run_energy_j")
    assert len(run_j) == 1 and run_j[0] > _column(rows, "power_limit_optimizer/profiling_energy_j")[-1]
    assert _column(rows, "power_limit_optimizer/simulated")[-1] == 1.0
    # The saving against the maximum limit is logged once when the optimizer could measure it: host load can
    # set aside every sample of the maximum limit on a toy step (issue 21: a loaded full-suite run did), and
    # then there is nothing to compare with. What holds on any machine: the log says what the report says.
    saved = plo.optimizer.report().get("energy_saved_pct")
    assert _column(rows, "power_limit_optimizer/energy_saved_pct") == (
        [] if saved is None else [pytest.approx(saved)]
    )
    # The interval's energy at logging steps (no LightningZeusMonitor of this monitor logs it), and the report.
    assert _column(rows, "power_limit_optimizer/energy_interval_j")
    (record,) = load_run(run_dir_for(report))
    assert record.finished and record.power_limit.optimal_power_limit_w == optimal


@pytest.mark.system
def test_gradient_accumulation_profiles_optimizer_steps(gpu0: ZeusMonitor, tmp_path: Path, burn_cpu) -> None:
    flavour = Flavour("lightning.pytorch", "zeus_callbacks.lightning")
    plo = flavour.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST)
    model = flavour.module(burn_cpu, plo)
    trainer = flavour.trainer(tmp_path, [plo], max_steps=150, accumulate_grad_batches=3)
    trainer.fit(model, _data(n=4 * 3 * 150))

    assert len(model.seen) == 3 * trainer.global_step
    decided_at = next(step for step, _, phase in model.seen if phase == "done")
    # Waiting, warm-up and profiling count optimizer steps, not micro-batches.
    assert decided_at == FAST["wait_steps"] + plo.optimizer.profiling_steps


@pytest.mark.system
def test_energy_monitor_logs_intervals_and_totals(
    flavour: Flavour, gpu0: ZeusMonitor, tmp_path: Path, burn_cpu
) -> None:
    energy = flavour.zeus.LightningZeusMonitor(gpu0, logging_interval="epoch")
    flavour.trainer(tmp_path, [energy], max_steps=48, logger=True).fit(flavour.module(burn_cpu), _data())

    rows = _csv_rows(tmp_path)
    intervals = _column(rows, "energy/interval_j")
    assert len(intervals) == 3  # 48 steps of 16 batches
    assert all(e > 0 for e in intervals) and _column(rows, "energy/gpu0_interval_j") == intervals
    (total,) = _column(rows, "energy/total_j")
    assert total == pytest.approx(energy.total_energy_j()) and total >= sum(intervals) - 1e-9  # float sums
    assert _column(rows, "energy/simulated")[-1] == 1.0
    assert gpu0.open_windows == []


@pytest.mark.system
def test_energy_monitor_logs_co2eq_and_cost(gpu0: ZeusMonitor, tmp_path: Path, burn_cpu) -> None:
    flavour = Flavour("lightning.pytorch", "zeus_callbacks.lightning")
    energy = flavour.zeus.LightningZeusMonitor(gpu0, "epoch", carbon_intensity=400, price_per_kwh=0.1)
    flavour.trainer(tmp_path, [energy], max_steps=32, logger=True).fit(flavour.module(burn_cpu), _data())

    rows = _csv_rows(tmp_path)
    intervals, grams = _column(rows, "energy/interval_j"), _column(rows, "energy/interval_co2eq_g")
    assert len(grams) == len(intervals) == 2
    assert grams == pytest.approx([e / 3.6e6 * 400 for e in intervals])
    (total,), (cost,) = _column(rows, "energy/total_j"), _column(rows, "energy/total_cost")
    assert cost == pytest.approx(total / 3.6e6 * 0.1)


@pytest.mark.system
def test_energy_monitor_report_path_writes_the_run_report(
    gpu0: ZeusMonitor, tmp_path: Path, burn_cpu
) -> None:
    from zeus_callbacks.core.report import load_run, run_dir_for

    flavour = Flavour("lightning.pytorch", "zeus_callbacks.lightning")
    report = tmp_path / "run.html"
    energy = flavour.zeus.LightningZeusMonitor(gpu0, report_path=report)
    flavour.trainer(tmp_path, [energy], max_steps=12).fit(flavour.module(burn_cpu), _data())
    (record,) = load_run(run_dir_for(report))
    assert len(record.steps) == 12 and record.finished
    assert "SIMULATED" in report.read_text()


@pytest.mark.system
def test_energy_monitor_step_interval_follows_log_every_n_steps(
    gpu0: ZeusMonitor, tmp_path: Path, burn_cpu
) -> None:
    flavour = Flavour("lightning.pytorch", "zeus_callbacks.lightning")
    energy = flavour.zeus.LightningZeusMonitor(gpu0)
    trainer = flavour.trainer(tmp_path, [energy], max_steps=20, logger=True)
    trainer.log_every_n_steps = 5
    trainer.fit(flavour.module(burn_cpu), _data())
    assert len(_column(_csv_rows(tmp_path), "energy/interval_j")) == 4


@pytest.mark.system
def test_energy_monitor_rejects_bad_interval(gpu0: ZeusMonitor) -> None:
    from zeus_callbacks.lightning import LightningZeusMonitor

    with pytest.raises(ValueError, match=r"`LightningZeusMonitor\(logging_interval='batch'\)`"):
        LightningZeusMonitor(gpu0, logging_interval="batch")


@pytest.mark.system
@pytest.mark.parametrize(
    "first, second",
    [
        ("lightning.pytorch", "lightning.pytorch"),
        ("pytorch_lightning", "pytorch_lightning"),
        ("lightning.pytorch", "pytorch_lightning"),  # the state is the same for both packages
    ],
)
def test_checkpoint_resume_does_not_profile_again(
    first: str, second: str, gpu0: ZeusMonitor, tmp_path: Path, burn_cpu
) -> None:
    adapters = {
        "lightning.pytorch": "zeus_callbacks.lightning",
        "pytorch_lightning": "zeus_callbacks.lightning.pl",
    }
    a, b = Flavour(first, adapters[first]), Flavour(second, adapters[second])
    plo = a.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST)
    ckpt = a.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)  # at the end of the epoch
    first = a.trainer(tmp_path, [plo, ckpt], max_steps=150, enable_checkpointing=True)
    first.fit(a.module(burn_cpu, plo), _data())
    optimal = plo.optimizer.optimal_power_limit_w
    assert optimal is not None

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]
    assert saved["LightningGlobalPowerLimitOptimizer"]["optimal_power_limit_w"] == optimal

    resumed = b.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST)
    model = b.module(burn_cpu, resumed, stop_when_done=False)
    b.trainer(tmp_path, [resumed], max_steps=first.global_step + 10).fit(
        model, _data(), ckpt_path=tmp_path / "ckpt" / "last.ckpt"
    )

    assert resumed.optimizer.optimal_power_limit_w == optimal
    assert resumed.optimizer.profiling_steps == plo.optimizer.profiling_steps  # the counters carry on
    assert [w for _, w, _ in model.seen] == [optimal] * 10  # applied from the first resumed step
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000


@pytest.mark.system
def test_corrupted_checkpoint_state_is_refused_with_one_warning(
    flavour: Flavour, gpu0: ZeusMonitor, tmp_path: Path, burn_cpu, caplog
) -> None:
    """A checkpoint whose optimizer state is corrupted (here a negative energy): one warning naming the
    checkpoint, training resumes and profiling starts afresh; the GPU is restored at the end."""
    plo = flavour.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST)
    ckpt = flavour.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = flavour.trainer(tmp_path, [plo, ckpt], max_steps=150, enable_checkpointing=True)
    first.fit(flavour.module(burn_cpu, plo), _data())
    path = tmp_path / "ckpt" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"]["LightningGlobalPowerLimitOptimizer"]["stats"][0]["energy_j"] = -1.0
    torch.save(checkpoint, path)

    resumed = flavour.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST)
    trainer = flavour.trainer(tmp_path, [resumed], max_steps=first.global_step + 5)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer.fit(flavour.module(burn_cpu, resumed, stop_when_done=False), _data(), ckpt_path=path)
    refused = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(refused) == 1 and "corrupted" in refused[0] and "profiling starts afresh" in refused[0]
    assert trainer.global_step == first.global_step + 5
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000


@pytest.mark.system
def test_exception_in_training_step_restores_the_gpu(
    flavour: Flavour, gpu0: ZeusMonitor, tmp_path: Path, burn_cpu
) -> None:
    plo = flavour.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST)
    model = flavour.module(burn_cpu, plo, fail_below_w=MAX_W)
    with pytest.raises(RuntimeError, match="training failed while profiling"):
        flavour.trainer(tmp_path, [plo], max_steps=150).fit(model, _data())
    # The interrupted limit is profiled again from its warm-up if the optimizer trains again.
    assert plo.optimizer.phase == "waiting" and plo.optimizer.optimal_power_limit_w is None
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000
    assert guard().entries == []
    assert gpu0.open_windows == []


@pytest.mark.slow
def test_ddp_example_ranks_choose_the_same_limit(run_example) -> None:
    # torchrun starts both ranks at once; Lightning's own launcher would import everything twice in a row.
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    stdout = run_example(
        "lightning/train_power_limit.py",
        "--devices",
        "2",
        launcher=launch,
        spec="2*a40",
        env=TOY_STEPS_COUNTER,
    )
    chosen = dict(re.findall(r"rank (\d+) \(simulated GPU \d+\): optimal power limit (\d+) W", stdout))
    assert sorted(chosen) == ["0", "1"], stdout
    assert chosen["0"] == chosen["1"]
    assert stdout.count("GPU restored to 300 W") == 2


@pytest.mark.slow
def test_ddp_under_lightnings_own_launcher_decides_once_for_both_ranks(
    tmp_path: Path, sim_state_dir: Path
) -> None:
    """Issue 24: under `strategy="ddp"` launched by Lightning itself, rank 0 builds its callbacks before it
    knows it is a rank; it decided alone, and rank 1 waited out a wall-clock join timeout, then decided alone."""
    env = {
        **os.environ,
        **TOY_STEPS_COUNTER,
        "ZEUS_CALLBACKS_SIMULATE": "2*a40",
        "ZEUS_CALLBACKS_SIM_STATE_DIR": str(sim_state_dir),
        "ZEUS_CALLBACKS_JOIN_TIMEOUT_S": "1",  # the old timeout, short: had it decided, the ranks would split
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning" / "train_power_limit.py"), "--devices", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    chosen = re.findall(
        r"rank (\d+) \(simulated GPU \d+\): optimal power limit (\d+) W after (\d+) profiling steps",
        proc.stdout,
    )
    assert sorted(r for r, _, _ in chosen) == ["0", "1"], proc.stdout
    assert len({(w, steps) for _, w, steps in chosen}) == 1, chosen  # one limit, after the same steps
    assert "decides for its own GPU(s) alone" not in proc.stderr


class SpawnTiny(importlib.import_module("lightning.pytorch").LightningModule):
    """A module `ddp_spawn` can pickle (a top-level class), so that the refusal is the callback's."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.system
def test_ddp_spawn_refused_with_a_clear_message(gpu0: ZeusMonitor, tmp_path: Path) -> None:
    flavour = Flavour("lightning.pytorch", "zeus_callbacks.lightning")
    plo = flavour.zeus.LightningGlobalPowerLimitOptimizer(gpu0, **FAST)
    trainer = flavour.trainer(tmp_path, [plo], max_steps=5, strategy="ddp_spawn")
    with pytest.raises(TypeError, match=r'ddp_spawn.*strategy=\\?"ddp"'):
        trainer.fit(SpawnTiny(), _data())
    assert get_gpus()[0].power_limit_mw() == MAX_W * 1000
