"""The worker's CPU-tier loads: copies from host slots into the blocks a hit restores.

Loads are issued in `start_load_kv`, one batched copy per layer on a side
stream with an event per layer; `wait_for_layer_load` makes the compute stream
wait only for that layer, so restoring overlaps the forward layer by layer.
Draft layers are copied last, since the drafter runs after the target.
With several KV-cache groups loads are asynchronous instead (async_loads.py):
the request runs only once its copies are done, so nothing waits per layer.

`WorkerLoads` is the load half of `worker_side.DraftOffloadWorker`, which sets up
the state it uses (the layout, host pool, copiers, streams, reporting metadata).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_draft_offload.async_loads import AsyncLoads
from vllm_draft_offload.copy_routes import PairCopier
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.metadata import (
    DraftOffloadMetadata,
    DraftOffloadWorkerMetadata,
    TransferJob,
)
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.overlap_loads import OverlapLoads
from vllm_draft_offload.transfers import LayerRegion, PairBatch, UnitCopies
from vllm_draft_offload.worker_audit import SlotChecksums, job_slots
from vllm_draft_offload.worker_l3 import L3Link

if TYPE_CHECKING:
    from vllm_draft_offload.l3_worker import WorkerL3

logger = logging.getLogger(__name__)


@dataclass
class InflightLoad:
    """A step's loads, timed on the load stream."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    target_bytes: int
    draft_bytes: int
    chunks: int


class WorkerLoads:
    """Issues a step's load jobs (and overlapped loads as their fetches land), lets
    the forward wait per layer, and times the copies."""

    # Set up by the worker (DraftOffloadWorker.__init__ and register_kv_caches).
    async_loads: bool
    _async: AsyncLoads
    _overlap: OverlapLoads
    l3: WorkerL3 | None
    _l3_link: L3Link | None
    layout: UnitLayout | None
    pair_copier: PairCopier | None
    regions: list[LayerRegion]
    _copies: UnitCopies | None
    _aliases: dict[str, str]
    _on_device: bool
    _load_stream: torch.cuda.Stream | None
    _layer_events: dict[str, torch.Event]
    _last_load_event: torch.Event | None
    _load_keepalive: list[torch.Tensor]
    _worker_meta: DraftOffloadWorkerMetadata
    _load_error_blocks: set[int]
    _failed_load_reqs: set[str]
    _failed_load_jobs: set[int]
    stats: DraftOffloadStats
    checksums: SlotChecksums | None
    _timed_loads: list[InflightLoad]
    counts_chunks: bool

    def _ordered_regions(self) -> list[int]:
        # Target layers first: the drafter runs after the whole target forward.
        return sorted(range(len(self.regions)), key=lambda i: self.regions[i].slot.is_draft)

    def _valid_loads(self, jobs: list[TransferJob]) -> list[tuple[TransferJob, PairBatch]]:
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
            assert self._copies is not None
            try:
                copies = self._copies.pairs(job.host_pages, job.gpu_blocks)
            except ValueError as exc:
                logger.warning("DraftOffloadConnector: load job %d refused: %s", job.job_id, exc)
                self._fail_load(job, "load_error")
                continue
            if self.checksums is not None and not self.checksums.passes(job):
                self._fail_load(job, "audit_mismatch")
                continue
            valid.append((job, copies))
        return valid

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
        if self.l3 is not None:
            # Before this step's fetches start, so they run at the lowered interval.
            self.l3.set_reads_waiting(meta.l3_reads_waiting or bool(meta.fetches))
            if meta.cancel_fetches:
                self.l3.cancel_fetches(meta.cancel_fetches)
        for fetch in meta.fetches:
            if self.l3 is None:
                self._worker_meta.failed_jobs[fetch.job_id] = 1
                self._worker_meta.failure_causes[fetch.job_id] = "l3_unavailable"
                self._overlap.landed(fetch.job_id, None)
            else:
                self.l3.fetch_unit(fetch.job_id, fetch.slot, fetch.chunk_key)
        self._overlap.abandon(meta.abandon_loads)
        for job in meta.loads:
            if job.overlapped:
                self._overlap.add(job, self._blocks_written_event())
        self._advance_overlaps()
        planned = self._valid_loads([job for job in meta.loads if not job.overlapped])
        if not planned:
            return
        loads = [job for job, _ in planned]
        order = self._ordered_regions()
        batch = PairBatch.concat([pairs for _, pairs in planned], len(self._copies.group_rows))
        if self._on_device:
            assert self._load_stream is not None
            # New blocks may have been written by the previous step's kernels.
            self._load_stream.wait_stream(torch.cuda.current_stream())
        chunks = self._num_chunks(loads) if self.counts_chunks else 0
        keepalive, events = self._run_loads(order, batch, chunks)
        last_event: torch.Event | None = None
        for layer, event in zip(order, events, strict=True):
            if event is not None:
                last_event = event
                if not self.async_loads:
                    self._layer_events[self.regions[layer].slot.name] = event
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

    def _run_loads(
        self, order: list[int], batch: PairBatch, chunks: int
    ) -> tuple[list[torch.Tensor], list[torch.Event | None]]:
        """Copy host pages to GPU blocks, the layers `order` names in that order (on the
        load stream, after what it already waits for), timed as one load of `chunks`."""
        started = time.perf_counter()
        start_event = None
        if self._on_device:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record(self._load_stream)
        assert self.pair_copier is not None
        total, draft = self.pair_copier.batch_bytes(batch)
        num_bytes = {False: total - draft, True: draft}
        # The pair kernel's layers in a few launches (copy_routes.py), the rest split
        # between the address-table kernel and DMA (copy_paths.py); an event per layer.
        keepalive, events = self.pair_copier.run_layers(batch, order, "load", self._load_stream)
        last_event = next((event for event in reversed(events) if event is not None), None)
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
        return keepalive, events

    def _blocks_written_event(self) -> torch.Event | None:
        """An event after the device work issued so far: an overlapped load's copies
        follow it, as its request's new blocks may have been written by earlier kernels
        (a later forward never touches them: the request waits for its load)."""
        if not self._on_device:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def _advance_overlaps(self) -> None:
        """Copy the units of overlapped loads whose fetches landed since the last call,
        every load's in one batch per layer."""
        if self._l3_link is not None:
            for result in self._l3_link.take_landings():
                self._overlap.landed(result.job_id, result.successors)
        if not self._overlap:
            return
        assert self._copies is not None
        planned = self._overlap.copies_due(self._copies)
        if not planned:
            return
        if self._on_device:
            assert self._load_stream is not None
            for load, _ in planned:
                if load.after is not None:
                    self._load_stream.wait_event(load.after)
        batch = PairBatch.concat(
            [pairs for _, copies in planned for _, pairs in copies], len(self._copies.group_rows)
        )
        chunks = sum(len(copies) for _, copies in planned) if self.counts_chunks else 0
        keepalive, events = self._run_loads(self._ordered_regions(), batch, chunks)
        last_event = next((event for event in reversed(events) if event is not None), None)
        for load, copies in planned:
            self._overlap.issued(load, [index for index, _ in copies], last_event, keepalive)

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
        assert self.layout is not None
        return sum(len(job_slots(self.layout, job)) for job in jobs)
