"""Zeus 0.16's documented behaviour, checked on zeus_callbacks with only the import changed.

Written from Zeus's documentation, examples and the behaviour its test suite checks (no code copied):
the plain loop with every hook of Zeus's `Callback`, Zeus-style selectors, Zeus's state classes, saved
profiles (written by Zeus and by us, reused with each selector), interrupted epochs, the Hugging Face
signature, and the monitor's windows. Where zeus_callbacks differs on purpose, the test checks both the
default and the one argument that gives Zeus's behaviour (docs/zeus-migration.md, "Coming from Zeus").
"""

from __future__ import annotations

import csv
import inspect
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from zeus_callbacks import (
    Callback,
    CallbackSet,
    Done,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    OptimumSelector,
    Profiling,
    Ready,
    ReplayZeusMonitor,
    Time,
    Warmup,
    ZeusCost,
    ZeusMonitor,
    sim,
)
from zeus_callbacks.core.power_limit.search import PowerLimitStats

zeus_pl = pytest.importorskip("zeus.optimizer.power_limit")

WORK_S = 0.1
DATA = Path(sim.__file__).parent / "data" / "zeus_profiles"


def vsim(spec: str = "a40", **kw) -> sim.SimulatedSystem:
    kw.setdefault("noise", 0.02)
    kw.setdefault("seed", 1)
    return sim.simulate(spec, virtual_clock=True, **kw)


def zeus_loop(plo, system, epochs: int, steps_per_epoch: int, trace=None) -> None:
    """Zeus's documented plain loop, every hook of its `Callback` called."""
    plo.on_train_begin()
    for _ in range(epochs):
        plo.on_epoch_begin()
        for _ in range(steps_per_epoch):
            plo.on_step_begin()
            if trace is not None:  # the state a step runs in, as Zeus's test reads it
                trace.append((type(plo.state).__name__, system.gpus[0].power_limit_mw // 1000))
            system.run_step(WORK_S)
            plo.on_step_end()
        plo.on_epoch_end()
        plo.on_evaluate(0.5)
    plo.on_train_end()


def true_costs(system: sim.SimulatedSystem, grid: list[int], selector) -> np.ndarray:
    trace = system.gpus[0].trace
    t = np.array([WORK_S * trace.relative_time(pl) for pl in grid])
    e = t * np.array([trace.power(pl) for pl in grid])
    return selector.score(t, e, float(grid[0]), t[0])


# -- the plain loop, the callback surface, the state classes ------------------------------------------
def test_plain_loop_with_every_zeus_hook_and_the_state_classes():
    system = vsim()
    plo = GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), wait_steps=1)
    assert isinstance(plo, Callback)
    assert plo.state == Ready(next_power_limit=300_000, steps=1)
    trace: list[tuple[str, int]] = []
    chosen = []
    # The optimizer keeps its choice after `on_train_end` (which restores the GPU), as a later run's.
    original = GlobalPowerLimitOptimizer.on_train_end

    def spy(self):
        chosen.append(system.gpus[0].power_limit_mw)
        original(self)

    plo.on_train_end = spy.__get__(plo)
    zeus_loop(plo, system, epochs=12, steps_per_epoch=50, trace=trace)
    names = [name for name, _ in trace]
    assert names[0] == "Ready" and "Warmup" in names and "Profiling" in names and names[-1] == "Done"
    # Warm-up and profiling happen at the limit the state names, in mW as in Zeus.
    plo2 = GlobalPowerLimitOptimizer(ZeusMonitor(), wait_steps=0, warmup_steps=2)
    plo2.on_step_begin()
    assert plo2.state == Warmup(current_power_limit=300_000, steps=2)
    for _ in range(2):
        system.run_step(WORK_S)
        plo2.on_step_end()
        plo2.on_step_begin()
    assert isinstance(plo2.state, Profiling) and plo2.state.current_power_limit == 300_000
    plo2.on_train_end()
    assert isinstance(plo.state, Done)
    assert plo.state.optimal_power_limit == plo.optimal_power_limit_w * 1000 == chosen[0]
    assert system.gpus[0].power_limit_mw == 300_000  # restored at on_train_end


