"""Prometheus side of the draft-offload telemetry (``vllm:draft_offload_*``).

vLLM builds this once in the frontend: ``PrometheusStatLogger`` creates
``KVConnectorProm(vllm_config, ["model_name", "engine"], {idx: [model, str(idx)]})``,
which calls ``DraftOffloadConnector.build_prom_metrics(vllm_config, metric_types,
labelnames, per_engine_labelvalues)`` with ``metric_types`` mapping the
prometheus_client classes to the ones to instantiate (prometheus_client itself, or
the Ray wrappers under ``RayPrometheusStatLogger``). Every scheduler-stats record
then calls ``observe(scheduler_stats.kv_connector_stats, engine_idx)``.

Metrics are therefore created through ``self._counter_cls``/``self._histogram_cls``
only, with the keyword arguments both backends accept, and always carry vLLM's
per-engine labels first. All names start with ``vllm:`` so that vLLM's
``unregister_vllm_metrics()`` cleans them up on re-creation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger

from vllm_draft_offload.metrics import (
    AUDIT_RESULTS,
    DIRECTIONS,
    FALLBACK_CAUSES,
    L3_DECLINE_CAUSES,
    PARTS,
    REFUSAL_CAUSES,
    TIERS,
    DraftOffloadStats,
)

logger = init_logger(__name__)

PREFIX: Final = "vllm:draft_offload_"

# Restore of a few chunks from pinned CPU is ~ms; from remote L3 it can take seconds.
RESTORE_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# A hit normally recomputes at most the partial tail chunk (+1 token), so the low
# buckets are fine-grained; large values mean the restore was mostly wasted.
RECOMPUTED_TOKENS_BUCKETS: Final[tuple[float, ...]] = (
    0, 1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384,
)  # fmt: skip


@dataclass(frozen=True)
class MetricDef:
    name: str  # full name as given to prometheus_client (counters get "_total" appended)
    kind: str  # "counter" | "histogram"
    documentation: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


def _counter(short: str, doc: str, *labels: str) -> MetricDef:
    return MetricDef(PREFIX + short, "counter", doc, labels)


STORED_CHUNKS = _counter("stored_chunks", "Chunks (target+draft units) stored, by tier.", "tier")
LOADED_CHUNKS = _counter("loaded_chunks", "Chunks (target+draft units) restored, by tier.", "tier")
STORED_BYTES = _counter("stored_bytes", "Bytes stored, by tier and KV part.", "tier", "part")
LOADED_BYTES = _counter("loaded_bytes", "Bytes restored, by tier and KV part.", "tier", "part")
TRANSFER_SECONDS = _counter(
    "transfer_seconds",
    "Wall time of timed transfers; bytes/this = throughput if every transfer is timed.",
    "direction",
    "tier",
)
HIT_CHUNKS = _counter("lookup_hit_chunks", "Chunks found on lookup, by tier.", "tier")
MISS_CHUNKS = _counter("lookup_miss_chunks", "Chunks not found on lookup, by tier.", "tier")
REFUSALS = _counter(
    "refusals", "Stored units refused because the draft part was missing/mismatched.", "cause"
)
FALLBACKS = _counter("fallbacks", "Restores that fell back to recompute, by cause.", "cause")
L3_DECLINED = _counter(
    "l3_declined_chunks",
    "Storage (L3) chunks recomputed instead of fetched under l3.hit_policy=cost, by "
    "cause: estimated slower, not looked up, engine speed unknown, fetch too slow.",
    "cause",
)
AUDIT_RECOMPUTE = _counter(
    "audit_recompute_units",
    "Stored units compared with a recompute of their prefix (sampled audit), by result.",
    "result",
)
SPEC_DRAFTS = _counter(
    "spec_drafts", "Drafting steps, by whether the request's prefix was restored.", "restored"
)
SPEC_ACCEPTED = _counter(
    "spec_accepted_tokens",
    "Accepted draft tokens, by whether the prefix was restored. Acceptance length = "
    "1 + rate(accepted_tokens) / rate(drafts).",
    "restored",
)
RESTORE_LATENCY = MetricDef(
    PREFIX + "restore_latency_seconds",
    "histogram",
    "Latency of restore (load) operations, by tier.",
    ("tier",),
    RESTORE_LATENCY_BUCKETS,
)
RECOMPUTED_PER_HIT = MetricDef(
    PREFIX + "recomputed_tokens_per_hit",
    "histogram",
    "Prompt tokens recomputed despite an offload hit, one sample per hit.",
    (),
    RECOMPUTED_TOKENS_BUCKETS,
)

ALL_METRICS: Final[tuple[MetricDef, ...]] = (
    STORED_CHUNKS,
    LOADED_CHUNKS,
    STORED_BYTES,
    LOADED_BYTES,
    TRANSFER_SECONDS,
    HIT_CHUNKS,
    MISS_CHUNKS,
    REFUSALS,
    FALLBACKS,
    L3_DECLINED,
    AUDIT_RECOMPUTE,
    SPEC_DRAFTS,
    SPEC_ACCEPTED,
    RESTORE_LATENCY,
    RECOMPUTED_PER_HIT,
)

_BY_DIRECTION: Final = {
    "chunks": {"store": STORED_CHUNKS, "load": LOADED_CHUNKS},
    "bytes": {"store": STORED_BYTES, "load": LOADED_BYTES},
}
# stats section -> metric, for sections whose key is the single label value
_SINGLE_LABEL: Final = {
    "hits": HIT_CHUNKS,
    "misses": MISS_CHUNKS,
    "refused": REFUSALS,
    "fallbacks": FALLBACKS,
    "l3_declined": L3_DECLINED,
    "drafts": SPEC_DRAFTS,
    "accepted": SPEC_ACCEPTED,
    "audit_recompute": AUDIT_RECOMPUTE,
}


class DraftOffloadPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {m.name: self._create(m) for m in ALL_METRICS}
        # (engine_idx, metric name, labelvalues) -> bound child; labels() is not free.
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        # Pre-create the known series at 0 for every engine, so that dashboards and
        # rate()-based alerts see them before the first event.
        for engine_idx in per_engine_labelvalues:
            for tier in TIERS:
                for metric in (STORED_CHUNKS, LOADED_CHUNKS, HIT_CHUNKS, MISS_CHUNKS):
                    self._child(engine_idx, metric, (tier,))
                self._child(engine_idx, RESTORE_LATENCY, (tier,))
                for part in PARTS:
                    self._child(engine_idx, STORED_BYTES, (tier, part))
                    self._child(engine_idx, LOADED_BYTES, (tier, part))
                for direction in DIRECTIONS:
                    self._child(engine_idx, TRANSFER_SECONDS, (direction, tier))
            for cause in REFUSAL_CAUSES:
                self._child(engine_idx, REFUSALS, (cause,))
            for cause in FALLBACK_CAUSES:
                self._child(engine_idx, FALLBACKS, (cause,))
            for cause in L3_DECLINE_CAUSES:
                self._child(engine_idx, L3_DECLINED, (cause,))
            for result in AUDIT_RESULTS:
                self._child(engine_idx, AUDIT_RECOMPUTE, (result,))
            for restored in ("true", "false"):
                self._child(engine_idx, SPEC_DRAFTS, (restored,))
                self._child(engine_idx, SPEC_ACCEPTED, (restored,))
            self._child(engine_idx, RECOMPUTED_PER_HIT, ())

    def _create(self, metric: MetricDef) -> Any:
        # Keyword arguments only, and only those RayCounterWrapper/RayHistogramWrapper
        # also accept, so the Ray metrics backend works unchanged.
        kwargs: dict[str, Any] = {
            "name": metric.name,
            "documentation": metric.documentation,
            "labelnames": list(self._labelnames) + list(metric.labelnames),
        }
        if metric.kind == "counter":
            return self._counter_cls(**kwargs)
        assert metric.kind == "histogram", metric
        return self._histogram_cls(buckets=list(metric.buckets or ()), **kwargs)

    def _child(self, engine_idx: int, metric: MetricDef, labelvalues: tuple[str, ...]) -> Any:
        key = (engine_idx, metric.name, labelvalues)
        child = self._children.get(key)
        if child is None:
            engine_labels = list(self.per_engine_labelvalues[engine_idx])
            child = self._metrics[metric.name].labels(*engine_labels, *labelvalues)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one scheduler step's payload (already summed over workers) to the
        counters/histograms of engine ``engine_idx``."""
        # Rebuilding validates the payload and gives typed, copied sections.
        data = DraftOffloadStats(data=transfer_stats_data).data

        for section, by_direction in _BY_DIRECTION.items():
            for key, value in data[section].items():
                direction, *labels = key.split("/")
                metric = by_direction.get(direction)
                if metric is None or len(labels) != len(metric.labelnames):
                    self._skip(section, key)
                    continue
                self._child(engine_idx, metric, tuple(labels)).inc(value)

        for key, value in data["seconds"].items():
            labels = tuple(key.split("/"))
            if len(labels) != len(TRANSFER_SECONDS.labelnames):
                self._skip("seconds", key)
                continue
            self._child(engine_idx, TRANSFER_SECONDS, labels).inc(value)

        for section, metric in _SINGLE_LABEL.items():
            for key, value in data[section].items():
                self._child(engine_idx, metric, (key,)).inc(value)

        for tier, samples in data["restore_s"].items():
            child = self._child(engine_idx, RESTORE_LATENCY, (tier,))
            for seconds in samples:
                child.observe(seconds)

        if data["recomputed"]:
            child = self._child(engine_idx, RECOMPUTED_PER_HIT, ())
            for tokens in data["recomputed"]:
                child.observe(tokens)

    @staticmethod
    def _skip(section: str, key: str) -> None:
        # A malformed key must not take the frontend's stats loop down; say it once.
        logger.warning_once("draft_offload metrics: skipping malformed %s key %r", section, key)
