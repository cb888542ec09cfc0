"""Draft-offload telemetry through vLLM 0.33's own stats plumbing (CPU only, no model).

The payload takes the same route as in a server: worker stats pickled inside a
ModelRunnerOutput (shm MessageQueue), merged by KVOutputAggregator, merged with the
scheduler-side stats, msgpack-encoded inside EngineCoreOutputs/SchedulerStats, then
consumed by KVConnectorLogging and KVConnectorProm, which resolve the connector class
through KVConnectorFactory from a KVTransferConfig.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import prometheus_client.values as prometheus_values
import pytest
from prometheus_client import REGISTRY, generate_latest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
    KVConnectorStats,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_draft_offload import metrics as dom
from vllm_draft_offload import metrics_prom as dom_prom
from vllm_draft_offload.metric_defs import ALL_METRICS, PREFIX
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.metrics_prom import DraftOffloadPromMetrics


class MetricsOnlyConnector(KVConnectorBase_V1):
    """Resolved by KVConnectorFactory via kv_connector_module_path=__name__. It only
    wires the two stats classmethods the way DraftOffloadConnector must, so these tests
    don't depend on the connector implementation; it is never instantiated."""

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return dom.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return dom_prom.build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector=MetricsOnlyConnector.__name__,
            kv_connector_module_path=__name__,
            kv_role="kv_both",
        )
    )


def _worker_stats(rank: int) -> DraftOffloadStats:
    s = DraftOffloadStats()
    # Both ranks restore 800 MB from CPU; rank 0 in 0.2 s, rank 1 in 0.6 s.
    s.record_transfer("load", "cpu", 600_000_000, 200_000_000, 4, 0.2 if rank == 0 else 0.6)
    if rank == 0:
        s.record_transfer("store", "cpu", 1_000_000_000, 250_000_000, 10, None)
        s.record_transfer("load", "l3", 300_000_000, 100_000_000, 2, 0.4)
        s.record_l3_thread_time("read", 0.5, 0.25)
    else:
        s.record_transfer("store", "l3", 2_000_000_000, 500_000_000, 20, 1.0)
        s.record_l3_thread_time("read", 1.5, 0.25)
        s.record_l3_thread_time("write", 2.0, 0.0)  # a write that only waited
    return s


def _scheduler_stats() -> DraftOffloadStats:
    s = DraftOffloadStats()
    s.record_lookup("cpu", 8, 2)
    s.record_lookup("l3", 2, 6)
    s.record_acceptance(True, 10, 25)
    s.record_acceptance(True, 10, 5)
    s.record_acceptance(False, 10, 12)
    s.record_refused("drafter_mismatch")
    s.record_refused("truncated", 2)
    s.record_fallback("l3_corrupt")
    s.record_audit_recompute("ok", 3)
    s.record_recomputed_tokens(15)
    s.record_recomputed_tokens(1)
    return s


def _engine_payload() -> dict[str, Any]:
    """Run one step's stats through the real worker->scheduler->frontend path."""
    outputs = []
    for rank in range(2):
        mro = ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            kv_connector_output=KVConnectorOutput(kv_connector_stats=_worker_stats(rank)),
        )
        outputs.append(pickle.loads(pickle.dumps(mro, protocol=pickle.HIGHEST_PROTOCOL)))
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs, output_rank=0)
    assert merged is not None and merged.kv_connector_output is not None
    stats = merged.kv_connector_output.kv_connector_stats
    assert isinstance(stats, DraftOffloadStats)
    # Scheduler.update_from_output merges the scheduler-side stats the same way.
    sched = _scheduler_stats()
    assert not sched.is_empty()
    stats = stats.aggregate(sched)

    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    assert decoded.scheduler_stats is not None
    payload = decoded.scheduler_stats.kv_connector_stats
    assert isinstance(payload, dict)
    return payload