def test_callback_set_drives_every_hook():
    calls: list[str] = []

    class Recorder(Callback):
        def on_epoch_begin(self):
            calls.append("epoch_begin")

        def on_instruction_begin(self, name):
            calls.append(f"begin {name}")

        def on_evaluate(self, metric):
            calls.append(f"evaluate {metric}")

    callbacks = CallbackSet([Recorder(), Callback()])
    for hook in (
        "on_train_begin",
        "on_epoch_begin",
        "on_step_begin",
        "on_step_end",
        "on_epoch_end",
        "on_train_end",
    ):
        getattr(callbacks, hook)()
    callbacks.on_instruction_begin("forward")
    callbacks.on_instruction_end("forward")
    callbacks.on_evaluate(0.9)
    assert calls == ["epoch_begin", "begin forward", "evaluate 0.9"]


@pytest.mark.system
def test_both_optimizers_are_zeus_callbacks_driven_by_a_callback_set(sim_gpus):
    """Zeus's `GlobalPowerLimitOptimizer` and `PipelineFrequencyOptimizer` are `Callback`s; a `CallbackSet`
    of both drives the pipeline one's instructions too."""
    from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

    sim_gpus("a40")
    pfo = PipelineFrequencyOptimizer(
        rank=0, pp_rank=0, pp_degree=1, world_size=1, wait_steps=0, profile_steps=1
    )
    plo = GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]))
    assert isinstance(pfo, Callback) and isinstance(plo, Callback)
    callbacks = CallbackSet([plo, pfo])
    callbacks.on_train_begin()
    callbacks.on_step_begin()
    for name in ("forward", "backward"):
        callbacks.on_instruction_begin(name)
        callbacks.on_instruction_end(name)
    callbacks.on_step_end()
    assert pfo.phase == "profiling" and pfo.profiling_steps == 1
    callbacks.on_train_end()
    pfo.close()


# Zeus 0.16's `GlobalPowerLimitOptimizer.__init__` and `HFGlobalPowerLimitOptimizer.__init__`
# (zeus/optimizer/power_limit.py): the reference the two classes Zeus has keep, by position.
ZEUS_SIGNATURE = [
    ("monitor", inspect.Parameter.empty),
    ("optimum_selector", None),
    ("wait_steps", 1),
    ("warmup_steps", 10),
    ("profile_steps", 40),
    ("pl_step", 25),
    ("profile_path", None),
]


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("zeus_callbacks", "GlobalPowerLimitOptimizer"),
        ("zeus_callbacks", "HFGlobalPowerLimitOptimizer"),
    ],
)
def test_zeus_classes_take_zeus_arguments_by_position(module: str, name: str) -> None:
    """Zeus's arguments, in Zeus's order and with Zeus's defaults, positional; every later option (`search`,
    ...) by keyword only. The other adapters' signatures are checked against the options record in
    tests/adapters/test_contract.py."""
    import importlib

    if name.startswith("HF"):
        pytest.importorskip("transformers")
    cls = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(cls).parameters.values())
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == ZEUS_SIGNATURE
    assert all(p.kind is p.KEYWORD_ONLY for p in params[len(positional) :])


# -- selectors ---------------------------------------------------------------------------------------
def test_zeus_style_selector_overriding_only_select():
    class Lowest(OptimumSelector):  # Zeus's abstract method: select(measurements) -> int
        def select(self, measurements):
            return min(m.power_limit for m in measurements)

    system = vsim()
    plo = GlobalPowerLimitOptimizer(ZeusMonitor(), Lowest(), warmup_steps=2, profile_steps=5)
    zeus_loop(plo, system, epochs=3, steps_per_epoch=30)
    assert plo.state == Done(optimal_power_limit=100_000)
    assert all(s.steps == 5 for s in plo.stats.values()) and sorted(plo.stats) == plo.grid[::-1]


# -- saved profiles ----------------------------------------------------------------------------------
SELECTORS = [Energy(), Time(), ZeusCost(0.25), MaxSlowdownConstraint(1.05), MaxSlowdownConstraint(1.2)]


