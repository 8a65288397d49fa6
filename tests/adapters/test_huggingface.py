"""The HF Trainer adapters on real `transformers.Trainer` runs (tiny GPT-2 on the CPU, simulated A40s)."""

from __future__ import annotations

import inspect
import json
import os
import re
import textwrap
from pathlib import Path

import pytest
from helpers import TOY_STEPS_COUNTER

pytest.importorskip("transformers")

import hf_trainers as hf  # noqa: E402
from hf_trainers import MAX_W, PLO_KW, STEP_GPU_WORK_S, Recorder, ZeusTrainer, make_trainer  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
)

from zeus_callbacks import sim  # noqa: E402
from zeus_callbacks.core.monitor.monitor import ZeusMonitor  # noqa: E402
from zeus_callbacks.core.monitor.reporting import POWER_LIMIT_PREFIX as OPTIMIZER_PREFIX  # noqa: E402
from zeus_callbacks.huggingface import (  # noqa: E402
    HFGlobalPowerLimitOptimizer,
    HFZeusMonitor,
)
from zeus_callbacks.sim import HFSimulatedGPUWork  # noqa: E402
from zeus_callbacks.sim.gpu_state import ENERGY_OFFSET, read_energy  # noqa: E402

node = hf.node  # the fixture: one simulated A40 with a 10 ms energy counter


@pytest.mark.system
def test_simulated_gpu_work_paces_each_step_by_the_limit_in_force(node, tmp_path):
    """Each step's queued GPU work (50 ms here, plus the trainer's own `STEP_GPU_WORK_S`) runs for that long at
    the maximum limit and for the trace's slowdown times that at 100 W (about 2.7x on the A40): the GPU's busy
    time, read from the energy the simulator accounted between two synchronisations
    (busy at the limit's power, idle otherwise, noise off), which the host's speed and load do not move (its
    late wake-ups are idle time). The wall time only from below."""
    gpu = node.gpus[0]
    sim.enqueue_if_simulated(0, 0.0)  # kernels from the start: the host's own CPU time is not GPU work

    def accounted() -> tuple[float, float]:
        """(J, s): the energy the simulator has accounted, and up to when (the last synchronisation's end)."""
        energy_mj, updated_s, *_ = read_energy(gpu._energy.state._buf, ENERGY_OFFSET)
        return energy_mj / 1000, updated_s

    def gpu_busy_s(limit_w: int) -> tuple[float, float]:
        gpu.set_power_limit_mw(limit_w * 1000)
        _, busy_w = gpu.operating_point()
        monitor = ZeusMonitor([0])
        trainer = make_trainer(tmp_path, [HFSimulatedGPUWork(0, 0.05)], max_steps=8)
        monitor.begin_window("train")  # synchronises: accounted up to here
        before_j, since_s = accounted()
        trainer.train()
        window_s = monitor.end_window("train").time  # synchronises: the last queued work is waited for
        after_j, until_s = accounted()
        idle_w = gpu.spec.idle_power_w
        return (after_j - before_j - idle_w * (until_s - since_s)) / (busy_w - idle_w), window_s

    (fast, fast_wall), (slow, _) = gpu_busy_s(MAX_W), gpu_busy_s(100)
    assert fast_wall >= 8 * 0.05  # 50 ms of GPU work a step, beside the toy model's host time
    work_s = 8 * (0.05 + STEP_GPU_WORK_S)
    assert fast == pytest.approx(work_s, rel=1e-6)  # the queued work, unslowed at the maximum limit
    assert slow == pytest.approx(work_s * gpu.trace.relative_time(100), rel=1e-6), (fast, slow)


def test_simulated_gpu_work_refuses_negative_work():
    with pytest.raises(ValueError, match="work_s must be >= 0"):
        HFSimulatedGPUWork(0, -1.0)


@pytest.mark.system
def test_optimizer_chooses_applies_and_restores(node, tmp_path):
    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    recorder = Recorder(node)
    make_trainer(tmp_path, [plo, recorder], max_steps=30).train()

    opt = plo.optimizer
    assert opt.phase == "done"
    chosen = opt.optimal_power_limit_w
    assert chosen in {r["power_limit_w"] for r in opt.report()["power_limits"]}
    assert {300, 200, 100} & set(recorder.limits_w) == {300, 200, 100}  # every limit was applied
    assert recorder.limits_w[-3:] == [chosen] * 3  # the choice holds during training
    assert node.gpus[0].power_limit_mw == MAX_W * 1000  # and is undone at train end


