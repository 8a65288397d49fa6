"""`zeus-callbacks simulate` on shipped traces and on a user's own files (in each supported format)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zeus_callbacks import sim
from zeus_callbacks.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_shipped_trace_text(capsys):
    rc, out, _ = run_cli(capsys, "--workload", "imagenet/resnet50/256", "--selector", "zeus-cost")
    assert rc == 0
    assert "SIMULATED a40" in out and "chosen power limit:" in out and "(simulated)" in out
    assert "by the trace" in out and "by the measurements" in out


def test_json_fields(capsys):
    rc, out, _ = run_cli(
        capsys, "--gpu", "v100", "--selector", "max-slowdown", "--max-slowdown", "1.2", "--json"
    )
    assert rc == 0
    r = json.loads(out)
    for key in (
        "simulated",
        "gpu",
        "workload",
        "selector",
        "optimal_power_limit_w",
        "profiling_steps",
        "profiling_energy_j",
        "energy_saved_pct_true",
        "time_lost_pct_true",
        "energy_saved_pct_measured",
        "time_lost_pct_measured",
        "power_limits",
    ):
        assert key in r, key
    assert (
        r["simulated"] is True and r["gpu"] == "v100" and r["selector"] == "MaxSlowdownConstraint(factor=1.2)"
    )
    assert r["power_limit_range_w"] == [100, 250]
    assert r["time_lost_pct_true"] <= 20 * 1.01


def test_sweep_takes_more_steps_than_adaptive(capsys):
    steps = {}
    for search in ("sweep", "adaptive"):
        rc, out, _ = run_cli(capsys, "--search", search, "--json", "--seed", "3")
        assert rc == 0
        steps[search] = json.loads(out)["profiling_steps"]
    assert steps["sweep"] == 9 * 50 and steps["adaptive"] <= 0.65 * steps["sweep"]


def _nsdi23(path: Path) -> Path:
    rows = ["dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power"]
    for pl, t, p in [(150, 130.0, 140.0), (200, 110.0, 180.0), (250, 101.0, 215.0), (300, 100.0, 240.0)]:
        rows.append(f"mydata,mynet,64,adam,{pl},{t},{p}")
    path.write_text("\n".join(rows) + "\n")
    return path


def _zeus2(path: Path) -> Path:
    pts = [(100, 1.3, 150.0), (200, 1.05, 230.0), (300, 1.0, 280.0)]
    path.write_text(json.dumps({"64": [{"power_limit": pl, "time": t, "energy": t * p} for pl, t, p in pts]}))
    return path


def _monitor_csv(path: Path) -> Path:
    rows = ["start_time,window_name,elapsed_time,gpu0_energy"]
    for i, (pl, t, p) in enumerate(
        [(250, 20.0, 220.0), (200, 21.0, 180.0), (150, 25.0, 140.0), (100, 33.0, 100.0)]
    ):
        rows.append(f"{1000 + 30 * i},__GlobalPowerLimitOptimizer_{pl},{t},{t * p}")
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("make", "name", "workload", "gpu", "expect_range"),
    [
        (_nsdi23, "summary_power_mine.csv", "mydata/mynet/64", None, [150, 300]),
        (_zeus2, "my_a10g_profile.json", "64", None, [100, 300]),
        (_monitor_csv, "V100+mynet+gpu0.csv", None, None, [100, 250]),
        (_nsdi23, "mine.csv", "mydata/mynet/64/adam", "a40", [150, 300]),
    ],
)
def test_user_files(tmp_path: Path, capsys, make, name, workload, gpu, expect_range):
    path = make(tmp_path / name)
    argv = ["--trace", str(path), "--selector", "energy", "--json"]
    argv += ["--workload", workload] if workload else []
    argv += ["--gpu", gpu] if gpu else []
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    r = json.loads(out)
    assert r["power_limit_range_w"] == expect_range and r["simulated"] is True
    assert r["gpu"] == {"my_a10g_profile.json": "a10g", "V100+mynet+gpu0.csv": "v100"}.get(name, "a40")
    assert expect_range[0] <= r["optimal_power_limit_w"] <= expect_range[1]
    assert r["energy_saved_pct_true"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "/does/not/exist.csv"], "does not exist"),
        (["--workload", "no/such/workload"], "is not in"),
        (["--gpu", "t4", "--workload", "12345"], "Batch size '12345'"),
        (["--noise", "-1"], "--noise"),
        (["--pl-step", "0"], "--pl-step"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert message in err and err.startswith("zeus-callbacks simulate:") and err.count("\n") == 1


def test_unreadable_files_exit_2(tmp_path: Path, capsys):
    bad_header = tmp_path / "weird.csv"
    bad_header.write_text("a,b,c\n1,2,3\n")
    rc, _, err = run_cli(capsys, "--trace", str(bad_header))
    assert rc == 2 and "Cannot tell the format" in err
    bad_json = tmp_path / "broken.json"
    bad_json.write_text("{nope")
    rc, _, err = run_cli(capsys, "--trace", str(bad_json), "--workload", "64")
    assert rc == 2 and err.count("\n") == 1


def test_from_a_shipped_dump_builds_its_node(capsys):
    """`--from V100_x8`: the dump's eight boards, each with its own range, timing from the V100's traces."""
    rc, out, err = run_cli(capsys, "--from", "V100_x8", "--json", "--selector", "energy")
    assert rc == 0, err
    r = json.loads(out)
    node = r["node"]
    assert r["gpu"] == "8 x Tesla V100-SXM2-16GB" and node["driver_version"] == "550.127.05"
    assert (
        node["provenance"] == "Tesla V100-SXM2-16GB from an nvidia-smi dump; timing modelled from V100 traces"
    )
    assert [g["power_limit_range_w"][0] for g in node["gpus"]] == [150, 100, 100, 100, 150, 100, 150, 150]
    assert r["trace"].endswith("summary_power_v100.csv, scaled to 100-300 W (modelled, not traced)")
    rc, out, _ = run_cli(capsys, "--from", "RTX3070")
    assert rc == 0 and out.startswith("SIMULATED node of 1 x NVIDIA GeForce RTX 3070 from ")


def test_from_a_file_of_ones_own(tmp_path: Path, capsys):
    dump = tmp_path / "my node.txt"
    dump.write_text((Path(sim.__file__).parent / "data/gpu_dumps/H100NVLx2.nvidia-smi-a.txt").read_text())
    rc, out, err = run_cli(capsys, "--from", str(dump), "--json")
    assert rc == 0, err
    node = json.loads(out)["node"]
    assert node["dump"] == str(dump.resolve())
    assert [(g["power_limit_range_w"], g["power_limit_in_force_w"]) for g in node["gpus"]] == [
        ([200, 400], 310)
    ] * 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from", "A10", "--gpu", "a40"], "leave out --trace and --gpu"),
        (["--from", "no-such-node"], "neither a file nor a shipped dump"),
        (["--from", "A10", "--workload", "no/such/workload"], "is not in"),
    ],
)
def test_from_errors_are_one_line_exit_2(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert message in err and err.startswith("zeus-callbacks simulate:") and err.count("\n") == 1


def test_from_a_file_that_is_no_nvidia_smi_dump_says_what_to_give(tmp_path: Path, capsys):
    rocm = tmp_path / "mi300x.txt"
    rocm.write_text("===== ROCm System Management Interface =====\nGPU[0]\t\t: Device ID: 0x74a1\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path, words in ((rocm, "rocm-smi dump (AMD GPUs)"), (empty, "is empty")):
        rc, _, err = run_cli(capsys, "--from", str(path))
        assert rc == 2 and words in err and "nvidia-smi -q > node.txt" in err and err.count("\n") == 1


@pytest.mark.parametrize("module_only", [False, True])
def test_from_the_trace_figures_are_those_of_the_limit_in_force(tmp_path: Path, capsys, module_only):
    """GH200: 700 W in force under 900 W set; with the GPU scope N/A, the module's limit is what is set and the
    GPU gets what the rest of the module leaves. Without noise, the trace's figures are the measured ones."""
    text = (Path(sim.__file__).parent / "data/gpu_dumps/GH200.nvidia-smi-a.txt").read_text()
    if module_only:
        head, rest = text.split("    GPU Power Readings\n")
        gpu, tail = rest.split("    GPU Memory Power Readings")
        text = head + "    GPU Power Readings\n" + re.sub(r"(Limit\s*: )[\d.]+ W", r"\1N/A", gpu)
        text += "    GPU Memory Power Readings" + tail
    dump = tmp_path / "gh200.txt"
    dump.write_text(text)
    rc, out, err = run_cli(capsys, "--from", str(dump), "--noise", "0", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["power_limit_range_w"][1] == (1000 if module_only else 700)
    assert r["energy_saved_pct_true"] == pytest.approx(r["energy_saved_pct_measured"], abs=0.1)
    assert r["time_lost_pct_true"] == pytest.approx(r["time_lost_pct_measured"], abs=0.1)
