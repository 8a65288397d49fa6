"""HF killed hard while saving a checkpoint, then resumed: the resume works from the last complete state.

transformers 5 writes a checkpoint in place: weights, optimizer, scheduler, RNG state, then trainer_state.json
(with the callbacks' state) by a plain write; `get_last_checkpoint` takes the newest folder whatever it
holds. A SIGKILL in the middle of that write leaves a cut-short trainer_state.json in the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ROOT, TOY_STEPS_COUNTER

pytest.importorskip("transformers")

import hf_trainers as hf  # noqa: E402
from hf_trainers import MAX_W, PLO_KW, Recorder, ZeusTrainer, make_trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from zeus_callbacks import sim  # noqa: E402
from zeus_callbacks.core.monitor.monitor import ZeusMonitor  # noqa: E402
from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer  # noqa: E402

node = hf.node  # the fixture: one simulated A40 with a 10 ms energy counter

NAME = "HFGlobalPowerLimitOptimizer"

_PRELUDE = """
import json, os, signal, sys
from pathlib import Path
import torch
from transformers import TrainerCallback, TrainerState
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer
from hf_trainers import PLO_KW, ZeusTrainer, make_trainer

torch.set_num_threads(1)  # the simulator counts CPU time as GPU work
tmp = Path({tmp!r})
"""

# The first run: checkpoints every 8 steps; while writing checkpoint-16's trainer_state.json it writes half
# of it and SIGKILLs itself (a real SIGKILL of this process: no handler, no atexit, no restore).
_KILLED_WHILE_SAVING = """
save_to_json = TrainerState.save_to_json

def save_then_die(self, json_path):
    if self.global_step == 16:
        text = json.dumps(self.__dict__, indent=2, sort_keys=True)
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(text[: len(text) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.write(1, f"killing myself at {{plo.optimizer.power_limit_w}} W\\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    save_to_json(self, json_path)

TrainerState.save_to_json = save_then_die
plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
make_trainer(tmp, [plo], max_steps=40, save_strategy="steps", save_steps=8).train()
"""

# The resumed run, as a user restarts it: `resume_from_checkpoint=True`, with the opt-in that skips a
# cut-short checkpoint (ZeusTrainerMixin). It prints the optimizer's state at
# its first step (after the checkpoint's state was loaded) and at the end.
_RESUMED = """
class Probe(TrainerCallback):
    first = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first is None:
            opt = plo.optimizer
            self.first = {{"global_step": state.global_step, "profiling_steps": opt.profiling_steps,
                          "limits": sorted(opt.stats), "power_limit_w": opt.power_limit_w}}

plo, probe = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW), Probe()
trainer = make_trainer(
    tmp, [plo, probe], max_steps=40, save_strategy="steps", save_steps=8, trainer_cls=ZeusTrainer
)
trainer.train(resume_from_checkpoint=True)
result = {{"first": probe.first, "global_step": trainer.state.global_step, "phase": plo.optimizer.phase}}
os.write(1, ("RESULT " + json.dumps(result) + "\\n").encode())
"""


def _run(code: str, tmp_path: Path, state_dir: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        **TOY_STEPS_COUNTER,
        "ZEUS_CALLBACKS_SIMULATE": "a40",
        "ZEUS_CALLBACKS_SIM_STATE_DIR": str(state_dir),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT / "tests"), str(ROOT)]),
    }
    body = textwrap.dedent(_PRELUDE + code).format(tmp=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def _gpu_back_at_300_w(state_dir: Path) -> None:
    """The simulated GPU's limit is 300 W again, put back by the restore watchdog when the process died (its
    1 s bound is tested in tests/device/test_restore_watchdog.py; here a loaded host may take longer)."""
    system = sim.simulate("a40", state_dir=str(state_dir))
    try:
        deadline = time.monotonic() + 10.0
        while system.gpus[0].power_limit_mw != 300_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert system.gpus[0].power_limit_mw == 300_000
    finally:
        sim.disable()


def _saved_optimizer_state(checkpoint: Path) -> dict:
    data = json.loads((checkpoint / "trainer_state.json").read_text())
    return data["stateful_callbacks"][NAME]["attributes"]["optimizer_state"]


@pytest.mark.slow
def test_sigkill_while_saving_a_checkpoint_then_resume(tmp_path, sim_state_dir):
    killed = _run(_KILLED_WHILE_SAVING, tmp_path, sim_state_dir)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert "killing myself at" in killed.stdout
    out = tmp_path / "out"
    cut = out / "checkpoint-16" / "trainer_state.json"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.read_text())  # what the kill left: a cut-short trainer state in the newest checkpoint
    complete = _saved_optimizer_state(out / "checkpoint-8")
    assert complete["stats"], "checkpoint-8 should hold a partial profile"

    _gpu_back_at_300_w(sim_state_dir)  # with no later process of the training: the restore watchdog

    resumed = _run(_RESUMED, tmp_path, sim_state_dir)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    warnings = [line for line in resumed.stderr.splitlines() if str(cut) in line]
    assert len(warnings) == 1, resumed.stderr
    assert "cut short" in warnings[0] and f"Resuming from {out / 'checkpoint-8'}" in warnings[0]
    result = json.loads(re.search(r"^RESULT (.*)$", resumed.stdout, re.M).group(1))
    # Training and profiling resumed from checkpoint-8, the last complete state: its step, counters, limits.
    assert result["first"]["global_step"] == 8, (result, complete)
    assert result["first"]["profiling_steps"] == complete["profiling_steps"], (result, complete)
    assert result["first"]["limits"] == sorted(s["power_limit_w"] for s in complete["stats"]), (
        result,
        complete,
    )
    assert result["global_step"] == 40 and result["phase"] == "done", (result, complete)
    _gpu_back_at_300_w(sim_state_dir)


def _two_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    first = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    make_trainer(tmp_path, [first], max_steps=16, save_strategy="steps", save_steps=8).train()
    return tmp_path / "out" / "checkpoint-8", tmp_path / "out" / "checkpoint-16"


def _tamper(checkpoint: Path, change) -> None:
    path = checkpoint / "trainer_state.json"
    data = json.loads(path.read_text())
    change(data["stateful_callbacks"][NAME]["attributes"]["optimizer_state"])
    path.write_text(json.dumps(data))


def _negative_energy(state: dict) -> None:
    """A negative energy in the saved state: the first measured limit's, else (no limit measured yet) the
    profiling total's. How many limits 16 real-clock steps measure is up to the host's pace: under load
    (five CPU burners beside the suite) the newest checkpoint once held none."""
    if state["stats"]:
        state["stats"][0]["energy_j"] = -5.0
    else:
        state["profiling_energy_j"] = -5.0


def _half_a_measurement(state: dict) -> None:
    """The first measured limit's record cut to its limit and a stray field; with no limit measured yet (as for
    `_negative_energy`, under load), such a record for the grid's first limit, the maximum."""
    half = {"power_limit_w": state["stats"][0]["power_limit_w"] if state["stats"] else MAX_W, "bogus": 1}
    state["stats"][:1] = [half]


