"""Every bad input gets one clear error that names it and says what to do; nothing wrong is accepted.

Table-driven: each row is one bad input (an environment variable, a ZeusMonitor argument, a trace or `plan`
profile file, a CLI option) and words its error must hold. The CLI runs in-process (`cli.main`), and a few rows also
as a subprocess: exit code 2, one line on stderr `zeus-callbacks <cmd>: ...`, never a traceback. The valid
edge cases next to them keep working. The optimizers' and adapters' arguments, the power-limit profile_path
and `pipeline-plan` are in `test_bad_inputs_optimizers.py`; the helpers are in helpers.py. A newcomer's common mistakes
(issue 37) are one table, `test_mistakes.py`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import assert_one_clear_line, run_cli

from zeus_callbacks import cli, sim
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

A40 = {"ZEUS_CALLBACKS_SIMULATE": "a40"}


# -- environment variables of the simulator (every command reads them) --------------------------------------
ENV_CASES = [
    ({"ZEUS_CALLBACKS_SIMULATE": "a99"}, ["ZEUS_CALLBACKS_SIMULATE", "a99", "Choose one of"]),
    ({"ZEUS_CALLBACKS_SIMULATE": ","}, ["ZEUS_CALLBACKS_SIMULATE", "names no GPU"]),
    ({"ZEUS_CALLBACKS_SIMULATE": "0*a40"}, ["ZEUS_CALLBACKS_SIMULATE", "positive count"]),
    ({"ZEUS_CALLBACKS_SIMULATE": "x*a40"}, ["ZEUS_CALLBACKS_SIMULATE", "positive count"]),
    ({"ZEUS_CALLBACKS_SIMULATE": "a40:nosuch/work"}, ["ZEUS_CALLBACKS_SIMULATE", "nosuch/work"]),
    ({"ZEUS_CALLBACKS_SIMULATE": "a40@/nonexistent.csv"}, ["ZEUS_CALLBACKS_SIMULATE", "/nonexistent.csv"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_NOISE": "abc"}, ["ZEUS_CALLBACKS_SIM_NOISE='abc'", "0.02"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_NOISE": "nan"}, ["ZEUS_CALLBACKS_SIM_NOISE='nan'"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_NOISE": "inf"}, ["ZEUS_CALLBACKS_SIM_NOISE='inf'"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_NOISE": "-0.1"}, ["ZEUS_CALLBACKS_SIM_NOISE", "from 0 to 0.5"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_SEED": "x"}, ["ZEUS_CALLBACKS_SIM_SEED='x'", "whole number"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_SEED": "1.5"}, ["ZEUS_CALLBACKS_SIM_SEED='1.5'", "whole number"]),
    (
        {**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "melt"},
        ["ZEUS_CALLBACKS_SIM_FAULTS", "unknown fault 'melt'", "Known"],
    ),
    (
        {**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "lost_after=x"},
        ["ZEUS_CALLBACKS_SIM_FAULTS", "'x' is not a whole"],
    ),
    ({**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "lost_after=-1"}, ["ZEUS_CALLBACKS_SIM_FAULTS", "'-1'"]),
    (
        {**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "no_permission@5"},
        ["ZEUS_CALLBACKS_SIM_FAULTS", "GPU 5", "1 GPU"],
    ),
    ({**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "mig@x"}, ["ZEUS_CALLBACKS_SIM_FAULTS", "'x'"]),
    (
        {**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "not_supported=bogus"},
        ["ZEUS_CALLBACKS_SIM_FAULTS", "power, clocks"],
    ),
    ({**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "default_limit_w=x"}, ["ZEUS_CALLBACKS_SIM_FAULTS", "'x'"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "default_limit_w=nan"}, ["ZEUS_CALLBACKS_SIM_FAULTS", "'nan'"]),
    (
        {**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "default_limit_w=5000"},
        ["ZEUS_CALLBACKS_SIM_FAULTS", "100-300 W"],
    ),
    (
        {**A40, "ZEUS_CALLBACKS_SIM_FAULTS": "no_permission=3"},
        ["ZEUS_CALLBACKS_SIM_FAULTS", "takes no value"],
    ),
    ({**A40, "ZEUS_CALLBACKS_SIM_IDEAL": "bogus"}, ["ZEUS_CALLBACKS_SIM_IDEAL", "bogus", "Known"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS": "x"}, ["ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS='x'"]),
    ({**A40, "ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS": "nan"}, ["ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS='nan'"]),
    (
        {**A40, "ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS": "-5"},
        ["ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS", "0 to 10000"],
    ),
    ({**A40, "CUDA_VISIBLE_DEVICES": "0,0"}, ["CUDA_VISIBLE_DEVICES='0,0'", "name each GPU once"]),
]


@pytest.mark.parametrize(
    ("env", "words"), ENV_CASES, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in ENV_CASES]
)
@pytest.mark.parametrize("command", [["devices"], ["doctor"], ["measure", "--", "true"]])
def test_environment(env, words, command, monkeypatch, capsys):
    """Fails if a bad simulator variable is accepted, or its error is not one line that names it."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rc, _, err = run_cli(capsys, command)
    assert_one_clear_line(rc, err, command[0], *words)


