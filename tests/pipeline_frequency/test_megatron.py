"""PipelineFrequencyOptimizer in Megatron-Core's own pipeline schedules (1F1B, interleaved), 4 gloo ranks.

Runs `examples/megatron/train_gpt.py` (Megatron's `GPTModel`, `parallel_state` and schedules, unchanged; the
last stage also holds the output head) on 4 simulated A40s, with a coarse clock sweep so that it plans in
a few steps. The quantitative comparison (energy and time against all-max clocks, interleaved blocks) is
`benchmarks/pipeline_engines.py`'s.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

# Importing the engine alone takes 10-30 s on a loaded 2-core host.
pytestmark = pytest.mark.slow

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'zeus-callbacks[megatron]'")

from engine_runs import EXAMPLES, FAST, WORLD, check_planned_run, locked_clocks, run_example, sigterm_one_rank  # noqa: E402

_EXAMPLE = EXAMPLES / "megatron" / "train_gpt.py"


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[dict]], Path, str]:
    """Both schedules in turn in one set of 4 processes: (per rank, per schedule results; state dir; stdout)."""
    tmp = tmp_path_factory.mktemp("megatron")
    args = ["--schedules", "1f1b,interleaved", "--before-steps", "3", "--after-steps", "4", *FAST]
    results, stdout = run_example(_EXAMPLE, args, tmp)
    return results, tmp / "sim-state", stdout


@pytest.mark.parametrize(
    ("index", "schedule"),
    [
        (0, "forward_backward_pipelining_without_interleaving"),
        (1, "forward_backward_pipelining_with_interleaving"),
    ],
)
def test_megatron_schedule_profiled_planned_applied(megatron_run, index, schedule):
    results, _, stdout = megatron_run
    ranks = [r[index] for r in results]
    # What each rank ran (microbatch and virtual stage included) is Megatron's schedule; 8 microbatches.
    assert all(len(r["ran"]) == 2 * 8 * (1 + index) for r in ranks)
    check_planned_run(ranks, schedule)
    assert stdout.count("equals Megatron's schedule") == 2


def test_megatron_clocks_restored_at_the_end(megatron_run):
    _, state, _ = megatron_run
    assert locked_clocks(state) == [None] * WORLD


def test_megatron_clocks_restored_after_sigterm_to_one_rank(tmp_path):
    state = tmp_path / "sim-state"
    sigterm_one_rank(
        _EXAMPLE, ["--schedules", "interleaved", "--before-steps", "1", "--after-steps", "1", *FAST], state
    )
    assert locked_clocks(state) == [None] * WORLD


def test_instrument_megatron_wraps_the_schedules_and_restores_them(sim_gpus):
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from zeus_callbacks import PipelineFrequencyOptimizer
    from zeus_callbacks.megatron import instrument_megatron

    sim_gpus("a40", virtual_clock=True)
    pfo = PipelineFrequencyOptimizer(device_id=0, target_time_s=10.0)  # nothing runs: it only gets wrapped

    names = (
        "forward_step",
        "backward_step",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    )
    originals = {n: getattr(schedules, n) for n in names}
    hooks = instrument_megatron(pfo)
    try:
        assert all(getattr(schedules, n) is not originals[n] for n in names)
        assert getattr(schedules, names[0]).__wrapped__ is originals[names[0]]
        if inspect.signature(get_forward_backward_func).parameters:  # 0.13+; 0.12 asks parallel_state
            assert get_forward_backward_func(4, None) is getattr(schedules, names[2])  # the wrapped schedule
        with pytest.raises(RuntimeError, match="already instrumented"):
            instrument_megatron(pfo)
    finally:
        hooks.remove()
    assert {n: getattr(schedules, n) for n in names} == originals
    hooks.remove()  # idempotent
    instrument_megatron(pfo).remove()  # and again after remove()
    pfo.close()


def test_megatron_schedule_order_is_the_planners_1f1b_and_interleaved_order():
    from zeus_callbacks.core.pipeline_frequency.dag import build_schedule
    from zeus_callbacks.megatron import megatron_schedule_order

    assert megatron_schedule_order(4, 8) == build_schedule("1f1b", 4, 8)
    assert megatron_schedule_order(4, 8, 2) == build_schedule("interleaved-1f1b", 4, 8, 2)
    order = megatron_schedule_order(2, 4, 2)
    assert [str(i) for i in order[1][:4]] == ["F(s1,v1,m0)", "F(s1,v1,m1)", "F(s1,v3,m0)", "B(s1,v3,m0)"]
