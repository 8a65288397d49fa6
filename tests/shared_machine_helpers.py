"""Helpers of the shared-machine tests (issue 38): another user of the node, and the package's write routes.

`other_user()` is an unprivileged account made with `useradd` (root only); each route in `WRITE_ROUTES`
writes one file of the package the way the package does, at a path the test chooses.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from zeus_callbacks import sim

OTHER_USER = "zc-shared-test"


def other_user(name: str = OTHER_USER) -> pwd.struct_passwd:
    """An unprivileged account `name` of this node (made once with `useradd`); skips without root or useradd."""
    if os.geteuid() != 0:
        pytest.skip("needs root: another user's files are made by chown-ing them to a second account")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("needs useradd to make a second account")
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd refused to make the account {name}: {made.stderr.strip()}")
    return pwd.getpwnam(name)


def give_to(path: Path, user: pwd.struct_passwd) -> None:
    """`chown` `path` (a link itself, not its target) to `user`."""
    os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)


def _power_limit_profile(path: Path) -> None:
    from zeus_callbacks.core.power_limit.profile_file import ProfileContext, save_profile

    save_profile(path, ProfileContext("NVIDIA A40", (100, 300), 25, 1, True), {}, complete=False)


def _run_record(path: Path) -> None:
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor
    from zeus_callbacks.core.report.run_record import RunRecorder

    assert path.name == "record.rank0.json", "the recorder names its file"
    sim.simulate("a40", virtual_clock=True)
    rec = RunRecorder.start(path.parent, ZeusMonitor())
    rec.on_step_begin()
    rec.on_step_end()
    rec.finish()


def _html_report(path: Path) -> None:
    from zeus_callbacks.cli import main

    assert path.name == "report.html", "`zeus-callbacks report RUN_DIR` writes RUN_DIR/report.html"
    _run_record(path.parent / "record.rank0.json")
    assert main(["report", str(path.parent)]) == 0


def _journal(path: Path) -> None:
    from zeus_callbacks.core.device.journal import write_atomic

    write_atomic(path, {"pid": os.getpid(), "entries": []})


def _pipeline_profile(path: Path) -> None:
    from zeus_callbacks.core.pipeline_frequency.profile_file import ProfileRow, write_profile

    write_profile(
        path, [ProfileRow(0, "forward", 1410, 0.1, 20.0), ProfileRow(0, "backward", 1410, 0.2, 40.0)]
    )


def _pipeline_edges(path: Path) -> None:
    from zeus_callbacks.core.pipeline_frequency.profile_file import write_edge_delays

    write_edge_delays(path, [(0, "forward", 0, "backward", 0.001)])


def _zeus2_run(path: Path) -> None:
    from zeus_callbacks.core.heterogeneous.profile_file import BatchSizeRun, write_run

    write_run(path, BatchSizeRun(32, "NVIDIA A10", 0, True, 1, 2, None, False, ()))


def _zeus2_profile(path: Path) -> None:
    from zeus_callbacks.core.heterogeneous.profile_file import write_profile

    write_profile(path, {"32": [{"power_limit": 150, "energy": 1.0, "time": 0.1}]})


def _plan_plot(path: Path) -> None:
    from zeus_callbacks.cli import main

    argv = ["plan", "--profile", "a10", "--profile", "t4", "--global-batch", "1024", "--plot", str(path)]
    assert main(argv) == 0


def _demo_plot(path: Path) -> None:
    from zeus_callbacks.cli.demo_plot import plot

    rows = [
        {"power_limit_w": pl, "time_per_step_s": 30 / pl, "energy_per_step_j": pl / 10, "pruned": pl == 100}
        for pl in (100, 200, 300)
    ]
    report = {"power_limits": rows, "optimal_power_limit_w": 200, "gpu": "A40", "selector": "energy"}
    plot({**report, "simulated": True}, path)


def _monitor_log(path: Path) -> None:
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor

    sim.simulate("a40", virtual_clock=True)
    monitor = ZeusMonitor(log_file=path)
    monitor.begin_window("step")
    monitor.end_window("step")


def _epoch_log(path: Path) -> None:
    from zeus_callbacks.core.monitor.epoch_log import EpochLog
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor

    assert path.name == "run.time.csv", "EpochLog names its files after the prefix"
    sim.simulate("a40", virtual_clock=True)
    log = EpochLog(ZeusMonitor(), str(path.parent / "run"), sleep_ms=0)
    log.begin("train")
    log.end("train")


WRITE_ROUTES: dict[str, tuple[str, Callable[[Path], None]]] = {
    "power_limit_profile": ("plo.json", _power_limit_profile),
    "run_record": ("record.rank0.json", _run_record),
    "report_html": ("report.html", _html_report),
    "journal": ("1234-5678.json", _journal),
    "pipeline_profile": ("perseus.csv", _pipeline_profile),
    "pipeline_edge_delays": ("perseus.edges.csv", _pipeline_edges),
    "zeus2_run": ("run.json", _zeus2_run),
    "zeus2_profile": ("a10.json", _zeus2_profile),
    "plan_plot": ("plan.png", _plan_plot),
    "demo_plot": ("demo.png", _demo_plot),
    "monitor_log": ("monitor.csv", _monitor_log),
    "epoch_log": ("run.time.csv", _epoch_log),
}


def zeus_profile(path: Path, limits_w: tuple[int, ...] = (100, 200, 300)) -> None:
    """A Zeus-format power-limit profile whose lowest limit is cheapest by far (an attacker's pick)."""
    measurements = [{"power_limit": pl, "energy": pl / 10, "time": 1.0} for pl in limits_w]
    path.write_text(json.dumps({"measurements": measurements}))
