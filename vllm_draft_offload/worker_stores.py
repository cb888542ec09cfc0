"""Worker-side tracking of CPU-tier stores in flight, and of the finished requests
they keep alive.

vLLM holds a finished request's blocks until we report it in ``finished_sending``;
a request is reported once every store job issued for it has completed (or failed).
What a completed store means for the rest of the worker (timing, audit, L3 writes,
failure reports) is the caller's ``retire`` callback: this module only knows which
stores are done and which requests that frees.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_draft_offload.metadata import TransferJob


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
    # A copy done on the host (CPU tensors): its seconds, recorded when it retires.
    host_seconds: float | None = None
    # False while its copy waits to be issued by the store issuer (store_issuer.py):
    # not complete, whatever its event says.
    issued: bool = True


class StoreTracker:
    """Stores in flight, and per request the store jobs it still waits for."""

    def __init__(self) -> None:
        self._stores: list[InflightStore] = []
        self._req_store_jobs: dict[str, set[int]] = defaultdict(set)
        self._finishing_reqs: set[str] = set()

    def expect(self, jobs: list[TransferJob]) -> None:
        """Note this step's store jobs before any runs, so none retires its request early."""
        for job in jobs:
            self._req_store_jobs[job.req_id].add(job.job_id)
            if job.finishing:
                self._finishing_reqs.add(job.req_id)

    def add(self, store: InflightStore) -> None:
        self._stores.append(store)

    def synchronize(self) -> None:
        """Wait for every issued store copy (a preemption frees blocks, shutdown frees the
        pool): drain the store issuer first, so that every copy is issued."""
        for store in self._stores:
            if store.event is not None:
                store.event.synchronize()

    def poll(self, retire: Callable[[InflightStore], None]) -> set[str]:
        """Retire completed stores; return finished requests with nothing left in flight."""
        still_running = []
        done_reqs = set()
        for store in self._stores:
            if not store.issued or (store.event is not None and not store.event.query()):
                still_running.append(store)
                continue
            retire(store)
            job = store.job
            jobs = self._req_store_jobs[job.req_id]
            jobs.discard(job.job_id)
            if not jobs:
                del self._req_store_jobs[job.req_id]
                if job.req_id in self._finishing_reqs:
                    self._finishing_reqs.discard(job.req_id)
                    done_reqs.add(job.req_id)
        self._stores = still_running
        return done_reqs
