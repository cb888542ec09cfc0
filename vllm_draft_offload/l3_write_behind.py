"""Write-behind of units from the host pool into the L3 tier, on a worker.

Writes follow CPU-tier stores asynchronously: once a store landed and the scheduler
confirmed it on every rank, each of its units is queued and written (one LMCache object
per unit and rank, ``l3_objects``), shallowest chunk first, as many at once as the
staging pool allows, and held back while a request waits on storage. Every order is
reported released (its slot may be reused) and then ok or failed, exactly once each; a
failed write is logged and reported, never raised into the serving loop.

``L3WriteBehind`` is the write half of ``l3_worker.WorkerL3``, which supplies the unit
identity, the store and the reporting queues it uses.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_objects import STAGING_HEADER_BYTES, object_key
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.metadata import L3WriteOrder
from vllm_draft_offload.transfers import HostPool
from vllm_draft_offload.unit_codec import LayerSpec, UnitIdentity, unit_frame
from vllm_draft_offload.unit_write import copy_unit_into

logger = logging.getLogger(__name__)

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


class L3WriteBehind:
    """A worker's L3 write queue and the writes it runs, on background threads."""

    # Supplied by the worker tier (WorkerL3) before _init_writes.
    store: L3Store | None
    pool: HostPool
    layout: UnitLayout
    drafter_id: str
    rank: int
    fingerprint: str
    layer_specs: tuple[LayerSpec, ...]
    events: queue.SimpleQueue[tuple[str, str]]

    if TYPE_CHECKING:
        # WorkerL3's: times each write into its thread_times.
        def _clocked(self, op: str) -> AbstractContextManager[None]: ...

    def _init_writes(self, threads: int) -> None:
        """Writes run one unit per task, as many at once as the staging pool allows."""
        self.write_threads = write_concurrency(threads, self.store, self.layout.unit_bytes)
        self._write_pool = ThreadPoolExecutor(
            self.write_threads, thread_name_prefix="draft-offload-l3-write"
        )
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
        self._drop_orders(orders)

    def _drop_orders(self, orders: list[L3WriteOrder]) -> int:
        """Give up the writes of these orders; how many had not been cancelled already."""
        dropped = 0
        with self._write_cv:
            for order in orders:
                self._awaiting_store.discard(order.write_id)
                if order.write_id in self._cancelled:
                    self._cancelled.discard(order.write_id)
                    continue
                self._give_up(order.write_id)
                dropped += 1
        return dropped

    def abandon_writes(self, orders: list[L3WriteOrder]) -> None:
        """Shutdown: these orders were never confirmed by the scheduler, so they are not
        written; counted (and logged) as lost."""
        lost = self._drop_orders(orders)
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
