"""The copies that restore an admitted hit: which units, host pages and GPU blocks.

vLLM has allocated the request's blocks for the hit (`update_state_after_alloc`);
this turns the lookup's match into a load plan. A sliding-window group gets only
the blocks vLLM allocated for the window before the hit's end (windows.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.metadata import LoadUnit


@dataclass
class LoadPlan:
    units: list[UnitId] = field(default_factory=list)  # pinned in the index
    host_pages: list[list[int]] = field(default_factory=list)
    gpu_blocks: list[list[int]] = field(default_factory=list)
    # GPU blocks vLLM counts as loaded whose units are gone: reported for recompute.
    error_blocks: list[int] = field(default_factory=list)
    loaded_end: int = 0  # tokens restored end here
    # An overlapped restore's units, in chunk order (the pairs above, split by unit).
    overlap_units: list[LoadUnit] = field(default_factory=list)


def plan_load(
    index: CpuTierIndex,
    layout: UnitLayout,
    match: PrefixMatch,
    block_ids: tuple[list[int], ...],
    async_loads: bool,
    landing: Mapping[UnitId, int] | None = None,
    token_ids: Sequence[int] = (),
    num_successors: int = 0,
) -> LoadPlan:
    """Pin and pair the units of `match` (already trimmed to what vLLM admitted).

    `landing`: an overlapped restore, whose match takes units still being fetched
    (placeholder -> fetch job); each unit's pairs are also kept apart, with the fetch
    to wait for and the successor tokens (from `token_ids`) its header must start with.
    """
    groups = len(layout.groups)
    plan = LoadPlan(
        host_pages=[[] for _ in range(groups)],
        gpu_blocks=[[] for _ in range(groups)],
        loaded_end=match.end_token,
    )
    # vLLM may have trimmed the hit to an end whose window the units do not hold
    # (never with our own hit ends): then nothing can be restored.
    restorable = layout.restorable(match.start_token, match.end_token)
    if restorable and layout.state_groups:
        # A Mamba group's state comes from the unit ending where the hit ends (a hit
        # vLLM trimmed to elsewhere has none): else nothing can be restored.
        ending = [
            index.get(view.handle)  # type: ignore[arg-type]
            for chunk, view in match.chunks
            if (chunk + 1) * layout.chunk_size == match.end_token
        ]
        restorable = bool(ending) and ending[0] is not None and ending[0].has_state
    error_blocks: list[list[int]] = [[] for _ in range(groups)]
    for chunk, view in match.chunks:
        if chunk * layout.chunk_size >= match.end_token:
            break
        unit_id: UnitId = view.handle  # type: ignore[assignment]
        entry = index.get(unit_id) if restorable and plan.loaded_end == match.end_token else None
        fetch_job = landing.get(unit_id) if landing is not None else None
        if entry is None or not (entry.ready or fetch_job is not None):
            # Evicted between lookup and allocation: vLLM already counts these
            # tokens as loaded, so the worker reports their blocks (and every later
            # chunk's: a prefix cannot have holes) for recompute.
            plan.loaded_end = min(plan.loaded_end, chunk * layout.chunk_size)
            layout.add_restore_pages(
                [[] for _ in range(groups)],
                error_blocks,
                0,
                chunk,
                block_ids,
                match.start_token,
                match.end_token,
            )
            continue
        index.pin(unit_id)
        plan.units.append(unit_id)
        unit = LoadUnit([[] for _ in range(groups)], [[] for _ in range(groups)], fetch_job)
        layout.add_restore_pages(
            unit.host_pages,
            unit.gpu_blocks,
            entry.slot,
            chunk,
            block_ids,
            match.start_token,
            match.end_token,
        )
        for g in range(groups):
            plan.host_pages[g] += unit.host_pages[g]
            plan.gpu_blocks[g] += unit.gpu_blocks[g]
        if landing is not None:
            if fetch_job is not None:
                unit.successors = _successors_relied_on(
                    chunk, layout.chunk_size, match.end_token, token_ids, num_successors
                )
            plan.overlap_units.append(unit)
    plan.error_blocks = [block for blocks in error_blocks for block in blocks]
    if async_loads and plan.loaded_end < match.end_token:
        # vLLM recomputes a failed asynchronous load whole (and looks it up
        # again, finding the chunks still stored): copy nothing, and keep the
        # units, which are sound.
        for unit_id in plan.units:
            index.unpin(unit_id)
        plan.units, plan.loaded_end = [], match.start_token
        plan.host_pages = [[] for _ in range(groups)]
        plan.gpu_blocks = [[] for _ in range(groups)]
        plan.overlap_units = []
    return plan


def _successors_relied_on(
    chunk: int, chunk_size: int, end_token: int, token_ids: Sequence[int], num_successors: int
) -> tuple[int, ...]:
    """The tokens after the chunk that the restored part of its unit depends on: the
    draft KV of its last `num_successors` positions was built from them (hit_logic's
    trailing-block rule). A hit ending inside the chunk relies on fewer."""
    chunk_end = (chunk + 1) * chunk_size
    needed = max(0, min(end_token, chunk_end) - (chunk_end - num_successors))
    return tuple(token_ids[chunk_end : chunk_end + needed])
