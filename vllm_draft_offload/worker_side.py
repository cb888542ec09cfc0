"""Worker half of the connector: executes the scheduler's copy jobs.

Loads are `worker_loads` (issued in `start_load_kv`, waited for per layer).

Stores are issued in `wait_for_save`, which vLLM calls after the drafter's
forward, so draft KV is complete: every store job of the step as one copy. They
run on another side stream after an event recorded on the compute stream; their
source blocks stay alive because running requests keep their blocks, finished
requests are held by vLLM until we report them in `finished_sending`, and a
preemption makes us drain stores before the next forward (`handle_preemptions`).

This module issues the store copies; which stores are still in flight and which finished
requests they hold is `worker_stores`, audit checksums are `worker_audit`, and the
L3 tier's commit gating and report queues are `worker_l3`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from vllm_draft_offload.async_loads import AsyncLoads
from vllm_draft_offload.audit import RecomputeComparer
from vllm_draft_offload.config import CopyPath, DraftOffloadConfig
from vllm_draft_offload.copy_paths import CopyEngine
from vllm_draft_offload.copy_routes import PairCopier
from vllm_draft_offload.copy_rules import decode_stores_by_dma
from vllm_draft_offload.geometry import UnitLayout, build_unit_layout
from vllm_draft_offload.metadata import (
    DraftOffloadMetadata,
    DraftOffloadWorkerMetadata,
    TransferJob,
)
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.overlap_loads import OverlapLoads, remembered_fetches
from vllm_draft_offload.staged_stores import StagedStores, staging_units
from vllm_draft_offload.store_issuer import StoreBatch, StoreIssuer
from vllm_draft_offload.transfers import (
    HostPool,
    LayerRegion,
    PairBatch,
    UnitCopies,
    build_layer_regions,
)
from vllm_draft_offload.worker_audit import SlotChecksums
from vllm_draft_offload.worker_l3 import L3Link
from vllm_draft_offload.worker_loads import InflightLoad, WorkerLoads
from vllm_draft_offload.worker_stores import InflightStore, StoreTracker

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_draft_offload.l3_worker import WorkerL3

logger = logging.getLogger(__name__)


class DraftOffloadWorker(WorkerLoads):
    def __init__(
        self,
        config: DraftOffloadConfig,
        kv_cache_config: KVCacheConfig,
        draft_layer_names: frozenset[str],
        drafter_id: str = "",
        rank: int = 0,
        kv_cache_dtype: str = "auto",
        async_loads: bool = False,
        hit_slack: int = 0,
    ) -> None:
        self.config = config
        # Where hits may end (geometry.HitRules): what a sliding-window group's unit holds.
        self.hit_slack = hit_slack
        # Several KV-cache groups: loads are asynchronous (see DraftOffloadConnector).
        self.async_loads = async_loads
        self._async = AsyncLoads()
        # Loads admitted while their storage fetches still land (overlap_loads.py).
        self._overlap = OverlapLoads(async_loads, remembered_fetches=0)
        self.kv_cache_dtype = kv_cache_dtype
        self.drafter_id = drafter_id
        self.rank = rank
        self.l3: WorkerL3 | None = None
        self._l3_link: L3Link | None = None
        self.kv_cache_config = kv_cache_config
        self.draft_layer_names = draft_layer_names
        self.layout: UnitLayout | None = None
        self.pool: HostPool | None = None
        self.copier: CopyEngine | None = None
        self.pair_copier: PairCopier | None = None  # CPU-tier loads and stores
        self._decode_stores_dma = False  # resolved from the pages in register_kv_caches
        self._staged: StagedStores | None = None  # store_staging_units
        self.regions: list[LayerRegion] = []
        self._copies: UnitCopies | None = None
        self._aliases: dict[str, str] = {}
        self._on_device = False
        self._load_stream: torch.cuda.Stream | None = None
        self._store_stream: torch.cuda.Stream | None = None
        self._layer_events: dict[str, torch.Event] = {}
        self._last_load_event: torch.Event | None = None
        self._load_keepalive: list[torch.Tensor] = []
        self._stores = StoreTracker()
        # store_thread: the step's store copies are issued on a thread of their own.
        self._issuer: StoreIssuer | None = None
        self._worker_meta = DraftOffloadWorkerMetadata()
        self._load_error_blocks: set[int] = set()
        # Requests, and load jobs, with a load that failed (in part or whole) this
        # step: KV computed on them this step sits on a prefix that was not restored.
        self._failed_load_reqs: set[str] = set()
        self._failed_load_jobs: set[int] = set()
        self.stats = DraftOffloadStats()
        # Audit mode only: per-layer checksums of each slot taken when it was filled.
        self.checksums: SlotChecksums | None = None
        self.comparer: RecomputeComparer | None = None
        self._timed_loads: list[InflightLoad] = []
        # Every rank moves its shard of each chunk; count chunks once.
        self.counts_chunks = rank == 0

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = build_unit_layout(
            self.kv_cache_config, self.config.chunk_size, self.draft_layer_names, self.hit_slack
        )
        # KV-sharing layers alias another layer's tensor: move the bytes once and
        # let either name's wait_for_layer_load find the owner's event.
        layout_names = {slot.name for slot in layout.layers}
        owner_by_view = {
            (kv_caches[name].data_ptr(), kv_caches[name].stride()): name for name in layout_names
        }
        self._aliases = {
            name: owner_by_view[(tensor.data_ptr(), tensor.stride())]
            for name, tensor in kv_caches.items()
            if name not in layout_names and (tensor.data_ptr(), tensor.stride()) in owner_by_view
        }
        self.regions = build_layer_regions(layout, kv_caches, self.kv_cache_config.num_blocks)
        self.layout = layout
        sample = kv_caches[layout.layers[0].name]
        self._on_device = sample.is_cuda
        num_slots = self.config.cpu_bytes // layout.unit_bytes
        self.pool = HostPool(num_slots, layout.unit_bytes, pin=self._on_device)
        self._overlap = OverlapLoads(self.async_loads, remembered_fetches(num_slots))
        self._copies = UnitCopies(self.regions, self.pool)
        page_bytes = [slot.page_bytes for slot in layout.layers]
        self.copier = CopyEngine(self.config.copy_path, self.pool, page_bytes, self._on_device)
        self.pair_copier = PairCopier(self._copies, self.copier)
        self._staged = self._staging_buffer(layout.unit_bytes)
        if self._on_device:
            self._load_stream = torch.cuda.Stream()
            self._store_stream = torch.cuda.Stream()
        if self.config.store_thread:
            self._issuer = StoreIssuer(self._copy_stores, sample.device)
        self._decode_stores_dma = decode_stores_by_dma(
            self.config.decode_stores_dma, self.config.copy_path, page_bytes
        )
        if self._decode_stores_dma:
            logger.info("DraftOffloadConnector: decode steps' stores go by DMA (memcpy)")
        self.comparer = RecomputeComparer(
            layout,
            self.regions,
            self.pool,
            kv_caches,
            self.kv_cache_dtype,
            self.config.audit_tolerance,
            pin=self._on_device,
        )
        if self.config.audit:
            self.checksums = SlotChecksums(layout, self.pool)
        if self.config.l3.enabled:
            from vllm_draft_offload.l3_worker import WorkerL3

            self.l3 = WorkerL3(self.config.l3, layout, self.pool, self.drafter_id, self.rank)
            self._l3_link = L3Link(self.l3, layout, self.stats)
        logger.info(
            "DraftOffloadConnector: %d layers (%d draft) in %d group(s), unit %.2f MiB "
            "(draft %.2f MiB), CPU tier %d units, pinned=%s, copy_path=%s",
            len(layout.layers),
            sum(layer.is_draft for layer in layout.layers),
            len(layout.groups),
            layout.unit_bytes / 2**20,
            layout.draft_bytes / 2**20,
            num_slots,
            self.pool.pinned,
            self.copier.path if self._on_device else "memmove (CPU tensors)",
        )

    # ----------------------------------------------------------------- stores

    def handle_preemptions(self, meta: DraftOffloadMetadata) -> None:
        if meta.flush_stores:
            self._synchronize_stores()

    def _synchronize_stores(self) -> None:
        """Wait until every store copy so far is issued and has run."""
        if self._issuer is not None:
            self._issuer.drain()
        self._stores.synchronize()

    def wait_for_save(self, meta: DraftOffloadMetadata) -> None:
        self._finish_loads()
        if meta.compares and self.comparer is not None:
            # Ahead of this step's stores, so the audit's sync does not wait for them too.
            self.comparer.run(meta.compares, self._worker_meta, self._store_stream)
        if self._l3_link is not None:
            self._l3_link.apply_verdicts(meta)
        if not meta.stores:
            return
        self._stores.expect(meta.stores)
        failed_reqs, self._failed_load_reqs = self._failed_load_reqs, set()
        failed_jobs, self._failed_load_jobs = self._failed_load_jobs, set()
        assert self._copies is not None
        batch: list[InflightStore] = []
        parts: list[PairBatch] = []
        for job in meta.stores:
            if job.req_id in failed_reqs or failed_jobs.intersection(job.after_loads):
                logger.warning(
                    "DraftOffloadConnector: store job %d dropped: a load request %s's KV "
                    "depends on failed this step, so its new KV sits on a wrong prefix",
                    job.job_id,
                    job.req_id,
                )
                self._stores.add(InflightStore(job, None, failed_cause="store_after_load_failure"))
                continue
            try:
                pairs = self._copies.pairs(job.host_pages, job.gpu_blocks)
            except ValueError as exc:
                logger.warning("DraftOffloadConnector: store job %d refused: %s", job.job_id, exc)
                self._stores.add(InflightStore(job, None, failed_cause="store_error"))
                continue
            parts.append(pairs)
            batch.append(InflightStore(job, None))
        # A decode step's stores by DMA (decode_stores_dma): on the pair kernel they take
        # SMs from the decode steps they run beside.
        path: CopyPath | None = (
            "memcpy" if self._decode_stores_dma and not meta.prompt_step else None
        )
        self._issue_stores(batch, PairBatch.concat(parts, len(self._copies.group_rows)), path)

    def _issue_stores(
        self, stores: list[InflightStore], pairs: PairBatch, path: CopyPath | None = None
    ) -> None:
        """The step's store jobs as one copy: one plan, a kernel launch per KV-cache
        group (or the descriptor path's launch and DMA batch), one pair of events (per
        job they cost a launch's CPU time each, on the engine's critical path). The jobs
        complete together; the batch is timed as one transfer, recorded with the first
        job."""
        if not stores:
            return
        assert self.pair_copier is not None
        chunks = self._num_chunks([store.job for store in stores]) if self.counts_chunks else 0
        lead = stores[0]
        total, draft_bytes = self.pair_copier.batch_bytes(pairs)
        lead.sizes = (total - draft_bytes, draft_bytes, chunks)
        # After this step's forward and drafter wrote the KV: the compute stream's event
        # (recorded here, on the engine's thread, whose stream that is).
        ready = None
        if self._on_device and total:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        batch = StoreBatch(stores, pairs, ready, path)
        if self._issuer is not None:
            self._issuer.submit(batch)
        else:
            self._copy_stores(batch)
        for store in stores:
            self._stores.add(store)

    def _copy_stores(self, batch: StoreBatch) -> None:
        """Issue a batch's copy: on the store stream behind its event, timed there and
        recorded when it completes (get_transfer_results), or on the host now. On the
        engine's thread, or on the store issuer's (store_thread)."""
        assert self.pair_copier is not None
        lead = batch.stores[0]
        if batch.ready is None:
            started = time.perf_counter()
            self._run_stores(batch, None)
            lead.host_seconds = time.perf_counter() - started
            return
        stream = self._store_stream
        assert stream is not None
        stream.wait_event(batch.ready)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        keepalive = self._run_stores(batch, stream)
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        lead.start, lead.keepalive = start, keepalive
        for store in batch.stores:
            store.event = end

    def _staging_buffer(self, unit_bytes: int) -> StagedStores | None:
        """The staged store path (store_staging_units), or None where it is off."""
        assert self.pair_copier is not None
        setting = self.config.store_staging_units
        moves_every_layer = self.pair_copier.moves_every_layer
        if setting and not moves_every_layer:  # no GPU memory for a buffer no batch could use
            logger.warning(
                "DraftOffloadConnector: store_staging_units ignored: the pair kernel "
                "cannot move every layer here"
            )
            return None
        units = staging_units(
            setting,
            self.config.copy_path,
            self._on_device,
            moves_every_layer,
            unit_bytes,
            lambda: torch.cuda.mem_get_info()[0],
        )
        if not units:
            return None
        logger.info(
            "DraftOffloadConnector: stores staged through a GPU buffer of %d units (%d B)",
            units,
            units * unit_bytes,
        )
        return StagedStores(self.pair_copier, units, self._on_device)

    def _run_stores(
        self, batch: StoreBatch, stream: torch.cuda.Stream | None
    ) -> list[torch.Tensor]:
        """A batch's copy: staged where store_staging_units is on and can take it, else
        by its route."""
        assert self.pair_copier is not None
        if self._staged is not None:
            slots = self._staged.slots(batch.pairs)
            if slots is not None:
                return self._staged.run(batch.pairs, slots, stream)
        return self.pair_copier.run(batch.pairs, "store", stream, batch.path)

    def _retire_store(self, store: InflightStore) -> None:
        """A store copy completed (or was never run): time it, then report or park it."""
        job = store.job
        if store.start is not None and store.event is not None:
            seconds = store.start.elapsed_time(store.event) / 1000.0
            self.stats.record_transfer("store", "cpu", *store.sizes, seconds)
        elif store.host_seconds is not None:
            self.stats.record_transfer("store", "cpu", *store.sizes, store.host_seconds)
        if store.failed_cause is not None:
            self._fail_store(job, store.failed_cause)
        else:
            if self.checksums is not None:
                self.checksums.record_job(job)
            self._worker_meta.completed_jobs[job.job_id] = 1
            if self._l3_link is not None:
                self._l3_link.park(job)

    def _fail_store(self, job: TransferJob, cause: str) -> None:
        """Report a store not executed: the scheduler drops its reserved units."""
        meta = self._worker_meta
        self.stats.record_fallback(cause)
        meta.failed_jobs[job.job_id] = 1
        meta.failure_causes.setdefault(job.job_id, cause)
        if job.l3_units and self.l3 is not None:
            # Nothing to write: the units' L3 writes end as failed on this rank, which
            # releases the scheduler's pins once every rank has reported.
            self.l3.fail_writes(job.l3_units)

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this worker."""
        self._poll_loads()
        sending = self._stores.poll(self._retire_store)
        done_jobs, recving, failed = self._async.poll()
        self._advance_overlaps()
        overlapped, overlap_recving, overlap_failed, error_blocks = self._overlap.poll()
        if error_blocks:
            self.stats.record_fallback("load_error")
        self._load_error_blocks |= error_blocks
        for job_id in done_jobs + overlapped:
            # Unpinned by the scheduler once every worker's copies are done.
            self._worker_meta.completed_jobs[job_id] = 1
        return sending, recving | overlap_recving, failed | overlap_failed

    def _drain_l3(self) -> None:
        if self._l3_link is not None:
            self._l3_link.drain(self._worker_meta, self.checksums, self.counts_chunks)

    def build_worker_meta(self) -> DraftOffloadWorkerMetadata | None:
        self._drain_l3()
        meta = self._worker_meta
        if meta.is_empty():
            return None
        self._worker_meta = DraftOffloadWorkerMetadata()
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def shutdown(self) -> None:
        self._async.synchronize()
        self._overlap.synchronize()
        if self._issuer is not None:
            self._issuer.close()
        self._stores.synchronize()
        self._stores.poll(self._retire_store)
        if self._l3_link is not None:
            # No verdict comes for parked writes any more: unconfirmed KV is never written.
            self._l3_link.close()
            self._drain_l3()  # counts l3_write_lost_shutdown
        if self.comparer is not None:
            self.comparer.close()
        if self.pool is not None:
            self.pool.close()
