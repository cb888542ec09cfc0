"""The worker's side of the L3 tier: its unit traffic with storage, on background threads.

Writes follow CPU-tier stores asynchronously (``l3_write_behind``); a hit in L3 is
fetched into a CPU slot and then loaded like any CPU hit. Any failure (backend down,
object missing, truncated, corrupt, from another drafter or geometry) means the chunk is
not served and vLLM recomputes it; nothing here raises into the serving loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.fast_io import reader
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_fs_reads import ReadStopped
from vllm_draft_offload.l3_objects import object_key, open_store
from vllm_draft_offload.l3_write_behind import L3WriteBehind
from vllm_draft_offload.metadata import FETCH_CANCELLED
from vllm_draft_offload.run_pool import RunPool
from vllm_draft_offload.switch_interval import WaitingSwitchInterval
from vllm_draft_offload.transfers import HostPool
from vllm_draft_offload.unit_codec import LayerSpec, UnitRejected
from vllm_draft_offload.unit_fetch import NATIVE_PIECE_BYTES, PIECE_BYTES, fetch_unit_into
from vllm_draft_offload.unit_verify import ExpectedUnit

logger = logging.getLogger(__name__)


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


class WorkerL3(L3WriteBehind):
    """Worker-side L3 traffic, on background threads: fetches here, writes in its base
    (``L3WriteBehind``)."""

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
        # behind write-behind (l3_write_behind).
        self._init_writes(config.writes_in_flight)
        # A unit a read thread; with l3.threads_per_unit, fewer units at once, each read
        # by that many threads inside one native call (unit_fetch).
        self._read_pool = ThreadPoolExecutor(
            config.units_in_flight, thread_name_prefix="draft-offload-l3-read"
        )
        if config.threads_per_unit > 1 and self.store is not None and not self.store.reads_files:
            logger.warning(
                "DraftOffloadConnector: l3.threads_per_unit=%d splits fs:// reads only; "
                "this backend's units are copied whole, %d at a time",
                config.threads_per_unit,
                config.units_in_flight,
            )
        # l3.spread_reads: fs:// fetches read their units' bytes on these threads,
        # earliest unit first (unit_fetch.py), so that a fetch's first units land early
        # instead of all together after a whole unit's read; read threads open and wait.
        self._spread_pool: RunPool | None = None
        if config.spread_reads and self.store is not None and self.store.reads_files:
            self._spread_pool = RunPool(config.io_threads, "draft-offload-l3-spread")
        self.fetches_done: queue.SimpleQueue[FetchResult] = queue.SimpleQueue()
        # Fetches queued but not started, and those of them the scheduler cancelled; the
        # stop flags of those reading now (a cancel sets it: the read stops within a piece).
        self._fetch_lock = threading.Lock()
        self._fetches_queued: set[int] = set()
        self._fetches_cancelled: set[int] = set()
        self._fetch_stops: dict[int, bytearray] = {}
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

    def set_reads_waiting(self, waiting: bool) -> None:
        """Whether some request waits on a storage lookup or fetch now (the scheduler
        says so with every step): writes are held back and the GIL switch interval is
        lowered while one does, so that the reads it waits on run first and promptly."""
        self.hold_writes(waiting)
        self.switch_interval.set_waiting(waiting)

    # ------------------------------------------------------------------ fetches

    def fetch_unit(self, job_id: int, slot: int, chunk_key: bytes) -> None:
        if self.store is None:
            self.fetches_done.put(FetchResult(job_id, slot, None, "l3_unavailable"))
            return
        with self._fetch_lock:
            self._fetches_queued.add(job_id)
        self._read_pool.submit(self._fetch, job_id, slot, chunk_key, time.perf_counter())

    def cancel_fetches(self, job_ids: list[int]) -> None:
        """Skip these fetches if they have not started, and stop those reading now within
        a piece (fs://), each reported as FETCH_CANCELLED: a request that gave storage up
        recomputes beside them (reads left running made it 0.03-0.08 s slower on an H100,
        session 9). On an H200, stopping them did not change what strict's quiet declines
        cost from scheduling (7-18 ms before, sessions 29-30; 9-18 ms after, session 31)."""
        with self._fetch_lock:
            for job_id in job_ids:
                if job_id in self._fetches_queued:
                    self._fetches_cancelled.add(job_id)
                elif (stop := self._fetch_stops.get(job_id)) is not None:
                    stop[0] = 1

    def _fetch(self, job_id: int, slot: int, chunk_key: bytes, queued: float) -> None:
        # With spread_reads the bytes are read on the spread pool's threads: this
        # thread's CPU time is then only the open, the header and the wait.
        with self._clocked("read"):
            self._fetch_timed(job_id, slot, chunk_key, queued)

    def _fetch_timed(self, job_id: int, slot: int, chunk_key: bytes, queued: float) -> None:
        assert self.store is not None
        stop = bytearray(1)
        with self._fetch_lock:
            self._fetches_queued.discard(job_id)
            cancelled = job_id in self._fetches_cancelled
            self._fetches_cancelled.discard(job_id)
            if not cancelled:
                self._fetch_stops[job_id] = stop
        if cancelled:
            self.fetches_done.put(FetchResult(job_id, slot, None, FETCH_CANCELLED))
            return
        try:
            self._read_unit(job_id, slot, chunk_key, queued, stop)
        finally:
            with self._fetch_lock:
                del self._fetch_stops[job_id]

    def _read_unit(
        self, job_id: int, slot: int, chunk_key: bytes, queued: float, stop: bytearray
    ) -> None:
        """Read and check the unit into its slot; the result goes to ``fetches_done``."""
        assert self.store is not None
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
                self.config.threads_per_unit,
                stop,
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
        except ReadStopped:
            # Given up mid-read: the slot holds part of the unit and is never published.
            self.fetches_done.put(FetchResult(job_id, slot, None, FETCH_CANCELLED))
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