@pytest.mark.system
@pytest.mark.parametrize(("env", "words"), ENV_CASES[:1] + ENV_CASES[7:8] + ENV_CASES[-1:])
def test_environment_subprocess(env, words):
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "devices"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_clear_line(proc.returncode, proc.stderr, "devices", *words)


def test_verbose_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "a99")
    with pytest.raises(InvalidInputError, match="a99"):
        cli.main(["-v", "devices"])


@pytest.mark.parametrize("error", [TypeError, ValueError])
def test_a_bug_keeps_its_traceback(error, monkeypatch):
    """Errors that are not bad inputs of ours (a TypeError, or a ValueError raised outside this package, as
    by another library) are not turned into one line. Fails if `cli.main` words any ValueError as one."""
    from zeus_callbacks.cli import devices

    def boom(args):
        raise error("a bug")

    monkeypatch.setattr(devices, "run", boom)
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "a40")
    with pytest.raises(error, match="a bug"):
        cli.main(["devices"])


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"noise": math.nan}, ["noise", "from 0 to 0.5"]),
        ({"noise": math.inf}, ["noise"]),
        ({"seed": 1.5}, ["seed", "whole number"]),
        ({"faults": "hidden@3"}, ["GPU 3"]),
        ({"faults": "not_supported=fan"}, ["not_supported"]),
        ({"energy_refresh_ms": math.nan}, ["refresh"]),
        ({"ideal": "energy_counter,nope"}, ["nope"]),
    ],
)
def test_simulate_arguments(kw, words):
    with pytest.raises(InvalidInputError) as info:
        sim.simulate("a40", state_dir="", **kw)
    for w in words:
        assert w in str(info.value)
    assert sim.active() is None or not kw  # a refused node is never attached


@pytest.mark.parametrize(
    ("env", "check"),
    [
        ({"ZEUS_CALLBACKS_SIM_NOISE": "0"}, lambda s: s.noise == 0),
        ({"ZEUS_CALLBACKS_SIM_NOISE": "0.5"}, lambda s: s.noise == 0.5),
        ({"ZEUS_CALLBACKS_SIM_NOISE": " 0.02 "}, lambda s: s.noise == 0.02),
        ({"ZEUS_CALLBACKS_SIM_NOISE": ""}, lambda s: s.noise == 0),
        ({"ZEUS_CALLBACKS_SIM_SEED": "-3"}, lambda s: s.seed == -3),
        ({"ZEUS_CALLBACKS_SIM_FAULTS": "lost_after=0@0;default_limit_w=250"}, lambda s: True),
        ({"ZEUS_CALLBACKS_SIM_FAULTS": "not_supported;mig@0"}, lambda s: s.gpus[0].faults.mig),
        ({"ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS": "0"}, lambda s: s.gpus[0].energy_refresh_s == 0),
        ({"ZEUS_CALLBACKS_SIM_IDEAL": ""}, lambda s: True),
    ],
)
def test_valid_environment_edges(env, check, monkeypatch):
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "a40")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert check(sim.active())