EXPECTED_SUMS = {
    "chunks": {"load/cpu": 8, "store/cpu": 10, "load/l3": 2, "store/l3": 20},
    "bytes": {
        "load/cpu/target": 1_200_000_000,
        "load/cpu/draft": 400_000_000,
        "store/cpu/target": 1_000_000_000,
        "store/cpu/draft": 250_000_000,
        "load/l3/target": 300_000_000,
        "load/l3/draft": 100_000_000,
        "store/l3/target": 2_000_000_000,
        "store/l3/draft": 500_000_000,
    },
    # The untimed CPU store is absent: it must not skew throughput.
    "timed_bytes": {"load/cpu": 1_600_000_000, "load/l3": 400_000_000, "store/l3": 2_500_000_000},
    "hits": {"cpu": 8, "l3": 2},
    "misses": {"cpu": 2, "l3": 6},
    "refused": {"drafter_mismatch": 1, "truncated": 2},
    "fallbacks": {"l3_corrupt": 1},
    "drafts": {"true": 20, "false": 10},
    "accepted": {"true": 30, "false": 12},
    "audit_recompute": {"ok": 3},
    "l3_thread_seconds": {"read/wall": 2.0, "read/cpu": 0.5, "write/wall": 2.0},
    "recomputed": [15, 1],
}


def test_stats_cross_process_aggregate_and_reduce(vllm_config: VllmConfig) -> None:
    payload = _engine_payload()
    # The frontend resolves the class through the factory, as in a server.
    assert KVConnectorLogging(vllm_config.kv_transfer_config).connector_cls is MetricsOnlyConnector

    stats = MetricsOnlyConnector.build_kv_connector_stats(payload)
    assert isinstance(stats, DraftOffloadStats)
    for section, expected in EXPECTED_SUMS.items():
        assert stats.data[section] == expected, section
    assert stats.data["seconds"] == pytest.approx(
        {"load/cpu": 0.8, "load/l3": 0.4, "store/l3": 1.0}
    )
    assert sorted(stats.data["restore_s"]["cpu"]) == pytest.approx([0.2, 0.6])

    r = stats.reduce()
    assert r["cpu_hit_rate"] == 0.8
    assert r["l3_hit_rate"] == 0.25
    assert r["cpu_loaded_chunks"] == 8 and r["cpu_loaded_GB"] == 1.6
    assert r["cpu_stored_GB"] == 1.25 and r["l3_stored_GB"] == 2.5 and r["l3_loaded_GB"] == 0.4
    assert r["cpu_restore_GBps"] == 2.0  # 1.6 GB / 0.8 s
    assert r["l3_restore_GBps"] == 1.0
    assert r["cpu_restore_ms_mean"] == 400.0
    assert r["stored_draft_frac"] == 0.2  # 0.75 GB draft of 3.75 GB stored
    assert r["accept_len_restored"] == 2.5  # 1 + 30/20
    assert r["accept_len_fresh"] == 2.2  # 1 + 12/10
    assert r["recomputed_tokens_per_hit"] == 8.0
    assert r["audit_recompute_ok"] == 3 and "audit_recompute_mismatch" not in r
    assert r["l3_read_cpu_of_wall"] == 0.25 and r["l3_write_cpu_of_wall"] == 0.0
    assert r["refusals"] == 3 and r["fallbacks"] == 1
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in r.values())


def test_frontend_logging_accumulates_steps_without_mutating_payloads(
    vllm_config: VllmConfig,
) -> None:
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    p1, p2 = _engine_payload(), _engine_payload()
    snapshot = pickle.dumps(p1)
    logging.observe(p1)
    logging.observe(p2)
    # In-process engines hand the same dict to the Prometheus logger too.
    assert pickle.dumps(p1) == snapshot

    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    assert lines[0].startswith("KV Transfer metrics: cpu_hit_rate=0.8, ")
    # Two identical steps: totals double, ratios stay.
    assert "cpu_loaded_chunks=16," in lines[0]
    assert "accept_len_restored=2.5," in lines[0]
    assert "cpu_restore_GBps=2.0," in lines[0]
    assert lines[0].endswith("refusals=6, fallbacks=2")
    # log() resets the interval: nothing more to say.
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1


