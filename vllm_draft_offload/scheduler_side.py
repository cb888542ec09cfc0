"""Scheduler half of the connector: lookups, load/store planning, bookkeeping.

It never touches tensors. It decides which host slot every unit lives in and
tells the workers what to copy; workers report back which jobs are done. The
CPU-tier prefix match is cpu_lookup.py's, the per-request record request_state.py's,
the load job of an admitted hit load_jobs.py's, the store jobs store_jobs.py's, what
a completed job means job_outcomes.py's, and the load jobs of overlapped restores
restore_overlap.py's `OverlappedLoads`.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm_draft_offload.audit import RecomputeAudit
from vllm_draft_offload.chunk_keys import ChunkKeyChain, make_salt, request_salt
from vllm_draft_offload.config import DraftOffloadConfig
from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.cpu_lookup import CpuTierLookup, Landing
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.job_book import JobBook, JobRecord
from vllm_draft_offload.job_outcomes import JobOutcomes
from vllm_draft_offload.l3_writes import L3WritePlanner, part_remover
from vllm_draft_offload.load_jobs import LoadJobs
from vllm_draft_offload.metadata import (
    DraftOffloadMetadata,
    DraftOffloadWorkerMetadata,
    TransferJob,
)
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.request_options import request_options
from vllm_draft_offload.request_state import RequestState
from vllm_draft_offload.restore_overlap import OverlappedLoads
from vllm_draft_offload.store_jobs import StoreJobs
from vllm_draft_offload.window_pins import WindowPins

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_draft_offload.l3_prefetch import L3Prefetch

logger = logging.getLogger(__name__)

# Seconds without any finished job after which in-flight jobs no longer keep
# the engine stepping.
STALL_S = 60.0


class DraftOffloadScheduler:
    def __init__(
        self,
        config: DraftOffloadConfig,
        layout: UnitLayout,
        identity: dict[str, object],
        num_successors: int,
        world_size: int,
        decode_query_len: int = 1,
        min_compute_tokens: int = 1,
        async_loads: bool = False,
    ) -> None:
        self.config = config
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.num_successors = num_successors
        # Tokens per request in a decode step (1 + speculative tokens): a step whose
        # loading requests are no longer than this may be replayed as a full CUDA graph.
        self.decode_query_len = decode_query_len
        # Hits load asynchronously (see DraftOffloadConnector): the request waits
        # one step, and a failed load is reported per request, not per block.
        self.async_loads = async_loads
        self.salt = make_salt({**identity, "geometry": layout.fingerprint()})
        num_slots = config.cpu_bytes // layout.unit_bytes
        self.index = CpuTierIndex(num_slots)
        self._requests: dict[str, RequestState] = {}
        self.jobs = JobBook(world_size)
        self._job_ids = itertools.count(1)
        self._pending_loads: list[TransferJob] = []
        self._pending_finish_stores: list[TransferJob] = []
        self._kv_cache_manager: KVCacheManager | None = None
        self.stats = DraftOffloadStats()
        self.cpu_lookup = CpuTierLookup(
            self.index, layout, num_successors, min_compute_tokens, self.stats
        )
        self.l3: L3Prefetch | None = None
        if config.l3.enabled:
            # LMCache is imported only when its tier is configured.
            from vllm_draft_offload.l3_lookup import SchedulerL3
            from vllm_draft_offload.l3_prefetch import L3Prefetch

            self.l3 = L3Prefetch(
                SchedulerL3(config.l3, world_size),
                self.index,
                self.chunk_size,
                config.l3,
                self.stats,
                lambda: next(self._job_ids),
                layout.unit_bytes,
                salt=self.salt,
                # Checksum audits verify a unit before its copy; a unit still landing
                # has none yet.
                overlap=config.l3.overlap_restore and not config.audit,
            )
        # Overlapped restores' load jobs (restore_overlap.py).
        self.overlap = OverlappedLoads(
            self.l3.overlap if self.l3 is not None else None, self.jobs, self.chunk_size
        )
        if self.l3 is not None:
            self.l3.on_rekey = self.overlap.rekey
        self.l3_writes: L3WritePlanner | None = None
        if self.l3 is not None:
            self.l3_writes = L3WritePlanner(
                self.index,
                layout.unit_bytes,
                config.pending_write_bytes,
                world_size,
                self.stats,
                lambda: next(self._job_ids),
                part_remover(self.l3.lookup.store, world_size),
            )
            # A unit a lookup found is in storage: recomputing it writes it again only
            # if its fetch then failed.
            self.l3.on_found = self.l3_writes.mark_in_storage
            self.l3.on_unusable = self.l3_writes.mark_not_in_storage
        self.pins = WindowPins(layout)
        self.audit = RecomputeAudit(
            config.audit_recompute_fraction,
            self.index,
            layout,
            num_successors,
            world_size,
            self.stats,
            lambda: next(self._job_ids),
        )
        self.loads = LoadJobs(
            self.index,
            layout,
            num_successors,
            async_loads,
            self.jobs,
            self.overlap,
            self.l3,
            lambda: next(self._job_ids),
        )
        self.stores = StoreJobs(
            config,
            layout,
            num_successors,
            self.index,
            self.jobs,
            self.pins,
            self.audit,
            self.l3_writes,
            lambda: next(self._job_ids),
        )
        self.outcomes = JobOutcomes(
            self.index, self.jobs, self.pins, self.overlap, self.l3, self._requests
        )

    @property
    def min_compute_tokens(self) -> int:
        """Tokens a restored request computes itself (derived from vLLM's config; the
        CPU-tier lookup's hit rule applies it)."""
        return self.cpu_lookup.min_compute_tokens

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager
        self.pins.bind(manager.block_pool)

    # ------------------------------------------------------------------ lookup

    def _state(self, request: Request) -> RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if request.mm_features or request.prompt_embeds is not None:
            # Token ids alone do not identify multimodal or embedding inputs.
            return None
        lora = request.lora_request.lora_name if request.lora_request else None
        salt = request_salt(self.salt, lora, request.cache_salt)
        state = RequestState(
            request,
            ChunkKeyChain(salt, self.chunk_size),
            options=request_options(request.kv_transfer_params, request.request_id),
        )
        self._requests[request.request_id] = state
        return state

    def on_new_request(self, request: Request) -> None:
        self._state(request)

    def _match(
        self, state: RequestState, num_computed_tokens: int, landing: Landing | None = None
    ) -> PrefixMatch:
        return self.cpu_lookup.match(
            state.keys, state.request.all_token_ids, num_computed_tokens, landing
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None or not state.options.load:
            return 0, False
        tokens = request.all_token_ids
        match = self._match(state, num_computed_tokens)
        state.pending_fetches = None
        if self.l3 is not None:
            if self.l3.must_wait(
                request.request_id, match, state.keys.keys, len(tokens), num_computed_tokens
            ):
                state.pending_match = None
                return None, False
            # Units fetched from L3 are in the CPU tier now, or still landing for an
            # overlapped restore.
            landing = self.overlap.landing(request.request_id)
            match = self._match(state, num_computed_tokens, landing)
            state.pending_fetches = self.overlap.taken(request.request_id, landing, match)
        state.pending_match = match
        if self.audit.divert(request.request_id, match):
            self.overlap.release(state)
            return 0, False  # audited: vLLM recomputes the prefix, compared at store time
        # An overlapped restore always loads asynchronously: the forward must never
        # wait on storage reads.
        asynchronous = self.async_loads or state.pending_fetches is not None
        return match.num_tokens, asynchronous and match.num_tokens > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        match, state.pending_match = state.pending_match, None
        if match is None:
            self.overlap.release(state)
            return
        self.cpu_lookup.record_admission(match, request.num_tokens)
        if num_external_tokens == 0 or match.num_tokens == 0:
            self.overlap.release(state)
            return
        if match.num_tokens != num_external_tokens:
            # vLLM trimmed the hit (e.g. a partial local block); load what it kept.
            match.end_token = match.start_token + num_external_tokens
        job = self.loads.job(request, state, match, blocks)
        self._pending_loads.append(job)

    # ------------------------------------------------------------------ stores

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DraftOffloadMetadata:
        meta = DraftOffloadMetadata(
            loads=self._pending_loads,
            stores=self._pending_finish_stores,
            fetches=self.l3.take_fetch_jobs() if self.l3 is not None else [],
            cancel_fetches=self.l3.take_fetch_cancels() if self.l3 is not None else [],
        )
        for fetch in meta.fetches:
            self.jobs.add(fetch.job_id, JobRecord("", "fetch", []))
        # Asynchronous loads are not read by this step's forward.
        meta.wait_loads_before_forward = not self.async_loads and any(
            not job.overlapped
            and scheduler_output.num_scheduled_tokens.get(job.req_id, 0) <= self.decode_query_len
            for job in meta.loads
        )
        self._pending_loads, self._pending_finish_stores = [], []
        meta.prompt_step = self._computes_prompt(scheduler_output.num_scheduled_tokens)
        if self.l3 is not None:
            meta.l3_reads_waiting = self.l3.any_waiting()
            # Overlapped restores whose fetches fell behind: recompute what has not landed.
            self.overlap.check()
            # Step timing for the L3 cost model: (new tokens, context) per request.
            self.l3.cost.step_scheduled(
                [
                    (n, state.request.num_computed_tokens if state is not None else 0)
                    for r, n in scheduler_output.num_scheduled_tokens.items()
                    for state in (self._requests.get(r),)
                ],
                loads=bool(meta.loads),
            )
        meta.abandon_loads = self.overlap.take_abandoned()
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        self.pins.take_state_offers(
            getattr(scheduler_output, "kv_connector_block_state", None),
            lambda req_id: (
                state.next_store_chunk if (state := self._requests.get(req_id)) else None
            ),
        )
        self.stores.plan_step(
            meta,
            scheduler_output.num_scheduled_tokens,
            self._requests,
            self._kv_cache_manager.get_block_ids,
        )
        preempted = scheduler_output.preempted_req_ids or set()
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is None:
                continue
            if any(
                (record := self.jobs.get(job_id)) is not None and record.direction == "store"
                for job_id in state.inflight_jobs
            ):
                meta.flush_stores = True
            # Its blocks are gone; a resumed request re-looks-up from scratch.
            state.next_store_chunk = 0
            self.pins.forget(req_id)
            self.audit.release(req_id)
        if self.l3_writes is not None:
            meta.l3_cancel_writes = self.l3_writes.take_cancels()
        meta.l3_commit_jobs, meta.l3_abort_jobs = self.outcomes.take_verdicts()
        return meta

    def _computes_prompt(self, num_scheduled_tokens: dict[str, int]) -> bool:
        """Whether the step computes a prompt token of some request (one it does not
        track counts as one: its stores then keep copy_path's route)."""
        for req_id in num_scheduled_tokens:
            state = self._requests.get(req_id)
            if state is None or state.request.num_computed_tokens < state.request.num_prompt_tokens:
                return True
        return False

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        self.audit.release(request.request_id)
        if self.l3 is not None:
            self.l3.forget(request.request_id)
        if state is None:
            return False, None
        self._record_acceptance(request, restored=state.restored_tokens > 0)
        waiting_loads = [
            job_id
            for job_id in state.inflight_jobs
            if (record := self.jobs.get(job_id)) is not None and record.asynchronous
        ]
        if waiting_loads:
            # Finished while waiting for its load (aborted): it computed nothing to
            # store, and vLLM holds its blocks until the load is reported in
            # finished_recving. A finishing store would free them a second time. An
            # overlapped load stops waiting for its fetches, so the blocks come back.
            self.overlap.abandon(waiting_loads)
            self.pins.forget(request.request_id)
            return False, None
        job = self.stores.job(state, request.num_computed_tokens, block_ids, finishing=True)
        self.pins.forget(request.request_id)  # what no store needs (the job took its own)
        if job is None:
            return False, None
        self._pending_finish_stores.append(job)
        return True, None

    def _record_acceptance(self, request: Request, restored: bool) -> None:
        """Acceptance of a finished request, split by whether its prefix was restored.

        Needs vLLM's per-request spec-decode metrics
        (`per_request_spec_decode_metrics` "summary" or "detailed").
        """
        metrics = request.spec_decode_metrics
        if metrics is None:
            return
        steps = sum(metrics.histogram)
        accepted = sum(j * count for j, count in enumerate(metrics.histogram))
        if steps:
            self.stats.record_acceptance(restored, steps, accepted)

    # ------------------------------------------------------------- completion

    def on_step_output(self) -> None:
        """vLLM processed one step's output (called every step, unlike the method below)."""
        if self.l3 is not None:
            self.l3.on_step_output()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, DraftOffloadWorkerMetadata):
            return
        self.audit.on_output(meta)
        if self.l3_writes is not None:
            self.l3_writes.on_output(meta)
        if self.l3 is not None:
            self.l3.fetch_timings(meta.fetch_seconds, meta.fetch_since_queued)
        self.jobs.apply(meta, self.outcomes.complete)

    def has_inflight_jobs(self) -> bool:
        return bool(self.jobs)

    def keeps_engine_busy(self) -> bool:
        """In-flight jobs that are still making progress.

        Jobs that have not moved for STALL_S (a worker gone during shutdown,
        say) stop holding the engine loop, so it can never spin forever.
        """
        if self.outcomes.verdicts_pending():
            return True  # verdicts the workers hold L3 writes for go out with a step
        now = time.monotonic()
        writes = self.l3_writes
        if writes is not None and writes.has_work() and now - writes.last_progress < STALL_S:
            return True  # L3 writes drain while the engine is otherwise idle
        if not self.jobs:
            return False
        if self.jobs.stalled_for(now) < STALL_S:
            return True
        logger.warning(
            "DraftOffloadConnector: %d transfer job(s) made no progress for %.0f s",
            len(self.jobs),
            STALL_S,
        )
        return False

    def shutdown(self) -> None:
        if self.l3_writes is not None:
            self.l3_writes.close()
        if self.l3 is not None:
            self.l3.close()

    def has_finishing_stores(self) -> bool:
        return any(
            record.direction == "store" and record.req_id not in self._requests
            for record in self.jobs.records()
        )

    def reset_cache(self) -> int:
        """Drop the CPU tier; what stores and fetches in flight write never shows.
        Storage is shared and survives restarts: kept (see cache_generation)."""
        dropped = self.index.clear_unpinned()
        for state in self._requests.values():
            state.next_store_chunk = 0  # store their chunks again: no hole
        if (reset_l3 := getattr(self.l3, "reset", None)) is not None:
            reset_l3()
        return dropped

    def storage_tokens(self, req_id: str) -> int:
        """Tokens of the request's admitted hit that storage supplied (the rest came
        from the CPU tier)."""
        state = self._requests.get(req_id)
        return state.storage_tokens if state is not None else 0

    def restored_tokens(self, req_id: str) -> int:
        state = self._requests.get(req_id)
        return state.restored_tokens if state is not None else 0
