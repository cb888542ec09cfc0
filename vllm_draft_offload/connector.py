"""DraftOffloadConnector: vLLM's KV-connector interface wired to our halves."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_draft_offload.config import ConfigError, parse_config
from vllm_draft_offload.geometry import build_unit_layout, check_state_groups, hit_rules
from vllm_draft_offload.identity import drafter_identity, target_identity
from vllm_draft_offload.log_routing import route_to_vllm_handlers
from vllm_draft_offload.metadata import DraftOffloadMetadata, DraftOffloadWorkerMetadata
from vllm_draft_offload.metrics import build_kv_connector_stats
from vllm_draft_offload.scheduler_side import DraftOffloadScheduler
from vllm_draft_offload.worker_side import DraftOffloadWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _draft_layer_names(vllm_config: VllmConfig) -> frozenset[str]:
    context = vllm_config.compilation_config.static_forward_context
    return frozenset(
        name for name, layer in context.items() if getattr(layer, "is_draft_layer", False)
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):
        return 0  # no parallel groups (tests, single process)


class DraftOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads target and drafter KV of each chunk as one unit to a CPU tier."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_to_vllm_handlers()
        if kv_cache_config is None:
            raise ConfigError("DraftOffloadConnector needs vLLM >= 0.33 (kv_cache_config)")
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        self.config = parse_config(transfer_config.kv_connector_extra_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("DraftOffloadConnector does not support pipeline parallelism yet")
        check_state_groups(kv_cache_config, self.config)
        self._scheduler: DraftOffloadScheduler | None = None
        self._worker: DraftOffloadWorker | None = None
        # vLLM's label for hits storage supplied: a local directory is a disk.
        remote_url = str(self.config.l3.lmcache.get("remote_url", ""))
        self._storage_source = (
            CacheHitSource.DISK
            if remote_url.startswith(("fs://", "file://"))
            else CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        # vLLM 0.33 maps per-block load errors back to requests only with one
        # KV-cache group (block ids are per group; it raises otherwise). With more
        # groups a failed load must be reported per request (failed_recving), which
        # vLLM honours only for asynchronous loads: hits load one step ahead.
        async_loads = len(kv_cache_config.kv_cache_groups) > 1
        # Where hits end decides what a sliding-window group's unit holds: both halves
        # derive it, so their layouts agree.
        rules = hit_rules(vllm_config, self.config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            layout = build_unit_layout(
                kv_cache_config, self.config.chunk_size, hit_slack=rules.hit_slack
            )
            self.config.check_budget(layout.unit_bytes)
            num_successors = rules.num_successors
            identity = {
                "target": target_identity(vllm_config),
                "drafter": drafter_identity(vllm_config),
                # Bumped by operators to make everything stored before unreachable.
                "cache_generation": self.config.cache_generation,
            }
            parallel = vllm_config.parallel_config
            self._scheduler = DraftOffloadScheduler(
                self.config,
                layout,
                identity,
                num_successors,
                world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
                min_compute_tokens=rules.min_compute_tokens,
                decode_query_len=1
                + (
                    vllm_config.speculative_config.num_speculative_tokens
                    if vllm_config.speculative_config is not None
                    else 0
                ),
                async_loads=async_loads,
            )
            # A failed restore must fall back to recomputing, never fail the request.
            transfer_config.kv_load_failure_policy = "recompute"
            logger.info(
                "DraftOffloadConnector: chunk %d tokens, unit %.2f MiB (%.2f MiB draft), "
                "%d CPU units, %d successor token(s) kept per chunk",
                layout.chunk_size,
                layout.unit_bytes / 2**20,
                layout.draft_bytes / 2**20,
                self._scheduler.index.num_slots,
                num_successors,
            )
            _warn_if_tier_below_one_prompt(
                self._scheduler.index.num_slots,
                layout.chunk_size,
                vllm_config.model_config.max_model_len,
            )
        else:
            self._worker = DraftOffloadWorker(
                self.config,
                kv_cache_config,
                _draft_layer_names(vllm_config),
                # Each TP rank stores its own shard of a unit under its own L3 name,
                # and the header names the drafter so a foreign object is refused.
                drafter_id=json.dumps(drafter_identity(vllm_config), sort_keys=True),
                rank=_tp_rank(),
                # The audit reads fp8 caches, which vLLM allocates as bytes, as fp8.
                kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
                async_loads=async_loads,
                hit_slack=rules.hit_slack,
            )

    @property
    def scheduler(self) -> DraftOffloadScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> DraftOffloadWorker:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a preempted request loses nothing by recomputing.
        return False

    def _meta(self) -> DraftOffloadMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DraftOffloadMetadata)
        return meta

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, DraftOffloadMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Stores run once per step in wait_for_save, after the drafter's forward.
        return None

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Failed asynchronous loads are in finished_recving too (vLLM's contract).
        sending, recving, failed = self.worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> DraftOffloadWorkerMetadata | None:
        return self._worker.build_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        # vLLM 0.33: workers call this from ensure_kv_transfer_shutdown (Worker.shutdown),
        # and EngineCore.shutdown then calls Scheduler.shutdown, which calls it on the
        # scheduler's connector; workers flush their L3 writes there.
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until stores and storage fetches complete,
        # so a finished request's blocks are released even when nothing else runs.
        return self.scheduler.keeps_engine_busy()

    def has_pending_block_frees(self) -> bool:
        # Finished requests' blocks come back once their stores land: wait for
        # that rather than preempting a running request.
        return self.scheduler.has_finishing_stores()

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """A hit's tokens by the tier that supplied them: the CPU tier (`host`), or
        storage, fetched while the request waited (`disk` for an `fs://` directory,
        `external_unspecified` for a remote store such as Redis)."""
        if not num_external_tokens:
            return {}
        from_storage = min(self.scheduler.storage_tokens(request.request_id), num_external_tokens)
        sources = {
            CacheHitSource.HOST: num_external_tokens - from_storage,
            self._storage_source: from_storage,
        }
        return {source: tokens for source, tokens in sources.items() if tokens}

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ---------------------------------------------------------------- metrics

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is not None:
            # vLLM asks once per processed step output: the step clock of the L3 cost model.
            self._scheduler.on_step_output()
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.stats.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        # Imported here: Prometheus metrics are built only in the frontend, and the
        # workers, which only record stats, need not load the Prometheus side.
        from vllm_draft_offload.metrics_prom import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        self.scheduler.reset_cache()
        return True


def _warn_if_tier_below_one_prompt(num_slots: int, chunk_size: int, max_model_len: int) -> None:
    """A CPU tier that cannot hold one longest prompt's units restores no such prompt
    whole, from itself or from storage (a fetch lands in the tier): said once, at start,
    so a cut hit is not mistaken for a slow storage or the cost policy's choice."""
    units = max_model_len // chunk_size
    if num_slots < units:
        logger.warning(
            "DraftOffloadConnector: the CPU tier holds %d units (%d tokens), fewer than one "
            "max_model_len prompt's %d: hits of longer prefixes are cut to the tier's depth "
            "and the rest recomputed; cpu_bytes_to_use of %d units' bytes or more holds one",
            num_slots,
            num_slots * chunk_size,
            units,
            units,
        )
