"""Which of a request's chunks to store this step, and into which host slots.

A prefix match walks chunks from the start and stops at the first chunk it
cannot find, so a stored chunk is reachable only if every chunk before it is in
the tier too. The planner therefore walks a request's chunks in order and stops
at the first one it cannot store now (no free slot, or a variant it should not
duplicate yet); that chunk is retried at a later step, and no later chunk is
stored before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_draft_offload.chunk_keys import ChunkKeyChain
from vllm_draft_offload.config import DraftOffloadConfig
from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.hit_logic import storable_chunk_limit
from vllm_draft_offload.l3_writes import PlannedUnit
from vllm_draft_offload.metadata import TransferJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.request import Request


@dataclass
class StorePlan:
    """New units of one store job, and the copies that fill their slots."""

    # Chunks below this are stored, in flight or present; the next plan starts here.
    next_chunk: int
    # The chunk this plan started at: a failed store job is retried from here.
    first_chunk: int = 0
    units: list[UnitId] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # the chunk of each unit
    host_pages: list[list[int]] = field(default_factory=list)
    gpu_blocks: list[list[int]] = field(default_factory=list)
    # Each new unit with its slot and chain position, for the L3 write planner.
    l3_units: list[PlannedUnit] = field(default_factory=list)
    # A sliding-window page of `next_chunk` is freed: it and every later chunk of the
    # request can never be stored (window_pins).
    window_lost: bool = False


def plan_stores(
    index: CpuTierIndex,
    layout: UnitLayout,
    keys: Sequence[bytes],
    tokens: Sequence[int],
    first_chunk: int,
    limit: int,
    num_successors: int,
    block_ids: tuple[list[int], ...],
    on_full: Callable[[], None] | None = None,
    state_blocks: dict[int, dict[int, int]] | None = None,
) -> StorePlan:
    """Reserve slots for chunks [first_chunk, limit) in order, stopping at the first
    chunk that cannot be stored now (`on_full` is told when that is for want of a slot).

    `state_blocks`: per chunk, the blocks vLLM named as holding each Mamba group's
    state at the chunk's end (by layout group index); a unit without them holds no
    state, and one that has them replaces a stored copy that holds none."""
    chunk_size = layout.chunk_size
    plan = StorePlan(
        first_chunk,
        first_chunk,
        host_pages=[[] for _ in layout.groups],
        gpu_blocks=[[] for _ in layout.groups],
    )
    for chunk in range(first_chunk, limit):
        chunk_end = (chunk + 1) * chunk_size
        successors = tuple(tokens[chunk_end : chunk_end + num_successors])
        unit_id: UnitId = (keys[chunk], successors)
        chunk_states = (state_blocks or {}).get(chunk)
        has_state = layout.unit_has_state(chunk_states)
        existing = index.get(unit_id)
        # A stored copy without the state that this one has is replaced (its end becomes
        # a place a hit can end) when nothing uses it and this one can be stored now.
        replace = (
            existing is not None
            and has_state
            and not existing.has_state
            and existing.ready
            and not existing.pins
        )
        if existing is not None and not (
            replace
            and not _other_variants(index, unit_id)
            and _copyable(layout, chunk, block_ids, chunk_states)
        ):
            index.touch(unit_id)
            plan.next_chunk = chunk + 1
            continue
        if existing is None:
            if chunk_end + chunk_size > len(tokens) and _other_variants(index, unit_id):
                # Another successor variant exists and this request has no further
                # chunk to reuse behind it (yet): a copy would buy one token. Wait:
                # once the request grows a further chunk, this one is worth storing.
                break
            if not _copyable(layout, chunk, block_ids, chunk_states):
                plan.window_lost = True
                break
        if existing is not None:
            index.remove(unit_id)
        entry = index.reserve(unit_id, has_state)
        if entry is None:
            if on_full is not None:
                on_full()
            break  # every slot is storing or being loaded: retry this chunk later
        plan.next_chunk = chunk + 1
        plan.units.append(unit_id)
        plan.chunks.append(chunk)
        plan.l3_units.append(
            PlannedUnit(unit_id, entry.slot, chunk, keys[chunk - 1] if chunk else None)
        )
        layout.add_unit_pages(
            plan.host_pages,
            plan.gpu_blocks,
            entry.slot,
            chunk,
            block_ids,
            state_blocks=chunk_states,
        )
    return plan


def _other_variants(index: CpuTierIndex, unit_id: UnitId) -> bool:
    """Whether the tier holds a ready unit of the same chunk with other successors."""
    return any(e.unit_id != unit_id for e in index.ready_variants(unit_id[0]))


def _copyable(
    layout: UnitLayout,
    chunk: int,
    block_ids: tuple[list[int], ...],
    chunk_states: dict[int, int] | None,
) -> bool:
    """Whether every page the chunk's unit holds can be copied: none of their blocks
    has been freed by vLLM (and nobody holds it)."""
    probe: list[list[int]] = [[] for _ in layout.groups]
    return layout.add_unit_pages(
        probe, [[] for _ in layout.groups], 0, chunk, block_ids, state_blocks=chunk_states
    )


def stores_nothing(request: Request, config: DraftOffloadConfig, allowed: bool) -> bool:
    """Whether no chunk of the request may be stored now: it opted out (``allowed``
    false) or it is still shorter than ``min_store_tokens``."""
    return not allowed or request.num_tokens < config.min_store_tokens


def no_chunk_completes(
    request: Request,
    next_chunk: int,
    computed_after_step: int,
    config: DraftOffloadConfig,
    chunk_size: int,
    allowed: bool = True,
) -> bool:
    """Whether ``store_range`` is sure to find nothing to store, in a few comparisons:
    the request stores nothing at all (opted out, or shorter than ``min_store_tokens``),
    or the next chunk to store is not complete after this step and no failed load
    lowered the computed tokens below its start (which would make earlier chunks
    storable again). Most decode steps of most requests; ``store_range`` costs about ten
    times as much. The caller need not lower its next chunk as ``store_range`` would
    after a failed load: ``store_range`` lowers it again whenever it runs."""
    if stores_nothing(request, config, allowed):
        return True
    start = next_chunk * chunk_size
    return computed_after_step < start + chunk_size and request.num_computed_tokens >= start


def store_range(
    request: Request,
    next_chunk: int,
    computed_after_step: int,
    num_successors: int,
    config: DraftOffloadConfig,
    chunk_size: int,
    allowed: bool = True,
) -> tuple[int, int]:
    """(first, limit): the request's chunks [first, limit) that may be stored this step,
    from `next_chunk` on; none (limit <= first) on most decode steps, which complete
    no chunk, and none when the request opted out (`allowed` false). Cheap: no block
    table, no keys."""
    limit = storable_chunk_limit(
        request.num_tokens,
        computed_after_step,
        request.num_prompt_tokens,
        chunk_size,
        num_successors,
        config.store_decode,
    )
    # vLLM lowers num_computed_tokens when a load fails (recompute policy): chunks
    # past it are recomputed, and only what is recomputed may be stored.
    first = min(next_chunk, request.num_computed_tokens // chunk_size)
    if stores_nothing(request, config, allowed):
        return first, first
    return first, limit


def plan_request_stores(
    index: CpuTierIndex,
    layout: UnitLayout,
    keys: ChunkKeyChain,
    request: Request,
    next_chunk: int,
    computed_after_step: int,
    num_successors: int,
    config: DraftOffloadConfig,
    block_ids: tuple[list[int], ...],
    on_full: Callable[[], None] | None = None,
    state_blocks: dict[int, dict[int, int]] | None = None,
    allowed: bool = True,
) -> StorePlan:
    """Store plan of one request for this step: chunks from `next_chunk` whose KV is
    complete by the end of the step and whose successor tokens are known (none when
    the request opted out of stores: `allowed` false)."""
    tokens = request.all_token_ids
    next_chunk, limit = store_range(
        request,
        next_chunk,
        computed_after_step,
        num_successors,
        config,
        layout.chunk_size,
        allowed,
    )
    if limit <= next_chunk:
        return StorePlan(
            next_chunk,
            next_chunk,
            host_pages=[[] for _ in layout.groups],
            gpu_blocks=[[] for _ in layout.groups],
        )
    return plan_stores(
        index,
        layout,
        keys.extend(tokens),
        tokens,
        next_chunk,
        limit,
        num_successors,
        block_ids,
        on_full,
        state_blocks,
    )


def blocks_being_loaded(loads: Sequence[TransferJob]) -> dict[tuple[int, int], int]:
    """(layout group, GPU block) -> the load job of this step that writes it."""
    loading = {}
    for job in loads:
        for group, blocks in enumerate(job.gpu_blocks):
            # Error blocks (units gone since the lookup) are flat: vLLM recomputes
            # them, so they count as being written in every group.
            for block in (*blocks, *job.error_blocks):
                loading[(group, block)] = job.job_id
    return loading


def loads_read_by(
    layout: UnitLayout, block_ids: tuple[list[int], ...], loading: dict[tuple[int, int], int]
) -> list[int]:
    """Load jobs of this step writing blocks of a request's block table: the KV it
    computes this step, and so what it stores, depends on them."""
    if not loading:
        return []
    return sorted(
        {
            job_id
            for g, group in enumerate(layout.groups)
            for block in block_ids[group.group_id]
            if (job_id := loading.get((g, block))) is not None
        }
    )
