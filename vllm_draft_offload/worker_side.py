"""Worker half of the connector: executes the scheduler's copy jobs.

Loads are issued in `start_load_kv`, one batched copy per layer on a side
stream with an event per layer; `wait_for_layer_load` makes the compute stream
wait only for that layer, so restoring overlaps the forward layer by layer.
Draft layers are copied last, since the drafter runs after the target.
With several KV-cache groups loads are asynchronous instead (async_loads.py):
the request runs only once its copies are done, so nothing waits per layer.

Stores are issued in `wait_for_save`, which vLLM calls after the drafter's
forward, so draft KV is complete. They run on another side stream after an
event recorded on the compute stream; their source blocks stay alive because
running requests keep their blocks, finished requests are held by vLLM until
we report them in `finished_sending`, and a preemption makes us drain stores
before the next forward (`handle_preemptions`).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_draft_offload.async_loads import AsyncLoads
from vllm_draft_offload.audit import RecomputeComparer
from vllm_draft_offload.config import DraftOffloadConfig
from vllm_draft_offload.copy_paths import CopyEngine
from vllm_draft_offload.geometry import UnitLayout, build_unit_layout
from vllm_draft_offload.metadata import (
    DraftOffloadMetadata,
    DraftOffloadWorkerMetadata,
    L3WriteOrder,
    TransferJob,
)
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    build_layer_regions,
    layer_descriptors,
)
from vllm_draft_offload.unit_codec import checksum

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_draft_offload.l3_tier import WorkerL3

logger = logging.getLogger(__name__)


@dataclass
class InflightStore:
    job: TransferJob
    event: torch.Event | None
    keepalive: list[torch.Tensor] = field(default_factory=list)
    # Not executed: reported failed with this cause, so the scheduler drops its units.
    failed_cause: str | None = None
    # On a GPU: when the copy started on the store stream, and what it moves, recorded
    # with its duration once it completes.
    start: torch.cuda.Event | None = None
    sizes: tuple[int, int, int] = (0, 0, 0)  # target bytes, draft bytes, chunks


@dataclass
class InflightLoad:
    """A step's loads, timed on the load stream."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    target_bytes: int
    draft_bytes: int
    chunks: int