def _no_stats(state: dict) -> None:
    del state["stats"]


@pytest.mark.system
@pytest.mark.parametrize("change", [_negative_energy, _half_a_measurement, _no_stats])
@pytest.mark.parametrize("restore_flag", [False, True])
def test_corrupted_callback_state_is_refused_for_the_earlier_one(
    node, tmp_path, change, restore_flag, caplog
):
    """A trainer state that reads as JSON but whose optimizer state is corrupted: one warning naming the file;
    profiling resumes from the earlier checkpoint's state, with or without
    `restore_callback_states_from_checkpoint` (transformers then sets the state on a rebuilt callback)."""
    older, newest = _two_checkpoints(tmp_path)
    complete = _saved_optimizer_state(older)
    _tamper(newest, change)

    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    recorder = Recorder(node)
    trainer = make_trainer(
        tmp_path,
        [plo, recorder],
        max_steps=24,
        restore_callback_states_from_checkpoint=restore_flag,
    )
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer.train(resume_from_checkpoint=str(newest))

    refused = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("zeus_callbacks") and str(newest / "trainer_state.json") in r.getMessage()
    ]
    assert len(refused) == 1, caplog.text
    assert "corrupted" in refused[0] and str(older / "trainer_state.json") in refused[0]
    assert trainer.state.global_step == 24  # the model and steps come from the newest checkpoint
    opt = plo.optimizer
    assert set(opt.stats) >= {s["power_limit_w"] for s in complete["stats"]}
    assert opt.profiling_steps >= complete["profiling_steps"]
    assert node.gpus[0].power_limit_mw == 300_000