@pytest.mark.parametrize("workload", ["a40:imagenet/resnet50/256", "v100:resnet50", "a40:bert-base-uncased"])
def test_adaptive_profile_reused_with_another_selector_never_answers_wrongly(tmp_path: Path, workload):
    """A profile searched for one selector prunes what is bad *for it*; another selector re-profiles what
    it needs, and its answer is as good as a fresh search's (within 1% of the true optimum)."""
    original = tmp_path / "zeuscost.json"
    system = vsim(workload, seed=3)
    first = GlobalPowerLimitOptimizer(ZeusMonitor(), ZeusCost(0.5), profile_path=original)
    zeus_loop(first, system, epochs=40, steps_per_epoch=50)
    assert json.loads(original.read_text())["selector"] == "ZeusCost(eta_knob=0.5, world_size=1)"
    assert any(s.pruned for s in first.stats.values())  # the case that used to go wrong
    sim.disable()
    for selector in SELECTORS:
        path = tmp_path / f"{selector!r}.json"
        shutil.copy(original, path)
        system = vsim(workload, seed=4)
        plo = GlobalPowerLimitOptimizer(ZeusMonitor(), selector, profile_path=path)
        zeus_loop(plo, system, epochs=40, steps_per_epoch=50)
        costs = true_costs(system, plo.grid, selector)
        chosen = costs[plo.grid.index(plo.optimal_power_limit_w)]
        assert chosen <= 1.01 * costs.min(), (selector, plo.optimal_power_limit_w, plo.report())
        assert json.loads(path.read_text())["selector"] == repr(selector)
        # Reused again with the selector it now records: applied at once.
        again = GlobalPowerLimitOptimizer(ZeusMonitor(), selector, profile_path=path)
        assert again.state == Done(optimal_power_limit=plo.optimal_power_limit_w * 1000)
        sim.disable()


def test_a_limit_pruned_for_one_selector_counts_for_another(tmp_path: Path):
    """The issue's case: ZeusCost's search dropped 100 W early (too slow for it), yet 100 W uses the least
    energy. Reused with `Energy()`, the profile must not answer from the limits ZeusCost kept."""

    def steps(pl: int, n: int, time_s: float, energy_j: float, pruned: bool = False) -> dict:
        s = PowerLimitStats(pl)
        for i in range(n):
            d = 0.01 if i % 2 else -0.01
            s.add(time_s * (1 + d), energy_j * (1 + d))
        s.pruned = pruned
        return s.to_dict()

    from zeus_callbacks import __version__
    from zeus_callbacks.core.power_limit.schema import SCHEMA_VERSION

    vsim("a40", noise=0.0)
    path = tmp_path / "zeuscost.json"
    context = {"gpu_model": "NVIDIA A40", "power_limit_range_w": [100, 300], "pl_step_w": 100, "num_gpus": 1}
    path.write_text(
        json.dumps(
            {
                "format": "zeus_callbacks.power_limit_profile",
                "version": SCHEMA_VERSION,
                "context": {**context, "simulated": True, "package_version": __version__},
                "complete": True,
                "selector": "ZeusCost(eta_knob=0.5, world_size=1)",
                "search": "adaptive",
                "measurements": [
                    steps(300, 40, 0.100, 28.0),
                    steps(200, 40, 0.104, 24.0),
                    steps(100, 5, 0.180, 18.0, pruned=True),
                ],
            }
        )
    )
    same = GlobalPowerLimitOptimizer(ZeusMonitor(), ZeusCost(0.5), pl_step=100, profile_path=path)
    assert same.state == Done(optimal_power_limit=200_000)  # the selector it was searched for
    other = GlobalPowerLimitOptimizer(ZeusMonitor(), Energy(), pl_step=100, profile_path=path)
    assert other.state == Done(optimal_power_limit=100_000)  # before: 200 W, 33% more energy


def _zeus_measurements(stats, steps: int = 40) -> list:
    """Our measurements as Zeus's: each limit's time and energy over `steps` steps (per-step means, so
    limits that set aside a different number of steps compare fairly)."""
    return [
        zeus_pl.PowerLimitMeasurement(power_limit=pl, energy=m.energy, time=m.time)
        for pl, s in sorted(stats.items(), reverse=True)
        for m in [s.measurement(steps)]
    ]