def test_aggregate_reset_take_and_validation() -> None:
    a, b = _worker_stats(0), _worker_stats(1)
    b_before = pickle.dumps(b.data)
    assert a.aggregate(b) is a
    a.data["restore_s"]["cpu"].append(9.9)
    assert pickle.dumps(b.data) == b_before  # other is not aliased
    assert a.aggregate(DraftOffloadStats()) is a

    class Foreign(KVConnectorStats):
        def is_empty(self) -> bool:
            return False

    with pytest.raises(TypeError):
        a.aggregate(Foreign())

    a.reset()
    assert a.is_empty() and a.reduce() == {"refusals": 0, "fallbacks": 0}
    assert a.take() is None
    a.record_lookup("cpu", 0, 0)
    a.record_acceptance(False, 0, 0)
    assert a.is_empty()  # zero increments are no observations
    a.record_fallback("load_error")
    taken = a.take()
    assert taken is not None and taken.data["fallbacks"] == {"load_error": 1}
    assert a.is_empty()

    s = DraftOffloadStats()
    with pytest.raises(ValueError):
        s.record_transfer("load", "disk", 1, 1, 1, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        s.record_transfer("fetch", "cpu", 1, 1, 1, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        s.record_transfer("load", "cpu", -1, 1, 1, 0.1)
    with pytest.raises(ValueError):
        s.record_transfer("load", "cpu", 1, 1, 1, float("nan"))
    with pytest.raises(ValueError):
        s.record_refused("")
    with pytest.raises(ValueError):
        s.record_recomputed_tokens(-3)
    with pytest.raises(ValueError):
        s.record_audit_recompute("maybe")
    with pytest.raises(ValueError, match="op"):
        s.record_l3_thread_time("fetch", 1.0, 0.5)
    with pytest.raises(ValueError, match="cpu seconds"):
        s.record_l3_thread_time("read", 1.0, -0.5)
    assert s.is_empty()

    assert dom.build_kv_connector_stats(None) is not None
    assert dom.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]
    # A section from a newer version is ignored, known ones still count.
    mixed = dom.build_kv_connector_stats({"hits": {"cpu": 3}, "future_section": {"x": 1}})
    assert mixed is not None and mixed.data["hits"] == {"cpu": 3}
    with pytest.raises(TypeError):
        dom.build_kv_connector_stats({"hits": {"cpu": "3"}})


@pytest.fixture
def clean_registry():
    # prometheus_client picks multiprocess mode once, at import; vLLM setting the
    # env var later in this process (an in-process engine) does not switch it.
    if prometheus_values.ValueClass is not prometheus_values.MutexValue:
        pytest.skip("prometheus multiprocess mode: values are not in the default REGISTRY")
    unregister_vllm_metrics()  # what PrometheusStatLogger does before creating metrics
    yield REGISTRY
    unregister_vllm_metrics()


def test_prometheus_via_vllm_kv_connector_prom(vllm_config: VllmConfig, clean_registry) -> None:
    registry = clean_registry
    # Exactly what PrometheusStatLogger.__init__ passes, for two DP engines.
    labelnames = ["model_name", "engine"]
    per_engine = {idx: ["m", str(idx)] for idx in (0, 1)}
    prom = KVConnectorProm(vllm_config, labelnames, per_engine)
    assert isinstance(prom.prom_metrics, DraftOffloadPromMetrics)

    payload = _engine_payload()
    prom.observe(payload, engine_idx=1)
    prom.observe(payload, engine_idx=1)

    def val(name: str, engine: str = "1", **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})

    p = PREFIX
    assert val(p + "loaded_bytes_total", tier="cpu", part="target") == 2_400_000_000
    assert val(p + "loaded_bytes_total", tier="cpu", part="draft") == 800_000_000
    assert val(p + "stored_bytes_total", tier="l3", part="draft") == 1_000_000_000
    assert val(p + "stored_chunks_total", tier="cpu") == 20
    assert val(p + "loaded_chunks_total", tier="l3") == 4
    assert val(p + "transfer_seconds_total", direction="load", tier="cpu") == pytest.approx(1.6)
    assert val(p + "lookup_hit_chunks_total", tier="cpu") == 16
    assert val(p + "lookup_miss_chunks_total", tier="l3") == 12
    assert val(p + "refusals_total", cause="truncated") == 4
    assert val(p + "refusals_total", cause="checksum_mismatch") == 0  # pre-created
    assert val(p + "fallbacks_total", cause="l3_corrupt") == 2
    assert val(p + "audit_recompute_units_total", result="ok") == 6
    assert val(p + "audit_recompute_units_total", result="mismatch") == 0  # pre-created
    assert val(p + "fallbacks_total", cause="audit_recompute_mismatch") == 0  # pre-created
    assert val(p + "l3_thread_seconds_total", op="read", clock="wall") == pytest.approx(4.0)
    assert val(p + "l3_thread_seconds_total", op="write", clock="wall") == pytest.approx(4.0)
    assert val(p + "l3_thread_seconds_total", op="write", clock="cpu") == 0  # pre-created
    drafts_r = val(p + "spec_drafts_total", restored="true")
    acc_r = val(p + "spec_accepted_tokens_total", restored="true")
    drafts_f = val(p + "spec_drafts_total", restored="false")
    acc_f = val(p + "spec_accepted_tokens_total", restored="false")
    assert drafts_r and acc_r and drafts_f and acc_f
    assert 1 + acc_r / drafts_r == 2.5 and 1 + acc_f / drafts_f == 2.2  # the PromQL ratio
    assert val(p + "restore_latency_seconds_count", tier="cpu") == 4
    assert val(p + "restore_latency_seconds_sum", tier="cpu") == pytest.approx(1.6)
    assert val(p + "restore_latency_seconds_bucket", tier="cpu", le="0.25") == 2
    assert val(p + "restore_latency_seconds_bucket", tier="cpu", le="1.0") == 4
    assert val(p + "recomputed_tokens_per_hit_count") == 4
    assert val(p + "recomputed_tokens_per_hit_sum") == 32
    assert val(p + "recomputed_tokens_per_hit_bucket", le="1.0") == 2
    # Engine 0 exists (pre-created at 0) but got nothing from engine 1's stats.
    assert val(p + "loaded_bytes_total", engine="0", tier="cpu", part="target") == 0
    assert val(p + "fallbacks_total", engine="0", cause="l3_corrupt") == 0
    # A cause outside the known vocabulary gets its series on first use only.
    assert val(p + "fallbacks_total", engine="0", cause="oom_on_restore") is None
    extra = DraftOffloadStats()
    extra.record_fallback("oom_on_restore", 3)
    prom.observe(extra.to_dict(), engine_idx=0)
    assert val(p + "fallbacks_total", engine="0", cause="oom_on_restore") == 3

    text = generate_latest(registry).decode()
    families = {m.name for m in registry.collect() if m.name.startswith(PREFIX)}
    # prometheus_client strips "_total" from counter family names.
    assert families == {m.name for m in ALL_METRICS}
    for m in ALL_METRICS:
        suffix = "_total" if m.kind == "counter" else "_count"
        assert f"{m.name}{suffix}{{" in text, m.name
    line = 'loaded_bytes_total{engine="1",model_name="m",part="draft",tier="l3"} 2e+08'
    assert PREFIX + line in text.splitlines()

    # Malformed keys are skipped, not fatal to the frontend loop.
    prom.observe({"chunks": {"sideways/cpu": 1, "load": 1}}, engine_idx=0)
    assert val(p + "loaded_chunks_total", engine="0", tier="cpu") == 0


def test_prometheus_metrics_unregistered_by_vllm(vllm_config: VllmConfig, clean_registry) -> None:
    # PrometheusStatLogger re-creation calls unregister_vllm_metrics(); our names must
    # be covered by it, or the second build would raise "Duplicated timeseries".
    KVConnectorProm(vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
    unregister_vllm_metrics()
    KVConnectorProm(vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
