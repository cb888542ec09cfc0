"""The scheduler's store jobs: whether a request has anything to store in a step,
and the store job (with its record in the job book) of a request's plan, every step
it is scheduled and once when it finishes.

Which chunks to store and into which host slots is store_planner.py's; this module
turns a plan into the job the workers run, holds the sliding-window pages it reads
(window_pins.py) and queues its L3 writes (l3_writes.py). A step's store planning
reads each request's block table, and the recompute audit (audit.py) plans its
compares from the same read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_draft_offload.audit import RecomputeAudit
from vllm_draft_offload.config import DraftOffloadConfig
from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.job_book import JobBook, JobRecord
from vllm_draft_offload.l3_writes import L3WritePlanner
from vllm_draft_offload.metadata import DraftOffloadMetadata, TransferJob
from vllm_draft_offload.request_state import RequestState
from vllm_draft_offload.store_planner import (
    blocks_being_loaded,
    loads_read_by,
    no_chunk_completes,
    plan_request_stores,
    store_range,
)
from vllm_draft_offload.window_pins import WindowPins


@dataclass(eq=False)
class StoreJobs:
    """Plans store jobs for the scheduler (owned by `DraftOffloadScheduler`)."""

    config: DraftOffloadConfig
    layout: UnitLayout
    num_successors: int
    index: CpuTierIndex
    jobs: JobBook
    pins: WindowPins
    audit: RecomputeAudit
    l3_writes: L3WritePlanner | None
    new_job_id: Callable[[], int]
    chunk_size: int = field(init=False)  # the layout's

    def __post_init__(self) -> None:
        self.chunk_size = self.layout.chunk_size

    def nothing_due(self, state: RequestState, computed_after: int) -> bool:
        """Whether the request needs nothing this step: no chunk to store, no window
        page to hold, no audit to plan. Most decode steps complete no chunk, and
        building their block tables and plans every step cost about 10 us a request
        on the engine's critical path (`vllm-draft-offload hook-cost`)."""
        if self.pins.active or self.audit.pending(state.request.request_id):
            # Sliding-window pages and Mamba states are held from the step they are
            # computed or named (window_pins), and audits read the block table: such
            # requests are looked at every step.
            return False
        if no_chunk_completes(
            state.request,
            state.next_store_chunk,
            computed_after,
            self.config,
            self.chunk_size,
            state.options.store,
        ):
            return True  # the common decode step, without store_range's calls
        first, limit = store_range(
            state.request,
            state.next_store_chunk,
            computed_after,
            self.num_successors,
            self.config,
            self.chunk_size,
            state.options.store,
        )
        if limit > first:
            return False
        state.next_store_chunk = first  # as an empty plan would set it
        return True

    def plan_step(
        self,
        meta: DraftOffloadMetadata,
        num_scheduled_tokens: dict[str, int],
        requests: dict[str, RequestState],
        block_ids_of: Callable[[str], tuple[list[int], ...]],
    ) -> None:
        """The store jobs of this step's scheduled requests, added to `meta.stores`
        (each ordered after the step's loads in `meta.loads` that write blocks it
        reads), and the recompute audit's compares, planned from the same block
        table read, added to `meta.compares`."""
        loading = blocks_being_loaded(meta.loads)
        for req_id, num_scheduled in num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None:
                continue
            computed_after = state.request.num_computed_tokens + num_scheduled
            if self.nothing_due(state, computed_after):
                continue
            block_ids = block_ids_of(req_id)
            self.pins.track(req_id, state.next_store_chunk, computed_after, block_ids)
            job = self.job(state, computed_after, block_ids, finishing=False)
            if job is not None:
                job.after_loads = loads_read_by(self.layout, block_ids, loading)
                record = self.jobs.get(job.job_id)
                assert record is not None
                record.after_loads = tuple(job.after_loads)
                meta.stores.append(job)
            meta.compares += self.audit.plan(state.request, computed_after, block_ids)

    def job(
        self,
        state: RequestState,
        computed_after_step: int,
        block_ids: tuple[list[int], ...],
        finishing: bool,
    ) -> TransferJob | None:
        req_id = state.request.request_id
        # Freed sliding-window blocks a unit still needs are read where they are held.
        block_ids = self.pins.block_table(req_id, block_ids)
        state_blocks = self.pins.state_blocks(req_id) if self.layout.state_groups else None
        plan = plan_request_stores(
            self.index,
            self.layout,
            state.keys,
            state.request,
            state.next_store_chunk,
            computed_after_step,
            self.num_successors,
            self.config,
            block_ids,
            # No slot for a store: a queued L3 write gives its slot back once confirmed.
            on_full=self.l3_writes.relieve if self.l3_writes is not None else None,
            state_blocks=state_blocks,
            allowed=state.options.store,
        )
        if plan.window_lost:
            self.pins.give_up(req_id)
        state.next_store_chunk = plan.next_chunk
        held = self.pins.settle(req_id, plan.chunks, plan.next_chunk, block_ids)
        units = plan.units
        if not units and not (finishing and state.inflight_jobs):
            return None
        job = TransferJob(
            self.new_job_id(),
            state.request.request_id,
            "store",
            plan.host_pages,
            plan.gpu_blocks,
            finishing=finishing,
            # Pinned until every worker has its bytes in LMCache's staging buffer.
            l3_units=self.l3_writes.plan(plan.l3_units) if self.l3_writes is not None else [],
        )
        self.jobs.add(
            job.job_id,
            JobRecord(
                state.request.request_id,
                "store",
                units,
                first_chunk=plan.first_chunk,
                has_l3_writes=bool(job.l3_units),
                held_blocks=held,
            ),
        )
        state.inflight_jobs.add(job.job_id)
        return job
