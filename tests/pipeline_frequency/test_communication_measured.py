"""The pipeline example on 4 gloo ranks: with the time between instructions measured in the job, the planner's
iteration time at the maximum clocks is the measured one (issue 13)."""

from __future__ import annotations

import re

import pytest

from zeus_callbacks.core.pipeline_frequency.edge_delays import EdgeDelays
from zeus_callbacks.core.pipeline_frequency.profile_file import edge_delays_path, read_edge_delays

pytestmark = pytest.mark.slow


def test_predicted_iteration_time_is_the_measured_one(run_example, tmp_path) -> None:
    # The example's simulated kernels (4 ms per layer) dominate the host's own time per instruction (the
    # Linear layers, the schedule, gloo).
    out = run_example(
        "pipeline/train_pipeline.py",
        *("--before-steps", "20", "--after-steps", "2", "--profile-steps", "4", "--stride-mhz", "300"),
        *("--profile-csv", str(tmp_path / "profile.csv")),
    )
    measured = re.search(r"before \(all max clocks\)\s+([\d.]+)", out)
    predicted = re.search(r"predicted, all max clocks\s+([\d.]+)", out)
    assert measured and predicted, out[-2000:]
    error = float(predicted.group(1)) / float(measured.group(1)) - 1
    print(f"PREDICTION_ERROR {error:+.4f}")
    # The outcome only: the planner predicts an iteration of this run's size (half to twice it). How close
    # depends on the host's load (+0.3% to +1.8% in eight runs alone on 2 cores, +3.1% in a loaded full-suite
    # run; the same profile without the edge delays: -2.6%), so the figure is benchmarks/pipeline_example.py's
    # (40 interleaved iterations), and the exact claim, that measured delays predict the pipeline that ran,
    # is the deterministic test_edge_delays.py::test_measured_edge_delays_recover_the_pipeline_that_ran.
    assert -0.5 < error < 1.0, out[-2000:]
    # The delays travel beside the profile: every link between stages took time.
    delays = EdgeDelays.from_rows(read_edge_delays(edge_delays_path(tmp_path / "profile.csv")))
    links = {(a, b): d for (a, _, b, _), d in delays.delays_s.items() if a != b}
    assert sorted(links) == [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)]
    assert all(d > 0 for d in links.values()) and delays.step_overhead_s > 0
