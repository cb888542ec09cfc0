"""The load job of an admitted hit, with its record in the job book.

vLLM has allocated the request's blocks for the hit the lookup matched
(`update_state_after_alloc`); load_planner.py chooses the copies that restore it,
and this module makes them the job the workers run: binds an overlapped restore's
units still landing from storage to it (restore_overlap.py) and notes on the
request's record what the hit restores and which part of it storage supplied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.hit_logic import PrefixMatch, tokens_in_chunks
from vllm_draft_offload.job_book import JobBook, JobRecord
from vllm_draft_offload.load_planner import plan_load
from vllm_draft_offload.metadata import TransferJob
from vllm_draft_offload.request_state import RequestState
from vllm_draft_offload.restore_overlap import OverlappedLoads

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from vllm_draft_offload.l3_prefetch import L3Prefetch


@dataclass(eq=False)
class LoadJobs:
    """Makes the load jobs of admitted hits (owned by `DraftOffloadScheduler`)."""

    index: CpuTierIndex
    layout: UnitLayout
    num_successors: int
    async_loads: bool
    jobs: JobBook
    overlap: OverlappedLoads
    l3: L3Prefetch | None
    new_job_id: Callable[[], int]
    chunk_size: int = field(init=False)  # the layout's

    def __post_init__(self) -> None:
        self.chunk_size = self.layout.chunk_size

    def job(
        self,
        request: Request,
        state: RequestState,
        match: PrefixMatch,
        blocks: KVCacheBlocks,
    ) -> TransferJob:
        """The load job of the hit `match` (trimmed to what vLLM admitted) into the
        request's newly allocated `blocks`."""
        landing, state.pending_fetches = state.pending_fetches, None
        if self.l3 is not None:
            fetched = self.l3.take_fetched_chunk_keys(request.request_id)
            fetched |= {placeholder[0] for placeholder in landing or ()}
            state.storage_tokens = tokens_in_chunks(
                match, self.chunk_size, lambda chunk: state.keys.keys[chunk] in fetched
            )
        plan = plan_load(
            self.index,
            self.layout,
            match,
            blocks.get_block_ids(),
            self.async_loads,
            landing=landing,
            token_ids=request.all_token_ids,
            num_successors=self.num_successors,
        )
        job = TransferJob(
            self.new_job_id(),
            request.request_id,
            "load",
            plan.host_pages,
            plan.gpu_blocks,
            error_blocks=plan.error_blocks,
            overlapped=landing is not None,
            overlap_units=plan.overlap_units,
        )
        self.jobs.add(
            job.job_id,
            JobRecord(
                request.request_id,
                "load",
                plan.units,
                asynchronous=self.async_loads or landing is not None,
            ),
        )
        if landing is not None:
            self.overlap.bind(request.request_id, job.job_id, landing, plan.units)
        state.inflight_jobs.add(job.job_id)
        state.hit_start = match.start_token
        state.restored_tokens = max(0, plan.loaded_end - match.start_token)
        # Chunks already in the tier need no store; skip past them.
        state.next_store_chunk = max(state.next_store_chunk, match.end_token // self.chunk_size)
        return job
