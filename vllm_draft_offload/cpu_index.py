"""Scheduler-side index of the CPU tier: which units sit in which host slot.

Pure Python. The bytes live in each worker's pinned pool; the scheduler owns
slot allocation so every worker (every TP rank) writes and reads the same slot
for the same unit. A unit is visible to lookups only once every worker has
reported its store complete, and a unit being loaded is pinned: eviction takes
the least recently used unit that is neither storing nor pinned.
"""

from __future__ import annotations

from collections import OrderedDict
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
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

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
        self._entries.move_to_end(unit_id)

    def reserve(self, unit_id: UnitId) -> UnitEntry | None:
        """Take a slot for a unit about to be stored; None when all are busy."""
        if unit_id in self._entries:
            raise KeyError(f"unit already present: {unit_id[0].hex()}")
        if not self._free_slots and not self._evict_one():
            return None
        entry = UnitEntry(unit_id, self._free_slots.pop())
        self._entries[unit_id] = entry
        self._variants.setdefault(unit_id[0], []).append(unit_id)
        return entry

    def commit(self, unit_id: UnitId) -> None:
        entry = self._entries.get(unit_id)
        if entry is not None:
            entry.ready = True

    def pin(self, unit_id: UnitId) -> None:
        self._entries[unit_id].pins += 1
        self.touch(unit_id)

    def unpin(self, unit_id: UnitId) -> None:
        entry = self._entries.get(unit_id)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def rekey(self, old: UnitId, new: UnitId) -> None:
        """Give a reserved unit its final identity (an L3 fetch learns the successors)."""
        if new in self._entries:
            raise KeyError(f"unit already present: {new[0].hex()}")
        entry = self._entries.pop(old)
        variants = self._variants[old[0]]
        variants.remove(old)
        if not variants:
            del self._variants[old[0]]
        entry.unit_id = new
        self._entries[new] = entry
        self._variants.setdefault(new[0], []).append(new)

    def remove(self, unit_id: UnitId) -> None:
        """Drop a unit (failed store, corrupt data); its slot becomes free."""
        entry = self._entries.pop(unit_id, None)
        if entry is None:
            return
        variants = self._variants[unit_id[0]]
        variants.remove(unit_id)
        if not variants:
            del self._variants[unit_id[0]]
        self._free_slots.append(entry.slot)

    def clear_unpinned(self) -> int:
        """Forget every unit that no transfer uses (cache reset)."""
        victims = [u for u, e in self._entries.items() if e.ready and e.pins == 0]
        for unit_id in victims:
            self.remove(unit_id)
        return len(victims)

    def _evict_one(self) -> bool:
        for unit_id, entry in self._entries.items():
            if entry.ready and entry.pins == 0:
                self.remove(unit_id)
                self.num_evictions += 1
                return True
        return False
