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

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.fast_io import reader
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_residency import Presence, first_round_residency
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.metadata import FETCH_CANCELLED, L3WriteOrder
from vllm_draft_offload.run_pool import RunPool
from vllm_draft_offload.switch_interval import WaitingSwitchInterval
from vllm_draft_offload.transfers import HostPool
from vllm_draft_offload.unit_codec import LayerSpec, UnitIdentity, UnitRejected, unit_frame
from vllm_draft_offload.unit_fetch import NATIVE_PIECE_BYTES, PIECE_BYTES, fetch_unit_into
from vllm_draft_offload.unit_verify import ExpectedUnit
from vllm_draft_offload.unit_write import copy_unit_into

logger = logging.getLogger(__name__)


def object_key(chunk_key: bytes, rank: int) -> str:
    """LMCache object name of one rank's part of a unit (hex, as LMCache keys need)."""
    return f"{chunk_key.hex()}{rank:04x}"


def open_store(config: L3Config, unit_bytes: int = 0) -> L3Store | None:
    """Connect to the configured backend; None (and a warning) when it is unreachable.

    With `unit_bytes`, the default staging pool holds io_threads reads and as many
    writes at once: the unpinned host memory the tier may use, bounded by
    `l3_staging_mb` when that is set."""
    try:
        store = L3Store.from_lmcache(
            config.config_file,
            config.lmcache,
            timeout_s=config.timeout_s,
            min_staging_bytes=2 * config.io_threads * (unit_bytes + STAGING_HEADER_BYTES),
        )
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


# Room for a unit's header in a staging buffer (generous: layer table and checksums).
STAGING_HEADER_BYTES = 64 << 10
# While a request waits on storage (hold_writes), no write starts for up to this long:
# the fetches it waits on get the cores, memory bandwidth and GIL that write-behind (a
# copy and a file write per unit) would take. On an H100 host a restart's fetches landed
# 7 units in 73 ms while the previous prompt's write-behind was likely still draining one
# write at a time, against 64 in 0.21 s for the first prompt, with nothing to write
# (session 10). Past it, one write at a time, so write-behind still drains under a
# steady stream of storage hits.
WRITES_HELD_MAX_S = 0.5


