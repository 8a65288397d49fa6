"""Which job a process belongs to, as its scheduler names it: Slurm, torchrun (elastic), Kubernetes, or an id of
our own that every process the job starts shares.

The variables read, and where each scheduler documents them:
- Slurm (`srun`/`sbatch`, "OUTPUT ENVIRONMENT VARIABLES" of srun(1) and sbatch(1)): `SLURM_JOB_ID`,
  `SLURM_STEP_ID`, `SLURM_PROCID` (the task's rank in the step), `SLURM_JOB_USER`, `SLURM_JOB_PARTITION`,
  `SLURM_CLUSTER_NAME`, and for job arrays `SLURM_ARRAY_JOB_ID`/`SLURM_ARRAY_TASK_ID` (an array task is a
  job of its own: `<array job>_<task>`, as `sacct` shows it).
- torchrun (torch.distributed.elastic, "Environment Variables" of torchrun's documentation):
  `TORCHELASTIC_RUN_ID` (the same on every node of one rendezvous), `RANK`.
- Kubernetes: a pod learns its own name and namespace only through the downward API, under names the pod
  spec chooses; `POD_NAME` and `POD_NAMESPACE` are the names Kubernetes' own downward-API examples use. Without
  them, inside a pod (`KUBERNETES_SERVICE_HOST` set), the pod name is the host name and the namespace is read
  from the service account's `namespace` file, where one is mounted.
- Else `ZEUS_CALLBACKS_JOB_ID` when set, otherwise a new id, exported so that the processes the job starts
  (ranks of `torch.multiprocessing.spawn`, a launcher's children) inherit the same one.
"""

from __future__ import annotations

import getpass
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JobIdentity", "job_identity", "JOB_ID_ENV"]

JOB_ID_ENV = "ZEUS_CALLBACKS_JOB_ID"
"""A job id of the user's (or of ours, exported at first use) where no scheduler names the job."""

_K8S_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class JobIdentity:
    """A process's job as its scheduler names it.

    Attributes:
        scheduler: `slurm`, `torchrun`, `kubernetes` or `local` (an id of the user's or of ours).
        job_id: The scheduler's job id (Slurm: `12345`, or `12345_7` for an array task).
        user: Who runs the job (Slurm's `SLURM_JOB_USER`, else the process's user).
        host: This process's host name.
        rank: This process's rank in the job (Slurm task, torchrun rank), None when unknown.
        step: The Slurm job step, None elsewhere.
        partition: The Slurm partition (Kubernetes: the namespace), None elsewhere.
        cluster: The Slurm cluster name, None elsewhere.
        pod: The Kubernetes pod, None elsewhere.
    """

    scheduler: str
    job_id: str
    user: str
    host: str
    rank: int | None = None
    step: str | None = None
    partition: str | None = None
    cluster: str | None = None
    pod: str | None = None

    def labels(self) -> dict[str, str]:
        """The identity as metric labels (`job`, `scheduler`, `user`, and the fields that are set)."""
        labels = {"job": self.job_id, "scheduler": self.scheduler, "user": self.user}
        for name in ("step", "partition", "cluster", "pod"):
            value = getattr(self, name)
            if value is not None:
                labels[name] = value
        return labels


def job_identity(environ: Mapping[str, str] | None = None) -> JobIdentity:
    """This process's job: from Slurm, torchrun or Kubernetes variables, else an id every process of the job
    shares (`ZEUS_CALLBACKS_JOB_ID`, exported on first use when `environ` is the process's own)."""
    env = os.environ if environ is None else environ
    host = socket.gethostname()
    user = env.get("SLURM_JOB_USER") or _user()
    if env.get("SLURM_JOB_ID"):
        array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        job = f"{array_job}_{array_task}" if array_job and array_task else env["SLURM_JOB_ID"]
        return JobIdentity(
            "slurm",
            job,
            user,
            host,
            rank=_rank(env, "SLURM_PROCID"),
            step=env.get("SLURM_STEP_ID") or None,
            partition=env.get("SLURM_JOB_PARTITION") or None,
            cluster=env.get("SLURM_CLUSTER_NAME") or None,
        )
    if env.get("TORCHELASTIC_RUN_ID"):
        return JobIdentity("torchrun", env["TORCHELASTIC_RUN_ID"], user, host, rank=_rank(env, "RANK"))
    if env.get("POD_NAME") or env.get("KUBERNETES_SERVICE_HOST"):
        pod = env.get("POD_NAME") or host
        namespace = env.get("POD_NAMESPACE") or _k8s_namespace()
        job = env.get(JOB_ID_ENV) or pod
        return JobIdentity(
            "kubernetes", job, user, host, rank=_rank(env, "RANK"), partition=namespace, pod=pod
        )
    job_id = env.get(JOB_ID_ENV)
    if not job_id:
        job_id = uuid.uuid4().hex[:12]
        if environ is None:
            os.environ[JOB_ID_ENV] = job_id  # the ranks and tools this process starts share it
    return JobIdentity("local", job_id, user, host, rank=_rank(env, "RANK"))


def _rank(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    return int(text) if text.isdigit() else None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return str(os.getuid())


def _k8s_namespace() -> str | None:
    try:
        return _K8S_NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None