# -- ZeusMonitor -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"gpu_indices": "0"}, ["gpu_indices='0'", "list of GPU indices"]),
        ({"gpu_indices": ["0"]}, ["'0' is not a GPU index"]),
        ({"gpu_indices": [0.0]}, ["0.0 is not a GPU index"]),
        ({"gpu_indices": [True]}, ["True is not a GPU index"]),
        ({"gpu_indices": -1}, ["[-1] not among"]),
        ({"gpu_indices": [0, 0]}, ["named twice"]),
        ({"gpu_indices": {"a": 0}}, ["list of GPU indices"]),
        ({"gpu_indices": 1.0}, ["list of GPU indices"]),
        ({"power_sample_interval_s": 0}, ["power_sample_interval_s=0", "0.001"]),
        ({"power_sample_interval_s": -1}, ["power_sample_interval_s=-1"]),
        ({"power_sample_interval_s": math.nan}, ["power_sample_interval_s=nan"]),
        ({"power_sample_interval_s": math.inf}, ["power_sample_interval_s=inf"]),
        ({"power_sample_interval_s": "0.1"}, ["power_sample_interval_s='0.1'"]),
    ],
)
def test_monitor_arguments(kw, words, sim_gpus):
    """Fails if a bad `ZeusMonitor` argument (e.g. a GPU named twice) is accepted, or its error does not quote
    the call."""
    sim_gpus("a40")
    with pytest.raises(InvalidInputError) as info:
        ZeusMonitor(**kw)
    message = str(info.value)
    assert message.startswith("`ZeusMonitor(") and "\n" not in message
    for w in words:
        assert w in message


@pytest.mark.parametrize("visible", ["", "5", "abc"])
def test_monitor_without_visible_gpus_fails_at_construction(visible, sim_gpus, monkeypatch):
    sim_gpus("a40")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(
        InvalidInputError, match=r"no GPU is visible .*CUDA_VISIBLE_DEVICES=.*gpu_indices=\[\]"
    ):
        ZeusMonitor()
    assert ZeusMonitor(gpu_indices=[]).gpu_indices == []  # measuring only the CPU stays possible


@pytest.mark.parametrize(
    ("kw", "indices"),
    [
        ({"gpu_indices": 0}, [0]),  # one index, as Zeus users write it
        ({"gpu_indices": 1}, [1]),
        ({"gpu_indices": (1, 0)}, [1, 0]),
        ({"gpu_indices": range(2)}, [0, 1]),
        ({}, [0, 1]),
    ],
)
def test_monitor_valid_edges(kw, indices, sim_gpus):
    sim_gpus("2*a40")
    assert ZeusMonitor(power_sample_interval_s=0.001, **kw).gpu_indices == indices


# -- trace files of `zeus-callbacks simulate` ---------------------------------------------------------------
NSDI = "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"
ROW = "d,n,8,adam,{pl},{t},{p}\n"


def nsdi(*rows: tuple) -> str:
    return NSDI + "".join(ROW.format(pl=pl, t=t, p=p) for pl, t, p in rows)


