"""Bad inputs of the optimizers: their and their adapters' constructor arguments, the power-limit
`profile_path` contents (ours and Zeus's), `pipeline-plan` and the Perseus profile CSV.

Same rule as `test_bad_inputs.py`: one clear error that names the input and says what to do; from the CLI one
line `zeus-callbacks <cmd>: ...`, exit code 2, no traceback; valid edge cases keep working.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_clear, assert_one_clear_line, profile_to_the_end, run_cli

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow, write_profile
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer

# -- GlobalPowerLimitOptimizer and its adapters -------------------------------------------------------------
PLO_CASES = [
    ({"pl_step": "25"}, ["pl_step='25'"]),
    ({"pl_step": math.nan}, ["pl_step=nan"]),
    ({"pl_step": 0}, ["pl_step=0"]),
    ({"pl_step": 2.5}, ["pl_step=2.5"]),
    ({"profile_steps": "8"}, ["profile_steps='8'"]),
    ({"warmup_steps": -1}, ["warmup_steps=-1"]),
    ({"warmup_steps": 1.5}, ["warmup_steps=1.5"]),
    ({"wait_steps": "1"}, ["wait_steps='1'"]),
    ({"profile_path": 3}, ["profile_path=3"]),
]


@pytest.mark.parametrize(("kw", "words"), PLO_CASES)
def test_power_limit_optimizer_arguments(kw, words, sim_gpus):
    """Fails if a bad argument (e.g. a fractional step count) is accepted, or its error does not quote the
    call."""
    sim_gpus("a40")
    with pytest.raises((ValueError, TypeError)) as info:
        GlobalPowerLimitOptimizer(ZeusMonitor([0]), **kw)
    assert_clear(info.value, "GlobalPowerLimitOptimizer(", *words)


@pytest.mark.parametrize("monitor", ["x", None, 0])
def test_power_limit_optimizer_monitor(monitor, sim_gpus):
    sim_gpus("a40")
    with pytest.raises((ValueError, TypeError)) as info:
        GlobalPowerLimitOptimizer(monitor)
    assert_clear(info.value, "GlobalPowerLimitOptimizer(monitor=", "ZeusMonitor")


def test_power_limit_optimizer_without_gpus_fails_at_construction(sim_gpus):
    sim_gpus("a40")
    with pytest.raises((ValueError, TypeError)) as info:
        GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[]))
    assert_clear(info.value, "GlobalPowerLimitOptimizer(", "GPU")


@pytest.mark.parametrize(("kw", "words"), PLO_CASES[:3] + PLO_CASES[4:5])
def test_hf_adapter_arguments(kw, words, sim_gpus):
    pytest.importorskip("transformers")
    from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer

    sim_gpus("a40")
    with pytest.raises((ValueError, TypeError)) as info:
        HFGlobalPowerLimitOptimizer(ZeusMonitor([0]), **kw)
    assert_clear(info.value, *words)


def test_hf_adapter_monitor_string(sim_gpus):
    pytest.importorskip("transformers")
    from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer

    sim_gpus("a40")
    with pytest.raises((ValueError, TypeError)) as info:
        HFGlobalPowerLimitOptimizer("x")
    assert_clear(info.value, "HFGlobalPowerLimitOptimizer(monitor='x')", "ZeusMonitor")


@pytest.mark.parametrize(
    ("kw", "words"), [({"monitor": "x"}, ["monitor='x'", "ZeusMonitor"]), *PLO_CASES[:2]]
)
def test_lightning_adapter_arguments(kw, words, sim_gpus):
    pytest.importorskip("lightning")
    from zeus_callbacks.lightning import LightningGlobalPowerLimitOptimizer

    sim_gpus("a40")
    kw = {"monitor": ZeusMonitor([0]), **kw}
    with pytest.raises((ValueError, TypeError)) as info:
        LightningGlobalPowerLimitOptimizer(**kw)
    assert_clear(info.value, *words)


def test_valid_optimizer_edges(sim_gpus):
    sim_gpus("a40")
    opt = GlobalPowerLimitOptimizer(
        ZeusMonitor([0]), wait_steps=0, warmup_steps=0, profile_steps=1, pl_step=200
    )
    assert opt.pl_step == 200


# -- the power-limit optimizer's profile_path contents -----------------------------------------------------
def _finished_profile(path: Path) -> None:
    """A complete profile written by the optimizer itself, on a virtual-clock A40."""
    system = sim.simulate("a40", virtual_clock=True)
    opt = GlobalPowerLimitOptimizer(
        ZeusMonitor([0]), warmup_steps=1, profile_steps=2, pl_step=100, profile_path=path
    )
    profile_to_the_end(opt, system)
    assert opt.phase == "done"


def _tamper(path: Path, field: str, value) -> None:
    data = json.loads(path.read_text())
    data["measurements"][-1][field] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("energy_j", -50.0, ["energy"]),
        ("time_s", math.nan, ["time"]),
        ("power_limit_w", 5000, ["5000"]),
        ("power_limit_w", 5, ["5 W"]),
        ("steps", 0, ["steps"]),
    ],
)
def test_power_limit_profile_contents(field, value, words, tmp_path):
    """Fails if a profile with an unusable measurement is used: a negative or non-finite sum, a limit outside
    the GPU's range, steps=0 with time measured."""
    path = tmp_path / "plo.json"
    _finished_profile(path)
    _tamper(path, field, value)
    system = sim.simulate("a40", virtual_clock=True)
    with pytest.raises(ValueError) as info:
        opt = GlobalPowerLimitOptimizer(ZeusMonitor([0]), pl_step=100, profile_path=path)
        opt.on_step_begin()
        system.run_step(0.2)
        opt.on_step_end()
    assert_clear(info.value, str(path), *words)