class DraftOffloadWorker:
    def __init__(
        self,
        config: DraftOffloadConfig,
        kv_cache_config: KVCacheConfig,
        draft_layer_names: frozenset[str],
        drafter_id: str = "",
        rank: int = 0,
        kv_cache_dtype: str = "auto",
        async_loads: bool = False,
    ) -> None:
        self.config = config
        # Several KV-cache groups: loads are asynchronous (see DraftOffloadConnector).
        self.async_loads = async_loads
        self._async = AsyncLoads()
        self.kv_cache_dtype = kv_cache_dtype
        self.drafter_id = drafter_id
        self.rank = rank
        self.l3: WorkerL3 | None = None
        self.kv_cache_config = kv_cache_config
        self.draft_layer_names = draft_layer_names
        self.layout: UnitLayout | None = None
        self.pool: HostPool | None = None
        self.copier: CopyEngine | None = None
        self.regions: list[LayerRegion] = []
        self._aliases: dict[str, str] = {}
        self._on_device = False
        self._load_stream: torch.cuda.Stream | None = None
        self._store_stream: torch.cuda.Stream | None = None
        self._layer_events: dict[str, torch.Event] = {}
        self._last_load_event: torch.Event | None = None
        self._load_keepalive: list[torch.Tensor] = []
        self._stores: list[InflightStore] = []
        self._req_store_jobs: dict[str, set[int]] = defaultdict(set)
        self._finishing_reqs: set[str] = set()
        # Store job -> its L3 write orders, held back until the scheduler says the job
        # committed on every rank (a store that completed here may still hold KV of a
        # wrong prefix: another rank's load failed, or this request's earlier load).
        self._uncommitted_writes: dict[int, list[L3WriteOrder]] = {}
        self._worker_meta = DraftOffloadWorkerMetadata()
        self._load_error_blocks: set[int] = set()
        # Requests, and load jobs, with a load that failed (in part or whole) this
        # step: KV computed on them this step sits on a prefix that was not restored.
        self._failed_load_reqs: set[str] = set()
        self._failed_load_jobs: set[int] = set()
        self.stats = DraftOffloadStats()
        # Audit mode: slot -> per-layer checksums taken when its store completed.
        self._slot_checksums: dict[int, list[str]] = {}
        self.comparer: RecomputeComparer | None = None
        self._timed_loads: list[InflightLoad] = []
        # Every rank moves its shard of each chunk; count chunks once.
        self.counts_chunks = rank == 0

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = build_unit_layout(
            self.kv_cache_config, self.config.chunk_size, self.draft_layer_names
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
        self.copier = CopyEngine(
            self.config.copy_path,
            self.pool,
            [slot.page_bytes for slot in layout.layers],
            self._on_device,
        )
        if self._on_device:
            self._load_stream = torch.cuda.Stream()
            self._store_stream = torch.cuda.Stream()
        self.comparer = RecomputeComparer(
            layout,
            self.regions,
            self.pool,
            kv_caches,
            self.kv_cache_dtype,
            self.config.audit_tolerance,
            pin=self._on_device,
        )
        if self.config.l3.enabled:
            from vllm_draft_offload.l3_tier import WorkerL3

            self.l3 = WorkerL3(self.config.l3, layout, self.pool, self.drafter_id, self.rank)
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

    # ------------------------------------------------------------------ loads

    def _job_descriptors(
        self, region: LayerRegion, jobs: list[TransferJob], to_host: bool
    ) -> Descriptors:
        assert self.pool is not None
        return Descriptors.concat(
            [
                layer_descriptors(
                    region,
                    self.pool,
                    job.host_pages[region.group_index],
                    job.gpu_blocks[region.group_index],
                    to_host,
                )
                for job in jobs
            ]
        )

    def _ordered_regions(self) -> list[LayerRegion]:
        # Target layers first: the drafter runs after the whole target forward.
        return sorted(self.regions, key=lambda r: r.slot.is_draft)

    def _valid_loads(
        self, jobs: list[TransferJob]
    ) -> list[tuple[TransferJob, dict[str, Descriptors]]]:
        """Jobs whose copies can be built, with their copies per layer; the rest are
        reported for recompute."""
        valid = []
        for job in jobs:
            if job.error_blocks and self.async_loads:
                # The scheduler planned no copies: vLLM recomputes the request whole.
                self._fail_load(job, "load_error")
                continue
            if job.error_blocks:
                self.stats.record_fallback("load_error")
                self._load_error_blocks.update(job.error_blocks)
                self._failed_load_reqs.add(job.req_id)
                self._failed_load_jobs.add(job.job_id)
            try:
                copies = {
                    region.slot.name: self._job_descriptors(region, [job], to_host=False)
                    for region in self.regions
                }
            except ValueError as exc:
                logger.warning("DraftOffloadConnector: load job %d refused: %s", job.job_id, exc)
                self._fail_load(job, "load_error")
                continue
            if self.config.audit and not self._audit_passes(job):
                self._fail_load(job, "audit_mismatch")
                continue
            valid.append((job, copies))
        return valid

    def _job_slots(self, job: TransferJob) -> set[int]:
        assert self.layout is not None
        first = self.layout.groups[0]
        return {page // first.blocks_per_chunk for page in job.host_pages[0]}

    def _layer_checksums(self, slot: int) -> list[str]:
        assert self.pool is not None and self.layout is not None
        unit = self.pool.unit_view(slot).numpy()
        return [
            checksum(unit[layer.offset : layer.offset + layer.nbytes])
            for layer in self.layout.layers
        ]

    def _audit_passes(self, job: TransferJob) -> bool:
        """Compare every layer of every slot with the checksums taken at store time."""
        assert self.layout is not None
        for slot in self._job_slots(job):
            expected = self._slot_checksums.get(slot)
            actual = self._layer_checksums(slot)
            if expected is None:
                logger.warning("audit: slot %d has no store-time checksums", slot)
                return False
            bad = [
                layer.name
                for layer, want, got in zip(self.layout.layers, expected, actual, strict=True)
                if want != got
            ]
            if bad:
                logger.warning(
                    "audit: load job %d (request %s) slot %d differs from what was stored "
                    "in layer(s) %s; recomputing",
                    job.job_id,
                    job.req_id,
                    slot,
                    ", ".join(bad),
                )
                return False
        return True

    def _fail_load(self, job: TransferJob, cause: str) -> None:
        self.stats.record_fallback(cause)
        self._worker_meta.failed_jobs[job.job_id] = 1
        self._failed_load_reqs.add(job.req_id)
        self._failed_load_jobs.add(job.job_id)
        if self.async_loads:
            # Per-block errors cannot be mapped to requests with several groups.
            self._async.failed(job.req_id)
            return
        for blocks in job.gpu_blocks:
            self._load_error_blocks.update(blocks)

    def start_load_kv(self, meta: DraftOffloadMetadata) -> None:
        self._failed_load_reqs, self._failed_load_jobs = set(), set()
        for fetch in meta.fetches:
            if self.l3 is None:
                self._worker_meta.failed_jobs[fetch.job_id] = 1
                self._worker_meta.failure_causes[fetch.job_id] = "l3_unavailable"
            else:
                self.l3.fetch_unit(fetch.job_id, fetch.slot, fetch.chunk_key)
        planned = self._valid_loads(meta.loads)
        if not planned:
            return
        loads = [job for job, _ in planned]
        started = time.perf_counter()
        num_bytes = {True: 0, False: 0}
        start_event = None
        if self._on_device:
            assert self._load_stream is not None
            # New blocks may have been written by the previous step's kernels.
            self._load_stream.wait_stream(torch.cuda.current_stream())
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record(self._load_stream)
        last_event: torch.Event | None = None
        assert self.copier is not None
        regions = self._ordered_regions()
        descs = [Descriptors.concat([c[r.slot.name] for _, c in planned]) for r in regions]
        for region, desc in zip(regions, descs, strict=True):
            num_bytes[region.slot.is_draft] += desc.num_bytes
        # Every layer's small pages in one kernel launch, then each layer's DMA share,
        # with an event per layer (copy_paths.py).
        keepalive, events = self.copier.run_layers(descs, "load", self._load_stream)
        for region, event in zip(regions, events, strict=True):
            if event is not None:
                last_event = event
                if not self.async_loads:
                    self._layer_events[region.slot.name] = event
        if self.async_loads:
            # No forward reads these blocks before every worker reports the
            # request in finished_recving: no waits, only the final event.
            self._async.issued({job.job_id: job.req_id for job in loads}, last_event, keepalive)
        else:
            self._load_keepalive += keepalive
            if last_event is not None:
                self._last_load_event = last_event
            if meta.wait_loads_before_forward and last_event is not None:
                torch.cuda.current_stream().wait_event(last_event)
            for job in loads:
                self._worker_meta.completed_jobs[job.job_id] = 1
        chunks = self._num_chunks(loads) if self.counts_chunks else 0
        if start_event is not None and last_event is not None:
            self._timed_loads.append(
                InflightLoad(start_event, last_event, num_bytes[False], num_bytes[True], chunks)
            )
        else:
            self.stats.record_transfer(
                "load",
                "cpu",
                num_bytes[False],
                num_bytes[True],
                chunks,
                time.perf_counter() - started,
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        event = self._layer_events.pop(self._aliases.get(layer_name, layer_name), None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _finish_loads(self) -> None:
        # Layers the forward did not wait for (e.g. a step without drafting)
        # must still be in place before the next step reads them.
        if self._last_load_event is not None:
            torch.cuda.current_stream().wait_event(self._last_load_event)
            self._last_load_event = None
        self._layer_events.clear()
        self._load_keepalive = []

    # ----------------------------------------------------------------- stores

    def handle_preemptions(self, meta: DraftOffloadMetadata) -> None:
        if meta.flush_stores:
            for store in self._stores:
                if store.event is not None:
                    store.event.synchronize()

    def wait_for_save(self, meta: DraftOffloadMetadata) -> None:
        self._finish_loads()
        if meta.compares and self.comparer is not None:
            # Ahead of this step's stores, so the audit's sync does not wait for them too.
            self.comparer.run(meta.compares, self._worker_meta, self._store_stream)
        if self.l3 is not None:
            # Announce this step's writes before its cancels, which may name them.
            for job in meta.stores:
                if job.l3_units:
                    self.l3.expect_writes(job.l3_units)
            if meta.l3_cancel_writes:
                self.l3.cancel_writes(meta.l3_cancel_writes)
            # A verdict names only jobs every rank has retired, so this rank has either
            # parked the job's orders or already failed them (then there is nothing).
            for job_id in meta.l3_commit_jobs:
                orders = self._uncommitted_writes.pop(job_id, None)
                if orders is not None:
                    self.l3.write_units(orders)
            for job_id in meta.l3_abort_jobs:
                orders = self._uncommitted_writes.pop(job_id, None)
                if orders is not None:
                    self.l3.fail_writes(orders)
        if not meta.stores:
            return
        for job in meta.stores:
            self._req_store_jobs[job.req_id].add(job.job_id)
            if job.finishing:
                self._finishing_reqs.add(job.req_id)
        if self._on_device:
            assert self._store_stream is not None
            self._store_stream.wait_stream(torch.cuda.current_stream())
        failed_reqs, self._failed_load_reqs = self._failed_load_reqs, set()
        failed_jobs, self._failed_load_jobs = self._failed_load_jobs, set()
        for job in meta.stores:
            if job.req_id in failed_reqs or failed_jobs.intersection(job.after_loads):
                logger.warning(
                    "DraftOffloadConnector: store job %d dropped: a load request %s's KV "
                    "depends on failed this step, so its new KV sits on a wrong prefix",
                    job.job_id,
                    job.req_id,
                )
                self._stores.append(
                    InflightStore(job, None, failed_cause="store_after_load_failure")
                )
                continue
            try:
                parts = [self._job_descriptors(r, [job], to_host=True) for r in self.regions]
            except ValueError as exc:
                logger.warning("DraftOffloadConnector: store job %d refused: %s", job.job_id, exc)
                self._stores.append(InflightStore(job, None, failed_cause="store_error"))
                continue
            desc = Descriptors.concat(parts)
            draft = sum(
                p.num_bytes for p, r in zip(parts, self.regions, strict=True) if r.slot.is_draft
            )
            store = InflightStore(job, None)
            store.sizes = (
                desc.num_bytes - draft,
                draft,
                self._num_chunks([job]) if self.counts_chunks else 0,
            )
            assert self.copier is not None
            if self._on_device and desc.num_bytes:
                # Timed on the store stream, recorded when it completes (_poll_stores).
                assert self._store_stream is not None
                store.start = torch.cuda.Event(enable_timing=True)
                store.start.record(self._store_stream)
                store.keepalive = self.copier.run(desc, "store", self._store_stream)
                store.event = torch.cuda.Event(enable_timing=True)
                store.event.record(self._store_stream)
            else:
                started = time.perf_counter()
                self.copier.run(desc, "store", None)
                seconds = time.perf_counter() - started
                self.stats.record_transfer("store", "cpu", *store.sizes, seconds)
            self._stores.append(store)

    def _poll_stores(self) -> set[str]:
        """Retire completed stores; return finished requests with nothing left in flight."""
        still_running = []
        done_reqs = set()
        for store in self._stores:
            if store.event is not None and not store.event.query():
                still_running.append(store)
                continue
            job = store.job
            if store.start is not None and store.event is not None:
                seconds = store.start.elapsed_time(store.event) / 1000.0
                self.stats.record_transfer("store", "cpu", *store.sizes, seconds)
            if store.failed_cause is not None:
                self._fail_store(job, store.failed_cause)
            else:
                if self.config.audit:
                    for slot in self._job_slots(job):
                        self._slot_checksums[slot] = self._layer_checksums(slot)
                self._worker_meta.completed_jobs[job.job_id] = 1
                if self.l3 is not None and job.l3_units:
                    # Written once the scheduler confirms the job (l3_commit_jobs).
                    self._uncommitted_writes[job.job_id] = job.l3_units
            jobs = self._req_store_jobs[job.req_id]
            jobs.discard(job.job_id)
            if not jobs:
                del self._req_store_jobs[job.req_id]
                if job.req_id in self._finishing_reqs:
                    self._finishing_reqs.discard(job.req_id)
                    done_reqs.add(job.req_id)
        self._stores = still_running
        return done_reqs

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

    def _poll_loads(self) -> None:
        still_running = []
        for load in self._timed_loads:
            if not load.end.query():
                still_running.append(load)
                continue
            seconds = load.start.elapsed_time(load.end) / 1000.0
            self.stats.record_transfer(
                "load", "cpu", load.target_bytes, load.draft_bytes, load.chunks, seconds
            )
        self._timed_loads = still_running

    def _num_chunks(self, jobs: list[TransferJob]) -> int:
        return sum(len(self._job_slots(job)) for job in jobs)

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this worker."""
        self._poll_loads()
        sending = self._poll_stores()
        done_jobs, recving, failed = self._async.poll()
        for job_id in done_jobs:
            # Unpinned by the scheduler once every worker's copies are done.
            self._worker_meta.completed_jobs[job_id] = 1
        return sending, recving, failed

    def _drain_l3(self) -> None:
        l3 = self.l3
        if l3 is None:
            return
        meta = self._worker_meta
        write_counts = {
            "released": meta.l3_writes_released,
            "ok": meta.l3_writes_ok,
            "failed": meta.l3_writes_failed,
        }
        while not l3.write_reports.empty():
            kind, write_id = l3.write_reports.get()
            counts = write_counts[kind]
            counts[write_id] = counts.get(write_id, 0) + 1
        while not l3.fetches_done.empty():
            result = l3.fetches_done.get()
            if result.successors is None:
                meta.failed_jobs[result.job_id] = 1
                meta.failure_causes[result.job_id] = result.cause or "l3_corrupt"
                continue
            if self.config.audit:
                self._slot_checksums[result.slot] = list(result.layer_checksums)
            meta.completed_jobs[result.job_id] = 1
            meta.fetched_successors[result.job_id] = list(result.successors)
            meta.fetch_seconds[result.job_id] = result.seconds
            assert self.layout is not None
            self.stats.record_transfer(
                "load",
                "l3",
                self.layout.target_bytes,
                self.layout.draft_bytes,
                1 if self.counts_chunks else 0,
                None,
            )
        while not l3.events.empty():
            kind, detail = l3.events.get()
            if kind == "fallback":
                self.stats.record_fallback(detail)
            elif kind == "lost_shutdown":
                self.stats.record_fallback("l3_write_lost_shutdown", int(detail))
            elif kind == "stored":
                assert self.layout is not None
                self.stats.record_transfer(
                    "store",
                    "l3",
                    self.layout.target_bytes,
                    self.layout.draft_bytes,
                    1 if self.counts_chunks else 0,
                    None,
                )

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
        for store in self._stores:
            if store.event is not None:
                store.event.synchronize()
        self._poll_stores()
        if self.l3 is not None:
            # No verdict comes for these any more: unconfirmed KV is never written.
            parked = [order for orders in self._uncommitted_writes.values() for order in orders]
            self._uncommitted_writes.clear()
            self.l3.abandon_writes(parked)
            self.l3.close()  # flushes the committed writes still queued
            self._drain_l3()  # counts l3_write_lost_shutdown
        if self.comparer is not None:
            self.comparer.close()
        if self.pool is not None:
            self.pool.close()