@pytest.mark.system
def test_metrics_reach_trackers_before_and_after_and_log_history(node, tmp_path):
    monitor = ZeusMonitor([0])
    before, after = Recorder(), Recorder()
    # `before` sits where transformers puts the `report_to` trackers: ahead of the user's callbacks.
    # 8 samples a limit: with 4, a hiccup of the host in one toy step can set aside every sample of the
    # maximum limit, and the saving against it is then not reported (nothing to compare with).
    plo = HFGlobalPowerLimitOptimizer(monitor, **{**PLO_KW, "profile_steps": 8})
    callbacks = [before, HFZeusMonitor(monitor), plo, after]
    # ZeusTrainerMixin runs the metric callbacks before the trackers (on a plain Trainer: the next test).
    trainer = make_trainer(
        tmp_path, callbacks, max_steps=60, logging_steps=15, trainer_cls=ZeusTrainer
    )  # profiling ends well before
    trainer.train()

    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(train_logs) == 4
    for logs in (before.logs, after.logs, trainer.state.log_history):
        for entry in [e for e in logs if "loss" in e]:
            assert entry["energy/interval_j"] > 0
            assert entry["energy/interval_avg_power_w"] > 0
            assert entry["energy/simulated"] == 1.0
            assert entry[f"{OPTIMIZER_PREFIX}power_limit_w"] in (300.0, 200.0, 100.0)
            assert entry[f"{OPTIMIZER_PREFIX}phase_index"] in (1.0, 2.0, 3.0)  # warmup, profiling, done
            assert all(
                isinstance(v, (int, float)) for k, v in entry.items() if k.startswith(OPTIMIZER_PREFIX)
            )
            assert f"{OPTIMIZER_PREFIX}energy_interval_j" not in entry  # HFZeusMonitor reports it: once
        summary = logs[-1]
        assert "train_runtime" in summary
        assert summary["energy/total_j"] >= sum(e["energy/interval_j"] for e in logs if "loss" in e) * 0.99
        assert summary[f"{OPTIMIZER_PREFIX}phase_index"] == 3.0  # done
        assert "energy/interval_j" not in summary  # the run's totals, not its last few ms
        # The run's totals beside the choice and its saving against the maximum limit: the same run as the
        # monitor callback's window (opened and closed a callback apart, so equal only to the order of
        # magnitude on the real clock; exactly equal on the virtual clock: tests/power_limit/test_session.py).
        run_j, total_j = summary[f"{OPTIMIZER_PREFIX}run_energy_j"], summary["energy/total_j"]
        assert total_j / 2 < run_j < 2 * total_j
        assert (
            summary[f"{OPTIMIZER_PREFIX}run_time_s"] > 0 and summary[f"{OPTIMIZER_PREFIX}run_avg_power_w"] > 0
        )
        assert summary[f"{OPTIMIZER_PREFIX}simulated"] == 1.0
        # The saving against the maximum limit is logged when the optimizer could measure it: host load can
        # set aside every sample of the maximum limit on a toy step (a loaded full-suite run did), and then
        # there is nothing to compare with. What holds on any machine: the log says what the report says.
        saved = plo.optimizer.report().get("energy_saved_pct")
        assert summary.get(f"{OPTIMIZER_PREFIX}energy_saved_pct") == (
            None if saved is None else pytest.approx(saved)
        )
        assert (
            0 < summary[f"{OPTIMIZER_PREFIX}profiling_energy_j"] < summary[f"{OPTIMIZER_PREFIX}run_energy_j"]
        )
        assert summary[f"{OPTIMIZER_PREFIX}optimal_power_limit_w"] in (300.0, 200.0, 100.0)


