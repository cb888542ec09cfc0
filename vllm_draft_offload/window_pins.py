"""Sliding-window blocks held for the unit stores that still have to read them.

vLLM frees a request's sliding-window blocks as its window moves on (to the null
block, in the request's block table). A chunk's unit is often stored later than
its KV is computed: its successor tokens are known a step later, a full tier
retries it, a finishing request stores what is left. By then the pages the unit
holds (windows.py) may be gone. So, from the step a chunk's pages are computed
until its unit's store has read them, each such block carries one extra
reference (vLLM's ``BlockPool.touch``, as vLLM's own SimpleCPU offloading does
for stores in flight): the pool neither hands it out nor overwrites it, the
store reads it by its id, and the reference is dropped (``free_blocks``) when
the store job ends or the chunk no longer needs storing. That also keeps a freed
block from being reused while a store on the side stream still reads it.

While waiting, at most ``MAX_CHUNKS`` chunks per request are held from the next
one to store on, so a stalled store (a full tier) never holds more than that many
chunks' windows out of vLLM's pool; a chunk past that whose pages are freed is
simply not stored, and nothing after it either (a lookup could not reach it). A
planned store job holds every window block it reads, for as long as it runs.

A Mamba / linear-attention group's state at a chunk's end is held the same way,
from the step vLLM names its block (``boundary_state_offloads``, see
docs/hybrid.md) until the unit's store has read it: vLLM frees that block a step
or two later (``MambaManager.remove_skipped_blocks``), often before the chunk's
successor tokens are known. At most ``MAX_CHUNKS`` chunks from the next one to
store keep a held state; a chunk past that is stored without one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.windows import NULL_BLOCK

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import KVConnectorBlockState

# Chunks per request whose window pages are held ahead of its next store.
MAX_CHUNKS = 4

# (layout group index, index in the request's block table) -> held block
ChunkPins = dict[tuple[int, int], "KVCacheBlock"]


class WindowPins:
    """Per request and chunk, the sliding-window blocks its unit store still needs."""

    def __init__(self, layout: UnitLayout) -> None:
        self.layout = layout
        self.pool: BlockPool | None = None
        self._pins: dict[str, dict[int, ChunkPins]] = {}
        self._given_up: set[str] = set()
        # Whether some group has a sliding window or state (vLLM frees its blocks
        # early); the layout never changes, and this is read per request every step.
        self.active = any(group.reach is not None or group.state for group in layout.groups)

    def take_state_offers(
        self, block_state: KVConnectorBlockState | None, next_chunk: Callable[[str], int | None]
    ) -> None:
        """Hold the blocks vLLM names this step as holding a Mamba group's state at one
        of our chunk ends (``boundary_state_offloads``: exact block ids, complete once
        this step's forward ran; docs/hybrid.md). `next_chunk`: a request's next chunk
        to store (None: not one we store)."""
        layout = self.layout
        state_groups = {layout.groups[g].group_id: g for g in layout.state_groups}
        if not state_groups or block_state is None or self.pool is None:
            return
        for req_id, offers in block_state.boundary_state_offloads.items():
            first = next_chunk(req_id)
            if first is None:
                continue
            for group_id, block_id, boundary in offers:
                g = state_groups.get(group_id)
                if g is None or boundary <= 0 or boundary % layout.chunk_size:
                    continue  # not one of our chunk ends (a sub-block tail, say)
                chunk = boundary // layout.chunk_size - 1
                if chunk >= first:
                    self.offer(req_id, chunk, g, self.pool.blocks[block_id])

    def offer(self, req_id: str, chunk: int, g: int, block: KVCacheBlock) -> None:
        """vLLM named `block` as holding state group `g`'s state at `chunk`'s end for
        `req_id` (this step's forward completes it): hold it for the chunk's store."""
        if self.pool is None or req_id in self._given_up:
            return
        group = self.layout.groups[g]
        key = (g, chunk * group.blocks_per_chunk + group.first_page)
        pins = self._pins.setdefault(req_id, {}).setdefault(chunk, {})
        if key in pins:
            return
        self.pool.touch([block])
        pins[key] = block

    def state_blocks(self, req_id: str) -> dict[int, dict[int, int]]:
        """Per chunk, the held state blocks by layout group index."""
        found: dict[int, dict[int, int]] = {}
        for chunk, pins in self._pins.get(req_id, {}).items():
            for (g, _), block in pins.items():
                if self.layout.groups[g].state:
                    found.setdefault(chunk, {})[g] = block.block_id
        return found

    def bind(self, pool: BlockPool) -> None:
        self.pool = pool

    def held(self) -> int:
        return sum(len(pins) for chunks in self._pins.values() for pins in chunks.values())

    def track(
        self, req_id: str, next_chunk: int, computed_after: int, block_ids: tuple[list[int], ...]
    ) -> None:
        """Hold the unit pages of the request's chunks not stored yet that hold KV by
        the end of this step (vLLM allocated their blocks this step at the latest, and
        frees them at a later step's scheduling at the earliest)."""
        if self.pool is None or not self.active or req_id in self._given_up:
            return
        chunks = self._pins.setdefault(req_id, {})
        end = min(next_chunk + MAX_CHUNKS, -(-computed_after // self.layout.chunk_size))
        for chunk in range(next_chunk, end):
            self._hold(chunks.setdefault(chunk, {}), chunk, block_ids)

    def _hold(self, pins: ChunkPins, chunk: int, block_ids: tuple[list[int], ...]) -> None:
        """Add a reference to every unit page of `chunk` in a window group that is
        allocated (not the null block) and not held yet."""
        assert self.pool is not None
        for g, group in enumerate(self.layout.groups):
            if group.reach is None:
                continue  # full attention: vLLM holds its blocks until the request ends
            table = block_ids[group.group_id]
            for page in range(group.first_page, group.blocks_per_chunk):
                index = chunk * group.blocks_per_chunk + page
                if (g, index) in pins or index >= len(table) or table[index] == NULL_BLOCK:
                    continue
                block = self.pool.blocks[table[index]]
                self.pool.touch([block])
                pins[(g, index)] = block

    def block_table(self, req_id: str, block_ids: tuple[list[int], ...]) -> tuple[list[int], ...]:
        """The request's block table with held blocks in place of freed entries."""
        chunks = self._pins.get(req_id)
        if not chunks:
            return block_ids
        table = [list(ids) for ids in block_ids]
        for pins in chunks.values():
            for (g, index), block in pins.items():
                row = table[self.layout.groups[g].group_id]
                if index < len(row) and row[index] == NULL_BLOCK:
                    row[index] = block.block_id
        return tuple(table)

    def settle(
        self,
        req_id: str,
        stored: Iterable[int],
        next_chunk: int,
        block_ids: tuple[list[int], ...],
    ) -> list[KVCacheBlock]:
        """A store job was planned on `block_ids` (held blocks in place): hand it a
        reference to every window block it reads, for its whole flight (a store on the
        side stream must not read a block vLLM freed and reused meanwhile), released
        when it ends; release the holds of chunks below `next_chunk` it does not store
        (found in the tier)."""
        if self.pool is None or not self.active:
            return []
        chunks = self._pins.setdefault(req_id, {})
        taken: list[KVCacheBlock] = []
        for chunk in stored:
            pins = chunks.pop(chunk, {})
            self._hold(pins, chunk, block_ids)
            taken += pins.values()
        passed = [chunk for chunk in chunks if chunk < next_chunk]
        self.release(block for chunk in passed for block in chunks.pop(chunk).values())
        for chunk, pins in chunks.items():
            if chunk >= next_chunk + MAX_CHUNKS:  # a stalled request holds no more states
                far = [key for key in pins if self.layout.groups[key[0]].state]
                self.release(pins.pop(key) for key in far)
        return taken

    def give_up(self, req_id: str) -> None:
        """A chunk's pages were freed before they could be held: it and every later
        chunk of the request will never be stored, so hold nothing more for it."""
        self._given_up.add(req_id)
        self.forget(req_id, keep_given_up=True)

    def forget(self, req_id: str, keep_given_up: bool = False) -> None:
        """The request finished or lost its blocks (preempted, reset): release its holds."""
        chunks = self._pins.pop(req_id, {})
        self.release(block for pins in chunks.values() for block in pins.values())
        if not keep_given_up:
            self._given_up.discard(req_id)

    def release(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        if blocks and self.pool is not None:
            self.pool.free_blocks(blocks)