def test_power_limit_profile_truncated_or_binary(tmp_path):
    path = tmp_path / "plo.json"
    _finished_profile(path)
    system = sim.simulate("a40", virtual_clock=True)
    for content in (path.read_bytes()[:40], b"\x89PNG\x00\xff"):
        path.write_bytes(content)
        with pytest.raises(ValueError) as info:
            opt = GlobalPowerLimitOptimizer(ZeusMonitor([0]), pl_step=100, profile_path=path)
            opt.on_step_begin()
            system.run_step(0.2)
        assert_clear(info.value, str(path))


@pytest.mark.parametrize(
    ("measurement", "words"),
    [
        ({"power_limit": 5000, "energy": 100.0, "time": 1.0}, ["[5000] W outside", "100-300 W"]),
        ({"power_limit": 250, "energy": -5.0, "time": 1.0}, ["non-positive measurement"]),
        ({"power_limit": 250, "energy": 100.0, "time": 0.0}, ["non-positive measurement"]),
    ],
)
def test_zeus_power_limit_profile_contents(measurement, words, tmp_path):
    """A profile_path in Zeus's format (`{"measurements": [...]}`) with an unusable measurement."""
    path = tmp_path / "zeus.json"
    good = {"power_limit": 300, "energy": 120.0, "time": 0.9}
    path.write_text(json.dumps({"measurements": [good, measurement]}))
    system = sim.simulate("a40", virtual_clock=True)
    with pytest.raises(ValueError) as info:
        opt = GlobalPowerLimitOptimizer(ZeusMonitor([0]), pl_step=50, profile_path=path)
        opt.on_step_begin()
        system.run_step(0.2)
    assert_clear(info.value, str(path), *words)


# -- PipelineFrequencyOptimizer -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"min_frequency_mhz": 99999}, ["min_frequency_mhz=99999"]),
        ({"frequency_stride_mhz": 0}, ["frequency_stride_mhz=0"]),
        ({"frequency_stride_mhz": "90"}, ["frequency_stride_mhz='90'"]),
        ({"target_time_s": math.nan}, ["target_time_s=nan"]),
        ({"warmup_steps": -1}, ["warmup_steps=-1"]),
    ],
)
def test_pipeline_optimizer_arguments(kw, words, sim_gpus):
    sim_gpus("a40")
    with pytest.raises((ValueError, TypeError)) as info:
        pfo = PipelineFrequencyOptimizer(rank=0, pp_rank=0, pp_degree=1, world_size=1, wait_steps=0, **kw)
        pfo.on_step_begin()  # the GPU's clock range is known from the first step
        pfo.close()
    assert_clear(info.value, "PipelineFrequencyOptimizer(", *words)


