"""Scheduler-side index of the CPU tier: which units sit in which host slot.

Pure Python. The bytes live in each worker's pinned pool; the scheduler owns
slot allocation so every worker (every TP rank) writes and reads the same slot
for the same unit. A unit is visible to lookups only once every worker has
reported its store complete, and a unit being loaded is pinned: eviction takes
the least recently used unit that is neither storing nor pinned.

A unit dropped while a transfer still uses its slot (pinned by a load or an L3
snapshot, or still being written by a store or fetch) is *doomed*: lookups no
longer see it at once, but its slot is freed only when the last pin drops and
its writer has finished, so no new unit is ever written into a slot that is
still being read or written. While a unit id is doomed it cannot be reserved
again, so a pin or unpin by unit id always reaches the right entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

# A unit is one chunk's KV of every layer, plus the tokens after the chunk that
# its last position's EAGLE draft KV was built from.
UnitId = tuple[bytes, tuple[int, ...]]


@dataclass
class UnitEntry:
    unit_id: UnitId
    slot: int
    ready: bool = False
    pins: int = 0
    # Holds the Mamba / linear-attention state at its chunk's end (always True
    # without such a group): a hit may end after this unit only if so.
    has_state: bool = True

    @property
    def chunk_key(self) -> bytes:
        return self.unit_id[0]

    @property
    def successors(self) -> tuple[int, ...]:
        return self.unit_id[1]


class CpuTierIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("the CPU tier needs at least one slot")
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # LRU order: first = least recently used.
        self._entries: OrderedDict[UnitId, UnitEntry] = OrderedDict()
        self._variants: dict[bytes, list[UnitId]] = {}
        # Dropped units whose slot a transfer still uses; `ready` False means its
        # store or fetch has not reported back yet.
        self._doomed: dict[UnitId, UnitEntry] = {}
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[UnitEntry]:
        """Visible units, least recently used first."""
        return iter(list(self._entries.values()))

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def num_doomed(self) -> int:
        return len(self._doomed)

    def get(self, unit_id: UnitId) -> UnitEntry | None:
        return self._entries.get(unit_id)

    def ready_variants(self, chunk_key: bytes) -> list[UnitEntry]:
        """Ready units of one chunk, whatever successors they were stored with."""
        return [
            entry
            for unit_id in self._variants.get(chunk_key, ())
            if (entry := self._entries[unit_id]).ready
        ]

    def touch(self, unit_id: UnitId) -> None:
        if unit_id in self._entries:
            self._entries.move_to_end(unit_id)

    def reserve(self, unit_id: UnitId, has_state: bool = True) -> UnitEntry | None:
        """Take a slot for a unit about to be stored; None when all are busy, or
        while a dropped copy of the same unit is still in use."""
        if unit_id in self._entries:
            raise KeyError(f"unit already present: {unit_id[0].hex()}")
        if unit_id in self._doomed:
            return None
        if not self._free_slots and not self._evict_one():
            return None
        entry = UnitEntry(unit_id, self._free_slots.pop(), has_state=has_state)
        self._entries[unit_id] = entry
        self._variants.setdefault(unit_id[0], []).append(unit_id)
        return entry

    def commit(self, unit_id: UnitId) -> None:
        """Its store (or fetch) completed on every worker: visible from now on."""
        doomed = self._doomed.get(unit_id)
        if doomed is not None:
            doomed.ready = True  # the writer is done; never shown
            self._release_doomed(doomed)
            return
        entry = self._entries.get(unit_id)
        if entry is not None:
            entry.ready = True

    def pin(self, unit_id: UnitId) -> None:
        self._entries[unit_id].pins += 1
        self.touch(unit_id)

    def unpin(self, unit_id: UnitId, slot: int | None = None) -> None:
        """Drop one pin, also of a unit dropped meanwhile (its slot is freed with the
        last pin). With `slot`, only the copy in that slot."""
        doomed = self._doomed.get(unit_id)
        if doomed is not None:
            if slot is None or doomed.slot == slot:
                doomed.pins = max(0, doomed.pins - 1)
                self._release_doomed(doomed)
            return
        entry = self._entries.get(unit_id)
        if entry is not None and entry.pins > 0 and (slot is None or entry.slot == slot):
            entry.pins -= 1

    def rekey(self, old: UnitId, new: UnitId) -> bool:
        """Give a reserved unit its final identity (an L3 fetch learns the successors).

        False when that cannot be done because `old` was dropped meanwhile (a cache
        reset) or a dropped copy of `new` is still in use: `old` is then removed,
        as its writer has finished, and `new` stays absent.
        """
        if new in self._entries:
            raise KeyError(f"unit already present: {new[0].hex()}")
        if old in self._doomed or new in self._doomed:
            self.remove(old)
            return False
        entry = self._entries.pop(old)
        self._forget_variant(old)
        entry.unit_id = new
        self._entries[new] = entry
        self._variants.setdefault(new[0], []).append(new)
        return True

    def remove(self, unit_id: UnitId) -> None:
        """Drop a unit whose writer (if any) has finished: a failed store or fetch,
        corrupt data. Lookups stop seeing it now; its slot is free once unpinned."""
        doomed = self._doomed.get(unit_id)
        if doomed is not None:
            doomed.ready = True  # the writer reported back
            self._release_doomed(doomed)
            return
        entry = self._drop(unit_id)
        if entry is None:
            return
        entry.ready = True  # the caller says no writer is left
        self._doom(entry)

    def discard(self, unit_id: UnitId) -> None:
        """Drop a unit whatever transfer is in flight: a store or fetch still writing
        it keeps the slot until it reports back (commit or remove)."""
        entry = self._drop(unit_id)
        if entry is not None:
            self._doom(entry)

    def clear_unpinned(self) -> int:
        """Cache reset: drop every unit. Slots in use by a transfer (loads, L3
        snapshots, stores and fetches in flight) are freed once it ends, and what
        those stores and fetches write never becomes visible. Returns the number
        of ready units dropped."""
        dropped = sum(entry.ready for entry in self._entries.values())
        for unit_id in list(self._entries):
            self.discard(unit_id)
        return dropped

    def _drop(self, unit_id: UnitId) -> UnitEntry | None:
        entry = self._entries.pop(unit_id, None)
        if entry is not None:
            self._forget_variant(unit_id)
        return entry

    def _forget_variant(self, unit_id: UnitId) -> None:
        variants = self._variants[unit_id[0]]
        variants.remove(unit_id)
        if not variants:
            del self._variants[unit_id[0]]

    def _doom(self, entry: UnitEntry) -> None:
        if entry.ready and entry.pins == 0:
            self._free_slots.append(entry.slot)
        else:
            self._doomed[entry.unit_id] = entry

    def _release_doomed(self, entry: UnitEntry) -> None:
        if entry.ready and entry.pins == 0:
            del self._doomed[entry.unit_id]
            self._free_slots.append(entry.slot)

    def _evict_one(self) -> bool:
        for unit_id, entry in self._entries.items():
            if entry.ready and entry.pins == 0:
                self.remove(unit_id)
                self.num_evictions += 1
                return True
        return False
