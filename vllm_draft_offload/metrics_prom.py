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

from typing import Any, Final

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger

from vllm_draft_offload.metric_defs import (
    ALL_METRICS,
    AUDIT_RECOMPUTE,
    AUDIT_RESULTS,
    DIRECTIONS,
    FALLBACK_CAUSES,
    FALLBACKS,
    HIT_CHUNKS,
    L3_DECLINE_CAUSES,
    L3_DECLINED,
    L3_THREAD_CLOCKS,
    L3_THREAD_OPS,
    L3_THREAD_SECONDS,
    LOADED_BYTES,
    LOADED_CHUNKS,
    MISS_CHUNKS,
    PARTS,
    RECOMPUTED_PER_HIT,
    REFUSAL_CAUSES,
    REFUSALS,
    RESTORE_LATENCY,
    SPEC_ACCEPTED,
    SPEC_DRAFTS,
    STORED_BYTES,
    STORED_CHUNKS,
    TIERS,
    TRANSFER_SECONDS,
    MetricDef,
)
from vllm_draft_offload.metrics import DraftOffloadStats

logger = init_logger(__name__)

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
            for op in L3_THREAD_OPS:
                for clock in L3_THREAD_CLOCKS:
                    self._child(engine_idx, L3_THREAD_SECONDS, (op, clock))
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

        for section, metric in (
            ("seconds", TRANSFER_SECONDS),
            ("l3_thread_seconds", L3_THREAD_SECONDS),
        ):
            for key, value in data[section].items():
                labels = tuple(key.split("/"))
                if len(labels) != len(metric.labelnames):
                    self._skip(section, key)
                    continue
                self._child(engine_idx, metric, labels).inc(value)

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


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> DraftOffloadPromMetrics:
    """Body of ``DraftOffloadConnector.build_prom_metrics`` (classmethod, same
    arguments after ``cls``). Called once in the frontend by ``KVConnectorProm``."""
    return DraftOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
