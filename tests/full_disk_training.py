"""A short plain-loop run on a simulated A40 (virtual clock) whose files go to a directory that cannot take
them, for tests/test_full_disk.py (run as a script).

Usage: `python full_disk_training.py DIR WHAT FAILURE`.
- WHAT `outputs`: the power-limit profile (`DIR/plo.json`), the run record and report (`DIR/report.html`,
  `DIR/report.run/`), the energy ledger's lines (`DIR/ledger.jsonl`: a checkpoint line half-way, the end
  line at the end) and, unless read-only, the monitor's log (`DIR/monitor.csv`) go to DIR; the journal
  stays in memory. WHAT `journal`: the
  GPU-state journal goes to `DIR/journal` (`ZEUS_CALLBACKS_JOURNAL_DIR`).
- FAILURE `enospc` or `erofs`: DIR is a full or read-only file system (made by the caller); `efbig`: this
  process may write no byte to any file (RLIMIT_FSIZE 0, SIGXFSZ ignored, as `ulimit -f 0` in a shell
  that ignores it).

Prints one line `RESULT {...}`: the steps run, the power limit before and after, and every limit seen.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
from pathlib import Path

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import EnergyReporter
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.report import start_report

STEPS = 60


def main(directory: Path, what: str, failure: str) -> None:
    if what == "journal":
        os.environ["ZEUS_CALLBACKS_JOURNAL_DIR"] = str(directory / "journal")
    system = sim.simulate("a40", virtual_clock=True, noise=0.0)
    gpu = system.gpus[0]
    if failure == "efbig":
        tempfile.gettempdir()  # probed by writing a file, then cached: torch's imports ask for it later
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    outputs = what == "outputs"
    # A log that cannot be made at all (read-only) is refused when the monitor is made, before training.
    log = outputs and failure != "erofs"
    monitor = ZeusMonitor(log_file=directory / "monitor.csv" if log else None)
    plo = GlobalPowerLimitOptimizer(
        monitor,
        wait_steps=1,
        warmup_steps=1,
        profile_steps=2,
        pl_step=50,
        profile_path=directory / "plo.json" if outputs else None,
    )
    recorder = start_report(directory / "report.html", monitor) if outputs else None
    ledger = EnergyReporter(monitor, ledger_path=directory / "ledger.jsonl") if outputs else None
    if ledger is not None:
        ledger.start()
    before, seen, steps = gpu.power_limit_mw, set(), 0
    for _ in range(STEPS):
        plo.on_step_begin()
        if recorder is not None:
            recorder.on_step_begin()
        system.run_step(0.1)
        plo.on_step_end()
        if recorder is not None:
            recorder.on_step_end()
        seen.add(gpu.power_limit_mw)
        steps += 1
        if ledger is not None and steps == STEPS // 2:
            ledger.checkpoint(step=steps)
    if ledger is not None:
        ledger.stop()
    plo.on_train_end()
    if recorder is not None:
        recorder.finish([plo])
    result = {
        "steps": steps,
        "before_mw": before,
        "after_mw": gpu.power_limit_mw,
        "seen_mw": sorted(seen),
        "phase": plo.phase,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
