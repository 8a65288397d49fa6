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
    # Linear layers, the schedule, gloo); 20 baseline steps and 4 profiled steps per clock keep the medians
    # steady on a shared 2-core host (the benchmark's 40 baseline iterations: -1.1% to +0.5% off in 3 runs).
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
    # The planner's goal is 1% (benchmarks/pipeline_example.py measures it over 40 interleaved iterations:
    # -1.1% to +0.5% in four runs). Here, 4 ranks on 2 cores with 20 baseline steps run one after the other
    # measured +0.3% to +1.8% in eight runs (one a fresh-clone CI run); the same profile without the edge
    # delays predicts -2.6%. So 2% says the delays are in the model, within this host's spread.
    assert abs(error) <= 0.02, out[-2000:]
    # The delays travel beside the profile: every link between stages took time.
    delays = EdgeDelays.from_rows(read_edge_delays(edge_delays_path(tmp_path / "profile.csv")))
    links = {(a, b): d for (a, _, b, _), d in delays.delays_s.items() if a != b}
    assert sorted(links) == [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)]
    assert all(d > 0 for d in links.values()) and delays.step_overhead_s > 0
