"""Real `transformers.Trainer` runs of a tiny GPT-2 on the CPU against a simulated A40, for the HF adapter tests
(and their child processes): `make_trainer`, the `node` fixture, the `Recorder` tracker. Needs transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from zeus_callbacks import sim
from zeus_callbacks.huggingface import ZeusTrainerMixin
from zeus_callbacks.sim import HFSimulatedGPUWork


class ZeusTrainer(ZeusTrainerMixin, Trainer):
    """The opt-in: GPUs back when `train()` raises, cut-short checkpoints skipped, metrics before trackers."""


MAX_W = 300  # the simulated A40's maximum power limit
# Small profiles: the grid is 300, 200, 100 W; each limit gets 1 warm-up step and 2 to 4 measured steps.
PLO_KW = {"wait_steps": 1, "warmup_steps": 1, "profile_steps": 4, "pl_step": 100}


def torch_node(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[sim.SimulatedSystem]:
    """The simulated node `spec`, its state in this test's directory, for a fixture to yield from; the simulator
    is off afterwards."""
    state_dir = tmp_path / "sim-state"
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_STATE_DIR", str(state_dir))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulator counts CPU time as GPU work
    # Toy steps of a few ms: a counter refreshed every 10 ms (a fast board's) lets the small profiles
    # below finish in a few dozen steps; the A40's 100 ms needs as many steps as 100 ms takes.
    system = sim.simulate(spec, state_dir=str(state_dir), energy_refresh_ms=10)
    yield system
    torch.set_num_threads(threads)
    sim.disable()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[sim.SimulatedSystem]:
    """One simulated A40 whose state lives in this test's directory; the simulator is off afterwards."""
    yield from torch_node("a40", tmp_path, monkeypatch)


class Recorder(TrainerCallback):
    """A tracker: keeps what `on_log` hands it, and the power limit in force at each step end."""

    def __init__(self, system: sim.SimulatedSystem | None = None) -> None:
        self.logs: list[dict] = []
        self.limits_w: list[int] = []
        self._system = system

    def on_step_end(self, args, state, control, **kwargs):
        if self._system is not None:
            self.limits_w.append(self._system.gpus[0].power_limit_mw // 1000)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


class ToyData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


STEP_GPU_WORK_S = 0.012


def make_trainer(
    tmp_path: Path, callbacks: list, max_steps: int, model=None, trainer_cls: type = Trainer, **kw
) -> Trainer:
    """A `Trainer` of `tiny_model` on `ToyData`; every step also queues `STEP_GPU_WORK_S` of simulated GPU work
    (`HFSimulatedGPUWork`): the step's pace is the simulated GPU's, not the host's; a step then spans a refresh
    of the 10 ms energy counter on any host."""
    callbacks = [*callbacks, HFSimulatedGPUWork(0, STEP_GPU_WORK_S)]
    kw = {"logging_steps": 5, "save_strategy": "no", **kw}
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        **kw,
    )
    return trainer_cls(model=model or tiny_model(), args=args, train_dataset=ToyData(), callbacks=callbacks)