@pytest.mark.system
def test_checkpoint_resume_keeps_the_choice_without_profiling(node, tmp_path):
    """Fails if a resumed run profiles again or forgets the choice. The sweep measures a fixed number of steps
    per limit (16 here), so the first run finishes profiling on any host (the adaptive search set a loaded
    host's samples aside and had not chosen after 24 steps in a full-suite run)."""
    kw = {**PLO_KW, "search": "sweep"}
    first = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **kw)
    make_trainer(tmp_path, [first], max_steps=24, save_strategy="steps", save_steps=24).train()
    chosen = first.optimizer.optimal_power_limit_w
    assert chosen is not None
    checkpoint = tmp_path / "out" / "checkpoint-24"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]
    assert (
        saved["HFGlobalPowerLimitOptimizer"]["attributes"]["optimizer_state"]["optimal_power_limit_w"]
        == chosen
    )
    assert node.gpus[0].power_limit_mw == MAX_W * 1000

    second = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **kw)
    recorder = Recorder(node)
    trainer = make_trainer(
        tmp_path, [second, recorder], max_steps=30, restore_callback_states_from_checkpoint=True
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))

    assert trainer.state.global_step == 30
    # transformers' rebuild of the callback (`type(cb)(**cb.state()["args"])`) is the user's instance itself,
    # found through its own class (issue 39: no registry of instances).
    assert [
        cb for cb in trainer.callback_handler.callbacks if isinstance(cb, HFGlobalPowerLimitOptimizer)
    ] == [second]
    assert type(second)(**second.state()["args"]) is second and type(first)(None) is first
    assert second.optimizer.optimal_power_limit_w == chosen
    assert second.optimizer.profiling_steps == first.optimizer.profiling_steps  # the counters carry on
    assert recorder.limits_w == [chosen] * 6
    assert node.gpus[0].power_limit_mw == MAX_W * 1000


@pytest.mark.system
def test_resume_mid_profiling_by_default(node, tmp_path):
    """`resume_from_checkpoint` with default arguments carries on profiling at the next limit, with the
    counters of the first run (transformers restores callback state only with a flag; we do not need it)."""
    first = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    make_trainer(tmp_path, [first], max_steps=8, save_strategy="steps", save_steps=8).train()
    done = {pl for pl, s in first.optimizer.stats.items() if s.steps}
    assert first.optimizer.phase == "waiting" and done and done != {300, 200, 100}  # mid-profiling
    steps, energy = first.optimizer.profiling_steps, first.optimizer.profiling_energy_j

    second = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    recorder = Recorder(node)
    trainer = make_trainer(tmp_path, [second, recorder], max_steps=12)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-8"))

    opt = second.optimizer
    assert recorder.limits_w[0] not in done  # the next limit, not the first one again
    assert set(opt.stats) >= done and opt.profiling_steps > steps and opt.profiling_energy_j > energy
    assert {r["power_limit_w"] for r in opt.report()["power_limits"]} >= done


_RAISING_RUN = """
import torch
from transformers import TrainerCallback
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer
from hf_trainers import PLO_KW, make_trainer
from pathlib import Path

class Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        pl = plo.optimizer.power_limit_w
        if pl is not None and pl < 300:
            print("limit at the crash:", pl, flush=True)
            raise RuntimeError("crash mid-training")

torch.set_num_threads(1)
plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
make_trainer(Path({tmp!r}), [plo, Boom()], max_steps=30).train()
"""


@pytest.mark.slow
def test_exception_mid_training_restores_the_gpu(tmp_path, sim_state_dir, run_python):
    state_dir = sim_state_dir
    env = {
        "ZEUS_CALLBACKS_SIMULATE": "a40",
        "ZEUS_CALLBACKS_SIM_STATE_DIR": str(state_dir),
        "ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS": "10",  # toy steps of a few ms (see `node`)
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    code = textwrap.dedent(_RAISING_RUN).format(tmp=str(tmp_path))
    child = run_python(code, env=env, timeout=120, cwd=tmp_path)
    assert child.returncode != 0
    assert "RuntimeError: crash mid-training" in child.stderr
    assert re.search(r"limit at the crash: (200|100)", child.stdout), child.stdout + child.stderr
    # The guard restored at exit (no `on_train_end`): nothing left for a later repair to do.
    system = sim.simulate("a40", state_dir=str(state_dir))
    try:
        assert system.gpus[0].power_limit_mw == MAX_W * 1000
        assert not list((state_dir / system.state_path().name / "journal").glob("*.json"))
    finally:
        sim.disable()


@pytest.mark.slow
def test_sft_trainer(node, tmp_path):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    processing_class = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>"
    )
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=len(vocab), n_positions=64, bos_token_id=1, eos_token_id=1
    )
    model = GPT2LMHeadModel(config)
    dataset = datasets.Dataset.from_dict({"text": [f"sample {i} of a tiny corpus" for i in range(64)]})
    monitor = ZeusMonitor([0])
    plo = HFGlobalPowerLimitOptimizer(monitor, **PLO_KW)
    sft_args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=60,  # toy steps on a shared CPU are noisy: the search may measure a limit again
        per_device_train_batch_size=4,
        max_length=64,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=5,
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=dataset,
        processing_class=processing_class,
        callbacks=[HFZeusMonitor(monitor), plo],
    )
    trainer.train()
    assert plo.optimizer.phase == "done"
    assert trainer.state.log_history[-1]["energy/total_j"] > 0
    assert node.gpus[0].power_limit_mw == MAX_W * 1000


