"""Storage measured in the background, for lookups no request waits on any more.

A request that stops waiting on storage (declined because the engine's speed is not
known yet, or out of its wait allowance before its lookup answered) leaves its lookup
here. When the lookup answers, the units found are reported as in storage (so they
are not written again), and while the storage has no recent timing the first of them
(one per read thread: a round, l3_fetches.py) are fetched as a probe that no
request waits for: it times the storage for later requests and lands in the CPU tier.
One such probe runs at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

from vllm_draft_offload.l3_storage_estimate import StorageEstimate

# Lookups kept after their request stopped waiting.
MAX_LATE_LOOKUPS = 8


class BackgroundProbe:
    def __init__(
        self,
        storage: StorageEstimate,
        fetch_round: Callable[[Sequence[bytes]], list[int]],
        found: Callable[[Sequence[bytes]], None],
    ) -> None:
        self.storage = storage
        # Reserves fetches of chunk keys (in order, while slots last) for no request,
        # as one round; their job ids.
        self._fetch_round = fetch_round
        self._found = found  # told the chunk keys a lookup found in storage
        self._late: list[tuple[Future[list[bool]], list[bytes]]] = []
        self._jobs: set[int] = set()

    def keep(self, lookup: Future[list[bool]], chunk_keys: list[bytes]) -> None:
        """A lookup whose request stopped waiting: use its answer when it comes."""
        if len(self._late) < MAX_LATE_LOOKUPS:
            self._late.append((lookup, chunk_keys))

    def look_up(
        self, lookup: Callable[[list[bytes]], Future[list[bool]]], chunk_keys: list[bytes]
    ) -> None:
        """Look chunks up for no request (the engine cannot price a wait yet)."""
        if len(self._late) < MAX_LATE_LOOKUPS:
            self._late.append((lookup(chunk_keys), chunk_keys))

    def probe(self, chunk_keys: Sequence[bytes]) -> int:
        """Fetch the first units of `chunk_keys`, one per read thread, for no request,
        unless a probe is in flight already; how many were sent."""
        if self._jobs:
            return 0
        jobs = self._fetch_round(chunk_keys[: self.storage.parallel])
        self._jobs.update(jobs)
        return len(jobs)

    def fetch_finished(self, job_id: int) -> None:
        self._jobs.discard(job_id)

    def poll(self) -> None:
        """Lookups that answered: report what they found, probe if unmeasured."""
        if not self._late:
            return
        pending = []
        for future, chunk_keys in self._late:
            if not future.done():
                pending.append((future, chunk_keys))
                continue
            try:
                present = future.result()
            except Exception:  # counted when a request waited on it; here only a hint
                continue
            hits = next((i for i, found in enumerate(present) if not found), len(present))
            if hits:
                self._found(chunk_keys[:hits])
            if hits and self.storage.stale():
                self.probe(chunk_keys[:hits])
        self._late = pending
