"""The scheduler's book of transfer jobs in flight: what each one is, the workers'
reports on it, and when it is complete (every rank reported).

What a completed job means for the CPU tier, the request and storage is the
scheduler's to decide (job_outcomes.py); this module only keeps the records, folds
the workers' reports into them and keeps the clock of the last progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_draft_offload.cpu_index import UnitId
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

# Cause of a store computed on the blocks of a load that failed.
STORE_AFTER_LOAD_FAILURE = "store_after_load_failure"


@dataclass
class JobRecord:
    req_id: str
    direction: str  # load | store | fetch
    units: list[UnitId]
    reports: int = 0
    failed: bool = False
    cause: str | None = None
    successors: list[int] | None = None
    # Store only: the chunk its plan started at; a failed store is retried from here.
    first_chunk: int = 0
    after_loads: tuple[int, ...] = ()  # store only: TransferJob.after_loads
    # Load only: the request waits for it in WAITING_FOR_REMOTE_KVS (async_loads).
    asynchronous: bool = False
    has_l3_writes: bool = False  # store only: workers hold L3 writes for its verdict
    # Store only: sliding-window blocks held for it (window_pins), released when it ends.
    held_blocks: list[KVCacheBlock] = field(default_factory=list)

    def fail(self, cause: str) -> None:
        """Mark it failed; the first cause given is the one kept."""
        self.failed, self.cause = True, self.cause or cause


class JobBook:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size  # ranks that report every job
        self._jobs: dict[int, JobRecord] = {}
        # When a job was last added to an empty book or completed: the stall clock.
        self.last_progress = time.monotonic()

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job_id: int, record: JobRecord) -> None:
        if not self._jobs:
            self.last_progress = time.monotonic()  # the stall clock starts now
        self._jobs[job_id] = record

    def get(self, job_id: int) -> JobRecord | None:
        return self._jobs.get(job_id)

    def records(self) -> list[JobRecord]:
        return list(self._jobs.values())

    def apply(
        self,
        meta: DraftOffloadWorkerMetadata,
        on_complete: Callable[[int, JobRecord], None],
    ) -> None:
        """Fold one step's worker reports in. A job every rank has reported on leaves
        the book and goes to `on_complete` at once: failed jobs first, so a failed load
        marks the stores computed on it failed before their own reports complete them."""
        for job_id, cause in meta.failure_causes.items():
            if (record := self._jobs.get(job_id)) is not None:
                record.fail(cause)
        for job_id, successors in meta.fetched_successors.items():
            if (record := self._jobs.get(job_id)) is None:
                continue
            if record.successors is None:
                record.successors = successors
            elif record.successors != successors:
                # Ranks reported in different steps and read different units.
                record.fail("rank_mismatch")
        for counts, failed in ((meta.failed_jobs, True), (meta.completed_jobs, False)):
            for job_id, count in counts.items():
                if (record := self._jobs.get(job_id)) is None:
                    continue
                record.failed |= failed
                record.reports += count
                if record.reports >= self.world_size:
                    self.last_progress = time.monotonic()
                    del self._jobs[job_id]
                    on_complete(job_id, record)

    def fail_stores_computed_on(self, load_id: int, load: JobRecord) -> None:
        """A load failed: the stores computed on its blocks (in its step: the workers
        refuse those too; this request's later ones under async scheduling) must never
        be published."""
        for job_id, record in self._jobs.items():
            if record.direction == "store" and (
                load_id in record.after_loads or (job_id > load_id and record.req_id == load.req_id)
            ):
                record.fail(STORE_AFTER_LOAD_FAILURE)

    def stalled_for(self, now: float) -> float:
        """Seconds since the last progress."""
        return now - self.last_progress