def test_sweep_profile_answers_every_selector_at_construction_as_zeus(tmp_path: Path):
    """Zeus's check: after one profiling run, an optimizer built on the saved profile with each selector
    is `Done` at once, at the limit Zeus's selector picks from the same measurements."""
    path = tmp_path / "sweep.json"
    system = vsim("a40:imagenet/resnet50/256")
    plo = GlobalPowerLimitOptimizer(ZeusMonitor(), ZeusCost(0.5), search="sweep", profile_path=path)
    zeus_loop(plo, system, epochs=10, steps_per_epoch=50)
    zeus_ms = _zeus_measurements(plo.stats)
    pairs = [(Energy(), zeus_pl.Energy()), (Time(), zeus_pl.Time()), (ZeusCost(0.3), zeus_pl.ZeusCost(0.3))]
    for factor in (1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 100.0):
        pairs.append(
            (
                MaxSlowdownConstraint(factor, prefer="lowest_power_limit"),
                zeus_pl.MaxSlowdownConstraint(factor),
            )
        )
    for ours, theirs in pairs:
        reused = GlobalPowerLimitOptimizer(ZeusMonitor(), ours, search="sweep", profile_path=path)
        assert reused.state == Done(optimal_power_limit=theirs.select(zeus_ms) * 1000), ours
        assert system.gpus[0].power_limit_mw == theirs.select(zeus_ms) * 1000  # applied at construction
    # Our default slowdown rule: the least energy among the allowed limits.
    for factor in (1.05, 1.2):
        reused = GlobalPowerLimitOptimizer(
            ZeusMonitor(), MaxSlowdownConstraint(factor), search="sweep", profile_path=path
        )
        measured = [s.measurement(40) for s in plo.stats.values()]
        assert reused.state == Done(optimal_power_limit=MaxSlowdownConstraint(factor).select(measured) * 1000)


def _write_zeus_profile(path: Path, csv_name: str) -> list:
    """A profile file written by Zeus's own serialiser, from one of Zeus's recorded monitor logs."""
    with open(DATA / csv_name, newline="") as f:
        rows = list(csv.DictReader(f))
    ms = [
        zeus_pl.PowerLimitMeasurement(
            power_limit=int(r["window_name"].rsplit("_", 1)[1]),
            energy=sum(float(v) for k, v in r.items() if k.endswith("_energy")),
            time=float(r["elapsed_time"]),
        )
        for r in rows
    ]
    path.write_text(zeus_pl._PowerLimitMeasurementList(measurements=ms).json(indent=4))
    return ms


@pytest.mark.parametrize("csv_name", ["A40+resnet50+gpu0.csv", "A40+bert-base-uncased+gpu0.csv"])
def test_profile_written_by_zeus_is_read_with_a_warning(tmp_path: Path, caplog, csv_name):
    path = tmp_path / "zeus.json"
    zeus_ms = _write_zeus_profile(path, csv_name)
    written = path.read_text()
    system = vsim("a40")
    pairs = [
        (Energy(), zeus_pl.Energy()),
        (Time(), zeus_pl.Time()),
        (ZeusCost(0.5), zeus_pl.ZeusCost(0.5)),
        (MaxSlowdownConstraint(1.1, prefer="lowest_power_limit"), zeus_pl.MaxSlowdownConstraint(1.1)),
    ]
    for ours, theirs in pairs:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
            plo = GlobalPowerLimitOptimizer(ZeusMonitor(), ours, profile_path=path)
        assert plo.state == Done(optimal_power_limit=theirs.select(zeus_ms) * 1000), ours
        assert system.gpus[0].power_limit_mw == theirs.select(zeus_ms) * 1000
        assert any(
            "written by Zeus" in r.getMessage() and "could not be checked" in r.getMessage()
            for r in caplog.records
        )
    assert path.read_text() == written  # Zeus's file is left as Zeus wrote it
    sim.disable()
    vsim("v100")  # 100-250 W: the A40 profile's 300 W and 275 W are not this GPU's
    with pytest.raises(ValueError, match=r"outside this job's range"):
        GlobalPowerLimitOptimizer(ZeusMonitor(), profile_path=path)


