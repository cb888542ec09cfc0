"""A request's reusable prefix in the CPU tier, and the lookup stats of an admitted hit.

The rules of what a stored unit may be reused for live in hit_logic.py; this module
applies them to the CPU-tier index (scheduler_side.py asks it on every lookup),
counting units still landing from storage for an overlapped restore
(restore_overlap.py) as stored.
"""

from __future__ import annotations

from vllm_draft_offload.chunk_keys import ChunkKeyChain
from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.hit_logic import (
    PrefixMatch,
    StoredUnitView,
    common_prefix_length,
    match_prefix,
)
from vllm_draft_offload.metrics import DraftOffloadStats

# Chunk key -> (placeholder, fetch job) of a unit still landing from storage.
Landing = dict[bytes, tuple[UnitId, int]]


class CpuTierLookup:
    def __init__(
        self,
        index: CpuTierIndex,
        layout: UnitLayout,
        num_successors: int,
        min_compute_tokens: int,
        stats: DraftOffloadStats,
    ) -> None:
        self.index = index
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.num_successors = num_successors
        self.min_compute_tokens = min_compute_tokens
        self.stats = stats

    def _lookup(
        self,
        chunk_key: bytes,
        successors: tuple[int, ...],
        landing: Landing | None = None,
    ) -> tuple[StoredUnitView | None, StoredUnitView | None]:
        exact = self.index.get((chunk_key, successors))
        if exact is not None and exact.ready:
            return StoredUnitView(exact.unit_id, successors, exact.has_state), None
        if landing and chunk_key in landing:
            # Still landing from storage: taken as if stored with the request's own
            # successors; each worker checks the header's when it lands (overlap_loads).
            return StoredUnitView(landing[chunk_key][0], successors), None
        variants = self.index.ready_variants(chunk_key)
        if not variants:
            return None, None
        best = max(variants, key=lambda e: common_prefix_length(e.successors, successors))
        return None, StoredUnitView(best.unit_id, best.successors, best.has_state)

    def match(
        self,
        keys: ChunkKeyChain,
        tokens: list[int],
        num_computed_tokens: int,
        landing: Landing | None = None,
    ) -> PrefixMatch:
        """The request's longest reusable prefix from `num_computed_tokens` on."""
        return match_prefix(
            keys.extend(tokens),
            tokens,
            num_computed_tokens,
            self.chunk_size,
            self.num_successors,
            lambda key, successors: self._lookup(key, successors, landing),
            self.min_compute_tokens,
            can_end=self.layout.restorable,
            needs_state=bool(self.layout.state_groups),
        )

    def record_admission(self, match: PrefixMatch, num_tokens: int) -> None:
        """Lookup stats, once per admitted request (vLLM may ask several times)."""
        lookable = max(0, num_tokens // self.chunk_size - match.start_token // self.chunk_size)
        self.stats.record_lookup("cpu", len(match.chunks), max(0, lookable - len(match.chunks)))
        if match.chunks:
            # Tokens whose KV was stored but which are computed anyway: the
            # successor rule and the tokens a request must compute itself.
            last_chunk_end = (match.chunks[-1][0] + 1) * self.chunk_size
            self.stats.record_recomputed_tokens(max(0, last_chunk_end - match.end_token))
