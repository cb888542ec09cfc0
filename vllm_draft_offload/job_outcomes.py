"""What a transfer job every rank has reported on means for the CPU tier, its request
and storage.

The job book (job_book.py) folds the workers' reports in and hands over each job
once it is complete; here its units are published, unpinned or dropped, a failure's
consequences reach the request (a failed load fails the stores computed on it, a
failed store is retried), a fetch's result goes to the L3 prefetcher, and the verdict
on a store's L3 writes is kept until the next step sends it to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.job_book import JobBook, JobRecord
from vllm_draft_offload.request_state import RequestState
from vllm_draft_offload.restore_overlap import OverlappedLoads
from vllm_draft_offload.window_pins import WindowPins

if TYPE_CHECKING:
    from vllm_draft_offload.l3_prefetch import L3Prefetch


@dataclass(eq=False)
class JobOutcomes:
    """Applies completed jobs (owned by `DraftOffloadScheduler`, fed by its `JobBook`)."""

    index: CpuTierIndex
    jobs: JobBook
    pins: WindowPins
    overlap: OverlappedLoads
    l3: L3Prefetch | None
    requests: dict[str, RequestState]  # the scheduler's, by request id
    # Store jobs with L3 writes, finished on every rank: the verdict the workers
    # wait for before writing (commit) or dropping (abort) them, sent next step.
    l3_commits: list[int] = field(default_factory=list)
    l3_aborts: list[int] = field(default_factory=list)

    def complete(self, job_id: int, record: JobRecord) -> None:
        """Every rank reported on the job: publish, release or drop what it moved."""
        self.pins.release(record.held_blocks)
        if record.direction == "fetch":
            assert self.l3 is not None
            self.l3.fetch_finished(
                job_id, None if record.failed else record.successors, record.cause
            )
            return
        if record.has_l3_writes:
            # Decided only now, with every rank's report in and any later failure of a
            # load it was computed on applied: wrong KV never reaches storage.
            (self.l3_aborts if record.failed else self.l3_commits).append(job_id)
        state = self.requests.get(record.req_id)
        self.overlap.reported(job_id, state, record)
        if state is not None:
            state.inflight_jobs.discard(job_id)
            if record.failed:
                self._after_failure(state, job_id, record)
        for unit_id in record.units:
            if record.direction == "load":
                self.index.unpin(unit_id)
                if record.failed:
                    # A unit that failed to load (bad checksum) is never served again.
                    self.index.remove(unit_id)
            elif record.failed:
                self.index.remove(unit_id)
            else:
                self.index.commit(unit_id)

    def _after_failure(self, state: RequestState, job_id: int, record: JobRecord) -> None:
        if record.direction == "load":
            if record.asynchronous:
                state.restored_tokens = 0  # vLLM recomputes it from token 0
            self.jobs.fail_stores_computed_on(job_id, record)
        elif record.direction == "store" and record.cause != "store_error":
            # Retry once recomputed (no hole); a bad copy plan would only fail again.
            state.next_store_chunk = min(state.next_store_chunk, record.first_chunk)

    def verdicts_pending(self) -> bool:
        """Verdicts on L3 writes not yet sent to the workers."""
        return bool(self.l3_commits or self.l3_aborts)

    def take_verdicts(self) -> tuple[list[int], list[int]]:
        """The store jobs whose L3 writes to commit and to abort, for this step's
        metadata; none are left pending."""
        commits, aborts = self.l3_commits, self.l3_aborts
        self.l3_commits, self.l3_aborts = [], []
        return commits, aborts
