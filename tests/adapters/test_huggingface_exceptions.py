"""An exception that leaves `trainer.train()` but not the process puts the GPU back at once, with the opt-in
(`ZeusTrainerMixin`, `restoring_gpus`; real Trainer); a plain Trainer is not patched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from zeus_callbacks import sim  # noqa: E402
from zeus_callbacks.core.device.state_guard import guard  # noqa: E402
from zeus_callbacks.core.heterogeneous.training import RankPlan  # noqa: E402
from zeus_callbacks.core.monitor.monitor import ZeusMonitor  # noqa: E402
from zeus_callbacks.huggingface import (  # noqa: E402
    HeterogeneousTrainer,
    HFGlobalPowerLimitOptimizer,
    ZeusTrainerMixin,
    restoring_gpus,
)

pytestmark = pytest.mark.system  # other processes or the real clock (tests/tiers.py)


class ZeusTrainer(ZeusTrainerMixin, Trainer):
    """The opt-in that restores the GPUs the moment `train()` raises."""


MAX_W = 300  # the simulated A40's maximum power limit
PLO_KW = {"wait_steps": 1, "warmup_steps": 1, "profile_steps": 2, "pl_step": 100}


@pytest.fixture
def node(sim_gpus) -> Iterator[sim.SimulatedSystem]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulator counts CPU time as GPU work
    yield sim_gpus("a40")
    torch.set_num_threads(threads)


class Model(torch.nn.Module):
    """A linear model; its forward raises while `fail_below_w` is set and the GPU is below that limit."""

    def __init__(self, system: sim.SimulatedSystem) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.system = system
        self.fail_below_w: int | None = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        limit_w = self.system.gpus[0].power_limit_mw // 1000
        if self.fail_below_w is not None and limit_w < self.fail_below_w:
            raise RuntimeError(f"forward failed at {limit_w} W")
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class FailBelow(TrainerCallback):
    """Raises from `on_step_end` (outside `training_step`) once the GPU runs below `limit_w`."""

    def __init__(self, system: sim.SimulatedSystem, limit_w: int = MAX_W) -> None:
        self.system, self.limit_w = system, limit_w

    def on_step_end(self, args, state, control, **kwargs):
        self.failed_at_w = self.system.gpus[0].power_limit_mw // 1000
        if self.failed_at_w < self.limit_w:
            raise RuntimeError("callback failed below the maximum limit")


DATA = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(256)]


def trainer_args(tmp_path: Path, max_steps: int = 40) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
    )


def monitor() -> ZeusMonitor:
    return ZeusMonitor([0], approx_instant_energy=True)  # steps of a few ms, shorter than a refresh


def assert_restored_now(system: sim.SimulatedSystem) -> None:
    """The limit is back and nothing is left to restore, before any later process or exit runs."""
    assert system.gpus[0].power_limit_mw == MAX_W * 1000
    assert not guard().entries  # nothing journaled is left for exit or a repair


def failing_plain_trainer(system: sim.SimulatedSystem, tmp_path: Path) -> tuple[Trainer, FailBelow]:
    """A plain `Trainer` (no `ZeusTrainerMixin`) whose callbacks are the power-limit optimizer and a `FailBelow`,
    returned too."""
    fail = FailBelow(system)
    callbacks = [HFGlobalPowerLimitOptimizer(monitor(), **PLO_KW), fail]
    trainer = Trainer(
        model=Model(system), args=trainer_args(tmp_path), train_dataset=DATA, callbacks=callbacks
    )
    return trainer, fail


def test_callbacks_given_at_construction(node, tmp_path):
    fail = FailBelow(node)
    plo = HFGlobalPowerLimitOptimizer(monitor(), **PLO_KW)
    trainer = ZeusTrainer(
        model=Model(node), args=trainer_args(tmp_path), train_dataset=DATA, callbacks=[plo, fail]
    )
    with pytest.raises(RuntimeError, match="callback failed"):
        trainer.train()
    assert fail.failed_at_w == 200
    assert_restored_now(node)
    assert plo.optimizer.monitor.open_windows == []  # the energy reporter's windows are closed too


def test_callback_added_later_first_call_fails_in_training_step(node, tmp_path):
    model = Model(node)
    model.fail_below_w = MAX_W
    trainer = ZeusTrainer(model=model, args=trainer_args(tmp_path), train_dataset=DATA)
    trainer.add_callback(HFGlobalPowerLimitOptimizer(monitor(), **PLO_KW))
    with pytest.raises(RuntimeError, match="forward failed at 200 W"):
        trainer.train()
    assert_restored_now(node)


def test_callback_added_later_second_call_fails_anywhere(node, tmp_path):
    trainer = ZeusTrainer(model=Model(node), args=trainer_args(tmp_path, max_steps=4), train_dataset=DATA)
    plo = HFGlobalPowerLimitOptimizer(monitor(), **PLO_KW)
    trainer.add_callback(plo)
    trainer.train()  # too short to leave the maximum limit
    trainer.args.max_steps = 40
    trainer.add_callback(FailBelow(node))
    with pytest.raises(RuntimeError, match="callback failed"):
        trainer.train()
    assert_restored_now(node)
    # A caught failure leaves a trainer that trains again, and restores at its end as usual.
    trainer.pop_callback(FailBelow)
    trainer.train()
    assert plo.optimizer.phase == "done"
    assert_restored_now(node)


def test_heterogeneous_trainer(node, tmp_path):
    plan = RankPlan(
        rank=0, world_size=1, gpu_name="a40", local_batch=2, global_batch=2, offset=0, power_limit_w=150
    )
    trainer = HeterogeneousTrainer(
        model=Model(node),
        args=trainer_args(tmp_path),
        train_dataset=DATA,
        rank_plan=plan,
        callbacks=[FailBelow(node)],
    )
    with pytest.raises(RuntimeError, match="callback failed"):
        trainer.train()
    assert_restored_now(node)


def test_keyboard_interrupt_in_a_notebook_cell(node, tmp_path):
    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if node.gpus[0].power_limit_mw < MAX_W * 1000:
                raise KeyboardInterrupt

    plo = HFGlobalPowerLimitOptimizer(monitor(), **PLO_KW)
    trainer = ZeusTrainer(
        model=Model(node), args=trainer_args(tmp_path), train_dataset=DATA, callbacks=[plo, Interrupt()]
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert_restored_now(node)


def test_with_guard_on_a_plain_trainer(node, tmp_path):
    trainer, fail = failing_plain_trainer(node, tmp_path)
    with pytest.raises(RuntimeError, match="callback failed"), restoring_gpus(trainer):
        trainer.train()
    assert_restored_now(node)


def test_a_plain_trainer_without_the_opt_in_is_left_as_transformers_makes_it(node, tmp_path):
    """No process-wide patch: the GPU stays as the failed run left it until exit (or the opt-in)."""
    train = Trainer.train
    trainer, fail = failing_plain_trainer(node, tmp_path)
    with pytest.raises(RuntimeError, match="callback failed"):
        trainer.train()
    assert Trainer.train is train
    assert node.gpus[0].power_limit_mw == fail.failed_at_w * 1000 < MAX_W * 1000
    assert guard().entries  # journaled: exit (or a later restore) puts it back
    guard().restore()
    assert_restored_now(node)


class _Events:
    """IPython's `EventManager` as IPython 8's `IPython/core/events.py` has it (IPython is not installed
    here): `callbacks` by event, `register` (once per function), `unregister`, and `trigger` over a copy of
    the list, so a callback may unregister itself."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list] = {"pre_run_cell": [], "post_run_cell": []}

    def register(self, event, function):
        if function not in self.callbacks[event]:
            self.callbacks[event].append(function)

    def unregister(self, event, function):
        if function in self.callbacks[event]:
            return self.callbacks[event].remove(function)
        raise ValueError(f"Function {function!r} is not registered as a {event} callback")

    def trigger(self, event, *args, **kwargs):
        for func in self.callbacks[event][:]:
            func(*args, **kwargs)


