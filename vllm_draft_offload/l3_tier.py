"""The LMCache storage tier (L3) behind the CPU tier.

Units move between the host pool and L3 whole: one LMCache object per unit
and TP rank, holding every target and draft layer plus a header (key,
geometry fingerprint, drafter identity, successor tokens, checksums). Writes
follow CPU-tier stores asynchronously; a hit in L3 is fetched into a CPU slot
and then loaded like any CPU hit. Any failure (backend down, object missing,
truncated, corrupt, from another drafter or geometry) means the chunk is not
served and vLLM recomputes it; nothing here raises into the serving loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.l3_store import L3Error, L3Store
from vllm_draft_offload.transfers import HostPool
from vllm_draft_offload.unit_codec import (
    ExpectedUnit,
    LayerSpec,
    UnitHeader,
    UnitRejected,
    decode_unit,
    encode_unit,
    make_header,
)

logger = logging.getLogger(__name__)


def object_key(chunk_key: bytes, rank: int) -> str:
    """LMCache object name of one rank's part of a unit (hex, as LMCache keys need)."""
    return f"{chunk_key.hex()}{rank:04x}"


def open_store(config: L3Config) -> L3Store | None:
    """Connect to the configured backend; None (and a warning) when it is unreachable."""
    try:
        store = L3Store.from_lmcache(config.config_file, config.lmcache, timeout_s=config.timeout_s)
    except L3Error as exc:
        if exc.kind == "config":
            raise
        logger.warning("DraftOffloadConnector: L3 storage unavailable at start (%s)", exc)
        return None
    if not store.healthy():
        logger.warning(
            "DraftOffloadConnector: L3 backend %s unreachable at start; serving from the CPU "
            "tier and retrying in the background",
            store.settings.scheme,
        )
    return store


@dataclass(frozen=True)
class UnitToWrite:
    slot: int
    chunk_key: bytes
    successors: tuple[int, ...]


@dataclass(frozen=True)
class FetchResult:
    job_id: int
    slot: int
    successors: tuple[int, ...] | None  # None: failed
    cause: str | None = None
    layer_checksums: tuple[str, ...] = ()
    # Wall time of the read, decode and copy into the slot (feeds the cost model).
    seconds: float = 0.0