@pytest.mark.system
def test_corrupted_callback_state_without_earlier_state_says_profiling_starts_afresh(node, tmp_path, caplog):
    _, newest = _two_checkpoints(tmp_path)
    for checkpoint in (tmp_path / "out").glob("checkpoint-*"):
        if checkpoint != newest:
            _tamper(checkpoint, _no_stats)
    _tamper(newest, _negative_energy)

    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    trainer = make_trainer(tmp_path, [plo], max_steps=20)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer.train(resume_from_checkpoint=str(newest))
    refused = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("zeus_callbacks") and "trainer_state.json" in r.getMessage()
    ]
    assert len(refused) == 1 and "profiling starts afresh" in refused[0], caplog.text
    assert trainer.state.global_step == 20


@pytest.mark.system
def test_checkpoint_without_trainer_state_and_none_before_starts_over_saying_so(node, tmp_path, caplog):
    """Killed before trainer_state.json was begun, in the first checkpoint: no complete checkpoint at all."""
    _, newest = _two_checkpoints(tmp_path)
    for checkpoint in (tmp_path / "out").glob("checkpoint-*"):
        (checkpoint / "trainer_state.json").unlink()

    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    trainer = make_trainer(tmp_path, [plo], max_steps=10, trainer_cls=ZeusTrainer)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer.train(resume_from_checkpoint=True)
    messages = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("zeus_callbacks") and "trainer_state.json is missing" in r.getMessage()
    ]
    assert len(messages) == 1 and "training starts from the beginning" in messages[0], caplog.text
    assert str(newest) in messages[0]
    assert trainer.state.global_step == 10


@pytest.mark.system
def test_plain_trainer_resumes_from_exactly_the_checkpoint_named(node, tmp_path, caplog):
    """Without the opt-in nothing about resumption changes: a complete checkpoint named is the one resumed,
    and a cut-short newest one is left to transformers (which refuses it), with one line, said when the
    trainer is built, naming the last complete one to resume from."""
    older, newest = _two_checkpoints(tmp_path)
    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    trainer = make_trainer(tmp_path, [plo], max_steps=12)
    steps = []
    trainer.add_callback(
        type(
            "First",
            (TrainerCallback,),
            {"on_step_begin": lambda s, a, st, c, **k: steps.append(st.global_step)},
        )()
    )
    trainer.train(resume_from_checkpoint=str(older))
    assert steps[0] == 8 and trainer.state.global_step == 12  # checkpoint-8, although checkpoint-16 is newer

    (newest / "trainer_state.json").unlink()  # killed before it was written
    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **PLO_KW)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer = make_trainer(tmp_path, [plo], max_steps=4)  # said when the trainer is built
        with pytest.raises(OSError):  # transformers' own error: the named checkpoint is what it loads
            trainer.train(resume_from_checkpoint=str(newest))
    said = [r.getMessage() for r in caplog.records if str(newest / "trainer_state.json") in r.getMessage()]
    assert len(said) == 1 and f"resume_from_checkpoint={str(older)!r}" in said[0], caplog.text


# Our own file: the `profile_path` profile is written to a new file (`files.write_atomic`) and renamed over the
# profile. The first run SIGKILLs itself in the middle of writing the second save's new file.
_KILLED_WHILE_WRITING_THE_PROFILE = """
from zeus_callbacks.core import files

write_all, saves = files._write_all, []

def write_half_then_die(fd, data):
    if b'"format": "zeus_callbacks.power_limit_profile"' in data[:80]:
        saves.append(fd)
        if len(saves) == 2:
            os.write(fd, data[: len(data) // 2])
            os.fsync(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    return write_all(fd, data)

files._write_all = write_half_then_die
plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), profile_path=tmp / "plo.json", **PLO_KW)
make_trainer(tmp, [plo], max_steps=40).train()
"""

_RERUN_WITH_THE_PROFILE = """
import logging
logging.basicConfig(level=logging.INFO)
plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), profile_path=tmp / "plo.json", **PLO_KW)
make_trainer(tmp, [plo], max_steps=40).train()
result = {{"phase": plo.optimizer.phase, "limits": sorted(plo.optimizer.stats)}}
os.write(1, ("RESULT " + json.dumps(result) + "\\n").encode())
"""


