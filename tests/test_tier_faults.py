"""Faults under pressure, through the real vLLM Scheduler (tests/kv_sim.py):
a full CPU tier, slots pinned by transfers, failed loads and stores, resets."""

from __future__ import annotations

from pathlib import Path

from kv_sim import SimEngine, SimSetup, prompt

from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.scheduler_side import DraftOffloadScheduler

CHUNK = 32


def engine(model_dirs: tuple[Path, Path], **kwargs: object) -> SimEngine:
    return SimEngine(*model_dirs, SimSetup(**kwargs))


def sched_of(eng: SimEngine) -> DraftOffloadScheduler:
    return eng.scheduler.connector.scheduler


def test_full_tier_retries_the_chunk_it_could_not_store(model_dirs: tuple[Path, Path]) -> None:
    """1.1: a chunk that finds no free slot is stored later, never skipped, so the
    request's later chunks are reachable by a prefix match."""
    eng = engine(model_dirs, cpu_units=4)
    sched = sched_of(eng)
    eng.add_request("filler", prompt(1, 4 * CHUNK + 3), max_tokens=1)
    eng.run_until_done()
    assert len(sched.index) == 4
    # Every slot busy (e.g. loads in flight): no store can reserve a slot.
    busy = [entry.unit_id for entry in sched.index]
    for unit_id in busy:
        sched.index.pin(unit_id)
    tokens = prompt(2, 3 * CHUNK + 5)
    eng.add_request("b", tokens, max_tokens=8)
    eng.step()  # prefill: chunks 0..2 are complete, none can be reserved
    assert eng.scheduler.requests["b"].num_computed_tokens >= 3 * CHUNK
    for unit_id in busy:
        sched.index.unpin(unit_id)
    eng.run_until_done()

    eng.evict_gpu_kv()
    eng.add_request("c", tokens, max_tokens=1)
    eng.run_prefill("c")
    assert eng.external_hits["c"] == 3 * CHUNK
    assert eng.mismatched_positions("c") == []


def test_removed_pinned_unit_keeps_its_slot_until_unpinned() -> None:
    """1.3: dropping a unit a load still reads hides it at once but keeps its slot."""
    index = CpuTierIndex(1)
    unit, other = (b"u", ()), (b"v", ())
    index.reserve(unit)
    index.commit(unit)
    index.pin(unit)  # a load reads its slot
    index.remove(unit)  # e.g. the recompute audit condemned it
    assert index.get(unit) is None and index.ready_variants(b"u") == []
    assert index.reserve(other) is None  # the slot is still being read
    assert index.reserve(unit) is None  # nor may the same id come back meanwhile
    index.unpin(unit)
    entry = index.reserve(other)
    assert entry is not None and entry.slot == 0
