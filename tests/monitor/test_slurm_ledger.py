"""Per-job energy under a real Slurm (issue 41): a two-task `srun` job trains on simulated GPUs with the
power-limit optimizer; the ledger holds the Slurm job, both tasks, their energy and the choice, and
`zeus-callbacks jobs` sums them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_cluster

from zeus_callbacks.core.accounting.ledger import read

pytestmark = [pytest.mark.system, pytest.mark.slow]

# Each task: its rank and world from Slurm's variables, as users' scripts do; torch.distributed on gloo; the
# plain-loop helper on its own simulated GPU (SLURM_LOCALID), with each step's work queued on it.
_TRAIN = """
import os, sys
import torch
import torch.distributed as dist
from zeus_callbacks import MaxSlowdownConstraint, sim
from zeus_callbacks.accelerate import PowerLimitOptimizerHelper

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1],
                        rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
gpu = int(os.environ["SLURM_LOCALID"])
with PowerLimitOptimizerHelper(None, MaxSlowdownConstraint(1.1), wait_steps=1, warmup_steps=2,
                               profile_steps=4, pl_step=50) as plo:
    for _ in range(150):
        with plo.step():
            sim.enqueue_work(gpu, 0.03)
            sim.active().cuda_gpus()[gpu].synchronize()
print("task", dist.get_rank(), "chose", plo.optimizer.optimal_power_limit_w, flush=True)
dist.destroy_process_group()
"""


def _srun_training(slurm, tmp_path: Path, ledger: Path, **env: str) -> subprocess.CompletedProcess:
    """`srun -n 2` of `_TRAIN` on the simulated node `env` names, appending to `ledger`; it must succeed."""
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = {
        "ZEUS_CALLBACKS_SIM_STATE_DIR": str(tmp_path / "gpus"),
        "ZEUS_CALLBACKS_LEDGER": str(ledger),
        **env,
    }
    port = str(slurm_cluster._free_port())
    result = slurm.srun("-n", "2", "-p", "gpu", sys.executable, str(script), port, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture
def slurm(tmp_path: Path):
    cluster = slurm_cluster.start(tmp_path / "slurm")
    yield cluster
    slurm_cluster.stop(cluster)


def test_two_task_job_lands_in_the_ledger(slurm, tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    result = _srun_training(slurm, tmp_path, ledger, ZEUS_CALLBACKS_SIMULATE="2*a40")
    assert sorted(line.split()[1] for line in result.stdout.splitlines() if line.startswith("task")) == [
        "0",
        "1",
    ]

    entries = read([ledger]).entries
    assert len(entries) == 2 and {e.job.scheduler for e in entries} == {"slurm"}
    (job_id,) = {e.job.job_id for e in entries}
    assert job_id.isdigit() and {e.job.partition for e in entries} == {"gpu"}
    assert sorted(e.job.rank for e in entries) == [0, 1]
    assert all(e.event == "end" and e.simulated and e.energy_j > 0 and e.time_s > 0 for e in entries)
    assert len({e.gpus for e in entries}) == 2  # each task its own GPU
    assert all(e.power_limit_w is not None and 100 <= e.power_limit_w <= 300 for e in entries)

    out = subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", "jobs", str(ledger), "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (total,) = json.loads(out)["totals"]
    assert total["key"] == job_id and total["ranks"] == 2 and total["gpus"] == 2
    assert total["energy_j"] == pytest.approx(sum(e.energy_j for e in entries))


def test_a_job_under_a_sites_budget_stays_within_it(slurm, tmp_path):
    """A site's budget (ZEUS_CALLBACKS_POWER_BUDGET_W, W per GPU) set for the job: no limit above it, and
    each task's measured power within it up to the measurement's own bound."""
    ledger = tmp_path / "ledger.jsonl"
    _srun_training(
        slurm,
        tmp_path,
        ledger,
        ZEUS_CALLBACKS_SIMULATE="2*a40:imagenet/resnet50/256",
        ZEUS_CALLBACKS_POWER_BUDGET_W="200",
    )
    entries = read([ledger]).entries
    assert len(entries) == 2 and all(e.power_limit_w is not None and e.power_limit_w <= 200 for e in entries)
    for e in entries:
        assert e.energy_bound_j is not None
        assert (e.energy_j - e.energy_bound_j) / e.time_s <= 200
