"""The adapter mistakes of issue 37: each gets an error that names the mistake and the fix, raised where the
mistake is made (the framework's trainer built, or `fit`), instead of Python's bare `AttributeError ...
on_init_end` or `TypeError: missing ... monitor`. The non-adapter rows are in tests/test_mistakes.py.

The rows (`MISTAKES`):

- transformers' `Trainer(callbacks=[...])` given a Lightning callback (`LightningGlobalPowerLimitOptimizer`,
  `LightningZeusMonitor`), the core `GlobalPowerLimitOptimizer`, an Accelerate helper or an Ignite handler:
  `AttributeError` naming what it is and the HF class to pass (`OneFramework`);
- `Trainer(callbacks=[HFGlobalPowerLimitOptimizer])` or `[HFZeusMonitor]`, the class instead of an instance
  (transformers builds it with no arguments), and `HFGlobalPowerLimitOptimizer()` with no monitor:
  `TypeError` saying to pass an instance with its `ZeusMonitor` (`BuiltByTheUser`);
- `monitor=None`: `ValueError` saying to pass a `ZeusMonitor` (every adapter, `require_monitor`);
- Lightning's `Trainer(callbacks=[...])` given `HFGlobalPowerLimitOptimizer` or `HFZeusMonitor` (at `fit`),
  or the core optimizer (when the trainer is built): `AttributeError` naming the Lightning class to pass;
- `PowerLimitOptimizerHelper(ZeusMonitor(...))` / `ZeusMonitorHelper(ZeusMonitor(...))`, a monitor where
  the accelerator goes: `TypeError` saying to pass the accelerator.

Not covered: a Lightning callback *class* given to Lightning's `Trainer` (Lightning calls its hooks unbound;
it fails with Lightning's own `TypeError`), and a `ZeusMonitor` given as a callback (the monitor is not an
adapter).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from zeus_callbacks import ZeusMonitor, sim  # noqa: E402
from zeus_callbacks.accelerate import PowerLimitOptimizerHelper, ZeusMonitorHelper  # noqa: E402
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer  # noqa: E402
from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer, HFZeusMonitor  # noqa: E402
from zeus_callbacks.ignite import IgnitePowerLimitOptimizer  # noqa: E402
from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer, LightningZeusMonitor  # noqa: E402

try:  # DeepSpeed probes its accelerator in a subprocess when first imported, which transformers' first Trainer
    import deepspeed  # noqa: F401  does: imported here, at collection, it is no test's subprocess (tests/tiers.py)
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _one_gpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sim.simulate("a40", virtual_clock=True)
    yield
    sim.disable()


def hf_trainer(callback: Any) -> None:
    args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], max_steps=1)
    Trainer(model=torch.nn.Linear(2, 1), args=args, callbacks=[callback])


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)


def lightning_fit(callback: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            callbacks=[callback],
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
        )
        trainer.fit(_Module())


def monitor() -> ZeusMonitor:
    return ZeusMonitor([0])


@dataclass(frozen=True)
class Mistake:
    id: str
    make: Callable[[], None]  # makes the mistake
    error: type[Exception]
    says: str  # a regular expression: the mistake and the fix, in the message


MISTAKES = [
    Mistake(
        "lightning-plo-to-hf",
        lambda: hf_trainer(LightningGlobalPowerLimitOptimizer(monitor())),
        AttributeError,
        r"LightningGlobalPowerLimitOptimizer was given to transformers' Trainer.*a Lightning callback.*"
        r"Pass zeus_callbacks\.HFGlobalPowerLimitOptimizer\(monitor",
    ),
    Mistake(
        "lightning-monitor-to-hf",
        lambda: hf_trainer(LightningZeusMonitor(monitor())),
        AttributeError,
        r"LightningZeusMonitor was given to transformers' Trainer.*Pass zeus_callbacks\.HFZeusMonitor\(monitor\)",
    ),
    Mistake(
        "core-optimizer-to-hf",
        lambda: hf_trainer(GlobalPowerLimitOptimizer(monitor())),
        AttributeError,
        r"GlobalPowerLimitOptimizer was given to transformers' Trainer.*framework-free power-limit optimizer.*"
        r"Pass zeus_callbacks\.HFGlobalPowerLimitOptimizer",
    ),
    Mistake(
        "accelerate-helper-to-hf",
        lambda: hf_trainer(PowerLimitOptimizerHelper(None)),
        AttributeError,
        r"PowerLimitOptimizerHelper was given to transformers' Trainer.*Accelerate.*"
        r"Pass zeus_callbacks\.HFGlobalPowerLimitOptimizer",
    ),
    Mistake(
        "ignite-handler-to-hf",
        lambda: hf_trainer(IgnitePowerLimitOptimizer(monitor())),
        AttributeError,
        r"IgnitePowerLimitOptimizer was given to transformers' Trainer.*Ignite handler.*"
        r"Pass zeus_callbacks\.HFGlobalPowerLimitOptimizer",
    ),
    Mistake(
        "hf-plo-class-to-hf",
        lambda: hf_trainer(HFGlobalPowerLimitOptimizer),
        TypeError,
        r"`HFGlobalPowerLimitOptimizer\(\)` was built without arguments.*pass an instance, "
        r"`callbacks=\[HFGlobalPowerLimitOptimizer\(ZeusMonitor",
    ),
    Mistake(
        "hf-monitor-class-to-hf",
        lambda: hf_trainer(HFZeusMonitor),
        TypeError,
        r"`HFZeusMonitor\(\)` was built without arguments.*pass an instance, `callbacks=\[HFZeusMonitor\(ZeusMonitor",
    ),
    Mistake(
        "hf-plo-without-monitor",
        lambda: HFGlobalPowerLimitOptimizer(),  # type: ignore[call-arg]
        TypeError,
        r"`HFGlobalPowerLimitOptimizer\(\)` was built without arguments: it needs the zeus_callbacks\.ZeusMonitor",
    ),
    Mistake(
        "hf-plo-monitor-none",
        lambda: HFGlobalPowerLimitOptimizer(None),  # type: ignore[arg-type]
        ValueError,
        r"`HFGlobalPowerLimitOptimizer\(monitor=None\)`: pass a zeus_callbacks\.ZeusMonitor",
    ),
    Mistake(
        "lightning-plo-monitor-none",
        lambda: LightningGlobalPowerLimitOptimizer(None),  # type: ignore[arg-type]
        ValueError,
        r"`LightningGlobalPowerLimitOptimizer\(monitor=None\)`: pass a zeus_callbacks\.ZeusMonitor",
    ),
    Mistake(
        "hf-plo-to-lightning",
        lambda: lightning_fit(HFGlobalPowerLimitOptimizer(monitor())),
        AttributeError,
        r"HFGlobalPowerLimitOptimizer was given to Lightning's Trainer.*a transformers TrainerCallback.*"
        r"Pass zeus_callbacks\.LightningGlobalPowerLimitOptimizer\(monitor",
    ),
    Mistake(
        "hf-monitor-to-lightning",
        lambda: lightning_fit(HFZeusMonitor(monitor())),
        AttributeError,
        r"HFZeusMonitor was given to Lightning's Trainer.*Pass zeus_callbacks\.LightningZeusMonitor\(monitor\)",
    ),
    Mistake(
        "core-optimizer-to-lightning",
        lambda: lightning_fit(GlobalPowerLimitOptimizer(monitor())),
        AttributeError,
        r"GlobalPowerLimitOptimizer was given to Lightning's Trainer.*"
        r"Pass zeus_callbacks\.LightningGlobalPowerLimitOptimizer",
    ),
    Mistake(
        "monitor-to-accelerate-plo-helper",
        lambda: PowerLimitOptimizerHelper(monitor()),  # type: ignore[arg-type]
        TypeError,
        r"`PowerLimitOptimizerHelper\(ZeusMonitor\(\.\.\.\)\)`: its first argument is the run's "
        r"accelerate\.Accelerator.*Pass the accelerator",
    ),
    Mistake(
        "monitor-to-accelerate-monitor-helper",
        lambda: ZeusMonitorHelper(monitor()),  # type: ignore[arg-type]
        TypeError,
        r"`ZeusMonitorHelper\(ZeusMonitor\(\.\.\.\)\)`.*or the one given as `monitor=`",
    ),
]


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.id)
def test_each_adapter_mistake_names_the_mistake_and_the_fix(mistake: Mistake) -> None:
    with pytest.raises(mistake.error, match=mistake.says):
        mistake.make()


def test_the_right_objects_are_still_accepted() -> None:
    """The checks refuse nothing that is right: each class in its own framework."""
    hf_trainer(HFGlobalPowerLimitOptimizer(monitor()))
    hf_trainer(HFZeusMonitor(monitor()))
    lightning_fit(LightningZeusMonitor(monitor()))
    PowerLimitOptimizerHelper(None)
    ZeusMonitorHelper(None, monitor=monitor())
    assert not hasattr(GlobalPowerLimitOptimizer(monitor()), "on_init_end")  # hasattr still answers
    for callback in (HFGlobalPowerLimitOptimizer(monitor()), HFZeusMonitor(monitor())):
        shallow = copy.copy(callback)  # a copy is built with a marker, not as a class given with no arguments
        assert shallow is not callback and shallow._session is callback._session
    assert GlobalPowerLimitOptimizer(monitor(), profile_steps=8).profile_steps == 8  # Zeus's attributes
