"""Training on a heterogeneous plan: uneven sampler, exact weighted gradients under DDP, per-rank power limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from zeus_callbacks import ZeusCost
from zeus_callbacks.accelerate import prepare_accelerate_dataloader
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.heterogeneous.planner import plan
from zeus_callbacks.core.heterogeneous.profile_file import ExtrapolationError, load_profile
from zeus_callbacks.core.heterogeneous.training import (
    RankPlan,
    UnevenDistributedSampler,
    apply_power_limit,
    loss_scale,
    match_gpu_type,
    rank_plans,
    restore_power_limits,
    weight_gradients,
)


@pytest.fixture(scope="module")
def hetero_plan():
    return plan([load_profile("a10"), load_profile("t4")], [1, 1], 1024, ZeusCost(0.5))


# -- sampler -------------------------------------------------------------------------------------------------


def _samplers(n, local_batches, **kw):
    offsets = [sum(local_batches[:r]) for r in range(len(local_batches))]
    total = sum(local_batches)
    return [
        UnevenDistributedSampler(n, total, o, b, **kw) for o, b in zip(offsets, local_batches, strict=True)
    ]


@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_covers_each_global_batch_exactly_once(drop_last):
    local_batches = [3, 5, 2]
    samplers = _samplers(47, local_batches, shuffle=True, seed=7, drop_last=drop_last)
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        steps = samplers[0].num_steps
        assert steps == (4 if drop_last else 5)
        order = samplers[0].global_order()
        shares = [list(s) for s in samplers]
        assert [len(x) for x in shares] == [steps * b for b in local_batches]  # same steps on every rank
        for step in range(steps):
            batch = [
                i for s, b in zip(shares, local_batches, strict=True) for i in s[step * b : (step + 1) * b]
            ]
            assert batch == order[step * 10 : (step + 1) * 10]  # the global batch, each sample once
            assert len(set(batch)) == 10
        covered = set(order)
        assert len(covered) == (40 if drop_last else 47)
    loader = DataLoader(TensorDataset(torch.arange(47)), batch_size=5, sampler=samplers[1])
    assert {len(x) for (x,) in loader} == {5}


def test_sampler_refuses_a_slice_outside_the_global_batch():
    with pytest.raises(ValueError, match="inside the global batch"):
        UnevenDistributedSampler(100, 8, 6, 3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        UnevenDistributedSampler(5, 8, 0, 3)


# -- rank plans ----------------------------------------------------------------------------------------------


def test_rank_plans_split_the_plan(hetero_plan):
    a10, t4 = hetero_plan.types
    rps = rank_plans(hetero_plan, ["a10", "t4"])
    assert [(r.rank, r.offset, r.local_batch, r.power_limit_w) for r in rps] == [
        (0, 0, a10.local_batch, a10.power_limit_w),
        (1, a10.local_batch, t4.local_batch, t4.power_limit_w),
    ]
    assert a10.local_batch + t4.local_batch == 1024
    assert sum(r.loss_scale for r in rps) == pytest.approx(2.0)  # sum_r W b_r / B = W
    assert loss_scale(3, 8, 2) == 0.75
    assert match_gpu_type(hetero_plan, "NVIDIA A10G") == "a10"
    assert match_gpu_type(hetero_plan, "Tesla T4") == "t4"
    for other in ("NVIDIA A40", "NVIDIA A100-SXM4-40GB"):
        with pytest.raises(ValueError, match="Cannot tell"):
            match_gpu_type(hetero_plan, other)
    with pytest.raises(ValueError, match="do not match the plan's GPU counts"):
        rank_plans(hetero_plan, ["a10", "a10"])


def test_planner_refuses_batches_outside_the_measured_range():
    with pytest.raises(
        ExtrapolationError, match=r"global batch 4096 cannot be split.*local batch 32\.\.1024"
    ):
        plan([load_profile("a10"), load_profile("t4")], [1, 1], 4096, ZeusCost(0.5))


# -- power limits --------------------------------------------------------------------------------------------


@pytest.mark.system
def test_each_rank_power_limit_is_applied_and_restored(sim_gpus, hetero_plan):
    sim_gpus("a10g,t4")
    gpus = get_gpus()
    before = [g.power_limit_mw() for g in gpus]
    for rp in rank_plans(hetero_plan, ["a10", "t4"]):
        apply_power_limit(rp, gpu_index=rp.rank)
    assert [g.power_limit_mw() for g in gpus] == [t.power_limit_w * 1000 for t in hetero_plan.types]
    assert restore_power_limits()
    assert [g.power_limit_mw() for g in gpus] == before
    too_high = RankPlan(0, 2, "t4", 4, 8, 0, 300)
    with pytest.raises(ValueError, match="outside"):
        apply_power_limit(too_high, gpu_index=1)


@pytest.mark.system
def test_hf_and_lightning_adapters_apply_and_restore(sim_gpus, hetero_plan):
    from zeus_callbacks.huggingface import HFHeterogeneousCallback
    from zeus_callbacks.lightning import LightningHeterogeneous

    sim_gpus("a10g,t4")
    t4 = get_gpus()[1]
    rp = rank_plans(hetero_plan, ["a10", "t4"])[1]
    hf = HFHeterogeneousCallback(rp, gpu_index=1)
    hf.on_train_begin(None, None, None)
    assert t4.power_limit_mw() == rp.power_limit_w * 1000
    hf.on_train_end(None, None, None)
    assert t4.power_limit_mw() == 70_000

    module = torch.nn.Linear(2, 1)
    cb = LightningHeterogeneous(rp, gpu_index=1)
    cb.on_fit_start(None, module)
    module(torch.ones(1, 2)).sum().backward()
    assert module.bias.grad.item() == pytest.approx(rp.loss_scale)
    cb.on_fit_end(None, module)
    assert t4.power_limit_mw() == 70_000


def test_hf_trainer_feeds_the_local_batch_and_scales_the_loss(tmp_path):
    from transformers import TrainingArguments

    from zeus_callbacks.huggingface import HeterogeneousTrainer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

    data = [{"x": torch.randn(2), "labels": torch.randn(())} for _ in range(32)]
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=1
    )
    rp = RankPlan(
        rank=1, world_size=2, gpu_name="t4", local_batch=3, global_batch=8, offset=5, power_limit_w=70
    )
    trainer = HeterogeneousTrainer(model=Model(), args=args, train_dataset=data, rank_plan=rp)
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 4 and {len(b["x"]) for b in batches} == {3}
    model = trainer.model.train()
    plain = model(**batches[0])["loss"]
    assert trainer.compute_loss(model, batches[0]).item() == pytest.approx(plain.item() * 0.75)


def test_accelerate_dataloader_is_the_rank_share():
    from accelerate import Accelerator

    rp = RankPlan(
        rank=0, world_size=2, gpu_name="a10", local_batch=5, global_batch=8, offset=0, power_limit_w=150
    )
    loader, scale = prepare_accelerate_dataloader(Accelerator(cpu=True), TensorDataset(torch.arange(40)), rp)
    assert scale == pytest.approx(1.25)
    assert [len(x) for (x,) in loader] == [5] * 5


# -- DDP equivalence -----------------------------------------------------------------------------------------

_LOCAL = [3, 5]
_STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = sum(_LOCAL) * _STEPS
    return TensorDataset(
        torch.randn(n, 4, generator=g, dtype=torch.float64),
        torch.randn(n, 1, generator=g, dtype=torch.float64),
    )


def _ddp_worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    rp = RankPlan(rank, 2, "x", _LOCAL[rank], sum(_LOCAL), sum(_LOCAL[:rank]), 100)
    for mode in ("loss", "gradients", "unweighted"):
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        weights = weight_gradients(model, rp) if mode == "gradients" else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = _data()
        loader = DataLoader(
            data, batch_size=rp.local_batch, sampler=UnevenDistributedSampler.from_rank_plan(data, rp)
        )
        assert len(loader) == _STEPS
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if mode == "loss":
                loss = loss * rp.loss_scale
            opt.zero_grad()
            loss.backward()
            opt.step()
        if weights is not None:
            weights.remove()
        torch.save([p.detach() for p in model.parameters()], Path(out_dir) / f"{mode}{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can abort a spawned process at interpreter teardown (std::terminate); the work is saved.
    os._exit(0)


@pytest.mark.slow
def test_uneven_ddp_equals_full_batch_training(tmp_path):
    mp.spawn(_ddp_worker, args=(str(tmp_path),), nprocs=2)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    order = UnevenDistributedSampler(data, sum(_LOCAL), 0, sum(_LOCAL)).global_order()
    for step in range(_STEPS):
        x, y = data[order[step * 8 : (step + 1) * 8]]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    expected = [p.detach() for p in model.parameters()]
    for mode in ("loss", "gradients"):
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{mode}{rank}.pt")
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # Without the weights DDP's plain average of the two ranks' means is not the full-batch update.
    unweighted = torch.load(tmp_path / "unweighted0.pt")
    assert not torch.allclose(unweighted[0], expected[0], rtol=1e-6, atol=1e-8)


# -- the example ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_trains_planned_and_even(run_example):
    steps = ("--steps", "3", "--warmup-steps", "1", "--rounds", "1", "--time-scale", "0.25")
    out = run_example("heterogeneous/train_heterogeneous.py", *steps, timeout=240)
    assert "SIMULATED GPUs: GPU 0 NVIDIA A10G, GPU 1 Tesla T4" in out, out
    assert "a10 local batch 699 at 150 W, t4 local batch 325 at 70 W" in out
    assert "even (max power)" in out and "SIMULATED planned vs even split" in out
