"""`zeus-callbacks report`: writes the HTML of a recorded run; bad input gets one clear line, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
from helpers import run_cli  # noqa: E402
from report_builders import synthetic_record  # noqa: E402

from zeus_callbacks.core.report.records import write_record  # noqa: E402


def test_report_writes_one_html_file(tmp_path: Path, capsys):
    write_record(tmp_path / "run" / "record.rank0.json", synthetic_record())
    out = tmp_path / "r.html"
    rc, stdout, err = run_cli(capsys, ["report", str(tmp_path / "run"), "-o", str(out)])
    assert rc == 0, err
    assert f"Report written to {out}" in stdout
    assert out.read_text().startswith("<!DOCTYPE html>")
    rc, _, _ = run_cli(capsys, ["report", str(tmp_path / "run")])  # default: RUN_DIR/report.html
    assert rc == 0 and (tmp_path / "run" / "report.html").exists()


def _corrupt(d: Path) -> Path:
    d.mkdir()
    (d / "record.rank0.json").write_text('{"format": "zeus_callbacks.run_record", "version": 1, "gpus": 3')
    return d


def _file(d: Path) -> Path:
    d.write_text("not a folder")
    return d


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "no such folder"),
        (lambda p: _file(p / "file.txt"), "not a folder"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no run record"),
        (lambda p: _corrupt(p / "cut"), "not valid JSON"),
    ],
    ids=["missing", "file", "empty", "corrupt"],
)
def test_bad_run_dir_is_one_clear_line(tmp_path: Path, capsys, make, message):
    rc, stdout, err = run_cli(capsys, ["report", str(make(tmp_path))])
    assert rc == 2
    assert err.startswith("zeus-callbacks report: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_output_that_is_a_folder(tmp_path: Path, capsys):
    write_record(tmp_path / "run" / "record.rank0.json", synthetic_record())
    rc, _, err = run_cli(capsys, ["report", str(tmp_path / "run"), "-o", str(tmp_path)])
    assert rc == 2 and "is a folder" in err


def test_listed_in_help(capsys):
    rc, stdout, _ = run_cli(capsys, ["--help"])
    assert rc == 0 and "report" in stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--price", "0.1"], "add --report"),
        (["--report", "x.html", "--carbon-intensity", "-1"], "must be a number >= 0"),
        (["--report", "x.html", "--price", "nan"], "must be a number >= 0"),
    ],
)
def test_demo_report_options_checked_before_training(tmp_path: Path, capsys, args, message):
    rc, _, err = run_cli(capsys, ["demo", *args])
    assert rc == 2 and message in err and "Traceback" not in err


def test_demo_report_that_is_a_folder(tmp_path: Path, capsys):
    rc, _, err = run_cli(capsys, ["demo", "--report", str(tmp_path)])
    assert rc == 2 and "is a folder" in err


def test_demo_region_sets_a_sourced_intensity(capsys):
    from zeus_callbacks.cli.demo import _region_intensity

    g, source = _region_intensity("de")
    assert g > 0 and "2023" in source
    rc, _, err = run_cli(capsys, ["demo", "--report", "x.html", "--region", "nowhere"])
    assert rc == 2 and "Known:" in err
    rc, _, err = run_cli(capsys, ["demo", "--report", "x.html", "--region", "DE", "--carbon-intensity", "1"])
    assert rc == 2 and "pass one" in err
