"""The Grafana dashboard (`dashboards/zeus_callbacks.json`): it parses, uses only the metrics and labels the
endpoint exports, and a real Prometheus accepts every one of its queries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_servers import Prometheus, needs_prometheus

from zeus_callbacks.core.observability.endpoint import EXPORTED_METRICS, _labels_of

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "zeus_callbacks.json"
# Labels Prometheus adds to every scraped series, beside those the endpoint exports.
TARGET_LABELS = {"job", "instance"}


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    return exprs


def as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in as Grafana would."""
    expr = re.sub(r"label_values\((.*), \w+\)$", r"\1", expr)  # a variable query: its series selector
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__range", "1h")
        .replace("$train_job", ".*")
        .replace("$rank", ".*")
    )


def exported_names() -> dict[str, set[str]]:
    """Series name -> its labels, as the endpoint writes them (a counter with `_total`)."""
    return {
        name + ("_total" if kind == "counter" else ""): set(_labels_of(name))
        for name, (kind, _) in EXPORTED_METRICS.items()
    }


def test_dashboard_parses_and_uses_only_exported_metrics_and_labels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    exported = exported_names()
    used: set[str] = set()
    for expr in queries(dashboard):
        names = re.findall(r"\bzeus_callbacks_\w+", expr)
        assert names, expr
        for name in names:
            assert name in exported, f"{name!r} (in {expr!r}) is not exported by the endpoint"
            used.add(name)
            for matchers in re.findall(rf"\b{name}\{{([^}}]*)\}}", expr):
                for label in re.findall(r"(\w+)\s*=~?", matchers):
                    assert label in exported[name] | TARGET_LABELS, f"label {label!r} of {name!r} in {expr!r}"
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for item in label.split(","):
                assert any(item.strip() in labels for labels in exported.values()), (item, expr)
    # Every GPU reading and the optimizers' phase and choice have a panel.
    assert {n for n in exported if n.startswith("zeus_callbacks_gpu_")} <= used
    assert {"zeus_callbacks_optimizer_phase", "zeus_callbacks_optimizer_optimal_power_limit_watts"} <= used
    # Simulated GPUs are called so on the dashboard.
    assert any('simulated="true"' in expr for expr in queries(dashboard))


@pytest.mark.slow
@needs_prometheus
def test_a_real_prometheus_accepts_every_dashboard_query(tmp_path):
    prom = Prometheus(tmp_path / "prometheus", targets=[])
    try:
        for expr in queries(json.loads(DASHBOARD.read_text())):
            prom.query(as_promql(expr))  # raises unless Prometheus parsed and ran it
    finally:
        prom.stop()
