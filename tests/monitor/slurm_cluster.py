"""A real Slurm on this machine for the tests: Debian's `slurm-wlm` controller and node daemon (as root, with
munge), one node, one partition `gpu`, in a temporary directory with its own ports; `.ci/run` installs it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class SlurmCluster:
    """A running one-node cluster: `env` (SLURM_CONF) for `srun`/`sbatch`/`sinfo`."""

    directory: Path
    env: dict[str, str]

    def srun(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["srun", *args],
            env={**os.environ, **self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(directory: Path, host: str) -> str:
    ctld, slurmd = _free_port(), _free_port()
    return "\n".join(
        [
            "ClusterName=zctest",
            f"SlurmctldHost={host}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={directory}/state",
            f"SlurmdSpoolDir={directory}/spool",
            f"SlurmctldPidFile={directory}/slurmctld.pid",
            f"SlurmdPidFile={directory}/slurmd.pid",
            f"SlurmctldLogFile={directory}/slurmctld.log",
            f"SlurmdLogFile={directory}/slurmd.log",
            f"SlurmctldPort={ctld}",
            f"SlurmdPort={slurmd}",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # The host's CPUs (slurmd drains a node that claims more); two tasks fit on two.
            f"NodeName={host} CPUs={os.cpu_count() or 1} State=UNKNOWN",
            "PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
            "",
        ]
    )


def _munge_running() -> bool:
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


def _start_munge() -> None:
    if _munge_running():
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True)
    for _ in range(50):
        if _munge_running():
            return
        time.sleep(0.1)
    raise RuntimeError("munged did not start")


def start(directory: Path) -> SlurmCluster:
    """Start the controller and the node daemon; skip the test where Slurm is not installed or not root."""
    if os.geteuid() != 0 or not all(shutil.which(c) for c in ("slurmctld", "slurmd", "srun", "munged")):
        pytest.skip("needs root and Debian's slurm-wlm and munge (`.ci/run` installs them)")
    _start_munge()
    for sub in ("state", "spool"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    conf = directory / "slurm.conf"
    conf.write_text(_config(directory, host))
    env = {"SLURM_CONF": str(conf)}
    full = {**os.environ, **env}
    subprocess.run(["slurmctld", "-c"], env=full, check=True, capture_output=True)
    subprocess.run(["slurmd"], env=full, check=True, capture_output=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=full, capture_output=True, text=True).stdout
        if state.strip() == "idle":
            return SlurmCluster(directory, env)
        time.sleep(0.5)
    stop(SlurmCluster(directory, env))
    raise RuntimeError(f"the Slurm node never became idle; logs in {directory}")


def stop(cluster: SlurmCluster) -> None:
    """Stop both daemons (by their pid files)."""
    for name in ("slurmd.pid", "slurmctld.pid"):
        pid_file = cluster.directory / name
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