class WorkerL3:
    """Worker-side L3 traffic, on background threads."""

    def __init__(
        self,
        config: L3Config,
        layout: UnitLayout,
        pool: HostPool,
        drafter_id: str,
        rank: int,
    ) -> None:
        self.config = config
        self.layout = layout
        self.pool = pool
        self.drafter_id = drafter_id
        self.rank = rank
        self.fingerprint = layout.fingerprint()
        self.layer_specs = tuple(
            LayerSpec(slot.name, slot.is_draft, slot.nbytes) for slot in layout.layers
        )
        self.store = open_store(config)
        # Separate pools: a fetch has a request waiting on it and must never queue
        # behind the write-behind of a long prompt (one write task holds a thread
        # for all the units of its store job).
        self._write_pool = ThreadPoolExecutor(
            config.io_threads, thread_name_prefix="draft-offload-l3-write"
        )
        self._read_pool = ThreadPoolExecutor(
            config.io_threads, thread_name_prefix="draft-offload-l3-read"
        )
        self._lock = threading.Lock()
        self._pending_write_bytes = 0
        self._writes: list[Future[None]] = []
        self.snapshots_done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.fetches_done: queue.SimpleQueue[FetchResult] = queue.SimpleQueue()
        self.events: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()

    # ------------------------------------------------------------------ writes

    def write_units(self, job_id: int, raw_units: list[tuple[int, bytes, tuple[int, ...]]]) -> None:
        """Copy the units out of their slots, then write them; reports `job_id` once copied.

        Units are admitted one by one while the write backlog has room, so a store
        job larger than the backlog still writes its first units.
        """
        units = [UnitToWrite(*unit) for unit in raw_units]
        unit_bytes = self.layout.unit_bytes
        with self._lock:
            room = self.config.max_pending_write_bytes - self._pending_write_bytes
            admitted = units[: max(0, room // unit_bytes)] if self.store is not None else []
            nbytes = unit_bytes * len(admitted)
            self._pending_write_bytes += nbytes
        for _ in range(len(units) - len(admitted)):
            # Backlog full or no backend: drop the write, never stall or grow memory.
            self.events.put(("fallback", "l3_write_dropped"))
        if not admitted:
            self.snapshots_done.put(job_id)
            return
        self._writes.append(self._write_pool.submit(self._write, job_id, admitted, nbytes))
        self._writes = [w for w in self._writes if not w.done()]

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every write issued so far has finished (or failed)."""
        wait(list(self._writes), timeout=timeout_s)

    def _write(self, job_id: int, units: list[UnitToWrite], nbytes: int) -> None:
        try:
            blobs = []
            for unit in units:
                payload = self.pool.unit_view(unit.slot).numpy().copy()
                blobs.append((unit, payload))
            # The slots may be reused from here on: the copies are ours.
            self.snapshots_done.put(job_id)
            for unit, payload in blobs:
                header = make_header(
                    key=unit.chunk_key.hex(),
                    geometry_fingerprint=self.fingerprint,
                    drafter_id=self.drafter_id,
                    num_tokens=self.layout.chunk_size,
                    layers=self.layer_specs,
                    payload=payload,
                    successor_tokens=unit.successors,
                )
                assert self.store is not None
                self.store.put(object_key(unit.chunk_key, self.rank), encode_unit(header, payload))
                self.events.put(("stored", unit.chunk_key.hex()))
        except L3Error as exc:
            logger.warning("DraftOffloadConnector: L3 write failed: %s", exc)
            self.events.put(("fallback", "store_failed"))
        except Exception:  # never let a storage bug reach the serving loop
            logger.exception("DraftOffloadConnector: unexpected L3 write error")
            self.events.put(("fallback", "store_failed"))
        finally:
            with self._lock:
                self._pending_write_bytes -= nbytes

    # ------------------------------------------------------------------ fetches

    def fetch_unit(self, job_id: int, slot: int, chunk_key: bytes) -> None:
        if self.store is None:
            self.fetches_done.put(FetchResult(job_id, slot, None, "l3_unavailable"))
            return
        self._read_pool.submit(self._fetch, job_id, slot, chunk_key)

    def _fetch(self, job_id: int, slot: int, chunk_key: bytes) -> None:
        assert self.store is not None
        started = time.perf_counter()
        expected = ExpectedUnit(
            key=chunk_key.hex(),
            geometry_fingerprint=self.fingerprint,
            drafter_id=self.drafter_id,
            layers=self.layer_specs,
            num_tokens=self.layout.chunk_size,
        )

        def into_slot(blob: memoryview) -> UnitHeader:
            header, payload = decode_unit(blob, expected)
            self.pool.unit_view(slot).numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
            return header

        try:
            header = self.store.get_into(object_key(chunk_key, self.rank), into_slot)
            if header is None:
                self.fetches_done.put(FetchResult(job_id, slot, None, "object_missing"))
                return
            self.fetches_done.put(
                FetchResult(
                    job_id,
                    slot,
                    tuple(header.successor_tokens),
                    layer_checksums=tuple(entry.checksum for entry in header.layers),
                    seconds=time.perf_counter() - started,
                )
            )
        except UnitRejected as exc:
            logger.warning(
                "DraftOffloadConnector: L3 object %s refused (%s); recomputing",
                chunk_key.hex(),
                exc,
            )
            self.fetches_done.put(FetchResult(job_id, slot, None, exc.cause))
        except L3Error as exc:
            cause = "l3_unavailable" if exc.kind in ("unavailable", "timeout") else "l3_corrupt"
            logger.warning("DraftOffloadConnector: L3 read of %s failed: %s", chunk_key.hex(), exc)
            self.fetches_done.put(FetchResult(job_id, slot, None, cause))
        except Exception:
            logger.exception("DraftOffloadConnector: unexpected L3 read error")
            self.fetches_done.put(FetchResult(job_id, slot, None, "l3_corrupt"))

    def close(self) -> None:
        self._read_pool.shutdown(wait=True, cancel_futures=True)
        self._write_pool.shutdown(wait=True, cancel_futures=False)
        if self.store is not None:
            self.store.close()


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
        self.store = open_store(config)
        self._pool = ThreadPoolExecutor(
            LOOKUP_THREADS, thread_name_prefix="draft-offload-l3-lookup"
        )
        self._lock = threading.Lock()
        self._broken: OrderedDict[bytes, None] = OrderedDict()

    def lookup(self, chunk_keys: list[bytes]) -> Future[list[bool]]:
        return self._pool.submit(self._contains, chunk_keys)

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
        return [
            all(found[i * ranks : (i + 1) * ranks]) and not self.is_broken(key)
            for i, key in enumerate(chunk_keys)
        ]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()
