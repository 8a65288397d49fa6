"""PipelineFrequencyOptimizer in a DeepSpeed PipelineEngine (1F1B `TrainSchedule`), 4 gloo ranks.

Runs `examples/deepspeed/train_pipeline_module.py` (DeepSpeed's `PipelineModule`, engine and schedule,
unchanged; the first stage also holds the embedding, the last the output head) on 4 simulated A40s, with a
coarse clock sweep so that it plans in a few steps. The quantitative comparison (energy and time against
all-max clocks, interleaved blocks) is `benchmarks/pipeline_engines.py`'s.
"""

from __future__ import annotations

import pytest

# Importing the engine alone takes 10-30 s on a loaded 2-core host.
pytestmark = pytest.mark.slow

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'zeus-callbacks[deepspeed]'")

from engine_runs import EXAMPLES, FAST, WORLD, check_planned_run, locked_clocks, run_example, sigterm_one_rank  # noqa: E402

_EXAMPLE = EXAMPLES / "deepspeed" / "train_pipeline_module.py"


def test_deepspeed_train_schedule_profiled_planned_applied_and_restored(tmp_path):
    results, stdout = run_example(_EXAMPLE, ["--before-steps", "3", "--after-steps", "4", *FAST], tmp_path)
    ranks = [r[0] for r in results]
    assert all(len(r["ran"]) == 2 * 8 for r in ranks)  # 8 microbatches, counted in turn
    check_planned_run(ranks, "TrainSchedule")
    assert "equals DeepSpeed's TrainSchedule" in stdout
    assert locked_clocks(tmp_path / "sim-state") == [None] * WORLD


def test_deepspeed_clocks_restored_after_sigterm_to_one_rank(tmp_path):
    state = tmp_path / "sim-state"
    sigterm_one_rank(_EXAMPLE, ["--before-steps", "1", "--after-steps", "1", *FAST], state)
    assert locked_clocks(state) == [None] * WORLD


def test_deepspeed_schedule_order_is_the_planners_1f1b():
    from zeus_callbacks.core.pipeline_frequency.dag import build_schedule
    from zeus_callbacks.deepspeed import deepspeed_schedule_order

    assert deepspeed_schedule_order(4, 8) == build_schedule("1f1b", 4, 8)
    assert deepspeed_schedule_order(2, 1) == build_schedule("1f1b", 2, 1)


def test_instrument_deepspeed_patches_only_the_engine_and_undoes_it(sim_gpus):
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from zeus_callbacks import PipelineFrequencyOptimizer
    from zeus_callbacks.deepspeed import instrument_deepspeed

    sim_gpus("a40", virtual_clock=True)
    pfo = PipelineFrequencyOptimizer(device_id=0, target_time_s=10.0)  # nothing runs: it only gets wrapped

    class_map = dict(PipelineEngine._INSTRUCTION_MAP)
    engine = PipelineEngine.__new__(PipelineEngine)  # no process group is needed to patch one engine
    hooks = instrument_deepspeed(engine, pfo)
    own = engine.__dict__["_INSTRUCTION_MAP"]
    assert own[schedule.ForwardPass].__wrapped__ is class_map[schedule.ForwardPass]
    assert own[schedule.SendActivation] is class_map[schedule.SendActivation]
    assert PipelineEngine._INSTRUCTION_MAP == class_map  # the class is untouched
    with pytest.raises(TypeError, match="already instrumented"):
        instrument_deepspeed(engine, pfo)
    hooks.remove()
    assert "_INSTRUCTION_MAP" not in engine.__dict__ and "train_batch" not in engine.__dict__
    with pytest.raises(TypeError, match="not a DeepSpeed PipelineEngine"):
        instrument_deepspeed(object(), pfo)  # type: ignore[arg-type]
    pfo.close()
