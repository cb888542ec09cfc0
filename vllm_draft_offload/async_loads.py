"""Worker-side tracking of asynchronous loads (layouts with several KV-cache groups).

A request whose hit loads asynchronously waits in vLLM's WAITING_FOR_REMOTE_KVS
state and is not scheduled until every worker reports it in `finished_recving`,
so its copies need no per-layer waits: they run on the load stream and are
reported once their last event has completed. A load that fails is reported in
`failed_recving` (and in `finished_recving`, as vLLM requires); vLLM then
recomputes the request from token 0 after a new lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class _Inflight:
    jobs: dict[int, str]  # load job id -> request id
    event: _Event | None  # None: the copies ran synchronously (CPU tensors)
    keepalive: list[torch.Tensor] = field(default_factory=list)


class AsyncLoads:
    def __init__(self) -> None:
        self._inflight: list[_Inflight] = []
        self._failed: set[str] = set()

    def issued(
        self, jobs: dict[int, str], event: _Event | None, keepalive: list[torch.Tensor]
    ) -> None:
        """Copies of `jobs` were issued; `event` completes after their last layer."""
        if jobs:
            self._inflight.append(_Inflight(jobs, event, keepalive))

    def failed(self, req_id: str) -> None:
        """The request's load was not executed: report it now."""
        self._failed.add(req_id)

    def poll(self) -> tuple[list[int], set[str], set[str]]:
        """(completed load jobs, finished_recving, failed_recving) since the last poll."""
        done_jobs: list[int] = []
        finished, failed = set(self._failed), self._failed
        self._failed = set()
        still = []
        for load in self._inflight:
            if load.event is not None and not load.event.query():
                still.append(load)
                continue
            done_jobs += load.jobs
            finished.update(load.jobs.values())
        self._inflight = still
        return done_jobs, finished, failed

    def synchronize(self) -> None:
        for load in self._inflight:
            if load.event is not None:
                load.event.synchronize()