# -- `zeus-callbacks pipeline-plan` and the Perseus profile CSV -------------------------------------------------
def _perseus(path: Path) -> None:
    rows = []
    for s in range(2):
        for kind, mult in (("forward", 0.02), ("backward", 0.04)):
            for f in range(1740, 1100, -90):
                t = mult * (0.2 + 0.8 * 1740 / f)
                rows.append(ProfileRow(s, kind, f, t, (80 + 200 * (f / 1740) ** 3) * t))
    write_profile(path, rows)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--target-time", "nan"], [("--target-time", "target_time")]),
        (["--target-time", "inf"], [("--target-time", "target_time")]),
        (["--target-time", "-1"], [("--target-time", "target_time")]),
        (["--p-blk", "inf"], [("--p-blk", "p_blk")]),
        (["--p-blk", "nan"], [("--p-blk", "p_blk")]),
        (["--p-blk", "-5"], [("--p-blk", "p_blk")]),
        (["--p-blk", "x"], [("--p-blk", "p_blk")]),
        (["--microbatches", "0"], [("--microbatches", "microbatches")]),
        (["--points", "0"], [("--points", "points")]),
        (["--stages", "0"], [("--stages", "stages")]),
    ],
)
def test_pipeline_plan_options(argv, words, tmp_path, capsys):
    path = tmp_path / "p.csv"
    _perseus(path)
    base = {"--profile": str(path), "--p-blk": "90", "--microbatches": "4"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    rc, _, err = run_cli(capsys, ["pipeline-plan", *[x for kv in base.items() for x in kv]])
    assert_one_clear_line(rc, err, "pipeline-plan", *words)


PERSEUS_HEADER = "stage,instruction,frequency,time,energy\n"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", ["not a text file"]),
        (PERSEUS_HEADER + "0,forward,1740,nan,5\n0,backward,1740,0.1,5\n", [("line 2", ":2:"), "time"]),
        (PERSEUS_HEADER + "0,forward,1740,inf,5\n0,backward,1740,0.1,5\n", [("line 2", ":2:"), "time"]),
        (PERSEUS_HEADER + "0,forward,1740,0.1,nan\n0,backward,1740,0.1,5\n", [("line 2", ":2:"), "energy"]),
        (PERSEUS_HEADER + "0,forward,0,0.1,5\n0,backward,1740,0.1,5\n", [("line 2", ":2:"), "frequency"]),
        (PERSEUS_HEADER + "0,forward,1740,0,5\n0,backward,1740,0.1,5\n", [("line 2", ":2:"), "time"]),
        (PERSEUS_HEADER + "0,forward,1740\n0,backward,1740,0.1,5\n", [("line 2", ":2:")]),
        (PERSEUS_HEADER + "-1,forward,1740,0.1,5\n0,backward,1740,0.1,5\n", [("line 2", ":2:"), "stage"]),
    ],
)
def test_perseus_profile_files(content, words, tmp_path, capsys):
    path = tmp_path / "p.csv"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    rc, _, err = run_cli(
        capsys, ["pipeline-plan", "--profile", str(path), "--p-blk", "90", "--microbatches", "4"]
    )
    assert_one_clear_line(rc, err, "pipeline-plan", str(path), *words)


@pytest.mark.system
def test_pipeline_plan_subprocess(tmp_path):
    path = tmp_path / "p.csv"
    _perseus(path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeus_callbacks.cli",
            "pipeline-plan",
            "--profile",
            str(path),
            "--p-blk",
            "inf",
        ]
        + ["--microbatches", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_clear_line(proc.returncode, proc.stderr, "pipeline-plan", ("--p-blk", "p_blk"))


def test_pipeline_plan_valid_edges(tmp_path, capsys):
    path = tmp_path / "p.csv"
    _perseus(path)
    argv = [
        "pipeline-plan",
        "--profile",
        str(path),
        "--p-blk",
        "0,90",
        "--microbatches",
        "1",
        "--points",
        "2",
    ]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 0, err
