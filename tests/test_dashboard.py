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

import prometheus_client.values as prometheus_values
import pytest
from prometheus_client import REGISTRY
from vllm.config import (
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.plugins import load_general_plugins
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

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
def registered_families(model_dirs: tuple[Path, Path]) -> set[str]:
    if prometheus_values.ValueClass is not prometheus_values.MutexValue:
        pytest.skip("prometheus multiprocess mode: families are not in the default REGISTRY")
    load_general_plugins()
    target, draft = model_dirs
    model_config = ModelConfig(model=str(target), skip_tokenizer_init=True, max_model_len=2048)
    vllm_config = VllmConfig(
        model_config=model_config,
        speculative_config=SpeculativeConfig(
            method="draft_model",
            model=str(draft),
            num_speculative_tokens=2,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="DraftOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30},
        ),
    )
    unregister_vllm_metrics()
    try:
        PrometheusStatLogger(vllm_config, engine_indexes=[0])
        yield {family.name for family in REGISTRY.collect()}
    finally:
        unregister_vllm_metrics()


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
