"""The scheduler's side of the L3 tier: which chunks storage holds, off the scheduling
thread, and the small non-unit objects it keeps there (the calibration).

A unit counts as present only when every TP rank's object (``l3_objects``) exists and
this engine has not found it broken (its ranks disagree). A lookup that fails answers
"absent", so vLLM recomputes those chunks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_objects import object_key, open_store
from vllm_draft_offload.l3_residency import Presence, first_round_residency

logger = logging.getLogger(__name__)

# Lookups in flight at once. Each holds a thread only while it waits for its one
# round of concurrent exists calls, so many requests' lookups overlap instead of
# queueing behind each other.
LOOKUP_THREADS = 32
# Chunk keys remembered as broken (ranks disagree): never fetched again by this engine.
MAX_BROKEN_KEYS = 65536


class SchedulerL3:
    """Scheduler-side existence checks, off the scheduling thread.

    A unit counts as present only when every TP rank's object exists; all ranks'
    objects of all chunks of a lookup are checked in one concurrent round.
    """

    def __init__(self, config: L3Config, world_size: int = 1) -> None:
        self.world_size = world_size
        # A fetch's first round: the units a worker reads at once (l3.units_in_flight).
        self.first_round_units = config.units_in_flight
        self.store = open_store(config)
        self._pool = ThreadPoolExecutor(
            LOOKUP_THREADS, thread_name_prefix="draft-offload-l3-lookup"
        )
        self._lock = threading.Lock()
        self._broken: OrderedDict[bytes, None] = OrderedDict()

    def lookup(self, chunk_keys: list[bytes]) -> Future[list[bool]]:
        """Which chunks storage holds; with fs:// also whether the page cache holds the
        first round a fetch of the leading hits reads (`Presence.first_round`)."""
        return self._pool.submit(self._contains, chunk_keys)

    def read_object(self, name: str) -> Future[bytes | None]:
        """A small non-unit object (the calibration), or None when absent."""
        return self._pool.submit(self._read, name)

    def write_object(self, name: str, data: bytes) -> Future[None]:
        return self._pool.submit(self._write, name, data)

    def _read(self, name: str) -> bytes | None:
        if self.store is None:
            return None
        return self.store.get(name)

    def _write(self, name: str, data: bytes) -> None:
        if self.store is not None:
            self.store.put(name, data)

    def is_broken(self, chunk_key: bytes) -> bool:
        with self._lock:
            return chunk_key in self._broken

    def mark_broken(self, chunk_key: bytes) -> None:
        """Never serve this unit again, and delete its objects where the backend can."""
        with self._lock:
            self._broken[chunk_key] = None
            self._broken.move_to_end(chunk_key)
            while len(self._broken) > MAX_BROKEN_KEYS:
                self._broken.popitem(last=False)
        if self.store is not None and self.store.supports_remove:
            self._pool.submit(self._remove_all_ranks, chunk_key)

    def reset(self) -> None:
        """Forget what this engine learnt about storage (cache reset)."""
        with self._lock:
            self._broken.clear()

    def _remove_all_ranks(self, chunk_key: bytes) -> None:
        assert self.store is not None
        for rank in range(self.world_size):
            try:
                self.store.remove(object_key(chunk_key, rank))
            except Exception as exc:  # best effort: the negative cache already guards
                logger.warning("DraftOffloadConnector: L3 remove failed: %s", exc)

    def _contains(self, chunk_keys: list[bytes]) -> list[bool]:
        if self.store is None or not chunk_keys:
            return [False] * len(chunk_keys)
        ranks = self.world_size
        names = [object_key(key, rank) for key in chunk_keys for rank in range(ranks)]
        try:
            found = self.store.contains_many(names)
        except L3Error as exc:
            logger.warning("DraftOffloadConnector: L3 lookup failed: %s", exc)
            return [False] * len(chunk_keys)
        if len(found) != len(names):
            logger.warning(
                "DraftOffloadConnector: L3 lookup answered %d of %d", len(found), len(names)
            )
            return [False] * len(chunk_keys)
        presence = Presence(
            all(found[i * ranks : (i + 1) * ranks]) and not self.is_broken(key)
            for i, key in enumerate(chunk_keys)
        )
        # Asked here, before any read of them is sent (l3_residency.py).
        presence.first_round = first_round_residency(
            self.store.files_resident,
            chunk_keys,
            presence,
            self.first_round_units,
            lambda key: [object_key(key, rank) for rank in range(ranks)],
        )
        presence.answered_at = time.perf_counter()
        return presence

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()