# -- interrupted epochs ------------------------------------------------------------------------------
def test_epochs_interrupt_profiling_only_with_search_zeus():
    """Zeus: an epoch's end during warm-up or profiling puts the GPU back at the maximum limit and that
    limit is profiled again from its warm-up. Here profiling carries on, unless `search="zeus"`."""
    for search in ("zeus", "adaptive"):
        system = vsim()
        plo = GlobalPowerLimitOptimizer(
            ZeusMonitor(), Energy(), warmup_steps=3, profile_steps=6, search=search
        )
        after_epoch: list[tuple[str, int]] = []
        trace: list[tuple[str, int]] = []
        for _ in range(40):
            plo.on_epoch_begin()
            for _ in range(8):  # shorter than warm-up + profiling (9 steps)
                plo.on_step_begin()
                system.run_step(WORK_S)
                plo.on_step_end()
                trace.append((type(plo.state).__name__, system.gpus[0].power_limit_mw // 1000))
            interrupted = type(plo.state).__name__ in ("Warmup", "Profiling")
            plo.on_epoch_end()
            if interrupted:
                after_epoch.append((type(plo.state).__name__, system.gpus[0].power_limit_mw // 1000))
            if isinstance(plo.state, Done):
                break
        if search == "zeus":
            # Interrupted every time: never 9 steps in an epoch, so no limit is ever measured fully.
            assert after_epoch and all(a == ("Ready", 300) for a in after_epoch)
            assert not plo.stats and not isinstance(plo.state, Done)
            assert {pl for name, pl in trace if name == "Warmup"} == {300}  # the same limit, again
        else:
            assert isinstance(plo.state, Done) and not after_epoch[0][0] == "Ready"
        sim.disable()
    # With epochs long enough for one limit each, Zeus's mode measures every limit fully and finishes.
    system = vsim()
    plo = GlobalPowerLimitOptimizer(ZeusMonitor(), Energy(), warmup_steps=3, profile_steps=6, search="zeus")
    zeus_loop(plo, system, epochs=len(plo.grid) + 3, steps_per_epoch=13)
    assert isinstance(plo.state, Done) and all(s.steps == 6 for s in plo.stats.values())
    assert sorted(plo.stats, reverse=True) == plo.grid


# -- the monitor's windows ---------------------------------------------------------------------------
def test_monitor_windows_as_zeus(caplog):
    system = vsim("2*a40")
    monitor = ZeusMonitor(gpu_indices=1)  # Zeus's data-parallel example passes an int
    assert monitor.gpu_indices == [1]
    monitor = ZeusMonitor()
    monitor.begin_window("a")
    system.run_step(WORK_S)
    state = monitor.measurement_states["a"]
    assert set(state.gpu_energy) == {0, 1} and state.time > 0
    with pytest.raises(ValueError, match="already open"):
        monitor.begin_window("a")
    monitor.begin_window("a", restart=True)  # a notebook cell that failed mid-window
    system.run_step(WORK_S)
    m = monitor.end_window("a")
    assert m.time == pytest.approx(WORK_S, rel=0.1) and m.total_energy > 0  # one step, not two
    monitor.begin_window("b")
    monitor.reset_windows()
    assert monitor.measurement_states == {} and monitor.open_windows == []
    # A window the counters did not move in reads 0 J: said once per GPU (Zeus warns too).
    with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
        monitor.begin_window("empty")
        assert monitor.end_window("empty").total_energy == 0.0
        monitor.begin_window("empty")
        monitor.end_window("empty")
    zero = [r for r in caplog.records if "0.000 J" in r.getMessage()]
    assert len(zero) == 2 and "approx_instant_energy" in zero[0].getMessage()


def test_replay_monitor_replays_a_recorded_run(tmp_path: Path):
    """A run recorded by the monitor's log, replayed: the optimizer takes exactly the same decisions."""
    log = tmp_path / "monitor.csv"
    system = vsim(seed=7)

    class WindowsOnly(ZeusMonitor):
        """The log holds windows, not the one-second power the optimizer reads besides (a replay has
        none): recorded without it, the replay can take exactly the same decisions."""

        def one_second_power_w(self) -> float | None:
            return None

    recorded = GlobalPowerLimitOptimizer(WindowsOnly(log_file=log), ZeusCost(0.5), warmup_steps=2)
    zeus_loop(recorded, system, epochs=20, steps_per_epoch=50)
    sim.disable()
    system = vsim(seed=99, noise=0.2)  # other GPUs' figures: only the replayed ones may count
    replayed = GlobalPowerLimitOptimizer(
        ReplayZeusMonitor(log_file=log, ignore_sync_execution=True), ZeusCost(0.5), warmup_steps=2
    )
    zeus_loop(replayed, system, epochs=20, steps_per_epoch=50)
    assert replayed.state == recorded.state
    assert sorted(replayed.stats) == sorted(recorded.stats)
    for pl, s in recorded.stats.items():
        r = replayed.stats[pl]
        assert (r.steps, r.visits) == (s.steps, s.visits)
        assert (r.time_s, r.energy_j) == pytest.approx((s.time_s, s.energy_j), rel=1e-9)
    monitor = ReplayZeusMonitor(log_file=log)
    assert monitor.gpu_indices == [0]
    monitor.begin_window("other")
    with pytest.raises(RuntimeError, match="Was expecting window"):
        monitor.end_window("other")
    with pytest.raises(RuntimeError, match="not ongoing"):
        monitor.end_window("other")
