"""Perseus profile CSV: round trip, and clear errors on bad files."""

from __future__ import annotations

import json

import pytest
from profile_rows import _profile

from zeus_callbacks.cli import main
from zeus_callbacks.core.pipeline_frequency.frontier import FrequencyOption
from zeus_callbacks.core.pipeline_frequency.planning import options_from_rows
from zeus_callbacks.core.pipeline_frequency.profile_file import read_profile, write_profile


def test_round_trip(tmp_path):
    path = tmp_path / "profile.csv"
    rows = _profile(3)
    write_profile(path, reversed(rows))
    assert path.read_text().splitlines()[0] == "stage,instruction,frequency,time,energy"
    assert read_profile(path) == rows  # by stage, forward first, from the highest clock down
    assert read_profile(path, num_stages=3) == rows
    assert not list(tmp_path.glob("*.tmp"))


def test_reads_zeus_style_rows_in_any_order(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(
        "stage, instruction, frequency, time, energy\n"
        "0,backward,1410,0.05,9.5\n0,forward,1740,0.02,5.0\n0,forward,1410,0.025,4.5\n0,backward,1740,0.04,10\n"
    )
    rows = read_profile(path)
    assert [r.instruction for r in rows] == ["backward", "forward", "forward", "backward"]  # file order
    options = options_from_rows(rows)
    assert options[0, "forward"] == [FrequencyOption(1740, 0.02, 5.0), FrequencyOption(1410, 0.025, 4.5)]
    assert [o.frequency_mhz for o in options[0, "backward"]] == [1740, 1410]


@pytest.mark.parametrize(
    "text,match",
    [
        ("stage,instruction,frequency,time\n0,forward,1740,0.1\n", "missing column.*energy"),
        ("stage,instruction,frequency,time,energy\n", "no profile rows"),
        (
            "stage,instruction,frequency,time,energy\n0,forward,1740,-0.1,5\n0,backward,1740,0.1,5\n",
            "time must be",
        ),
        (
            "stage,instruction,frequency,time,energy\n0,forward,1740,0.1,-5\n0,backward,1740,0.1,5\n",
            "energy must",
        ),
        ("stage,instruction,frequency,time,energy\n0,forward,1740,abc,5\n", "cannot parse"),
        ("stage,instruction,frequency,time,energy\n0,recompute,1740,0.1,5\n", "not one of"),
        ("stage,instruction,frequency,time,energy\n0,forward,1740,0.1,5\n0,forward,1740,0.2,5\n", "twice"),
        ("stage,instruction,frequency,time,energy\n0,forward,1740,0.1,5\n", "stage 0 has no backward"),
        (
            "stage,instruction,frequency,time,energy\n0,forward,1740,0.1,5\n0,backward,1740,0.1,5\n"
            "2,forward,1740,0.1,5\n2,backward,1740,0.1,5\n",
            "stage 1 has no forward",
        ),
    ],
)
def test_bad_files(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_profile(path)


def test_stage_count_is_checked(tmp_path):
    path = tmp_path / "p.csv"
    write_profile(path, _profile(2))
    with pytest.raises(ValueError, match="stage 2 has no forward"):
        read_profile(path, num_stages=3)
    with pytest.raises(ValueError, match="out of range"):
        read_profile(path, num_stages=1)


def test_cli_pipeline_plan_json(tmp_path, capsys):
    path = tmp_path / "profile.csv"
    write_profile(path, _profile(3))
    argv = ["pipeline-plan", "--profile", str(path), "--p-blk", "85,90,95", "--microbatches", "6", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref, plan = out["max_frequency"], out["plan"]
    assert out["num_stages"] == 3 and out["schedule"] == "1f1b"
    assert plan["iteration_time_s"] <= ref["iteration_time_s"] * (1 + 1e-9)
    assert plan["energy_j"] < ref["energy_j"] and plan["energy_saving"] > 0
    assert [len(stage) for stage in plan["stages"]] == [12, 12, 12]
    assert {e["frequency_mhz"] for stage in plan["stages"] for e in stage} <= set(range(1740, 1100, -90))
    times = [p["iteration_time_s"] for p in out["frontier"]]
    assert times == sorted(times)


def test_cli_pipeline_plan_text_and_errors(tmp_path, capsys):
    path = tmp_path / "profile.csv"
    write_profile(path, _profile(2))
    base = ["pipeline-plan", "--profile", str(path), "--microbatches", "4"]
    assert main([*base, "--p-blk", "90", "--schedule", "gpipe", "--target-time", "1.0"]) == 0
    text = capsys.readouterr().out
    assert "stage 1:" in text and "chosen plan" in text
    assert main([*base, "--p-blk", "90,90,90"]) == 2
    assert "3 values for 2 stages" in capsys.readouterr().err
    assert main([*base, "--p-blk", "90", "--target-time", "0.001"]) == 2
    assert "infeasible" in capsys.readouterr().err


def test_cli_pipeline_plan_interleaved(tmp_path, capsys):
    path = tmp_path / "profile.csv"
    write_profile(path, _profile(2))
    base = ["pipeline-plan", "--profile", str(path), "--p-blk", "90", "--microbatches", "4"]
    assert main([*base, "--schedule", "interleaved-1f1b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "interleaved-1f1b" and out["chunks_per_stage"] == 2
    stages = out["plan"]["stages"]
    assert [len(s) for s in stages] == [16, 16]  # 2 chunks x 4 microbatches x (forward, backward)
    assert {e["virtual_stage"] for e in stages[1]} == {1, 3}
    assert out["plan"]["iteration_time_s"] <= out["max_frequency"]["iteration_time_s"] * (1 + 1e-9)
    assert main([*base, "--schedule", "looped-bfs", "--chunks", "3"]) == 0
    text = capsys.readouterr().out
    assert "looped-bfs pipeline, 2 stages x 3 chunks" in text and "F0@5:" in text
    assert main([*base, "--chunks", "2"]) == 2
    assert "1f1b runs one model chunk per stage" in capsys.readouterr().err
    assert main([*base, "--schedule", "interleaved-1f1b", "--microbatches", "5"]) == 2
    assert "multiple of 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"stage,instruction,frequency,time,energy\n0,forward,1740,0.1,5\x00\n", "not a text file"),
        (b"", r":1: missing column.*the file is empty"),
        (b"stage,instruction,frequency,time,energy\n0,forward,1740,0.1,5,7\n", ":2: 6 field"),
    ],
)
def test_not_a_profile(tmp_path, content, match):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        read_profile(path)


def test_blank_lines_and_bom_are_read(tmp_path):
    path = tmp_path / "profile.csv"
    write_profile(path, _profile(1))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\n\n", 1))
    assert read_profile(path) == _profile(1)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--microbatches", "abc"], "--microbatches 'abc': pass an integer >= 1"),
        (["--points", "1"], "--points '1': pass an integer >= 2"),
        (["--p-blk", "90,nan"], "--p-blk '90,nan' ('nan')"),
    ],
)
def test_cli_bad_numbers_one_line(tmp_path, capsys, extra, words):
    path = tmp_path / "profile.csv"
    write_profile(path, _profile(2))
    argv = ["pipeline-plan", "--profile", str(path), "--p-blk", "90", "--microbatches", "4", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"zeus-callbacks pipeline-plan: {words}"), err