def write_concurrency(threads: int, store: L3Store | None, unit_bytes: int) -> int:
    """Writes in flight per worker: `threads`, as far as half the staging pool holds
    them (the other half stays free for fetches, which a request waits on)."""
    if store is None:
        return 1
    per_write = unit_bytes + STAGING_HEADER_BYTES
    return max(1, min(threads, store.settings.staging_bytes // 2 // per_write))


@dataclass(frozen=True)
class FetchResult:
    job_id: int
    slot: int
    successors: tuple[int, ...] | None  # None: failed
    cause: str | None = None
    layer_checksums: tuple[str, ...] = ()
    # Wall time of the read, decode and copy into the slot (feeds the cost model).
    seconds: float = 0.0
    # From the moment the fetch was queued on this worker to its landing: the storage's
    # time for a round (engine steps between do not count, as they do for the scheduler).
    since_queued: float = 0.0


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
        self.store = open_store(config, layout.unit_bytes)
        # Lowered only while a request waits on storage (set_reads_waiting).
        self.switch_interval = WaitingSwitchInterval.for_config(config)
        # Bytes a fetch reads (and hashes) at a time, by the Python reader and by the
        # native one (unit_fetch; benchmarks vary them).
        self.fetch_piece_bytes = PIECE_BYTES
        self.fetch_native_piece_bytes = NATIVE_PIECE_BYTES
        if self.store is not None:
            logger.info("DraftOffloadConnector: L3 fetches and writes use the %s loop", reader())
        # Separate pools: a fetch has a request waiting on it and must never queue
        # behind write-behind. Writes run one unit per task, as many at once as the
        # staging pool allows.
        self.write_threads = write_concurrency(
            config.write_threads or config.io_threads, self.store, layout.unit_bytes
        )
        self._write_pool = ThreadPoolExecutor(
            self.write_threads, thread_name_prefix="draft-offload-l3-write"
        )
        self._read_pool = ThreadPoolExecutor(
            config.io_threads, thread_name_prefix="draft-offload-l3-read"
        )
        # l3.spread_reads: fs:// fetches read their units' bytes on these threads,
        # earliest unit first (unit_fetch.py), so that a fetch's first units land early
        # instead of all together after a whole unit's read; read threads open and wait.
        self._spread_pool: RunPool | None = None
        if config.spread_reads and self.store is not None and self.store.reads_files:
            self._spread_pool = RunPool(config.io_threads, "draft-offload-l3-spread")
        # Write queue: orders whose store completed, shallowest chunk first, each
        # written by whichever write task runs next (so a cancel can still take it).
        self._write_cv = threading.Condition()
        self._write_heap: list[tuple[int, int, L3WriteOrder]] = []
        self._queued: dict[int, L3WriteOrder] = {}
        self._awaiting_store: set[int] = set()
        self._cancelled: set[int] = set()
        self._writes_in_flight = 0
        self._hold_writes = False
        self._held_since = 0.0
        self._write_seq = itertools.count()
        self.lost_at_shutdown = 0
        # (released | ok | failed, write id), drained into the worker metadata.
        self.write_reports: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self.fetches_done: queue.SimpleQueue[FetchResult] = queue.SimpleQueue()
        # Fetches queued but not started, and those of them the scheduler cancelled.
        self._fetch_lock = threading.Lock()
        self._fetches_queued: set[int] = set()
        self._fetches_cancelled: set[int] = set()
        self.events: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        # ("read" | "write", wall s, thread CPU s) per unit, drained into the stats:
        # a thread whose wall time runs well past its CPU time waits (GIL, core, disk).
        self.thread_times: queue.SimpleQueue[tuple[str, float, float]] = queue.SimpleQueue()

    @contextmanager
    def _clocked(self, op: str) -> Iterator[None]:
        """Report the calling thread's wall and CPU time of the block as `op`
        (thread_times), however the block ends."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.thread_times.put((op, time.perf_counter() - wall, time.thread_time() - cpu))

    # ------------------------------------------------------------------ writes

    def expect_writes(self, orders: list[L3WriteOrder]) -> None:
        """Orders of a store job just issued; they are queued once its copy lands and
        the scheduler has confirmed the job on every rank (write_units)."""
        with self._write_cv:
            self._awaiting_store.update(order.write_id for order in orders)

    def write_units(self, orders: list[L3WriteOrder]) -> None:
        """The store of these units completed: queue their writes, one task each."""
        queued = 0
        with self._write_cv:
            for order in orders:
                self._awaiting_store.discard(order.write_id)
                if order.write_id in self._cancelled:
                    self._cancelled.discard(order.write_id)  # already reported
                    continue
                self._queued[order.write_id] = order
                heapq.heappush(self._write_heap, (order.chunk, next(self._write_seq), order))
                queued += 1
        for _ in range(queued):
            self._write_pool.submit(self._write_next)

    def fail_writes(self, orders: list[L3WriteOrder]) -> None:
        """The store of these units failed on this rank: there is nothing to write."""
        with self._write_cv:
            for order in orders:
                self._awaiting_store.discard(order.write_id)
                if order.write_id in self._cancelled:
                    self._cancelled.discard(order.write_id)
                    continue
                self._give_up(order.write_id)

    def abandon_writes(self, orders: list[L3WriteOrder]) -> None:
        """Shutdown: these orders were never confirmed by the scheduler, so they are not
        written; counted (and logged) as lost."""
        lost = 0
        with self._write_cv:
            for order in orders:
                self._awaiting_store.discard(order.write_id)
                if order.write_id in self._cancelled:
                    self._cancelled.discard(order.write_id)
                    continue
                self._give_up(order.write_id)
                lost += 1
        if lost:
            self.lost_at_shutdown += lost
            logger.warning(
                "DraftOffloadConnector: %d L3 write(s) not yet confirmed by the scheduler "
                "at shutdown; those units are not in storage",
                lost,
            )
            self.events.put(("lost_shutdown", str(lost)))

    def cancel_writes(self, write_ids: list[int]) -> None:
        """The scheduler dropped these writes; skip each one not staged yet."""
        with self._write_cv:
            for write_id in write_ids:
                if write_id in self._awaiting_store:
                    self._awaiting_store.discard(write_id)
                    self._cancelled.add(write_id)
                    self._give_up(write_id)
                elif self._queued.pop(write_id, None) is not None:
                    self._give_up(write_id)  # its heap entry is skipped when popped
            self._write_cv.notify_all()

    def _give_up(self, write_id: int) -> None:
        self.write_reports.put(("released", write_id))
        self.write_reports.put(("failed", write_id))

    def set_reads_waiting(self, waiting: bool) -> None:
        """Whether some request waits on a storage lookup or fetch now (the scheduler
        says so with every step): writes are held back and the GIL switch interval is
        lowered while one does, so that the reads it waits on run first and promptly."""
        self.hold_writes(waiting)
        self.switch_interval.set_waiting(waiting)

    def hold_writes(self, hold: bool) -> None:
        """While `hold` (a request waits on storage: the scheduler says so with every
        step), no write starts for WRITES_HELD_MAX_S, then one at a time."""
        with self._write_cv:
            if hold != self._hold_writes:
                self._hold_writes = hold
                self._held_since = time.monotonic()
                self._write_cv.notify_all()

    def _writes_allowed(self) -> tuple[int | None, float | None]:
        """(writes that may run now, None: no limit; seconds until that changes)."""
        if not self._hold_writes:
            return None, None
        held_s = time.monotonic() - self._held_since
        if held_s < WRITES_HELD_MAX_S:
            return 0, WRITES_HELD_MAX_S - held_s
        return 1, None

    def pending_writes(self) -> int:
        with self._write_cv:
            return len(self._queued) + self._writes_in_flight

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write has finished (or failed); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._write_cv:
            while self._queued or self._writes_in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._write_cv.wait(left)
        return True

    def _write_next(self) -> None:
        with self._write_cv:
            while True:
                allowed, recheck_s = self._writes_allowed()
                if allowed is None or self._writes_in_flight < allowed:
                    break
                self._write_cv.wait(recheck_s)
            order = None
            while self._write_heap:
                _, _, candidate = heapq.heappop(self._write_heap)
                if self._queued.pop(candidate.write_id, None) is not None:
                    order = candidate
                    break
            if order is None:
                return  # cancelled meanwhile
            self._writes_in_flight += 1
        try:
            with self._clocked("write"):
                self._write(order)
        finally:
            with self._write_cv:
                self._writes_in_flight -= 1
                self._write_cv.notify_all()

    def _write(self, order: L3WriteOrder) -> None:
        """Copy the slot once, straight into LMCache's staging buffer, and write it.

        Whatever happens, the order is reported released (the slot may be reused)
        and then ok or failed, exactly once each.
        """
        released = False
        ok = False
        try:
            store = self.store
            if store is None:
                raise L3Error("unavailable", "no L3 backend", op="put")
            identity = UnitIdentity(
                key=order.chunk_key.hex(),
                geometry_fingerprint=self.fingerprint,
                drafter_id=self.drafter_id,
                num_tokens=self.layout.chunk_size,
                successor_tokens=order.successors,
            )
            frame = unit_frame(identity, self.layer_specs)

            def release() -> None:
                # The bytes are LMCache's now: the slot may be reused from here on.
                nonlocal released
                released = True
                self.write_reports.put(("released", order.write_id))

            def fill(buf: memoryview) -> None:
                slot = memoryview(self.pool.unit_view(order.slot).numpy())
                copy_unit_into(buf, frame, slot, identity, self.layer_specs, on_copied=release)

            store.put_with(object_key(order.chunk_key, self.rank), frame.nbytes, fill)
            ok = True
        except L3Error as exc:
            # A backend that is down fails every write at once; the store has already
            # warned that it went down, so do not repeat that once per unit.
            quiet = exc.kind in ("unavailable", "closed")
            (logger.debug if quiet else logger.warning)(
                "DraftOffloadConnector: L3 write failed: %s", exc
            )
        except Exception:  # never let a storage bug reach the serving loop
            logger.exception("DraftOffloadConnector: unexpected L3 write error")
        finally:
            if not released:
                self.write_reports.put(("released", order.write_id))
            self.write_reports.put(("ok" if ok else "failed", order.write_id))
            if ok:
                self.events.put(("stored", order.chunk_key.hex()))

    # ------------------------------------------------------------------ fetches

    def fetch_unit(self, job_id: int, slot: int, chunk_key: bytes) -> None:
        if self.store is None:
            self.fetches_done.put(FetchResult(job_id, slot, None, "l3_unavailable"))
            return
        with self._fetch_lock:
            self._fetches_queued.add(job_id)
        self._read_pool.submit(self._fetch, job_id, slot, chunk_key, time.perf_counter())

    def cancel_fetches(self, job_ids: list[int]) -> None:
        """Skip these fetches if they have not started (reported as FETCH_CANCELLED)."""
        with self._fetch_lock:
            self._fetches_cancelled.update(j for j in job_ids if j in self._fetches_queued)

    def _fetch(self, job_id: int, slot: int, chunk_key: bytes, queued: float) -> None:
        # With spread_reads the bytes are read on the spread pool's threads: this
        # thread's CPU time is then only the open, the header and the wait.
        with self._clocked("read"):
            self._fetch_timed(job_id, slot, chunk_key, queued)

    def _fetch_timed(self, job_id: int, slot: int, chunk_key: bytes, queued: float) -> None:
        assert self.store is not None
        with self._fetch_lock:
            self._fetches_queued.discard(job_id)
            cancelled = job_id in self._fetches_cancelled
            self._fetches_cancelled.discard(job_id)
        if cancelled:
            self.fetches_done.put(FetchResult(job_id, slot, None, FETCH_CANCELLED))
            return
        started = time.perf_counter()
        expected = ExpectedUnit(
            key=chunk_key.hex(),
            geometry_fingerprint=self.fingerprint,
            drafter_id=self.drafter_id,
            layers=self.layer_specs,
            num_tokens=self.layout.chunk_size,
        )

        try:
            # Straight into the slot: it is not published before the result says ok.
            dest = memoryview(self.pool.unit_view(slot).numpy())
            header = fetch_unit_into(
                self.store,
                object_key(chunk_key, self.rank),
                expected,
                dest,
                self.fetch_piece_bytes,
                self._spread_pool,
                self.fetch_native_piece_bytes,
            )
            if header is None:
                self.fetches_done.put(FetchResult(job_id, slot, None, "object_missing"))
                return
            landed = time.perf_counter()
            self.fetches_done.put(
                FetchResult(
                    job_id,
                    slot,
                    tuple(header.successor_tokens),
                    layer_checksums=tuple(entry.checksum for entry in header.layers),
                    seconds=landed - started,
                    since_queued=landed - queued,
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

    def close(self, flush_timeout_s: float | None = None) -> int:
        """Flush queued writes for up to `flush_timeout_s` (default: the config's),
        then stop; returns how many units could not be written (also logged)."""
        timeout = self.config.flush_timeout_s if flush_timeout_s is None else flush_timeout_s
        self._read_pool.shutdown(wait=True, cancel_futures=True)
        if self._spread_pool is not None:
            self._spread_pool.shutdown()  # after the reads that submit to it
        self.set_reads_waiting(False)  # no request waits any more: flush at full speed
        if not self.flush(timeout):
            with self._write_cv:
                lost = len(self._queued) + self._writes_in_flight
                for write_id in list(self._queued):
                    self._give_up(write_id)
                self._queued.clear()
                self._write_heap.clear()
            self.lost_at_shutdown += lost
            logger.warning(
                "DraftOffloadConnector: %d L3 write(s) not finished within "
                "l3.flush_timeout_s=%.1f s at shutdown; those units are not in storage",
                lost,
                timeout,
            )
            self.events.put(("lost_shutdown", str(lost)))
        # Writes still in flight fail fast once the store is closed.
        self._write_pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()
        self._write_pool.shutdown(wait=True)
        return self.lost_at_shutdown


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
        # A fetch's first round: one unit per read thread (each worker's io_threads).
        self.first_round_units = config.io_threads
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
        return presence

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()