GOOD = [(100, 2.0, 90.0), (200, 1.5, 150.0), (300, 1.2, 200.0)]
MONITOR = "start_time,window_name,elapsed_time,gpu0_energy\n"
TRACE_CASES = [
    ("a40.csv", nsdi((math.nan, 2.0, 90.0), *GOOD[1:]), ["line 2", "power_limit is 'nan'"]),
    ("a40.csv", nsdi((math.inf, 2.0, 90.0), *GOOD[1:]), ["line 2", "power_limit is 'inf'"]),
    ("a40.csv", nsdi((-100, 2.0, 90.0), *GOOD[1:]), ["line 2", "power_limit is '-100'"]),
    ("a40.csv", nsdi(*GOOD[:2], (300, 0, 200.0)), ["line 4", "time_per_epoch is '0'"]),
    ("a40.csv", nsdi(*GOOD[:2], (300, 1.2, "nan")), ["line 4", "average_power is 'nan'"]),
    ("a40.csv", nsdi(*GOOD[:2], (300, 1.2, "x")), ["line 4", "average_power is 'x'"]),
    ("a40.csv", NSDI + "d,n,8,adam,100\n", ["line 2", "fields where the header has 7"]),
    ("a40.csv", NSDI + "d,n,8,adam,100,1,2,3\n", ["line 2", "fields where the header has 7"]),
    ("a40.csv", "dataset,network,time_per_epoch\n", ["line 1", "header lacks"]),
    ("a40.csv", MONITOR + "0,__GlobalPowerLimitOptimizer_300,0,10\n", ["line 2", "elapsed_time is '0'"]),
    ("a40.csv", MONITOR + "0,__GlobalPowerLimitOptimizer_300,1\n", ["line 2", "fields"]),
    ("a40.csv", MONITOR + "0,__GlobalPowerLimitOptimizer_300,1,nan\n", ["line 2", "gpu0_energy is 'nan'"]),
    ("a40.csv", "what,ever\n1,2\n", ["Cannot tell the format"]),
    (
        "a40.json",
        '{"8": [{"power_limit": 300, "time": 1, "energy"',
        ["line 1", "not valid JSON", "truncated"],
    ),
    ("a40.json", '{"8": [{"power_limit": 300, "time": 0, "energy": 10}]}', ['"8", entry 0', "time is 0"]),
    ("a40.json", '{"8": [{"power_limit": -5, "time": 1, "energy": 10}]}', ["power_limit is -5"]),
    ("a40.json", '{"8": [{"power_limit": 300, "time": 1, "energy": NaN}]}', ["energy is nan"]),
    ("a40.json", '{"8": [{"power_limit": 300, "time": 1}]}', ["expected power_limit, time and energy"]),
    ("a40.json", '{"eight": []}', ["'eight' is not a batch size"]),
    ("a40.json", "[1, 2]", ["is not a Zeus² profile"]),
    ("a40.json", b"\x89PNG\r\n\x1a\n\x00\x00", ["is not a text file"]),
    ("a40.csv", b"\x89PNG\r\n\x1a\n\x00\xff\xfe", ["is not a text file"]),
]


@pytest.mark.parametrize(("name", "content", "words"), TRACE_CASES)
def test_trace_files(name, content, words, tmp_path, capsys):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    rc, _, err = run_cli(capsys, ["simulate", "--trace", str(path), "--workload", "d/n/8"])
    assert_one_clear_line(rc, err, "simulate", str(path), *words)


@pytest.mark.system
def test_trace_file_subprocess(tmp_path):
    path = tmp_path / "a40.json"
    path.write_text('{"8": [{"power_limit": 300, "time": 1, "ene')
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "simulate", "--trace", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_clear_line(proc.returncode, proc.stderr, "simulate", str(path), "line 1", "not valid JSON")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--noise", "nan"], ["--noise nan", "0.02"]),
        (["--noise", "inf"], ["--noise inf"]),
        (["--noise", "-1"], ["--noise -1"]),
        (["--pl-step", "0"], ["--pl-step 0"]),
        (["--trace", "/nonexistent/a40.csv"], ["/nonexistent/a40.csv", "does not exist"]),
        (["--gpu", "a40", "--workload", "no/such/key"], ["no/such/key"]),
    ],
)
def test_simulate_options(argv, words, capsys):
    rc, _, err = run_cli(capsys, ["simulate", *argv])
    assert_one_clear_line(rc, err, "simulate", *words)


def test_valid_trace_file_edges(tmp_path, capsys):
    """Duplicated header spaces aside, a plain three-limit trace and a Zeus² JSON with a zero energy are fine."""
    csv_path = tmp_path / "a40.csv"
    csv_path.write_text(nsdi(*GOOD))
    rc, out, err = run_cli(
        capsys, ["simulate", "--trace", str(csv_path), "--workload", "d/n/8", "--pl-step", "100"]
    )
    assert rc == 0, err
    assert "SIMULATED" in out
    trace = sim.load_trace(csv_path, "d/n/8")
    assert trace.power_limits_w.tolist() == [100, 200, 300]


