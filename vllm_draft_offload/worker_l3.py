"""The worker's side of the L3 tier's hand-offs: commit gating of L3 writes, and turning
``WorkerL3``'s report queues into worker metadata and stats.

A store that completed here may still hold KV of a wrong prefix (another rank's load
failed, or this request's earlier load), so its L3 write orders are parked until the
scheduler says the job committed on every rank (``l3_commit_jobs``) or not
(``l3_abort_jobs``). Unconfirmed KV is never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_draft_offload.metadata import (
    DraftOffloadMetadata,
    DraftOffloadWorkerMetadata,
    L3WriteOrder,
    TransferJob,
)
from vllm_draft_offload.metrics import DraftOffloadStats

if TYPE_CHECKING:
    from vllm_draft_offload.geometry import UnitLayout
    from vllm_draft_offload.l3_worker import FetchResult, WorkerL3
    from vllm_draft_offload.worker_audit import SlotChecksums


class L3Link:
    """Parks completed stores' L3 writes until their verdict, and drains L3's reports."""

    def __init__(self, l3: WorkerL3, layout: UnitLayout, stats: DraftOffloadStats) -> None:
        self.l3 = l3
        self.layout = layout
        self.stats = stats
        # Store job -> its L3 write orders, held back until the scheduler's verdict.
        self._uncommitted_writes: dict[int, list[L3WriteOrder]] = {}
        # Fetches taken off L3's queue, to report with the next drain, and those that
        # `take_landings` has not returned yet (a drain must not hide them from it).
        self._landed: list[FetchResult] = []
        self._unseen: list[FetchResult] = []

    def apply_verdicts(self, meta: DraftOffloadMetadata) -> None:
        """This step's write announcements, cancels, and commit/abort verdicts (the
        step's hold on writes came with its loads: WorkerL3.set_reads_waiting)."""
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

    def park(self, job: TransferJob) -> None:
        """A store completed: its writes wait for the scheduler's verdict."""
        if job.l3_units:
            # Written once the scheduler confirms the job (l3_commit_jobs).
            self._uncommitted_writes[job.job_id] = job.l3_units

    def _pull(self) -> None:
        while not self.l3.fetches_done.empty():
            result = self.l3.fetches_done.get()
            self._landed.append(result)
            self._unseen.append(result)

    def take_landings(self) -> list[FetchResult]:
        """Fetches finished since the last call, for overlapped loads to copy at once
        (also those a drain has reported meanwhile); each is still reported to the
        scheduler with a `drain`."""
        self._pull()
        new, self._unseen = self._unseen, []
        return new

    def drain(
        self,
        meta: DraftOffloadWorkerMetadata,
        checksums: SlotChecksums | None,
        counts_chunks: bool,
    ) -> None:
        """Move finished writes, fetches and events from L3's queues into ``meta`` and stats."""
        l3 = self.l3
        write_counts = {
            "released": meta.l3_writes_released,
            "ok": meta.l3_writes_ok,
            "failed": meta.l3_writes_failed,
        }
        while not l3.write_reports.empty():
            kind, write_id = l3.write_reports.get()
            counts = write_counts[kind]
            counts[write_id] = counts.get(write_id, 0) + 1
        self._pull()
        landed, self._landed = self._landed, []
        for result in landed:
            if result.successors is None:
                meta.failed_jobs[result.job_id] = 1
                meta.failure_causes[result.job_id] = result.cause or "l3_corrupt"
                continue
            if checksums is not None:
                checksums.put(result.slot, list(result.layer_checksums))
            meta.completed_jobs[result.job_id] = 1
            meta.fetched_successors[result.job_id] = list(result.successors)
            meta.fetch_seconds[result.job_id] = result.seconds
            meta.fetch_since_queued[result.job_id] = result.since_queued
            self.stats.record_transfer(
                "load",
                "l3",
                self.layout.target_bytes,
                self.layout.draft_bytes,
                1 if counts_chunks else 0,
                None,
            )
        while not l3.thread_times.empty():
            self.stats.record_l3_thread_time(*l3.thread_times.get())
        while not l3.events.empty():
            kind, detail = l3.events.get()
            if kind == "fallback":
                self.stats.record_fallback(detail)
            elif kind == "lost_shutdown":
                self.stats.record_fallback("l3_write_lost_shutdown", int(detail))
            elif kind == "stored":
                self.stats.record_transfer(
                    "store",
                    "l3",
                    self.layout.target_bytes,
                    self.layout.draft_bytes,
                    1 if counts_chunks else 0,
                    None,
                )

    def close(self) -> None:
        """Abandon parked writes (no verdict comes any more) and flush committed ones."""
        parked = [order for orders in self._uncommitted_writes.values() for order in orders]
        self._uncommitted_writes.clear()
        self.l3.abandon_writes(parked)
        self.l3.close()  # flushes the committed writes still queued
