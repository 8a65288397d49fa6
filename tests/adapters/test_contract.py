"""The adapter contract, executable (issue 39): every adapter class, driven by its real framework on the CPU
with a simulated GPU through scripted runs, makes exactly the session calls of the contract
(`zeus_callbacks.core.power_limit.session`, `zeus_callbacks.core.monitor.session`).

The sessions' classes are recorded (each contract method logs its call, then runs as usual), so what is
checked is what the adapter asks of its session, in the framework's own event order. Registering an adapter:
one line in `ADAPTERS` (its framework's driver, its kind, the class). The scripted runs:

- `end`: 2 epochs of 4 optimizer steps, to the end;
- `raise`: the 6th step raises mid-epoch (after 5 steps and 1 epoch);
- `resume`: 1 epoch saved in the framework's checkpoint, then 1 more epoch resumed from it (the calls of the
  resumed run are checked; the first run's must include `state_dict`, a power-limit adapter's checkpoint);
- `zeus`: 3 epochs under `search="zeus"`, where every epoch end must reach the optimizer.

Only the calls' order and counts are asserted (no time, no energy): the outcome is the same on any host.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import Unpack

from zeus_callbacks import ZeusMonitor
from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor.session import EnergySession
from zeus_callbacks.core.power_limit.keywords import OptimizerArguments, PowerLimitArguments
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.options import ZEUS_POSITIONAL, PowerLimitOptions
from zeus_callbacks.core.power_limit.session import PowerLimitSession

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

try:  # DeepSpeed probes its accelerator in a subprocess when first imported, which transformers' first Trainer
    import deepspeed  # noqa: F401  does: imported here, at collection, it is no test's subprocess (tests/tiers.py)
except ImportError:
    pass

OPTIONS = {"wait_steps": 1, "warmup_steps": 1, "profile_steps": 2, "pl_step": 100}
STEPS_PER_EPOCH, RAISE_AFTER = 4, 5
COLLECTIVES = ("all_reduce", "all_reduce_record", "broadcast_object", "all_gather_object")
CONTRACT = (
    "load_state", "start", "step_begin", "step_end", "epoch_end", "interval_metrics", "summary", "end", "fail",
    "state_dict",
)  # fmt: skip


@dataclass(frozen=True)
class Adapter:
    framework: str  # a key of `DRIVERS`
    kind: str  # "power_limit" (a `PowerLimitSession`) or "energy" (an `EnergySession`)
    module: str
    name: str

    @property
    def cls(self) -> type:
        pytest.importorskip(DRIVERS[self.framework].needs)
        return getattr(importlib.import_module(self.module), self.name)

    def build(self, first: Any, search: str = "adaptive", **own: Any) -> Any:
        """The adapter on `first` (the monitor, or the Accelerate helpers' accelerator)."""
        if self.kind == "power_limit":
            return self.cls(first, **OPTIONS, search=search, **own)
        return self.cls(first, **own)


ADAPTERS = [
    Adapter("hf", "power_limit", "zeus_callbacks.huggingface", "HFGlobalPowerLimitOptimizer"),
    Adapter("hf", "energy", "zeus_callbacks.huggingface", "HFZeusMonitor"),
    Adapter("lightning", "power_limit", "zeus_callbacks.lightning", "LightningGlobalPowerLimitOptimizer"),
    Adapter("lightning", "energy", "zeus_callbacks.lightning", "LightningZeusMonitor"),
    Adapter("accelerate", "power_limit", "zeus_callbacks.accelerate", "PowerLimitOptimizerHelper"),
    Adapter("accelerate", "energy", "zeus_callbacks.accelerate", "ZeusMonitorHelper"),
    Adapter("ignite", "power_limit", "zeus_callbacks.ignite", "IgnitePowerLimitOptimizer"),
    Adapter("ignite", "energy", "zeus_callbacks.ignite", "IgniteZeusMonitor"),
]


@dataclass(frozen=True)
class Run:
    """One scripted run: its epochs of `STEPS_PER_EPOCH` steps, whether the step after `RAISE_AFTER` raises,
    where it saves its checkpoint and which one it resumes from, and the search."""

    epochs: int
    fail: bool = False
    checkpoint: str | None = None
    resume: str | None = None
    search: str = "adaptive"


class Failed(RuntimeError):
    """The scripted failure."""


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(4 * STEPS_PER_EPOCH, 8)), batch_size=4)


