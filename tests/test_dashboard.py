"""The Grafana dashboard queries only metrics that a real server registers.

vLLM's own PrometheusStatLogger is built for an engine with a drafter and
DraftOffloadConnector, exactly as `vllm serve` builds it, and every metric name
in every panel's PromQL must be one of the families it registered. A renamed or
dropped metric, on either side, fails this test instead of a blank panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from vllm_draft_offload.metrics_prom import ALL_METRICS

DASHBOARD = Path(__file__).parents[1] / "configs" / "grafana" / "draft-offload.json"
METRIC_NAME = re.compile(r"vllm:[a-z0-9_:]+")
# Series suffixes Prometheus adds to a family's name.
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    return exprs


def _family(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


@pytest.fixture
def registered_families(vllm_prometheus: object) -> set[str]:
    """The families of the PrometheusStatLogger `vllm_prometheus` built (conftest.py)."""
    return {family.name for family in REGISTRY.collect()}


def test_dashboard_queries_only_registered_metrics(registered_families: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {_family(name) for expr in _queries(dashboard) for name in METRIC_NAME.findall(expr)}
    assert queried, "the dashboard queries no metric"
    missing = sorted(queried - registered_families)
    assert not missing, f"dashboard queries metrics nobody registers: {missing}"


def test_dashboard_covers_the_connector_metrics() -> None:
    """Every connector metric an operator needs has a panel (hit rate, GB/s, latency,
    fallbacks, refusals, acceptance restored vs fresh, audit)."""
    text = " ".join(_queries(json.loads(DASHBOARD.read_text())))
    unused = [m.name for m in ALL_METRICS if m.name not in text]
    # transfer_seconds backs the GB/s log line; rates of bytes are the dashboard's view.
    assert unused == ["vllm:draft_offload_transfer_seconds"], unused


def test_panels_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), panel["title"]
