"""The `report_to` trackers read back after a causal-LM training script with the README's HF snippet and
`--report_to all` (issue 37): TensorBoard's event files, MLflow's client and W&B's offline run file each hold the
energy series the callbacks log, and each run's metadata says SIMULATED. The script is `data/train_clm.py`
(transformers' `run_clm.py` in shape: a text file, a model from a config), run on a simulated A40 offline."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from zeus_callbacks.huggingface.trackers import SIMULATED_KEY, SIMULATED_TAG  # noqa: E402

SCRIPT = Path(__file__).parent / "data" / "train_clm.py"
MAX_STEPS, LOGGING_STEPS = 12, 4
LOGGED_AT = [4, 8, 12]  # the log events during training: every LOGGING_STEPS up to MAX_STEPS
# HFZeusMonitor's per logging interval (one shorter than two counter refreshes is merged into the next log event's,
# so at the log events the trainer's log history has them); HFGlobalPowerLimitOptimizer's at every log event (the
# end-of-training one too); the run's totals, once at the end of training.
INTERVAL_SERIES = ("energy/interval_j", "energy/interval_time_s", "energy/interval_avg_power_w")
EVERY_LOG = ("power_limit_optimizer/power_limit_w", "power_limit_optimizer/phase_index")
RUN_TOTALS = ("energy/total_j", "energy/total_time_s", "power_limit_optimizer/run_energy_j")
SIMULATED = ("energy/simulated", "power_limit_optimizer/simulated")


@dataclass
class TrackedRun:
    """What one tracker holds of a run: each series by the name the callbacks logged it under, as (step, value)
    pairs, and the run's metadata (TensorBoard's texts, MLflow's parameters and tags, W&B's config and tags)."""

    series: dict[str, list[tuple[int, float]]]
    metadata: dict[str, str]


def _train(tmp_path: Path, trainer: str) -> tuple[str, Path]:
    """Run the script under `ZEUS_CALLBACKS_SIMULATE=a40`, offline, every tracker writing under `tmp_path`;
    returns its output and its folder."""
    run_dir = tmp_path / trainer
    run_dir.mkdir()
    text = tmp_path / "train.txt"
    words = "the gpu power limit energy model step joule watt slow fast measure choose train".split()
    lines = (" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400))
    text.write_text("\n".join(lines) + "\n")
    env = {
        **os.environ,
        "ZEUS_CALLBACKS_SIMULATE": "a40",
        "ZEUS_CALLBACKS_SIM_STATE_DIR": str(run_dir / "sim-state"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "TENSORBOARD_LOGGING_DIR": str(run_dir / "tensorboard"),
        "MLFLOW_TRACKING_URI": (run_dir / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3.7+ asks for a database; a file store reads back the same
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(run_dir),
        "WANDB_SILENT": "true",
    }
    args = [f"--train_file={text}", "--output_dir=out", "--report_to=all", f"--trainer={trainer}"]
    args += [f"--max_steps={MAX_STEPS}", f"--logging_steps={LOGGING_STEPS}", "--save_strategy=no"]
    args += ["--per_device_train_batch_size=4", "--use_cpu=true", "--disable_tqdm=true"]
    command = [sys.executable, str(SCRIPT), *args]
    proc = subprocess.run(command, env=env, cwd=run_dir, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr, run_dir


def tensorboard_run(logdir: Path) -> TrackedRun:
    """The event files read by TensorBoard's `EventAccumulator` (transformers prefixes training logs `train/`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    series = {
        tag.removeprefix("train/"): [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }
    texts = {
        tag.removesuffix("/text_summary"): b"".join(e.tensor_proto.string_val).decode()
        for tag in events.Tags()["tensors"]
        for e in events.Tensors(tag)
    }
    return TrackedRun(series, texts)