def _fails(steps_done: int, fail: bool) -> None:
    if fail and steps_done == RAISE_AFTER:
        raise Failed("training failed mid-epoch")


# -- one driver per framework: `run(adapter, tmp_path, Run(...))` ------------------------------------------
class HFDriver:
    needs = "transformers"

    def run(self, adapter: Adapter, tmp: Path, run: Run) -> None:
        from hf_trainers import ZeusTrainer, tiny_model
        from transformers import TrainerCallback, TrainingArguments

        class Data(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return 4 * STEPS_PER_EPOCH

            def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
                x = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(i))
                return {"input_ids": x, "labels": x}

        class Raises(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                _fails(state.global_step, run.fail)

        saving = {"save_strategy": "epoch"} if run.checkpoint else {"save_strategy": "no"}
        if run.resume:  # transformers' second path: it rebuilds the callback and sets its saved attributes
            saving["restore_callback_states_from_checkpoint"] = True
        args = TrainingArguments(
            output_dir=str(tmp / "hf"), num_train_epochs=run.epochs, per_device_train_batch_size=4, use_cpu=True,
            report_to=[], disable_tqdm=True, logging_steps=2, **saving,
        )  # fmt: skip
        callbacks = [adapter.build(ZeusMonitor(gpu_indices=[0]), run.search), Raises()]
        trainer = ZeusTrainer(model=tiny_model(), args=args, train_dataset=Data(), callbacks=callbacks)
        trainer.train(
            resume_from_checkpoint=str(tmp / "hf" / f"checkpoint-{STEPS_PER_EPOCH}") if run.resume else None
        )


class LightningDriver:
    needs = "lightning"

    def run(self, adapter: Adapter, tmp: Path, run: Run) -> None:
        import lightning.pytorch as L

        class Tiny(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(8, 1)

            def training_step(self, batch, batch_idx):
                _fails(self.trainer.global_step, run.fail)
                return self.layer(batch[0]).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=run.epochs, logger=False, log_every_n_steps=2,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[adapter.build(ZeusMonitor(gpu_indices=[0]), run.search)],
        )  # fmt: skip
        trainer.fit(Tiny(), _loader(), ckpt_path=run.resume)
        if run.checkpoint:
            trainer.save_checkpoint(run.checkpoint)


class AccelerateDriver:
    needs = "accelerate"

    def run(self, adapter: Adapter, tmp: Path, run: Run) -> None:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt, loader = accelerator.prepare(model, opt, _loader())
        helper = adapter.build(accelerator, run.search, log_every_n_steps=2)
        if run.resume:
            accelerator.load_state(run.resume)
        done = 0
        with helper:
            for _ in range(1 if run.resume else 0, run.epochs):  # the loop keeps its own epoch count
                for (x,) in loader:
                    with helper.step():
                        _fails(done, run.fail)
                        accelerator.backward(model(x).pow(2).mean())
                        opt.step()
                        opt.zero_grad()
                    done += 1
                if adapter.kind == "power_limit":
                    helper.epoch_end()
        if run.checkpoint:
            accelerator.save_state(run.checkpoint)


class IgniteDriver:
    needs = "ignite"

    def run(self, adapter: Adapter, tmp: Path, run: Run) -> None:
        from ignite.engine import Engine
        from ignite.handlers import Checkpoint, DiskSaver

        model = torch.nn.Linear(8, 1)

        def update(engine, batch):
            _fails(engine.state.iteration - 1, run.fail)
            return model(batch[0]).pow(2).mean().item()

        engine = Engine(update)
        zeus = adapter.build(ZeusMonitor(gpu_indices=[0]), run.search, log_every_n_steps=2)
        zeus.attach(engine)
        objects = {
            "model": model,
            "trainer": engine,
            **({"zeus": zeus} if adapter.kind == "power_limit" else {}),
        }
        if run.resume:
            (saved,) = Path(run.resume).glob("*.pt")
            Checkpoint.load_objects(objects, torch.load(saved, weights_only=False))
        engine.run(_loader(), max_epochs=run.epochs)
        if run.checkpoint:
            Checkpoint(objects, DiskSaver(run.checkpoint, require_empty=False))(engine)


DRIVERS: dict[str, Any] = {
    "hf": HFDriver(),
    "lightning": LightningDriver(),
    "accelerate": AccelerateDriver(),
    "ignite": IgniteDriver(),
}


# -- the recording session --------------------------------------------------------------------------------
@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, sim_gpus) -> Iterator[list[tuple[str, Any]]]:
    """Every contract call the sessions get, as `(method, result)`, in order."""
    sim_gpus("a40", energy_refresh_ms=10)
    seen: list[tuple[str, Any]] = []

    def recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def method(*args, **kwargs):
            result = original(*args, **kwargs)
            seen.append((name, result))
            return result

        return method

    for cls in (PowerLimitSession, EnergySession):
        for name in CONTRACT:
            if hasattr(cls, name):
                monkeypatch.setattr(cls, name, recording(name, getattr(cls, name)))
    # The collectives, to see that a rank that failed enters none (its peers may not have failed).
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, recording(name, getattr(dist, name)))
    # The optimizer's own loading, to see that the session is its only caller.
    load = GlobalPowerLimitOptimizer.load_state_dict
    monkeypatch.setattr(
        GlobalPowerLimitOptimizer, "load_state_dict", recording("optimizer.load_state_dict", load)
    )
    yield seen


