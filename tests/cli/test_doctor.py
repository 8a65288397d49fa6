"""`zeus-callbacks doctor`: a read-only node check, labelled when simulated, non-zero when optimizers would stop."""

from __future__ import annotations

import json
import os
import stat

from zeus_callbacks import cli
from zeus_callbacks.core.device import node_info


def _doctor_json(capsys) -> tuple[int, dict]:
    code = cli.main(["doctor", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_doctor_reports_every_gpu_and_passes_on_a_healthy_node(sim_gpus, capsys):
    node = sim_gpus("a40,t4")
    code, report = _doctor_json(capsys)
    assert code == 0 and report["problems"] == []
    assert report["simulated"] is True
    uuids = {g.uuid for g in node.gpus}
    assert {g["uuid"] for g in report["gpus"]} == uuids
    a40 = next(g for g in report["gpus"] if g["name"] == "NVIDIA A40")
    assert (a40["min_power_limit_w"], a40["max_power_limit_w"], a40["power_limit_w"]) == (100, 300, 300)
    assert a40["energy_counter"] is True and a40["energy_refresh_ms"] is not None
    assert a40["power_average_w"] > 0 and a40["power_instant_w"] > 0
    assert a40["supported_sm_clocks"] > 10 and a40["max_sm_clock_mhz"] == 1740
    assert report["permission"]["may_change"] is True


def test_doctor_table_is_labelled_simulated(sim_gpus, capsys):
    sim_gpus("a40")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SIMULATED GPUs")
    assert "energy counter: yes" in out and "OK: nothing here stops the optimizers." in out


def test_doctor_fails_without_permission_and_says_why(sim_gpus, capsys):
    sim_gpus("a40", faults="no_permission")
    code, report = _doctor_json(capsys)
    assert code == 1
    assert report["permission"]["may_change"] is False
    assert any("may not change power limits" in p for p in report["problems"])


def test_doctor_changes_nothing_and_lists_leftovers(sim_gpus, capsys, tmp_path, monkeypatch):
    node = sim_gpus("a40")
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    monkeypatch.setenv("ZEUS_CALLBACKS_JOURNAL_DIR", str(journal))
    gpu = node.gpus[0]
    gpu.set_power_limit_mw(150_000)  # as a run that died hard would have left it
    entry = {"uuid": gpu.uuid, "name": "NVIDIA A40", "knob": "power_limit", "original": 300_000}
    # pid 2**22 + 1 is above Linux's pid_max: certainly not a live process.
    (journal / "dead.json").write_text(json.dumps({"pid": 2**22 + 1, "start": "1", "entries": [entry]}))
    code, report = _doctor_json(capsys)
    assert [(x["knob"], x["original"]) for x in report["leftovers"]] == [("power_limit", 300_000)]
    assert any("zeus-callbacks restore" in w for w in report["warnings"])
    assert gpu.power_limit_mw == 150_000  # read-only: the leftover is reported, not repaired
    assert (journal / "dead.json").exists()


def test_doctor_without_nvml_exits_1_with_a_hint(capsys):
    assert cli.main(["doctor"]) == 1
    assert "ZEUS_CALLBACKS_SIMULATE" in capsys.readouterr().err


def test_journal_dir_check_refuses_unsafe_directories(tmp_path):
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    assert node_info.check_journal_dir(good).safe
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert node_info.check_journal_dir(shared).problem == "is writable by other users"
    link = tmp_path / "link"
    link.symlink_to(good)
    assert node_info.check_journal_dir(link).problem == "is a symbolic link"
    afile = tmp_path / "file"
    afile.write_text("")
    assert node_info.check_journal_dir(afile).problem == "is not a directory"
    assert stat.S_ISDIR(os.stat(good).st_mode)


def test_doctor_and_devices_show_the_limit_in_force_below_the_one_set(sim_gpus, capsys):
    # A real GH200 dump: 700 W in force (Current Power Limit) under 900 W set (Requested) and default.
    sim_gpus("nvidia-smi:GH200")
    code, report = _doctor_json(capsys)
    (g,) = report["gpus"]
    assert code == 0 and (g["power_limit_w"], g["requested_power_limit_w"], g["default_power_limit_w"]) == (
        700,
        900,
        900,
    )
    assert any("700 W is in force under the 900 W set" in w for w in report["warnings"])
    assert cli.main(["devices", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["power_limit_w"], row["requested_power_limit_w"]) == (700, 900)


def test_doctor_says_a_board_without_counter_or_power_measures_no_energy(sim_gpus, capsys):
    sim_gpus("nvidia-smi:GTX680")
    _, report = _doctor_json(capsys)
    assert any("no energy counter and no power reading" in w for w in report["warnings"])
    assert not any("comes from sampled power" in w for w in report["warnings"])