@pytest.mark.slow
def test_torchrun_two_ranks_choose_the_same_limit(tmp_path, sim_state_dir, run_example):
    stdout = run_example(
        "huggingface/train_power_limit.py",
        *("--steps", "70", "--output-dir", str(tmp_path / "out")),
        launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
        spec="2*a40",
        env={"OMP_NUM_THREADS": "1", **TOY_STEPS_COUNTER},
        timeout=150,
    )
    chosen = dict(re.findall(r"rank (\d): chose (\d+) W \(SIMULATED\)", stdout))
    assert set(chosen) == {"0", "1"}, stdout
    assert chosen["0"] == chosen["1"]
    system = sim.simulate("2*a40", state_dir=str(sim_state_dir))
    try:
        assert [g.power_limit_mw for g in system.gpus] == [MAX_W * 1000] * 2
    finally:
        sim.disable()


DEMO_ARGS = ["demo", "--steps", "60", "--warmup-steps", "1", "--profile-steps", "4", "--pl-step", "100"]


@pytest.mark.slow
def test_demo_json(sim_state_dir):
    """Fails if anything but the report reaches stdout (DeepSpeed, which accelerate imports when it is
    installed, printed a warning there, so the JSON did not parse), or if the report lacks the reference or
    gives a negative slowdown (a busy host once left `assert 300 in {100, 200}`)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "zeus_callbacks.cli", *DEMO_ARGS, "--json", "--noise", "0"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["simulated"] is True
    profiled = {r["power_limit_w"] for r in report["power_limits"]}
    assert MAX_W in profiled and report["reference_power_limit_w"] == MAX_W
    assert report["optimal_power_limit_w"] in profiled
    assert report["gpu"] == "NVIDIA A40"
    assert {"energy_saved_pct", "time_lost_pct", "time_lost_measured_pct", "profiling_energy_j"} <= set(
        report
    )
    assert report["time_lost_pct"] >= 0
    system = sim.simulate("a40", state_dir=str(sim_state_dir))  # the demo ran in this state directory
    assert system.gpus[0].power_limit_mw == MAX_W * 1000
    sim.disable()


@pytest.mark.slow
def test_demo_table_and_plot(sim_state_dir, tmp_path, capsys):
    from zeus_callbacks.cli import main

    png = tmp_path / "demo.png"
    assert main([*DEMO_ARGS, "--gpu", "v100", "--selector", "max-slowdown", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED GPU" in out
    assert re.search(r"Chosen power limit: \d+ W \(SIMULATED\)", out)
    assert "Tesla V100" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_refuses_bad_arguments(capsys):
    from zeus_callbacks.cli import main

    assert main(["demo", "--real", "--gpu", "a40"]) == 2
    assert "--real" in capsys.readouterr().err


def test_signature_matches_zeus():
    zeus_pl = pytest.importorskip("zeus.optimizer.power_limit")
    ours = list(inspect.signature(HFGlobalPowerLimitOptimizer).parameters)
    theirs = list(inspect.signature(zeus_pl.HFGlobalPowerLimitOptimizer).parameters)
    assert ours[: len(theirs)] == theirs


@pytest.mark.system
def test_import_does_not_load_transformers(run_python):
    code = "import sys, zeus_callbacks; assert 'transformers' not in sys.modules, 'transformers imported'"
    assert run_python(code).returncode == 0


@pytest.mark.system
def test_monitor_none_is_refused_and_no_instance_is_registered(node):
    """`monitor=None` outside transformers' rebuild is a mistake said as such, and building callbacks
    leaves no process-wide registry behind (issue 39): a new one never adopts an older one's session."""
    first = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    with pytest.raises(ValueError, match=r"HFGlobalPowerLimitOptimizer\(monitor=None\)"):
        HFGlobalPowerLimitOptimizer(None)  # type: ignore[arg-type]
    second = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    assert second._session is not first._session and type(second) is not type(first)
    assert type(second).__name__ == type(first).__name__ == "HFGlobalPowerLimitOptimizer"
    assert not hasattr(HFGlobalPowerLimitOptimizer, "_built")