@pytest.mark.slow
def test_sigkill_while_writing_the_profile_keeps_the_last_complete_one(tmp_path, sim_state_dir):
    killed = _run(_KILLED_WHILE_WRITING_THE_PROFILE, tmp_path, sim_state_dir)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    profile = json.loads((tmp_path / "plo.json").read_text())  # the first save, whole
    assert not profile["complete"] and len(profile["measurements"]) == 1
    # The second, cut short, was never renamed; unnamed (O_TMPFILE), it went with the process.
    assert sorted(p.name for p in tmp_path.glob("*plo.json*")) == ["plo.json"]
    _gpu_back_at_300_w(sim_state_dir)

    rerun = _run(_RERUN_WITH_THE_PROFILE, tmp_path, sim_state_dir)
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
    assert f"Loaded a partial power-limit profile from {tmp_path / 'plo.json'}" in rerun.stderr
    result = json.loads(re.search(r"^RESULT (.*)$", rerun.stdout, re.M).group(1))
    assert result["phase"] == "done" and profile["measurements"][0]["power_limit_w"] in result["limits"]
    _gpu_back_at_300_w(sim_state_dir)


# A cap on the first run of `test_corrupted_callback_state_falls_back_to_the_profile`: it stops earlier, at
# the first checkpoint saved once the profile holds a measurement.
_MAX_FIRST_STEPS = 400


class _StopOnceProfiled(TrainerCallback):
    """Stops training at the first checkpoint saved once the profile file at `path` holds a measurement. How many
    real-clock steps that takes is the host's pace: under load (the suite beside another suite) the 300 W
    reference was set aside and measured again for all of 16 steps, and no profile had been written."""

    def __init__(self, path: Path) -> None:
        self.path, self.stopped_at = path, None

    def on_save(self, args, state, control, **kwargs):
        if self.path.exists() and json.loads(self.path.read_text())["measurements"]:
            self.stopped_at = state.global_step
            control.should_training_stop = True


@pytest.mark.system
def test_corrupted_callback_state_falls_back_to_the_profile(node, tmp_path, caplog):
    profile_path = tmp_path / "plo.json"
    first = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), profile_path=profile_path, **PLO_KW)
    stop = _StopOnceProfiled(profile_path)
    make_trainer(
        tmp_path, [first, stop], max_steps=_MAX_FIRST_STEPS, save_strategy="steps", save_steps=8
    ).train()
    assert stop.stopped_at is not None, f"no limit measured in {_MAX_FIRST_STEPS} steps"
    measured = {m["power_limit_w"] for m in json.loads(profile_path.read_text())["measurements"]}
    for checkpoint in (tmp_path / "out").glob("checkpoint-*"):
        _tamper(checkpoint, _negative_energy)
    newest = tmp_path / "out" / f"checkpoint-{stop.stopped_at}"

    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), profile_path=profile_path, **PLO_KW)
    trainer = make_trainer(tmp_path, [plo], max_steps=stop.stopped_at + 8)
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        trainer.train(resume_from_checkpoint=str(newest))
    refused = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("zeus_callbacks") and "trainer_state.json" in r.getMessage()
    ]
    assert len(refused) == 1 and f"carries on from the profile {profile_path}" in refused[0], caplog.text
    assert set(plo.optimizer.stats) >= measured


def test_a_fifo_as_trainer_state_is_refused_not_waited_on(tmp_path):
    """Issue 38 item 5: a FIFO planted as a checkpoint's trainer_state.json made every reader of the adapter
    (`trainer_state_problem`, `checkpoint_state`, `resumed_checkpoint`, the cut-short warning) hang on
    `open`. Each now answers at once, as for an unreadable file. Guarded by a timeout: on failure the
    blocked reader is released by opening the FIFO's other end."""
    import threading

    from zeus_callbacks.huggingface import checkpoints

    output = tmp_path / "out"
    older, newest = output / "checkpoint-8", output / "checkpoint-16"
    older.mkdir(parents=True)
    (older / "trainer_state.json").write_text(json.dumps({"global_step": 8}))
    newest.mkdir()
    fifo = newest / "trainer_state.json"
    os.mkfifo(fifo)
    calls = {
        "problem": lambda: checkpoints.trainer_state_problem(newest),
        "state": lambda: checkpoints.checkpoint_state(newest, NAME),
        "resumed": lambda: checkpoints.resumed_checkpoint(str(output), 16),
        "complete": lambda: checkpoints.complete_checkpoint(str(output), True),
    }
    answers: dict[str, object] = {}
    worker = threading.Thread(target=lambda: answers.update({k: f() for k, f in calls.items()}), daemon=True)
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive():  # release the reader blocked on the FIFO, then fail
        os.close(os.open(fifo, os.O_RDWR))
        worker.join(timeout=5)
        pytest.fail(f"a reader waited on the FIFO: answered only {sorted(answers)}")
    assert "not a regular file" in str(answers["problem"]), answers
    assert answers["state"] is None and answers["resumed"] is None
    assert answers["complete"] == str(older)  # resumes from the last complete checkpoint
