"""ProfileDataLoader's logs, the power-limit windows, and `zeus-callbacks profile` on simulated GPUs."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from zeus_callbacks.cli import main as cli_main
from zeus_callbacks.cli.profile import sim_workload_for_batch
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.heterogeneous.profile_file import load_profile
from zeus_callbacks.core.heterogeneous.profiler import profile_power_limits
from zeus_callbacks.core.monitor.dataloader import ProfileDataLoader
from zeus_callbacks.core.monitor.epoch_log import scale_to_full_epoch, subset_indices, subset_scaling_factor

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "heterogeneous" / "profile_script.py"


@pytest.fixture(autouse=True)
def _close_profile_logs():
    yield
    ProfileDataLoader.close_logs()


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# -- pure scaling -------------------------------------------------------------------------------------------


def test_subset_scaling_follows_zeus():
    assert subset_indices(100, 0.1) == list(range(0, 100, 10))
    # Zeus: len(dataset) / (len(subset) - batch_size); the first batch is added unscaled.
    assert subset_scaling_factor(1000, 100, 10) == pytest.approx(1000 / 90)
    assert scale_to_full_epoch(2.0, 3.0, 10.0) == 32.0
    with pytest.raises(ValueError, match="no more than one batch"):
        subset_scaling_factor(1000, 10, 10)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        subset_indices(100, 0.0)


@pytest.mark.system
def test_profile_dataloader_rejects_bad_arguments(sim_gpus, tmp_path):
    sim_gpus("a10g")
    ds = TensorDataset(torch.zeros(10, 2))
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        ProfileDataLoader(ds, batch_size=2, split="test", log_prefix=tmp_path / "x")
    with pytest.raises(ValueError, match="subset_proportion"):
        ProfileDataLoader(ds, batch_size=2, split="train", subset_proportion=1.5, log_prefix=tmp_path / "x")


# -- ProfileDataLoader ----------------------------------------------------------------------------------------


@pytest.mark.system
def test_profile_dataloader_writes_scaled_time_energy_and_power(sim_gpus, tmp_path, burn_cpu, monkeypatch):
    sim_gpus("a10g")
    monkeypatch.setenv("ZEUS_LOG_PREFIX", str(tmp_path / "logs" / "bs5"))
    monkeypatch.setenv("ZEUS_MONITOR_SLEEP_MS", "20")
    dataset = TensorDataset(torch.arange(200, dtype=torch.float32))
    train = ProfileDataLoader(dataset, batch_size=5, split="train", subset_proportion=0.1)
    evaluation = ProfileDataLoader(dataset, batch_size=5, split="eval", subset_proportion=0.1)
    assert len(train) == 4  # every 10th sample: 20 samples in batches of 5
    assert train.scaling_factor == pytest.approx(200 / (20 - 5))
    # 0.1 s per batch: the batches after the first span several refreshes of the A10G's 100 ms counter.
    for _ in range(2):
        seen = [x for (x,) in train for _ in [burn_cpu(0.1)]]
        assert torch.cat(seen).tolist() == [float(i) for i in range(0, 200, 10)]
    for _ in evaluation:
        burn_cpu(0.1)

    time_rows = _rows(tmp_path / "logs" / "bs5.time.csv")
    assert [(r["epoch"], r["split"]) for r in time_rows] == [("1", "train"), ("2", "train"), ("1", "eval")]
    energy_rows = _rows(tmp_path / "logs" / "bs5+gpu0.energy.csv")
    assert len(energy_rows) == 3
    for t, e, rec in zip(time_rows, energy_rows, train.records, strict=True):
        measured, scaled = float(e["measured_time"]), float(t["time"])
        # first batch as measured + the other 3 batches x 13.3: between the two bounds.
        assert measured < scaled < train.scaling_factor * measured
        assert float(e["time"]) == pytest.approx(scaled)
        assert float(e["measured_energy"]) > 0 and float(e["energy"]) > float(e["measured_energy"])
        assert e["simulated"] == "1" and rec.simulated
    power = (tmp_path / "logs" / "bs5+gpu0.power.csv").read_text().splitlines()
    assert power[0] == "Time,Power" and len(power) >= 2
    assert all(int(line.split(",")[1]) > 0 for line in power[1:])


@pytest.mark.system
def test_only_scale_time_runs_the_whole_dataset(sim_gpus, tmp_path):
    sim_gpus("a10g")
    dataset = TensorDataset(torch.arange(100, dtype=torch.float32))
    loader = ProfileDataLoader(
        dataset,
        batch_size=5,
        split="train",
        subset_proportion=0.5,
        only_scale_time=True,
        log_prefix=tmp_path / "run",
    )
    assert len(loader) == 20 and loader.scaling_factor == pytest.approx(100 / (50 - 5))
    assert sum(len(x) for (x,) in loader) == 100
    assert loader.records[0].time_s > loader.records[0].measured_time_s


@pytest.mark.system
def test_profile_dataloader_needs_a_prefix(sim_gpus):
    sim_gpus("a10g")
    with pytest.raises(ValueError, match="ZEUS_LOG_PREFIX"):
        ProfileDataLoader(TensorDataset(torch.zeros(4)), batch_size=2, split="train")


# -- power-limit windows -----------------------------------------------------------------------------------


@pytest.mark.system
def test_profile_power_limits_measures_each_limit_and_restores(sim_gpus, tmp_path, burn_cpu):
    sim_gpus("a10g")
    out = tmp_path / "run.json"
    windows = profile_power_limits(
        lambda: burn_cpu(0.004), [150, 300], warmup_steps=1, steps_per_window=3, output=out
    )
    assert [w.power_limit_w for w in windows] == [300, 150]
    assert all(w.time_s > 0 and w.energy_j > 0 and w.steps == 3 for w in windows)
    assert get_gpus()[0].power_limit_mw() == 300_000  # restored to the limit in force before
    data = json.loads(out.read_text())
    assert data["simulated"] and data["gpu_model"] == "NVIDIA A10G" and not data["oom"]
    assert [w["power_limit_w"] for w in data["windows"]] == [300, 150]
    with pytest.raises(ValueError, match=r"outside .*range"):
        profile_power_limits(lambda: None, [400], warmup_steps=0, steps_per_window=1)


def test_profile_power_limits_starts_at_the_limit_in_force(sim_gpus, monkeypatch):
    # A real H100 NVL dump: 310 W in force of a 400 W maximum. The default grid never raises a site's cap
    # (issue 36) unless ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT=1, as for the power-limit optimizer.
    system = sim_gpus("nvidia-smi:H100NVLx2", virtual_clock=True)

    def step() -> None:
        system.run_step(0.2)

    windows = profile_power_limits(step, warmup_steps=0, steps_per_window=1, pl_step=50)
    assert [w.power_limit_w for w in windows] == [310, 260, 200]  # no point within half a step of the minimum
    assert get_gpus()[0].power_limit_mw() == 310_000
    monkeypatch.setenv("ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT", "1")
    windows = profile_power_limits(step, warmup_steps=0, steps_per_window=1, pl_step=100)
    assert [w.power_limit_w for w in windows] == [400, 300, 200]


# -- zeus-callbacks profile ----------------------------------------------------------------------------------


def test_sim_workload_follows_the_batch_size():
    assert sim_workload_for_batch("a10g", None, 64) == "cifar100/shufflenetv2/64"
    assert sim_workload_for_batch("a40", "imagenet/resnet50/256/adam", 128) == "imagenet/resnet50/128/adam"
    assert sim_workload_for_batch("a40", "resnet50", 128) is None


@pytest.mark.slow
def test_cli_profile_writes_a_loadable_zeus2_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "a10g")
    out = tmp_path / "a10.json"
    rc = cli_main(
        [
            "profile",
            "--gpu-name", "a10",
            "--batch-sizes", "64,32",
            "--power-limits", "300,100",
            "--steps-per-window", "2",
            "--warmup-steps", "1",
            "--output", str(out),
            "--timeout", "120",
            "--", sys.executable, str(EXAMPLE), "--hidden", "8",
        ]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["simulated"] is True and meta["gpu"] == "a10" and meta["gpu_model"] == "NVIDIA A10G"
    assert meta["steps_per_window"] == 2 and meta["power_limits"] == [100, 300]
    assert set(meta["memory_peak_bytes"]) == {"32", "64"}
    assert meta["simulation"] == {
        "32": "a10g:cifar100/shufflenetv2/32",
        "64": "a10g:cifar100/shufflenetv2/64",
    }
    profile = load_profile(out)
    assert profile.gpu_name == "a10" and profile.steps_per_window == 2
    assert profile.batch_sizes.tolist() == [32, 64] and profile.power_limits_w.tolist() == [100, 300]
    assert (profile.time_s > 0).all() and (profile.energy_j > 0).all()
    assert "SIMULATED" in capsys.readouterr().out


@pytest.mark.system
def test_cli_profile_refuses_bad_runs(tmp_path, monkeypatch, capsys):
    base = ["profile", "--gpu-name", "a10", "--output", str(tmp_path / "p.json")]
    assert cli_main([*base, "--batch-sizes", "32", "--", "true"]) == 2
    assert "at least two batch sizes" in capsys.readouterr().err
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "a10g")
    assert cli_main([*base, "--batch-sizes", "32,48", "--", "true"]) == 2
    assert "no trace at batch size 48" in capsys.readouterr().err
    assert cli_main([*base, "--batch-sizes", "32,64", "--", sys.executable, "-c", "pass"]) == 1
    assert "profile_power_limits" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.system
def test_hf_and_lightning_epoch_logs_write_rows(sim_gpus, tmp_path, burn_cpu):
    from types import SimpleNamespace

    from zeus_callbacks.huggingface import HFEpochLog
    from zeus_callbacks.lightning import LightningEpochLog

    sim_gpus("a10g")
    hf = HFEpochLog(log_prefix=str(tmp_path / "hf"))
    hf.on_epoch_begin(None, None, None)
    burn_cpu(0.01)
    hf.on_epoch_end(None, None, None)
    hf.on_train_end(None, None, None)
    assert [r["split"] for r in _rows(tmp_path / "hf.time.csv")] == ["train"]

    pl = LightningEpochLog(log_prefix=str(tmp_path / "pl"))
    trainer = SimpleNamespace(sanity_checking=False)
    pl.on_train_epoch_start(trainer, None)
    pl.on_validation_epoch_start(trainer, None)
    burn_cpu(0.01)
    pl.on_validation_epoch_end(trainer, None)
    pl.on_train_epoch_end(trainer, None)
    pl.on_fit_end(trainer, None)
    rows = _rows(tmp_path / "pl.time.csv")
    assert [r["split"] for r in rows] == ["eval", "train"]
    assert float(rows[1]["time"]) >= float(
        rows[0]["time"]
    )  # the validation epoch ran inside the training one
