"""Messages between the scheduler-side and worker-side connector halves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class TransferJob:
    """Copies between host slots and GPU blocks for one request.

    For each layout group g, `host_pages[g][i]` (slot * blocks_per_chunk +
    page) pairs with `gpu_blocks[g][i]`. Every layer of the group moves with
    the same pairs, so target and draft layers always travel together.
    """

    job_id: int
    req_id: str
    direction: Literal["load", "store"]
    host_pages: list[list[int]]
    gpu_blocks: list[list[int]]
    # Store only: the request has finished; report it in finished_sending once
    # all of its stores are done so vLLM frees its blocks.
    finishing: bool = False

    @property
    def num_pages(self) -> int:
        return sum(len(pages) for pages in self.host_pages)


@dataclass
class DraftOffloadMetadata(KVConnectorMetadata):
    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    # A request with stores in flight was preempted: its blocks may be reused
    # this step, so in-flight stores must finish before the forward.
    flush_stores: bool = False


@dataclass
class DraftOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: finished jobs, summed over workers by `aggregate`."""

    completed_jobs: dict[int, int] = field(default_factory=dict)
    failed_jobs: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> DraftOffloadWorkerMetadata:
        assert isinstance(other, DraftOffloadWorkerMetadata)
        merged = DraftOffloadWorkerMetadata(dict(self.completed_jobs), dict(self.failed_jobs))
        for target, source in (
            (merged.completed_jobs, other.completed_jobs),
            (merged.failed_jobs, other.failed_jobs),
        ):
            for job_id, count in source.items():
                target[job_id] = target.get(job_id, 0) + count
        return merged
