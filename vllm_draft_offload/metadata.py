"""Messages between the scheduler-side and worker-side connector halves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class L3WriteOrder:
    """One unit the scheduler wants written to L3 by every worker (TP rank).

    The scheduler decides what is written, so all ranks write the same units; each
    rank reports per order when the slot may be reused ("released": the bytes are
    in LMCache's staging buffer, or the write was given up) and how it ended.
    """

    write_id: int
    slot: int
    chunk_key: bytes
    successors: tuple[int, ...]
    # Chunk index in its prompt: workers write shallow chunks first.
    chunk: int


@dataclass
class LoadUnit:
    """One unit of an overlapped load (restore_overlap.py): its page pairs, and the
    storage fetch that is still filling its host slot when the load was planned."""

    host_pages: list[list[int]]
    gpu_blocks: list[list[int]]
    # None: the unit sat in the CPU tier already; else copied once this fetch landed
    # on this worker, with a header whose successor tokens start with `successors`
    # (the tokens the request's hit relies on: its draft KV was built from them).
    fetch_job: int | None = None
    successors: tuple[int, ...] = ()


@dataclass
class TransferJob:
    """Copies between host slots and GPU blocks for one request.

    For each layout group g, `host_pages[g][i]` (GroupLayout.host_page: slot *
    pages_per_unit + page in the unit) pairs with `gpu_blocks[g][i]`. Every layer
    of the group moves with the same pairs, so target and draft layers always
    travel together.
    """

    job_id: int
    req_id: str
    # compare: copy the GPU blocks aside and compare them with the host slot
    # (the sampled recompute audit, audit.py); the slot is not written.
    direction: Literal["load", "store", "compare"]
    host_pages: list[list[int]]
    gpu_blocks: list[list[int]]
    # Store only: the request has finished; report it in finished_sending once
    # all of its stores are done so vLLM frees its blocks.
    finishing: bool = False
    # Load only: GPU blocks of chunks whose unit is gone since the lookup; the
    # worker reports them as failed so vLLM recomputes them, and loads the rest.
    error_blocks: list[int] = field(default_factory=list)
    # Store only, with an L3 tier: units to write to L3 once the store completes.
    l3_units: list[L3WriteOrder] = field(default_factory=list)
    # Store only: load jobs of the same step that write GPU blocks this request's KV
    # was computed on (its own, or another request's it shares through vLLM's prefix
    # cache). If one of them fails, the store holds KV of a wrong prefix: dropped.
    after_loads: list[int] = field(default_factory=list)
    # Load only: an overlapped load (restore_overlap.py) and its units in chunk order; the
    # request waits in WAITING_FOR_REMOTE_KVS until every rank reports it finished.
    overlapped: bool = False
    overlap_units: list[LoadUnit] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum(len(pages) for pages in self.host_pages)


# Failure cause of a fetch a worker skipped or stopped mid-read because the scheduler
# cancelled it: not a refusal, and storage still holds the unit.
FETCH_CANCELLED = "fetch_cancelled"


@dataclass
class FetchJob:
    """Read one unit from L3 into a host slot."""

    job_id: int
    slot: int
    chunk_key: bytes


@dataclass
class DraftOffloadMetadata(KVConnectorMetadata):
    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    fetches: list[FetchJob] = field(default_factory=list)
    # Fetch jobs nobody waits for any more whose request gave storage up as too slow: a
    # worker skips one it has not started and stops one it is reading (fs://, within a
    # piece), reporting either with cause FETCH_CANCELLED.
    cancel_fetches: list[int] = field(default_factory=list)
    compares: list[TransferJob] = field(default_factory=list)
    # A request with stores in flight was preempted: its blocks may be reused
    # this step, so in-flight stores must finish before the forward.
    flush_stores: bool = False
    # A loading request's step may run as a full CUDA graph (its query is as short
    # as a decode step's), where per-layer hooks do not run: wait for all loads
    # before the forward instead of layer by layer.
    wait_loads_before_forward: bool = False
    # L3 writes the scheduler gave up (a tail dropped under pressure): a worker that
    # has not staged one yet skips it.
    l3_cancel_writes: list[int] = field(default_factory=list)
    # Store jobs with L3 writes that every rank completed and that were not failed
    # afterwards (a load they were computed on failed): their writes may go out.
    l3_commit_jobs: list[int] = field(default_factory=list)
    # Store jobs with L3 writes that failed on some rank or were failed afterwards:
    # their KV may be wrong, so it never reaches storage.
    l3_abort_jobs: list[int] = field(default_factory=list)
    # Some request waits on a storage lookup or fetch: workers hold write-behind to
    # one unit at a time and lower the GIL switch interval meanwhile
    # (WorkerL3.set_reads_waiting).
    l3_reads_waiting: bool = False
    # The step schedules a prompt token of some request (a prefill, or a preempted
    # request's recompute): its stores keep copy_path's route (decode_stores_dma).
    prompt_step: bool = True
    # Overlapped loads the scheduler gave up waiting on (their fetches too slow, or the
    # request aborted): units not landed yet are reported as load errors, not awaited.
    abandon_loads: list[int] = field(default_factory=list)


@dataclass
class DraftOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: finished jobs, summed over workers by `aggregate`."""

    completed_jobs: dict[int, int] = field(default_factory=dict)
    failed_jobs: dict[int, int] = field(default_factory=dict)
    # Fetch job -> successor tokens found in the L3 object header.
    fetched_successors: dict[int, list[int]] = field(default_factory=dict)
    # Fetch job -> seconds the read, decode and copy took (slowest rank).
    fetch_seconds: dict[int, float] = field(default_factory=dict)
    # Fetch job -> seconds from the worker queueing it to its landing (slowest rank).
    fetch_since_queued: dict[int, float] = field(default_factory=dict)
    # Failed job -> why (a refusal or fallback cause).
    failure_causes: dict[int, str] = field(default_factory=dict)
    # Compare job -> {"draft"|"target": layers that differ from the recomputed KV}.
    audit_mismatch_layers: dict[int, dict[str, list[str]]] = field(default_factory=dict)
    # L3 write order -> ranks whose copy of the slot is done (staged, or given up).
    l3_writes_released: dict[int, int] = field(default_factory=dict)
    # L3 write order -> ranks that wrote their part / failed or skipped it.
    l3_writes_ok: dict[int, int] = field(default_factory=dict)
    l3_writes_failed: dict[int, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.completed_jobs
            or self.failed_jobs
            or self.l3_writes_released
            or self.l3_writes_ok
            or self.l3_writes_failed
        )

    def aggregate(self, other: KVConnectorWorkerMetadata) -> DraftOffloadWorkerMetadata:
        assert isinstance(other, DraftOffloadWorkerMetadata)
        merged = DraftOffloadWorkerMetadata(
            dict(self.completed_jobs),
            dict(self.failed_jobs),
            dict(self.fetched_successors),
            dict(self.fetch_seconds),
            dict(self.fetch_since_queued),
            dict(self.failure_causes),
            {
                job: {part: list(names) for part, names in parts.items()}
                for job, parts in self.audit_mismatch_layers.items()
            },
            dict(self.l3_writes_released),
            dict(self.l3_writes_ok),
            dict(self.l3_writes_failed),
        )
        for target, source in (
            (merged.completed_jobs, other.completed_jobs),
            (merged.failed_jobs, other.failed_jobs),
            (merged.l3_writes_released, other.l3_writes_released),
            (merged.l3_writes_ok, other.l3_writes_ok),
            (merged.l3_writes_failed, other.l3_writes_failed),
        ):
            for job_id, count in source.items():
                target[job_id] = target.get(job_id, 0) + count
        for job_id, successors in other.fetched_successors.items():
            if merged.fetched_successors.setdefault(job_id, successors) != successors:
                # Ranks read different variants: the unit cannot be trusted.
                merged.failure_causes[job_id] = "rank_mismatch"
        for timings, theirs in (
            (merged.fetch_seconds, other.fetch_seconds),
            (merged.fetch_since_queued, other.fetch_since_queued),
        ):
            for job_id, seconds in theirs.items():
                timings[job_id] = max(seconds, timings.get(job_id, 0.0))
        for job_id, cause in other.failure_causes.items():
            merged.failure_causes.setdefault(job_id, cause)
        for job_id, parts in other.audit_mismatch_layers.items():
            mine = merged.audit_mismatch_layers.setdefault(job_id, {})
            for part, names in parts.items():
                # Ranks hold shards of the same layers: report each name once.
                mine[part] = sorted({*mine.get(part, ()), *names})
        return merged
