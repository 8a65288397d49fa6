"""The power-limit optimizer on 2 simulated nodes x 2 GPUs: two torchrun agents on this machine, each node
with its own simulated GPUs, state and journal; local vs global rank, per-node GPUs, one decision for the job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two torchrun agents, four gloo processes

_TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from zeus_callbacks import GlobalPowerLimitOptimizer, ZeusMonitor, local_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    monitor = ZeusMonitor(gpu_indices=[local_rank()])
    plo = GlobalPowerLimitOptimizer(monitor, wait_steps=1, warmup_steps=1, profile_steps=4, pl_step=100)
    gpu = monitor.gpus[local_rank()]
    grad = torch.ones(1000)
    limits_seen = set()
    for step in range(400):
        plo.on_step_begin()
        t = time.process_time()
        while time.process_time() - t < 0.01:
            pass
        dist.all_reduce(grad)
        plo.on_step_end()
        limits_seen.add(gpu.power_limit_mw() // 1000)
        if plo.phase == "done" and step > 5:
            break
    decided = dist.get_world_size()
    out = {
        "rank": dist.get_rank(), "local_rank": local_rank(), "node": os.environ["NODE"], "uuid": gpu.uuid,
        "optimal": plo.optimal_power_limit_w, "limit_now": gpu.power_limit_mw() // 1000,
        "step": step, "world": decided, "limits_seen": sorted(limits_seen),
    }
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    plo.on_train_end()
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_two_gpus_each_one_decision(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    agents = []
    for node in (0, 1):
        node_dir = tmp_path / f"node{node}"
        env = {
            **os.environ,
            "NODE": str(node),
            "ZEUS_CALLBACKS_SIMULATE": "2*a40",
            "ZEUS_CALLBACKS_SIM_STATE_DIR": str(node_dir / "sim"),
            "ZEUS_CALLBACKS_JOURNAL_DIR": str(node_dir / "journal"),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(script),
            str(out),
        ]
        agents.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    logs = []
    for a in agents:
        try:
            logs.append(a.communicate(timeout=420)[0])
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            raise
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    # Global ranks 0-3; local ranks 0 and 1 on each node; each rank on its node's own GPU.
    assert sorted((r["node"], r["local_rank"]) for r in ranks) == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert len({r["uuid"] for r in ranks}) == 4  # two nodes never share a GPU
    # One decision for the whole job, taken at the same step on every rank, and in force on every GPU.
    assert {r["optimal"] for r in ranks} == {ranks[0]["optimal"]} and ranks[0]["optimal"] is not None
    assert len({r["step"] for r in ranks}) == 1
    assert all(r["limit_now"] == r["optimal"] for r in ranks)
    assert all(len(r["limits_seen"]) >= 2 for r in ranks)  # each node's GPUs were profiled
    # After training each node's GPUs are back at their maximum, in each node's own state.
    for node in (0, 1):
        state = tmp_path / f"node{node}" / "sim"
        code = (
            "from zeus_callbacks import sim; "
            f"s = sim.simulate('2*a40', state_dir={str(state)!r}); "
            "print([g.power_limit_mw for g in s.gpus])"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_CALLBACKS_")}
        printed = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert printed.stdout.strip() == "[300000, 300000]", printed.stderr
