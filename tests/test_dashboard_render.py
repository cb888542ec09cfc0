"""`vllm-draft-offload dashboard-render`: the dashboard's PromQL evaluated over scrapes.

The scrape is synthetic but real in everything else: vLLM's PrometheusStatLogger,
built as `vllm serve` builds it with DraftOffloadConnector (`vllm_prometheus` in
conftest.py), records known per-second stats through its own `record()` (so the
connector's `DraftOffloadPromMetrics.observe` renders them), and prometheus_client
writes the /metrics text each second. A metric renamed on either side leaves a panel
without data and fails here.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("promql_parser")

from vllm_draft_offload.bench.serve import dashboard  # noqa: E402
from vllm_draft_offload.bench.serve.promql import (  # noqa: E402
    Evaluator,
    UnsupportedPromQL,
    bucket_quantile,
    extrapolated_rate,
    instant_rate,
    parse,
)
from vllm_draft_offload.bench.serve.scrape import Scrapes, read_scrapes, write_block  # noqa: E402

DASHBOARD = Path(__file__).parents[1] / "configs" / "grafana" / "draft-offload.json"
SECONDS = 12
T0 = 1_800_000_000.0


def _one_second_of_stats() -> tuple[object, object]:
    """The SchedulerStats and IterationStats one engine second reports."""
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from vllm_draft_offload.metrics import DraftOffloadStats

    ours = DraftOffloadStats()
    ours.record_lookup("cpu", hit_chunks=3, miss_chunks=1)
    ours.record_lookup("l3", hit_chunks=1, miss_chunks=1)
    ours.record_transfer("load", "cpu", int(2e9), int(5e8), chunks=4, seconds=0.004)
    ours.record_transfer("store", "cpu", int(1e9), int(2.5e8), chunks=2, seconds=None)
    ours.record_recomputed_tokens(1)
    ours.record_fallback("load_error")
    ours.record_refused("checksum_mismatch", 2)
    ours.record_l3_declined("slower_than_recompute", 5)
    ours.record_audit_recompute("ok", 3)
    ours.record_l3_thread_time("read", 0.08, 0.06)
    ours.record_l3_thread_time("write", 0.2, 0.05)
    ours.record_acceptance(True, num_drafts=10, num_accepted=15)
    ours.record_acceptance(False, num_drafts=10, num_accepted=20)
    spec = SpecDecodingStats.new(2)
    for _ in range(4):
        spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    scheduler = SchedulerStats(
        prefix_cache_stats=PrefixCacheStats(requests=1, queries=100, hits=20),
        connector_prefix_cache_stats=PrefixCacheStats(requests=1, queries=80, hits=60),
        spec_decoding_stats=spec,
        kv_connector_stats=ours.data,
    )
    iteration = IterationStats()
    iteration.time_to_first_tokens_iter = [0.05]
    return scheduler, iteration


@pytest.fixture
def scrape_file(vllm_prometheus: object, tmp_path: Path) -> Path:
    """SECONDS scrapes, one a second, of a server recording the same stats each second."""
    from prometheus_client import REGISTRY, generate_latest

    path = tmp_path / "metrics.prom"
    with path.open("w") as out:
        for i in range(SECONDS):
            if i:  # the first scrape: the server up, nothing served yet
                vllm_prometheus.record(*_one_second_of_stats())  # type: ignore[attr-defined]
            write_block(out, T0 + i, generate_latest(REGISTRY).decode())
    return path


def _evaluate(path: Path) -> dict[str, dict[str, float | None]]:
    """Every panel's legends -> value at the last scrape."""
    board = json.loads(DASHBOARD.read_text())
    scrapes = read_scrapes(path)
    variables = dashboard.default_variables(board, dashboard.rate_interval(scrapes))
    panels = dashboard.evaluate_dashboard(board, scrapes, variables)
    return {p.title: {k: dashboard._last(v) for k, (_, v) in p.series.items()} for p in panels}