def _ids(adapters: list[Adapter]) -> list[Any]:
    return [pytest.param(a, id=a.name) for a in adapters]


def _check_run(
    calls: list[tuple[str, Any]], adapter: Adapter, steps: int, epochs: int, resumed: bool = False
):
    """The calls of one run that ended normally."""
    loads = [n for n, _ in calls].count("optimizer.load_state_dict")
    names = [
        n
        for n, _ in calls
        if n not in ("step_begin", "state_dict", "optimizer.load_state_dict", *COLLECTIVES)
    ]
    closed = sum(1 for n, r in calls if n == "step_end" and r)
    assert loads == names.count("load_state"), "the optimizer's state is loaded around the session"
    first = ["load_state", "start"] if resumed and adapter.kind == "power_limit" else ["start"]
    assert names[: len(first)] == first, names[:5]
    assert names[-2:] == ["summary", "end"] and names.count("summary") == names.count("end") == 1, names[-5:]
    assert closed == steps, (closed, steps)
    assert names.count("epoch_end") == (epochs if adapter.kind == "power_limit" else 0)
    assert "interval_metrics" in names[len(first) : -2]
    assert "fail" not in names and names.count("start") == 1
    assert names.count("load_state") == (1 if resumed and adapter.kind == "power_limit" else 0)
    every = [n for n, _ in calls]
    assert every.index("start") < every.index("step_begin")  # no step before the run starts


@pytest.mark.parametrize("adapter", _ids(ADAPTERS))
def test_a_run_to_the_end(adapter: Adapter, calls, tmp_path: Path) -> None:
    DRIVERS[adapter.framework].run(adapter, tmp_path, Run(epochs=2))
    _check_run(calls, adapter, steps=2 * STEPS_PER_EPOCH, epochs=2)
    assert get_gpus()[0].power_limit_mw() == 300_000  # the GPU's own limit again