def mlflow_run(tracking_uri: str) -> TrackedRun:
    """The one run of the file store, read by `MlflowClient` (`get_metric_history` per metric)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    series = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    return TrackedRun(series, {**run.data.params, **run.data.tags})


def wandb_records(path: Path) -> list:
    """The records of a W&B offline run file (`run-*.wandb`): a 7-byte header (`:W&B`, magic, version), then
    LevelDB's log format (32 KiB blocks; chunks of a 4-byte CRC, a 2-byte length and a type: full, first,
    middle, last), each record one of wandb's own `wandb_internal_pb2.Record` protobufs."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, chunks, records = path.read_bytes(), 32 * 1024, 7, b"", []
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last chunk of a record
            record = Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_run(wandb_dir: Path) -> TrackedRun:
    """The offline run's history rows (`train/global_step` is the trainer's step) and metadata (run tags, config)."""
    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    series: dict[str, list[tuple[int, float]]] = {}
    metadata: dict[str, str] = {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            for key, value in row.items():
                if key.startswith("train/") and isinstance(value, (int, float)):
                    series.setdefault(key.removeprefix("train/"), []).append(
                        (row["train/global_step"], value)
                    )
        elif kind == "run":  # the run as set up, and again when its tags change
            metadata["tags"] = " ".join(record.run.tags)
            metadata.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            metadata.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return TrackedRun(series, {key: str(value) for key, value in metadata.items()})


def interval_steps(run_dir: Path) -> list[int]:
    """The steps whose log event carried an energy interval, from the trainer's own `trainer_state.json`."""
    history = json.loads((run_dir / "out" / "trainer_state.json").read_text())["log_history"]
    return [entry["step"] for entry in history if "energy/interval_j" in entry]


def _read_back(run_dir: Path) -> dict[str, TrackedRun]:
    return {
        "tensorboard": tensorboard_run(run_dir / "tensorboard"),
        "mlflow": mlflow_run((run_dir / "mlruns").as_uri()),
        "wandb": wandb_run(run_dir),
    }


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["zeus", "sft"])
def test_every_tracker_holds_the_energy_series_and_says_simulated(tmp_path, monkeypatch, trainer):
    """The README's way to the trackers (`class MyTrainer(ZeusTrainerMixin, Trainer)`, and the same with TRL's
    `SFTTrainer`): TensorBoard, MLflow and W&B each hold every interval series at each step where the trainer's
    log history has one, the optimizer's at every log event, the run's totals once at the end, all non-negative, the SIMULATED metrics, and a SIMULATED tag in the run's metadata."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _, run_dir = _train(tmp_path, trainer)
    intervals = interval_steps(run_dir)
    assert intervals and set(intervals) <= set(LOGGED_AT), intervals
    for tracker, run in _read_back(run_dir).items():
        for names, steps in (
            (INTERVAL_SERIES, intervals),
            (EVERY_LOG, [*LOGGED_AT, MAX_STEPS]),
            (RUN_TOTALS, [MAX_STEPS]),
        ):
            for name in names:
                series = run.series.get(name, [])
                assert [step for step, _ in series] == steps, (tracker, name, sorted(run.series))
                assert all(value >= 0 for _, value in series), (tracker, name, series)
        for name in SIMULATED:
            assert {value for _, value in run.series[name]} == {1.0}, (tracker, name)
        # TensorBoard's text, MLflow's tag, W&B's config entry; and W&B's run tag.
        assert run.metadata.get(SIMULATED_KEY, "").startswith("SIMULATED"), (tracker, run.metadata.keys())
        assert tracker != "wandb" or SIMULATED_TAG in run.metadata["tags"].split(), run.metadata["tags"]


@pytest.mark.system
@pytest.mark.slow
def test_a_plain_trainer_warns_that_its_trackers_miss_the_energy(tmp_path, monkeypatch):
    """A plain `Trainer(callbacks=[...])`: transformers runs the trackers before the
    user's callbacks, so they get no energy figure; the callback says so at WARNING (which scripts such as
    run_clm.py show; INFO they do not) and names the way that works."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    output, run_dir = _train(tmp_path, "plain")
    said = [line for line in output.splitlines() if "ZeusTrainerMixin" in line]
    assert len(said) == 1 and "tensorboard" in said[0] and "mlflow" in said[0] and "wandb" in said[0], output
    for tracker, run in _read_back(run_dir).items():
        assert "loss" in run.series, tracker  # the trainer's own metrics arrive
        assert not any(name.startswith(("energy/", "power_limit_optimizer/")) for name in run.series), tracker