def test_every_panel_shows_what_the_server_recorded(scrape_file: Path) -> None:
    got = _evaluate(scrape_file)
    approx = pytest.approx
    assert got["Hit rate per tier (chunks found / looked up)"] == {"cpu": 0.75, "l3": 0.5}
    assert got["External prefix-cache hit rate (vLLM)"] == {
        "external hits / queries": 0.75,
        "GPU prefix cache": 0.2,
    }
    assert got["Loaded GB/s by tier and part"] == {
        "cpu target": approx(2.0), "cpu draft": approx(0.5), "l3 target": 0.0, "l3 draft": 0.0,
    }  # fmt: skip
    assert got["Stored GB/s by tier and part"] == {
        "cpu target": approx(1.0), "cpu draft": approx(0.25), "l3 target": 0.0, "l3 draft": 0.0,
    }  # fmt: skip
    # every restore took 4 ms: in the (2.5 ms, 5 ms] bucket, interpolated linearly
    assert got["Restore latency quantiles"] == {
        "p50 cpu": approx(0.00375), "p90 cpu": approx(0.00475), "p99 cpu": approx(0.004975),
    }  # fmt: skip
    assert got["Recomputed tokens per hit"] == {"p50": approx(0.5), "p99": approx(0.99)}
    fallbacks = got["Fallbacks to recompute by cause"]
    assert fallbacks.pop("load_error") == approx(1.0) and set(fallbacks.values()) == {0.0}
    refusals = got["Refused stored units by cause"]
    assert refusals.pop("checksum_mismatch") == approx(2.0) and set(refusals.values()) == {0.0}
    assert got["Acceptance length: restored vs fresh prefixes"] == {
        "restored=true": approx(2.5),
        "restored=false": approx(3.0),
    }
    assert got["Acceptance length (vLLM spec decode, all requests)"] == {
        "all requests": approx(2.0)
    }
    audit = got["Recompute audit results"]
    assert audit == {"ok": approx(3.0), "mismatch": 0.0, "error": 0.0}
    ttft = got["Time to first token (vLLM)"]
    assert 0.04 < ttft["p50"] <= 0.06 and ttft["p50"] < ttft["p99"] <= 0.06
    assert got["Units (target+draft chunks) stored and loaded per second"] == {
        "stored cpu": approx(2.0), "stored l3": 0.0, "loaded cpu": approx(4.0), "loaded l3": 0.0,
    }  # fmt: skip
    declined = got["Storage hits declined (slower than recompute)"]
    assert declined.pop("slower_than_recompute") == approx(5.0)
    assert set(declined.values()) == {0.0}
    assert got["Storage threads: CPU time / wall time"] == {
        "read": approx(0.75), "write": approx(0.25),
    }  # fmt: skip


def test_render_writes_the_png_and_its_series(scrape_file: Path, tmp_path: Path) -> None:
    png = tmp_path / "docs" / "dashboard.png"
    rc = dashboard.main(
        ["--metrics", str(scrape_file), "--out", str(png), "--dashboard", str(DASHBOARD)]
    )
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
    summary = json.loads(Path(f"{png}.json").read_text())
    assert summary["rate_interval_s"] == 4.0  # 4 scrape intervals of 1 s
    titles = [p["title"] for p in summary["panels"]]
    assert titles == [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    hit = summary["panels"][0]["series"]["cpu"]
    assert hit["last"] == 0.75 and len(hit["times"]) == SECONDS
    assert hit["values"][0] is None  # nothing looked up yet: 0/0, a gap as in Grafana


def test_unsupported_promql_fails_loudly(scrape_file: Path, tmp_path: Path) -> None:
    board = json.loads(DASHBOARD.read_text())
    board["panels"][0]["targets"][0]["expr"] = "avg(rate(vllm:prompt_tokens_total[1m]))"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(board))
    rc = dashboard.main(
        ["--metrics", str(scrape_file), "--out", str(tmp_path / "x.png"), "--dashboard", str(bad)]
    )
    assert rc == 1 and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("avg(rate(x_total[1m]))", "aggregation 'avg'"),
        ("sum without (a) (rate(x_total[1m]))", "only 'sum by"),
        ("rate(x_total[1m]) / on (a) rate(x_total[1m])", "vector matching"),
        ("rate(x_total[1m]) > 1", "binary operator '>'"),
        ("increase(x_total[1m])", "function increase()"),
        ("rate(x_total[1m] offset 1m)", "offset"),
        ("x_total", "VectorSelector"),
        ("-rate(x_total[1m])", "UnaryExpr"),
    ],
)
def test_evaluator_refuses_what_it_does_not_implement(expr: str, message: str) -> None:
    with pytest.raises(UnsupportedPromQL, match=message):
        Evaluator(Scrapes()).evaluate(parse(expr), T0)