# -- `zeus-callbacks plan` profiles ---------------------------------------------------------------------------
def profile(metadata: dict | None = None, **batches) -> str:
    data = batches or {
        "8": [
            {"power_limit": 70, "time": 1.0, "energy": 50.0},
            {"power_limit": 60, "time": 1.2, "energy": 48.0},
        ],
        "16": [
            {"power_limit": 70, "time": 1.8, "energy": 95.0},
            {"power_limit": 60, "time": 2.1, "energy": 90.0},
        ],
    }
    if metadata is not None:
        data = {**data, "metadata": metadata}
    return json.dumps(data)


PLAN_CASES = [
    (profile({"idle_power_w": -5}), ["metadata.idle_power_w is -5", ">= 0"]),
    (profile({"idle_power_w": "x"}), ["metadata.idle_power_w is 'x'"]),
    (profile({"steps_per_window": 0}), ["metadata.steps_per_window is 0", ">= 1"]),
    (profile({"steps_per_window": "ten"}), ["metadata.steps_per_window is 'ten'"]),
    (profile({"max_batch_size": 0}), ["metadata.max_batch_size is 0"]),
    (profile([1]), ['"metadata" must be an object']),
    (profile(eight=[{"power_limit": 70, "time": 1, "energy": 1}]), ["key 'eight' (a batch size)"]),
    (
        profile(**{"8": [{"power_limit": "x", "time": 1, "energy": 1}]}),
        ["\"8\", entry 0: power_limit is 'x'"],
    ),
    (profile(**{"8": [{"power_limit": 70, "time": 0, "energy": 1}]}), ["time is 0", "> 0"]),
    (profile(**{"8": [{"power_limit": 70, "time": 1, "energy": -1}]}), ["energy is -1"]),
    (profile(**{"8": [{"power_limit": 70, "time": 1}]}), ["no energy"]),
    (profile(**{"8": {"power_limit": 70}}), ["batch size 8"]),
    ('{"8": [{"power_limit": 70, "time": NaN, "energy": 1}]}', ["time is nan"]),
    ('{"8": [{"power_limit": 70, "time": Infinity, "energy": 1}]}', ["time is inf"]),
    ('{"8": [{"power_limit": 70, "ti', ["line 1", "not valid JSON", "truncated"]),
    ("[]", ["not a Zeus² profile"]),
    (b"\x89PNG\r\n\x1a\n\x00\xff", ["not a text file"]),
]


@pytest.mark.parametrize(("content", "words"), PLAN_CASES)
def test_plan_profiles(content, words, tmp_path, capsys):
    path = tmp_path / "mine.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    rc, _, err = run_cli(capsys, ["plan", "--profile", str(path), "--profile", "t4", "--global-batch", "64"])
    assert_one_clear_line(rc, err, "plan", str(path), *words)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--global-batch", "0"], ["global_batch"]),
        (["--global-batch", "64", "--count", "0", "--count", "1"], ["counts"]),
        (["--global-batch", "64", "--batch-granularity", "0"], ["batch_granularity"]),
        (["--global-batch", "64", "--eta", "nan"], ["eta_knob=nan"]),
        (["--global-batch", "64", "--count", "1"], ["2 --profile but 1 --count"]),
        (["--global-batch", "64", "--profile", "/nonexistent.json"], ["/nonexistent.json"]),
    ],
)
def test_plan_options(argv, words, capsys):
    rc, _, err = run_cli(capsys, ["plan", "--profile", "a10", "--profile", "t4", *argv])
    assert_one_clear_line(rc, err, "plan", *words)


def test_plan_valid_edges(tmp_path, capsys):
    """A profile with zero idle power, one step per window and extra metadata keys plans as before."""
    path = tmp_path / "mine.json"
    path.write_text(profile({"idle_power_w": 0, "steps_per_window": 1, "gpu": "x", "note": "kept"}))
    rc, out, err = run_cli(
        capsys, ["plan", "--profile", str(path), "--profile", "t4", "--global-batch", "64"]
    )
    assert rc == 0, err
    assert "energy" in out and "−" not in out