@pytest.fixture
def notebook(monkeypatch):
    """This process as an IPython kernel: `IPython.get_ipython()` answers a shell whose events are `_Events`."""
    import sys
    import types

    shell = types.SimpleNamespace(events=_Events())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    return shell


def test_a_plain_trainer_in_a_notebook_is_put_back_when_the_failed_cell_ends(
    node, tmp_path, notebook, caplog
):
    """Issue 38 item 5: a plain `Trainer` whose `train()` raises in a notebook cell. Nothing is patched; the
    callbacks watch IPython's `post_run_cell` for the run, so when the cell ends the GPU is put back, with one
    warning that says why and names the opt-in. On the parent commit the GPU stayed at the failed run's
    limit until the kernel exited."""
    train = Trainer.train
    trainer, fail = failing_plain_trainer(node, tmp_path)
    with pytest.raises(RuntimeError, match="callback failed"):  # the cell raises
        trainer.train()
    assert node.gpus[0].power_limit_mw == fail.failed_at_w * 1000 < MAX_W * 1000  # until the cell ends
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        notebook.events.trigger("post_run_cell", None)  # IPython, as the cell ends
    assert_restored_now(node)
    said = [r.getMessage() for r in caplog.records if "raised in this cell" in r.getMessage()]
    assert len(said) == 1 and "ZeusTrainerMixin" in said[0] and "restoring_gpus" in said[0], caplog.text
    assert notebook.events.callbacks["post_run_cell"] == []  # watched for the run only
    assert Trainer.train is train


def test_a_plain_trainer_that_completes_in_a_notebook_leaves_no_watcher(node, tmp_path, notebook, caplog):
    trainer = Trainer(
        model=Model(node),
        args=trainer_args(tmp_path, max_steps=4),
        train_dataset=DATA,
        callbacks=[HFGlobalPowerLimitOptimizer(monitor(), **PLO_KW)],
    )
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer.train()
        notebook.events.trigger("post_run_cell", None)
    assert notebook.events.callbacks["post_run_cell"] == []
    assert not [r for r in caplog.records if "raised" in r.getMessage()]


def test_a_caught_failure_on_a_plain_trainer_is_put_back_at_the_next_run(node, tmp_path, caplog):
    """Outside IPython (a script that catches the exception and trains again): the next run of the same
    callbacks puts the GPU back first, with one warning."""
    trainer, fail = failing_plain_trainer(node, tmp_path)
    with pytest.raises(RuntimeError, match="callback failed"):
        trainer.train()
    assert node.gpus[0].power_limit_mw < MAX_W * 1000
    trainer.pop_callback(FailBelow)
    seen: list[int] = []

    class First(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(node.gpus[0].power_limit_mw)

    trainer.add_callback(First())  # after the optimizer: sees what its on_train_begin left
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer.train()
    assert seen == [MAX_W * 1000]
    said = [r.getMessage() for r in caplog.records if "last trainer.train() raised" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert_restored_now(node)