def test_unknown_dashboard_variable_is_named() -> None:
    with pytest.raises(UnsupportedPromQL, match=r"\$instance"):
        dashboard.substitute('rate(x{i="$instance"}[$__rate_interval])', {"__rate_interval": "4s"})


# ------------------------------------------------------------ Prometheus semantics


def test_rate_extrapolates_like_prometheus() -> None:
    # 1 s samples, +2 each: the window (t-4, t] holds 4 of them, 1 s from each edge
    times, values = [97.0, 98.0, 99.0, 100.0], [10.0, 12.0, 14.0, 16.0]
    assert extrapolated_rate(times, values, t=100.0, range_s=4.0) == pytest.approx(2.0)
    # not extrapolated below zero: at +2/s the counter was 0 one second before its first
    # sample, though the window starts 8 s before it: covers 2 + 1 s, not 2 + 0.5
    assert extrapolated_rate([98.0, 99.0, 100.0], [2.0, 4.0, 6.0], 100.0, 10.0) == pytest.approx(
        4.0 * (3.0 / 2.0) / 10.0
    )
    # a reset (server restart) counts the new value from 0: 10 -> 3 is an increase of 3
    assert extrapolated_rate([99.0, 100.0], [10.0, 3.0], 100.0, 1.0) == pytest.approx(3.0)
    assert math.isnan(extrapolated_rate([100.0], [1.0], 100.0, 4.0))
    assert instant_rate([98.0, 99.5, 100.0], [1.0, 4.0, 5.0]) == pytest.approx(2.0)
    assert instant_rate([99.0, 100.0], [9.0, 2.0]) == pytest.approx(2.0)  # reset


def test_histogram_quantile_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert bucket_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: first bucket's top
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert bucket_quantile(1.0, [(1.0, 1.0), (math.inf, 2.0)]) == 1.0  # in +Inf: highest bound
    assert math.isnan(bucket_quantile(0.5, [(1.0, 1.0), (2.0, 2.0)]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))  # no observations
    assert bucket_quantile(-1, buckets) == -math.inf and bucket_quantile(2, buckets) == math.inf


def test_vector_arithmetic_matches_on_all_labels() -> None:
    scrapes = Scrapes()
    for t in (1.0, 2.0, 3.0):
        scrapes.add(t, "a_total", {"tier": "cpu"}, 10 * t)
        scrapes.add(t, "a_total", {"tier": "l3"}, 0.0)
        scrapes.add(t, "b_total", {"tier": "cpu"}, 5 * t)
    ev = Evaluator(scrapes)
    got = ev.evaluate(parse("1 + sum by (tier) (irate(a_total[3s])) / irate(b_total[3s])"), 3.0)
    assert got == {(("tier", "cpu"),): pytest.approx(3.0)}  # l3 has no partner on the right
    zero = ev.evaluate(parse('irate(a_total{tier="l3"}[3s]) / irate(a_total{tier="l3"}[3s])'), 3)
    assert math.isnan(zero[(("tier", "l3"),)])  # 0/0, as Prometheus: a gap in the graph
    assert ev.evaluate(parse('sum(irate(a_total{tier=~"c.*"}[3s]))'), 3.0) == {(): 10.0}
    assert ev.evaluate(parse('sum(irate(a_total{tier!="cpu"}[3s]))'), 3.0) == {(): 0.0}
    window = parse("rate(a_total[2s])").args[0].range
    assert window == timedelta(seconds=2)