@pytest.mark.system
def test_energy_monitor_logs_co2eq_and_cost_beside_energy(node, tmp_path):
    monitor = ZeusMonitor([0])
    recorder = Recorder()
    energy = HFZeusMonitor(monitor, carbon_intensity="DE", price_per_kwh=0.2)
    make_trainer(tmp_path, [energy, recorder], max_steps=20, logging_steps=10).train()

    from zeus_callbacks.core.monitor.carbon import RegionCarbonIntensity

    g_per_kwh = RegionCarbonIntensity("DE").g_per_kwh
    intervals = [e for e in recorder.logs if "energy/interval_j" in e]
    assert len(intervals) == 2
    for e in intervals:
        assert e["energy/interval_co2eq_g"] == pytest.approx(e["energy/interval_j"] / 3.6e6 * g_per_kwh)
        assert e["energy/interval_cost"] == pytest.approx(e["energy/interval_j"] / 3.6e6 * 0.2)
    summary = recorder.logs[-1]
    assert summary["energy/total_co2eq_g"] == pytest.approx(summary["energy/total_j"] / 3.6e6 * g_per_kwh)
    assert summary["energy/total_cost"] == pytest.approx(summary["energy/total_j"] / 3.6e6 * 0.2)


@pytest.mark.system
def test_energy_monitor_takes_rates_from_the_environment_and_refuses_bad_ones(node, monkeypatch):
    monkeypatch.setenv("ZEUS_CALLBACKS_CARBON_INTENSITY", "380")
    monkeypatch.setenv("ZEUS_CALLBACKS_ELECTRICITY_PRICE", "US-CA")
    rates = HFZeusMonitor(ZeusMonitor([0]))._session.reporter.rates
    assert rates.carbon_g_per_kwh == 380.0 and 0 < rates.price_per_kwh < 1
    with pytest.raises(ValueError, match="carbon_intensity=-1"):
        HFZeusMonitor(ZeusMonitor([0]), carbon_intensity=-1)
    monkeypatch.setenv("ZEUS_CALLBACKS_CARBON_INTENSITY", "Atlantis")
    with pytest.raises(ValueError, match="Known:"):
        HFZeusMonitor(ZeusMonitor([0]))


@pytest.mark.system
def test_plain_trainer_is_not_patched_and_its_trackers_ahead_get_no_metrics(node, tmp_path, caplog):
    """Nothing process-wide: `Trainer.train` is transformers' own; the callbacks stay where the user put them,
    so a tracker ahead of them misses their metrics, which still reach log_history (and one line says so)."""
    train = Trainer.train
    before, after = Recorder(), Recorder()
    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    trainer = make_trainer(tmp_path, [before, HFZeusMonitor(plo.optimizer.monitor), plo, after], max_steps=10)
    trainer.args.report_to = ["tensorboard"]  # what the line names; no tracker callback is added this late
    from zeus_callbacks.huggingface.trainer import LogsFirst

    LogsFirst._said_trackers = False
    with caplog.at_level("INFO", logger="zeus_callbacks"):
        trainer.train()
    assert Trainer.train is train and type(trainer).train is train
    assert trainer.callback_handler.callbacks.index(before) < trainer.callback_handler.callbacks.index(plo)
    assert all("energy/interval_j" not in e for e in before.logs)
    assert any("energy/interval_j" in e for e in after.logs)
    assert any("energy/interval_j" in e for e in trainer.state.log_history)
    said = [r.getMessage() for r in caplog.records if "ZeusTrainerMixin" in r.getMessage()]
    assert len(said) == 1 and "tensorboard" in said[0], caplog.text


@pytest.mark.system
def test_report_path_writes_the_run_report_with_the_profile(node, tmp_path):
    from zeus_callbacks.core.report import load_run, run_dir_for

    report = tmp_path / "run.html"
    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW, report_path=report)
    make_trainer(tmp_path, [plo], max_steps=30).train()
    assert plo.optimizer.phase == "done"
    (record,) = load_run(run_dir_for(report))
    assert len(record.steps) >= 20 and record.finished and record.simulated
    assert (
        record.power_limit is not None
        and record.power_limit.optimal_power_limit_w == plo.optimizer.optimal_power_limit_w
    )
    html = report.read_text()
    assert "SIMULATED" in html and "<svg" in html