@pytest.mark.parametrize("adapter", _ids(ADAPTERS))
def test_a_run_that_raises_mid_epoch_fails_without_figures(adapter: Adapter, calls, tmp_path: Path) -> None:
    """`fail` is the last call: no `summary` and no `end` (no collective on a rank that failed)."""
    with pytest.raises(Failed):
        DRIVERS[adapter.framework].run(adapter, tmp_path, Run(epochs=2, fail=True))
    every = [n for n, _ in calls]
    failing_step = len(every) - every[::-1].index("step_begin")
    assert every[failing_step:] == ["fail"], every[failing_step - 3 :]  # no collective after the failure
    names = [
        n
        for n, _ in calls
        if n not in ("step_begin", "state_dict", "optimizer.load_state_dict", *COLLECTIVES)
    ]
    assert names[0] == "start" and names.count("fail") == 1, names
    assert "summary" not in names and "end" not in names
    assert sum(1 for n, r in calls if n == "step_end" and r) == RAISE_AFTER
    assert names.count("epoch_end") == (1 if adapter.kind == "power_limit" else 0)
    assert get_gpus()[0].power_limit_mw() == 300_000


@pytest.mark.parametrize("adapter", _ids(ADAPTERS))
def test_a_run_resumed_from_a_checkpoint(adapter: Adapter, calls, tmp_path: Path) -> None:
    """A power-limit adapter's checkpoint holds `state_dict()`, and the resumed run `load_state`s it before
    `start`; an energy monitor's resumed run is a run of its own."""
    saved = tmp_path / "checkpoint"
    driver = DRIVERS[adapter.framework]
    driver.run(adapter, tmp_path, Run(epochs=1, checkpoint=str(saved)))
    assert ("state_dict" in [n for n, _ in calls]) == (adapter.kind == "power_limit")
    calls.clear()
    driver.run(adapter, tmp_path, Run(epochs=2, resume=str(saved)))
    _check_run(calls, adapter, steps=STEPS_PER_EPOCH, epochs=1, resumed=True)


@pytest.mark.parametrize("adapter", _ids([a for a in ADAPTERS if a.kind == "power_limit"]))
def test_every_epoch_end_reaches_the_optimizer_under_search_zeus(adapter: Adapter, calls, tmp_path) -> None:
    DRIVERS[adapter.framework].run(adapter, tmp_path, Run(epochs=3, search="zeus"))
    _check_run(calls, adapter, steps=3 * STEPS_PER_EPOCH, epochs=3)


# -- the options record -----------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", _ids([a for a in ADAPTERS if a.kind == "power_limit"]))
def test_every_adapter_takes_the_options_record(adapter: Adapter) -> None:
    """Names and defaults come from `PowerLimitOptions` alone: every power-limit adapter's signature is the
    monitor (the helper's accelerator), then every option with the record's default (Zeus's positional ones
    by position only in Zeus's two classes), then the adapter's own, keyword-only."""
    record = [(f.name, f.default) for f in fields(PowerLimitOptions) if f.default is not MISSING]
    params = list(inspect.signature(adapter.cls).parameters.values())[1:]
    assert [(p.name, p.default) for p in params[: len(record)]] == record
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    zeus_class = adapter.name == "HFGlobalPowerLimitOptimizer"
    assert positional == list(ZEUS_POSITIONAL if zeus_class else ("optimum_selector",))
    assert all(p.kind is p.KEYWORD_ONLY for p in params[len(record) :])
    with pytest.raises(TypeError, match=rf"`{adapter.name}\(\.\.\.\)`.*unexpected keyword argument 'warmup'"):
        adapter.cls(None, warmup=3)


