"""Scheduler-side L3 write planner: which units every worker (TP rank) writes to storage.

The scheduler decides, so all ranks write the same units. Rules:

* Head first. A unit is only worth writing if its predecessor chunk is in storage
  (a lookup stops at the first missing chunk), so a unit whose predecessor was
  dropped, failed or cancelled is not written. A predecessor this engine never
  planned came from a hit (CPU or storage), so it is taken as present.
* Tails go first. Queued units whose bytes are not yet in a worker's staging
  buffer stay pinned in the CPU tier (no copies exist), up to
  `max_pending_write_bytes`. Past it, or when the CPU tier has no free or evictable
  slot, the deepest queued chunk is dropped (and everything queued after it in its
  prompt), never another prompt's head.
* A unit is in storage only once every rank has written its part. If some rank
  failed, the other ranks' parts are removed where the backend can delete, and the
  key is remembered as absent.
* Every unit planned ends as written, `l3_write_dropped` (given up under pressure)
  or `store_failed` (a rank could not write it).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata, L3WriteOrder
from vllm_draft_offload.metrics import DraftOffloadStats

if TYPE_CHECKING:
    from vllm_draft_offload.l3_store import L3Store

logger = logging.getLogger(__name__)

# Chunk keys remembered as written / absent (about 10 MB each at most): 65536
# units of an 8B-sized model are 2.4 TB of storage.
RECORD_KEYS = 1 << 16


@dataclass
class PlannedUnit:
    """A unit the store planner wants in L3: identity, slot and chain position."""

    unit_id: UnitId
    slot: int
    chunk: int
    pred_key: bytes | None  # chunk key of the chunk before it in its prompt (None: chunk 0)


@dataclass
class _Write:
    order: L3WriteOrder
    unit_id: UnitId
    pred_key: bytes | None
    released: int = 0
    ok: int = 0
    failed: int = 0
    cancelled: bool = False
    pinned: bool = True


class _BoundedKeys:
    """Insertion-ordered set of chunk keys that forgets its oldest past `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)


class L3WritePlanner:
    def __init__(
        self,
        index: CpuTierIndex,
        unit_bytes: int,
        max_pending_bytes: int,
        world_size: int,
        stats: DraftOffloadStats,
        new_id: Callable[[], int],
        remove_parts: Callable[[bytes], None] | None = None,
        record_keys: int = RECORD_KEYS,
    ) -> None:
        self.index = index
        self.max_pending_units = max(1, max_pending_bytes // unit_bytes)
        self.world_size = world_size
        self.stats = stats
        self.new_id = new_id
        # Deletes every rank's part of a unit some rank failed to write (fs:// only).
        self._remove_parts = remove_parts
        self._remover: ThreadPoolExecutor | None = None
        self._writes: dict[int, _Write] = {}
        # Writes counted against max_pending_units: not cancelled, not yet staged everywhere.
        self._pending: set[int] = set()
        # Chunk key -> the live (not cancelled) write of it.
        self._by_key: dict[bytes, int] = {}
        # Predecessor chunk key -> live writes that depend on it.
        self._children: dict[bytes, set[int]] = {}
        self.written = _BoundedKeys(record_keys)
        self.absent = _BoundedKeys(record_keys)
        self._cancels: list[int] = []
        self.last_progress = time.monotonic()

    # ----------------------------------------------------------------- planning

    def plan(self, units: list[PlannedUnit]) -> list[L3WriteOrder]:
        """Orders for the units of one store job (in chunk order); pins each one."""
        accepted: list[_Write] = []
        for unit in units:
            key = unit.unit_id[0]
            if key in self.written or key in self._by_key:
                continue  # in storage or on its way: one variant per chunk key
            if unit.pred_key is not None and not self._predecessor_ok(unit.pred_key):
                self._drop_new(key)
                continue
            if len(self._pending) >= self.max_pending_units:
                victim = self._deepest_pending()
                if victim is None or victim.order.chunk <= unit.chunk:
                    # This unit is the deepest: it goes, queued heads stay.
                    self._drop_new(key)
                    continue
                self._cancel(victim)
            write = _Write(
                L3WriteOrder(self.new_id(), unit.slot, key, unit.unit_id[1], unit.chunk),
                unit.unit_id,
                unit.pred_key,
            )
            self.index.pin(unit.unit_id)
            self._writes[write.order.write_id] = write
            self._pending.add(write.order.write_id)
            self._by_key[key] = write.order.write_id
            if unit.pred_key is not None:
                self._children.setdefault(unit.pred_key, set()).add(write.order.write_id)
            self.absent.discard(key)
            accepted.append(write)
        if accepted and len(self._writes) == len(accepted):
            self.last_progress = time.monotonic()  # the stall clock starts now
        for write in accepted:
            if write.cancelled:
                # Given up before any worker saw it: no worker will ever report it.
                self._cancels.remove(write.order.write_id)
                write.failed = self.world_size
                self._finish(write)
        return [write.order for write in accepted if not write.cancelled]

    def relieve(self) -> bool:
        """The CPU tier has no free or evictable slot: drop the deepest queued write,
        whose slot becomes evictable once the workers confirm. False: nothing to drop."""
        victim = self._deepest_pending()
        if victim is None:
            return False
        self._cancel(victim)
        return True

    def take_cancels(self) -> list[int]:
        cancels, self._cancels = self._cancels, []
        return cancels

    def _predecessor_ok(self, pred_key: bytes) -> bool:
        if pred_key in self.written or pred_key in self._by_key:
            return True
        # Never planned here: it came from a hit, so it is in storage (or in the CPU
        # tier from a write this engine no longer remembers); absent: we know it is not.
        return pred_key not in self.absent

    def _deepest_pending(self) -> _Write | None:
        if not self._pending:
            return None
        return self._writes[max(self._pending, key=lambda i: (self._writes[i].order.chunk, i))]

    def _drop_new(self, key: bytes) -> None:
        self.absent.add(key)
        self.stats.record_fallback("l3_write_dropped")

    def _cancel(self, write: _Write) -> None:
        """Give a planned write up; its dependants in storage order go with it."""
        stack = [write]
        while stack:
            current = stack.pop()
            if current.cancelled:
                continue
            current.cancelled = True
            write_id = current.order.write_id
            key = current.order.chunk_key
            self._pending.discard(write_id)
            if self._by_key.get(key) == write_id:
                del self._by_key[key]
            self.absent.add(key)
            self._cancels.append(write_id)
            for child in self._children.pop(key, ()):
                if child in self._writes:
                    stack.append(self._writes[child])

    # ------------------------------------------------------------- completion

    def on_output(self, meta: DraftOffloadWorkerMetadata) -> None:
        for write_id, count in meta.l3_writes_released.items():
            write = self._writes.get(write_id)
            if write is None:
                continue
            write.released += count
            if write.released >= self.world_size:
                self._pending.discard(write_id)
                self._unpin(write)
        for counts, ok in ((meta.l3_writes_ok, True), (meta.l3_writes_failed, False)):
            for write_id, count in counts.items():
                write = self._writes.get(write_id)
                if write is None:
                    continue
                if ok:
                    write.ok += count
                else:
                    write.failed += count
                if write.ok + write.failed >= self.world_size:
                    self._finish(write)

    def _unpin(self, write: _Write) -> None:
        if not write.pinned:
            return
        write.pinned = False
        # Also when the unit was dropped meanwhile (a failed load of it, the recompute
        # audit, a reset): its slot is freed only with its last pin. The slot check
        # keeps us from unpinning a later unit of the same identity.
        self.index.unpin(write.unit_id, slot=write.order.slot)

    def _finish(self, write: _Write) -> None:
        self.last_progress = time.monotonic()
        write_id = write.order.write_id
        key = write.order.chunk_key
        del self._writes[write_id]
        self._pending.discard(write_id)
        self._unpin(write)
        if write.pred_key is not None:
            siblings = self._children.get(write.pred_key)
            if siblings is not None:
                siblings.discard(write_id)
                if not siblings:
                    del self._children[write.pred_key]
        if self._by_key.get(key) == write_id:
            del self._by_key[key]
        if write.ok >= self.world_size:
            self.written.add(key)
            self.absent.discard(key)
            return
        self.written.discard(key)
        self.absent.add(key)
        self.stats.record_fallback("l3_write_dropped" if write.cancelled else "store_failed")
        if write.ok:
            # Some ranks hold their part: a lookup must not find a unit others lack.
            self._remove(key)
        # Units queued behind this one lost their predecessor.
        for child in list(self._children.pop(key, ())):
            if child in self._writes:
                self._cancel(self._writes[child])

    def _remove(self, key: bytes) -> None:
        if self._remove_parts is None:
            return
        if self._remover is None:
            self._remover = ThreadPoolExecutor(1, thread_name_prefix="draft-offload-l3-remove")
        self._remover.submit(self._remove_quietly, key)

    def _remove_quietly(self, key: bytes) -> None:
        assert self._remove_parts is not None
        try:
            self._remove_parts(key)
        except Exception as exc:  # the key stays in `absent` either way
            logger.warning("DraftOffloadConnector: removing partial L3 unit failed: %s", exc)

    # ------------------------------------------------------------------ state

    def mark_in_storage(self, chunk_keys: Sequence[bytes]) -> None:
        """A lookup found these units in storage (another engine, or an earlier start,
        wrote them): a store of the same chunk does not write them again."""
        for key in chunk_keys:
            if key not in self._by_key:
                self.written.add(key)
                self.absent.discard(key)

    def mark_not_in_storage(self, chunk_key: bytes) -> None:
        """A unit found in storage could not be fetched (missing, corrupt, ranks
        disagree): the next store of it writes it again."""
        self.written.discard(chunk_key)

    def known_absent(self, chunk_key: bytes) -> bool:
        """This engine knows the unit is not (wholly) in storage."""
        return chunk_key in self.absent

    def has_work(self) -> bool:
        """Writes planned and not yet reported finished by every rank."""
        return bool(self._writes)

    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        if self._writes:
            logger.info(
                "DraftOffloadConnector: %d L3 write(s) unconfirmed at scheduler shutdown "
                "(workers flush them for up to l3.flush_timeout_s)",
                len(self._writes),
            )
        if self._remover is not None:
            self._remover.shutdown(wait=True)


def part_remover(store: L3Store | None, world_size: int) -> Callable[[bytes], None] | None:
    """Deletes every rank's part of a unit, on backends that can delete (fs://)."""
    if store is None or not store.supports_remove:
        return None

    def remove(chunk_key: bytes) -> None:
        from vllm_draft_offload.l3_objects import object_key  # LMCache only with its tier

        for rank in range(world_size):
            store.remove(object_key(chunk_key, rank))

    return remove
