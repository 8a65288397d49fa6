"""The two test tiers, checked on every test (a pytest plugin loaded by conftest.py).

- The deterministic tier, `pytest -m "not system"`: one process and the virtual clock (or no clock at all);
  quantitative claims belong here, with no tolerance set from a machine.
- The system tier, marked `system`: other processes (subprocesses, torch.distributed ranks, the sampling
  process, zeusd doubles), the real-clock simulator and real frameworks training on it. Its tests assert
  outcomes that hold on any machine (a limit below the maximum chosen, GPUs restored, ranks agree).
  Every `slow` test is a system test.

The deterministic tier runs without the restore watchdog (a process). A test without the `system` mark that
starts another process fails in its teardown with a line that says so. A real-clock simulated node is allowed
in the deterministic tier only for what does not depend on time (settings, errors, the simulator's recorded
sleeps); that one is a review rule, not checked: a test that reads time or energy off a real-clock node is
marked `system`.
"""

from __future__ import annotations

import multiprocessing.util
import os
import platform
import subprocess
from collections.abc import Iterator

import pytest

from zeus_callbacks.core.device.watchdog import WATCHDOG_ENV

SYSTEM = "system"

# The standard library's one-time probe of the processor (`platform.processor()` runs `uname -p` once per
# process and caches it) is made here, before any test: libraries a test imports call it at import (MLflow's
# telemetry schema, imported by transformers' tracker integrations), and that first import is not the test
# starting a process.
platform.processor()
# Nor do the trackers' own usage reports leave the test process (MLflow 3 sends telemetry unless told not to).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker(SYSTEM) is None:
            item.add_marker(SYSTEM)


@pytest.fixture(autouse=True)
def tier_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a deterministic-tier test that started another process."""
    if request.node.get_closest_marker(SYSTEM) is not None:
        yield
        return
    # The restore watchdog is another process, there for hard deaths: the system tier tests it.
    monkeypatch.setenv(WATCHDOG_ENV, "0")
    started: list[str] = []

    def track(name: str, original):
        def wrapper(*args, **kwargs):
            started.append(name)
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        subprocess.Popen, "_execute_child", track("a subprocess", subprocess.Popen._execute_child)
    )
    monkeypatch.setattr(
        multiprocessing.util,
        "spawnv_passfds",
        track("a spawned process", multiprocessing.util.spawnv_passfds),
    )
    monkeypatch.setattr(os, "fork", track("a forked process", os.fork))
    yield
    did = sorted(set(started))
    if did:
        pytest.fail(
            f"{request.node.nodeid} is in the deterministic tier but used {' and '.join(did)}: mark it "
            f"@pytest.mark.{SYSTEM} (and assert outcomes only) or test it in this process",
            pytrace=False,
        )