@pytest.mark.parametrize("adapter", [a for a in ADAPTERS if a.kind == "power_limit"], ids=lambda a: a.name)
def test_type_checkers_see_every_option(adapter: Adapter) -> None:
    """Issue 39: `**options` hid the options' names and types from type checkers and IDEs. Every power-limit
    adapter's `**options` is `Unpack[PowerLimitArguments]`, whose names and types are the record's (less
    `optimum_selector`, a parameter of its own); the core optimizer's is the same less `report_path`."""
    types = typing.get_type_hints(PowerLimitOptions)
    record = {f.name: types[f.name] for f in fields(PowerLimitOptions) if f.name != "optimum_selector"}
    assert typing.get_type_hints(PowerLimitArguments) == record
    assert set(record) - set(typing.get_type_hints(OptimizerArguments)) == {"report_path"}
    for owner, arguments in (
        (adapter.cls, PowerLimitArguments),
        (GlobalPowerLimitOptimizer, OptimizerArguments),
    ):
        init = owner.__init__
        options = eval(init.__annotations__["options"], vars(importlib.import_module(init.__module__)))
        assert options == Unpack[arguments], owner


# Modules where a power-limit option's name means another tool's option (the pipeline-frequency optimizer,
# the heterogeneous profiler and planner and their CLIs) or the demo's own shorter run: their defaults are theirs.
OTHER_TOOLS = (
    "core/pipeline_frequency/",
    "core/heterogeneous/",
    "cli/profile.py",
    "cli/plan.py",
    "cli/demo.py",
)


def test_the_options_defaults_are_written_once() -> None:
    """Issue 39: the options' defaults were written in 5 places. Outside `options.py` no parameter named after
    an option has a literal default, and no command-line flag named after one a literal `default=`: they
    take the record's (`PowerLimitOptions.<name>`) or none."""
    package = Path(importlib.import_module("zeus_callbacks").__file__).parent
    names = {f.name for f in fields(PowerLimitOptions)}
    written = []
    for path in sorted(package.rglob("*.py")):
        module = str(path.relative_to(package))
        if module == "core/power_limit/options.py" or module.startswith(OTHER_TOOLS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arguments):
                params = [*node.posonlyargs, *node.args]
                pairs = list(zip(params[len(params) - len(node.defaults) :], node.defaults, strict=True))
                pairs += [(p, d) for p, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d]
                written += [
                    f"{module}:{node_line(d)} {p.arg}={ast.unparse(d)}"
                    for p, d in pairs
                    if p.arg in names and isinstance(d, ast.Constant) and d.value is not None
                ]
            elif (
                isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
            ):
                flag = node.args[0]
                name = flag.value.lstrip("-").replace("-", "_") if isinstance(flag, ast.Constant) else ""
                written += [
                    f"{module}:{node_line(k.value)} --{name} default={ast.unparse(k.value)}"
                    for k in node.keywords
                    if name in names and k.arg == "default" and isinstance(k.value, ast.Constant)
                ]
    assert not written, f"an option's default written again (take PowerLimitOptions.<name>): {written}"


def node_line(node: ast.AST) -> int:
    return getattr(node, "lineno", 0)


def test_the_core_optimizer_and_the_accelerate_function_take_the_record(sim_gpus) -> None:
    """The two power-limit entry points that are no adapter class: `GlobalPowerLimitOptimizer`'s signature is
    the record's names and defaults (less `report_path`, the adapters' own), and `prepare_power_limit_optimizer`
    takes `**options: Unpack[PowerLimitArguments]`, building the record from them (a wrong name refused)."""
    pytest.importorskip("accelerate")
    from zeus_callbacks.accelerate import prepare_power_limit_optimizer

    record = [(f.name, f.default) for f in fields(PowerLimitOptions) if f.default is not MISSING]
    params = list(inspect.signature(GlobalPowerLimitOptimizer).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == [(n, d) for n, d in record if n != "report_path"]
    module = vars(importlib.import_module(prepare_power_limit_optimizer.__module__))
    assert (
        eval(prepare_power_limit_optimizer.__annotations__["options"], module) == Unpack[PowerLimitArguments]
    )
    sim_gpus("a40")
    with pytest.raises(TypeError, match="warmup"):
        prepare_power_limit_optimizer(None, warmup=3)
