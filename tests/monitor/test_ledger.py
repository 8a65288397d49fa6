"""The per-job energy ledger: the job's identity from its scheduler's variables, lines that never tear, sums
per job, user and partition, and the reporter appending its rank's line (issue 41)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from zeus_callbacks import ZeusMonitor
from zeus_callbacks.cli import main
from zeus_callbacks.core.accounting.identity import JOB_ID_ENV, JobIdentity, job_identity
from zeus_callbacks.core.accounting.ledger import LEDGER_ENV, LedgerEntry, append, read, totals
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.reporting import EnergyReporter, Rates

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_JOB_USER": "alice",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_CLUSTER_NAME": "c1",
    "RANK": "7",  # torchrun's, under srun: Slurm's task wins
    "TORCHELASTIC_RUN_ID": "elastic-1",
}


def test_slurm_identity_wins_over_torchrun():
    job = job_identity(SLURM)
    assert (job.scheduler, job.job_id, job.rank, job.step, job.user, job.partition, job.cluster) == (
        "slurm",
        "4242",
        1,
        "0",
        "alice",
        "gpu",
        "c1",
    )
    assert job.labels() == {
        "job": "4242",
        "scheduler": "slurm",
        "user": "alice",
        "step": "0",
        "partition": "gpu",
        "cluster": "c1",
    }


def test_slurm_array_task_is_a_job_of_its_own():
    job = job_identity({**SLURM, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "3"})
    assert job.job_id == "4240_3"  # as sacct names it


def test_torchrun_and_kubernetes_identities():
    job = job_identity({"TORCHELASTIC_RUN_ID": "r9", "RANK": "3"})
    assert (job.scheduler, job.job_id, job.rank) == ("torchrun", "r9", 3)
    pod = job_identity({"POD_NAME": "train-0", "POD_NAMESPACE": "ml", "RANK": "0"})
    assert (pod.scheduler, pod.job_id, pod.pod, pod.partition, pod.rank) == (
        "kubernetes",
        "train-0",
        "train-0",
        "ml",
        0,
    )


def test_local_id_is_generated_once_and_inherited(monkeypatch):
    monkeypatch.delenv(JOB_ID_ENV, raising=False)
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "POD_NAME", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    first = job_identity()
    assert first.scheduler == "local" and os.environ[JOB_ID_ENV] == first.job_id  # children inherit it
    assert job_identity().job_id == first.job_id
    assert job_identity({JOB_ID_ENV: "mine"}).job_id == "mine"


def _entry(job_id="1", rank=0, energy=100.0, event="end", run="r1", at=1.0, **kw) -> LedgerEntry:
    job = JobIdentity(
        "slurm", job_id, kw.pop("user", "alice"), "node1", rank=rank, partition=kw.pop("partition", "gpu")
    )
    return LedgerEntry(job, event, (f"GPU-{job_id}-{rank}",), energy, 10.0, run=run, written_at=at, **kw)


def test_append_round_trips_and_creates_a_private_file(tmp_path):
    path = tmp_path / "ledger.jsonl"
    entry = _entry(energy_bound_j=5.0, co2eq_g=1.5, power_limit_w=200.0, simulated=True)
    assert append(path, entry)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read([path]).entries == [entry]


def test_totals_take_the_newest_line_of_each_rank_and_run():
    entries = [
        _entry(rank=0, energy=50.0, event="checkpoint", at=1.0),
        _entry(rank=0, energy=120.0, at=2.0),  # supersedes its checkpoint
        _entry(rank=1, energy=110.0, at=2.0, energy_bound_j=None),
        _entry(rank=0, energy=30.0, run="r2", at=3.0, event="failed"),  # a requeued run of the same job
        _entry(job_id="2", energy=10.0, user="bob", partition="debug"),
    ]
    by_job = {t.key: t for t in totals(entries)}
    one = by_job["1"]
    assert (one.energy_j, one.ranks, one.runs, one.failed, one.energy_bound_j) == (260.0, 3, 2, True, None)
    assert by_job["2"].energy_j == 10.0
    by_user = {t.key: t.energy_j for t in totals(entries, by="user")}
    assert by_user == {"alice": 260.0, "bob": 10.0}
    assert [t.key for t in totals(entries, by="partition")] == ["gpu", "debug"]


def test_a_final_line_supersedes_its_runs_checkpoints_and_a_killed_run_counts_to_its_last():
    """Fails if `totals` counts a finished rank's checkpoint lines beside its end line (or takes a checkpoint
    written after the end by a stepped-back clock), or leaves out a rank killed after a checkpoint."""
    entries = [
        _entry(rank=0, energy=40.0, event="checkpoint", at=1.0, step=100),
        _entry(rank=0, energy=120.0, at=2.0),  # finished
        _entry(rank=0, energy=80.0, event="checkpoint", at=5.0, step=200),  # the clock stepped back
        _entry(rank=1, energy=30.0, event="checkpoint", at=1.0, step=100),
        _entry(rank=1, energy=70.0, event="checkpoint", at=2.0, step=200),  # then killed: no end line
    ]
    (job,) = totals(entries)
    assert (job.energy_j, job.ranks, job.checkpointed, job.failed) == (190.0, 2, 1, False)
    assert totals(entries[:2])[0].checkpointed == 0


def test_a_version_1_line_reads_as_a_line_without_a_step(tmp_path):
    path = tmp_path / "ledger.jsonl"
    record = json.loads(_entry(event="checkpoint").to_line())
    del record["step"]
    path.write_text(json.dumps({**record, "version": 1}) + "\n")
    (entry,) = read([path]).entries
    assert entry.event == "checkpoint" and entry.step is None
    with pytest.raises(ValueError, match="step"):
        _entry(step="100")


def test_reporter_writes_a_checkpoint_line_that_its_end_line_supersedes(sim_gpus, tmp_path):
    """Fails if the reporter writes no checkpoint line (with its step and this rank's figures since the run
    began, read without closing the run), or if `jobs` then sums the checkpoint beside the end."""
    system = sim_gpus("a40", virtual_clock=True)
    path = tmp_path / "ledger.jsonl"
    monitor = ZeusMonitor()
    reporter = EnergyReporter(monitor, ledger_path=path)
    reporter.start()
    monitor.begin_window("to the checkpoint", sync_execution=False)
    for _ in range(5):
        system.run_step(0.2)
    reporter.checkpoint(step=5)
    so_far = monitor.end_window("to the checkpoint", sync_execution=False)
    for _ in range(5):
        system.run_step(0.2)
    end = reporter.stop()
    checkpoint, final = read([path]).entries
    assert (checkpoint.event, checkpoint.step, final.event, final.step) == ("checkpoint", 5, "end", None)
    assert checkpoint.energy_j == pytest.approx(so_far.total_energy) and checkpoint.energy_bound_j is not None
    assert checkpoint.time_s == pytest.approx(so_far.time)
    assert 0 < checkpoint.energy_j < final.energy_j == pytest.approx(end["energy/total_j"])
    (job,) = totals(read([path]).entries)
    assert job.energy_j == final.energy_j and job.checkpointed == 0


def test_a_run_killed_after_a_checkpoint_is_summed_to_it(sim_gpus, tmp_path, capsys):
    """Fails if a rank that never wrote its end line (killed) is left out of `jobs`, or is not marked so."""
    system = sim_gpus("a40", virtual_clock=True)
    path = tmp_path / "ledger.jsonl"
    reporter = EnergyReporter(ZeusMonitor(), ledger_path=path)
    reporter.start()
    system.run_step(1.0)
    reporter.checkpoint(step=10)
    system.run_step(1.0)  # then SIGKILL: no end line
    (line,) = read([path]).entries
    assert main(["jobs", str(path), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["totals"]
    assert job["energy_j"] == line.energy_j > 0 and job["checkpointed"] == 1
    assert main(["jobs", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-2:] == ["SIM", "CKPT"]
    reporter.cancel()


@pytest.mark.parametrize(
    "adapter",
    [
        "huggingface:HFZeusMonitor",
        "huggingface:HFGlobalPowerLimitOptimizer",
        "lightning:LightningZeusMonitor",
        "lightning:LightningGlobalPowerLimitOptimizer",
    ],
)
def test_the_adapters_save_hooks_write_a_checkpoint_line(adapter, sim_gpus, tmp_path, monkeypatch):
    """Fails if HF's `on_save` or Lightning's `on_save_checkpoint` does not reach the ledger (with the
    trainer's global step)."""
    import importlib
    from types import SimpleNamespace

    framework, name = adapter.split(":")
    pytest.importorskip("transformers" if framework == "huggingface" else "lightning")
    system = sim_gpus("a40", virtual_clock=True)
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(LEDGER_ENV, str(path))
    callback = getattr(importlib.import_module(f"zeus_callbacks.{framework}"), name)(ZeusMonitor([0]))
    if framework == "huggingface":
        from transformers import TrainerControl, TrainerState, TrainingArguments

        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        state, control = TrainerState(global_step=7), TrainerControl()
        callback.on_train_begin(args, state, control)
        system.run_step(0.5)
        callback.on_save(args, state, control)
        callback.on_train_end(args, state, control)
    else:
        trainer = SimpleNamespace(global_step=7)
        callback.on_train_start(trainer, None)
        system.run_step(0.5)
        callback.on_save_checkpoint(trainer, None, {})
        callback._session.end()
    checkpoint, end = read([path]).entries
    assert (checkpoint.event, checkpoint.step, end.event) == ("checkpoint", 7, "end")
    assert 0 < checkpoint.energy_j <= end.energy_j


def test_no_ledger_no_checkpoint_line_and_no_window_closed(sim_gpus, tmp_path, monkeypatch):
    sim_gpus("a40", virtual_clock=True)
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    monitor = ZeusMonitor()
    reporter = EnergyReporter(monitor)
    reporter.checkpoint(step=1)  # before the run: nothing
    reporter.start()
    reporter.checkpoint(step=2)
    assert len(monitor.open_windows) == 2
    reporter.stop()


def test_bounds_add_up_when_every_line_has_one():
    entries = [_entry(rank=r, energy_bound_j=2.0 + r) for r in range(3)]
    assert totals(entries)[0].energy_bound_j == 9.0


def test_torn_and_foreign_lines_are_counted_not_fatal(tmp_path):
    path = tmp_path / "ledger.jsonl"
    append(path, _entry())
    with path.open("a") as f:
        f.write('{"job": {"scheduler": "slurm", "job_id": "1"\n')  # a torn line from some other writer
        f.write("not json at all\n")
    contents = read([path])
    assert len(contents.entries) == 1 and contents.skipped == 2


def test_a_symlink_or_fifo_is_refused_with_what_to_do(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep\n")
    link = tmp_path / "ledger.jsonl"
    link.symlink_to(target)
    with pytest.raises(InvalidInputError, match="regular file"):
        append(link, _entry())
    assert target.read_text() == "keep\n"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InvalidInputError, match="regular file"):
        append(fifo, _entry())  # never blocks waiting for a reader


def test_an_unwritable_ledger_is_logged_not_raised(tmp_path, caplog):
    folder = tmp_path / "missing" / "ledger.jsonl"
    assert not append(folder, _entry())
    assert "this line is lost" in caplog.text


def test_reporter_appends_its_ranks_line(sim_gpus, tmp_path):
    system = sim_gpus("2*a40", virtual_clock=True)
    path = tmp_path / "ledger.jsonl"
    monitor = ZeusMonitor()
    reporter = EnergyReporter(monitor, rates=Rates(carbon_g_per_kwh=400.0), ledger_path=path)
    reporter.start()
    for _ in range(5):
        system.run_step(0.2)
    totals_ = reporter.stop()
    (entry,) = read([path]).entries
    assert entry.event == "end" and entry.simulated
    assert entry.energy_j == pytest.approx(totals_["energy/total_j"])
    assert entry.time_s == pytest.approx(totals_["energy/total_time_s"])
    assert entry.co2eq_g == pytest.approx(totals_["energy/total_co2eq_g"])
    assert set(entry.gpus) == {g.uuid for g in system.gpus}


def test_reporter_notes_a_failed_run_without_a_collective(sim_gpus, tmp_path, monkeypatch):
    system = sim_gpus("a40", virtual_clock=True)
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(LEDGER_ENV, str(path))  # a site's ledger, no argument
    reporter = EnergyReporter(ZeusMonitor())
    reporter.start()
    system.run_step(0.5)
    reporter.cancel()
    (entry,) = read([path]).entries
    assert entry.event == "failed" and entry.energy_j > 0


def test_jobs_command_table_and_json(tmp_path, capsys):
    path = tmp_path / "ledger.jsonl"
    for e in (_entry(rank=0, energy=3.6e6), _entry(rank=1, energy=1.8e6), _entry(job_id="2", energy=3.6e5)):
        append(path, e)
    assert main(["jobs", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(t["key"], t["energy_j"], t["ranks"]) for t in out["totals"]] == [
        ("1", 5.4e6, 2),
        ("2", 3.6e5, 1),
    ]
    assert main(["jobs", str(path), "--by", "user"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["USER", "JOBS"] and table[1].split()[:6] == [
        "alice",
        "2",
        "1",
        "3",
        "3",
        "1.6",
    ]
    assert table[1].split()[6] == "?"  # these lines carry no bound
    assert main(["jobs", str(tmp_path / "nope.jsonl")]) == 2
    assert "is not a file" in capsys.readouterr().err


_APPENDER = """
import sys
from zeus_callbacks.core.accounting.identity import JobIdentity
from zeus_callbacks.core.accounting.ledger import LedgerEntry, append
path, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
job = JobIdentity("slurm", "77", "alice", "node1", rank=rank)
gpus = tuple(f"GPU-{rank}-{i:04d}-" + "x" * 40 for i in range(8))  # long lines: several KB each
for i in range(n):
    assert append(path, LedgerEntry(job, "checkpoint", gpus, float(i), float(i), written_at=float(i)))
"""


@pytest.mark.system
def test_concurrent_ranks_never_tear_a_line(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "ledger.jsonl"
    procs = [
        subprocess.Popen([sys.executable, "-c", _APPENDER, str(path), str(rank), "1000"]) for rank in range(8)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * 8
    contents = read([path])
    assert contents.skipped == 0 and len(contents.entries) == 8000
    (total,) = totals(contents.entries)
    assert total.ranks == 8 and total.energy_j == 8 * 999.0  # each rank's newest line


@pytest.mark.system
def test_a_full_disk_leaves_no_half_line(tmp_path, run_python):
    path = tmp_path / "ledger.jsonl"
    append(path, _entry())
    size = path.stat().st_size
    script = f"""
import logging, resource, signal
from zeus_callbacks.core.accounting.identity import JobIdentity
from zeus_callbacks.core.accounting.ledger import LedgerEntry, append
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, ({size + 100}, {size + 100}))
job = JobIdentity("slurm", "1", "alice", "node1", rank=5)
ok = append({str(path)!r}, LedgerEntry(job, "end", ("GPU-" + "y" * 400,), 1.0, 1.0))
print("appended" if ok else "lost")
"""
    result = run_python(script)
    assert result.stdout.strip() == "lost" and "free space" in result.stderr
    assert path.stat().st_size == size and len(read([path]).entries) == 1
