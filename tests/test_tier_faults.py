"""Faults under pressure, through the real vLLM Scheduler (tests/kv_sim.py):
a full CPU tier, slots pinned by transfers, failed loads and stores, resets."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def _chunk_units(sched: DraftOffloadScheduler, tokens: list[int]) -> list[tuple[bytes, tuple]]:
    """Unit ids of a draft_model request's chunks (no successor tokens)."""
    from vllm_draft_offload.chunk_keys import ChunkKeyChain

    return [(key, ()) for key in ChunkKeyChain(sched.salt, CHUNK).extend(tokens)]


def test_no_store_on_top_of_a_failed_load(model_dirs: tuple[Path, Path]) -> None:
    """1.4: when a request's load fails, the chunks it computes in the same step
    (on top of a prefix that was not restored) are not stored; they are stored
    once vLLM has recomputed them."""
    eng = engine(model_dirs, extra_config={"audit": True})
    sched = sched_of(eng)
    tokens = prompt(3, 4 * CHUNK + 5)
    eng.add_request("a", tokens[: 2 * CHUNK + 3], max_tokens=1)
    eng.run_until_done()
    units = _chunk_units(sched, tokens)
    first = sched.index.get(units[0])
    assert first is not None and first.ready and sched.index.get(units[2]) is None
    worker = eng.worker.worker
    worker.pool.unit_view(first.slot)[:64] ^= 0x55  # the load's audit refuses it
    eng.evict_gpu_kv()

    eng.add_request("b", tokens, max_tokens=4)
    eng.step()  # loads chunks 0-1 (fails), computes chunks 2-3 on top of them
    assert eng.load_metas, "the lookup found chunks 0-1"
    for unit_id in units[2:4]:
        entry = sched.index.get(unit_id)
        assert entry is None or not entry.ready, "KV computed on a failed load was stored"
    assert eng.take_published()["fallbacks"]["store_after_load_failure"] == 1
    eng.run_until_done()

    eng.evict_gpu_kv()
    eng.add_request("c", tokens, max_tokens=1)
    eng.run_prefill("c")
    assert eng.external_hits["c"] == 4 * CHUNK
    assert eng.mismatched_positions("c") == []


@pytest.mark.parametrize("l3", [False, True], ids=["cpu", "cpu+l3"])
def test_store_descriptor_error_fails_only_that_job(
    model_dirs: tuple[Path, Path], tmp_path: Path, l3: bool
) -> None:
    """1.7: a store whose copy plan cannot be built is dropped and counted; the
    engine keeps serving, the unit it reserved is never shown, and its slot (pinned
    for an L3 copy that will never be taken) is freed."""
    extra: dict[str, object] = {}
    if l3:
        extra = {"l3": {"enabled": True}, "lmcache.remote_url": f"fs://{tmp_path / 'l3'}"}
    eng = engine(model_dirs, extra_config=extra)
    sched = sched_of(eng)
    build = sched.build_connector_meta
    broken: list[int] = []

    def build_with_a_bad_store(scheduler_output):  # fault injection: a corrupt plan
        meta = build(scheduler_output)
        for job in meta.stores:
            if job.req_id == "a" and not broken:
                job.gpu_blocks[0][0] = 10**6  # no such GPU block
                broken.append(job.job_id)
        return meta

    sched.build_connector_meta = build_with_a_bad_store
    tokens = prompt(4, 2 * CHUNK + 3)
    eng.add_request("a", tokens, max_tokens=3)
    eng.run_until_done()
    assert broken
    assert eng.take_published()["fallbacks"]["store_error"] == 1
    assert len(eng.outputs["a"]) == 3
    units = _chunk_units(sched, tokens)
    assert sched.index.get(units[0]) is None  # dropped, not committed with junk
    assert sched.index.num_doomed == 0
    assert sched.index.num_used_slots == len(sched.index)
    if l3:
        eng.worker.worker.l3.flush(10)
        eng.step()  # report the other units' L3 snapshots
    assert all(entry.pins == 0 for entry in sched.index)


def test_reset_drops_the_cpu_tier_and_in_flight_stores(model_dirs: tuple[Path, Path]) -> None:
    """1.8: after reset_prefix_cache(reset_connector=True) nothing stored before it,
    nor anything a store in flight at that moment writes, is served from the CPU tier."""
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata

    eng = engine(model_dirs)
    sched = sched_of(eng)
    old = prompt(5, 2 * CHUNK + 3)
    eng.add_request("old", old, max_tokens=1)
    eng.run_until_done()
    assert len(sched.index) == 2

    # A store in flight at the reset: with two workers, the simulated one's report
    # is only half of what commits it.
    sched.jobs.world_size = 2
    tokens = prompt(6, 2 * CHUNK + 3)
    eng.add_request("a", tokens, max_tokens=4)
    store_ids = [job.job_id for job in eng.step().kv_connector_metadata.stores]
    assert store_ids and sched.index.num_used_slots == 4
    assert eng.scheduler.reset_prefix_cache(reset_connector=True) is False  # "a" runs
    assert len(sched.index) == 0
    assert sched.index.num_used_slots == 2  # the in-flight stores still write theirs
    other = DraftOffloadWorkerMetadata(completed_jobs=dict.fromkeys(store_ids, 1))
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=other))
    assert len(sched.index) == 0, "a store in flight at the reset became visible"
    assert sched.index.num_used_slots == 0
    request = eng.scheduler.requests["a"]
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)

    # Storing goes on after the reset: "a" stores its chunks again from its own KV.
    sched.jobs.world_size = 1
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.add_request("old2", old, max_tokens=1)
    eng.add_request("a2", tokens, max_tokens=1)
    eng.run_prefill("a2")
    assert eng.external_hits["old2"] == 0
    assert eng.external_hits["a2"] == 2 * CHUNK
    assert eng.mismatched_positions("a2") == []


def test_reset_during_a_recompute_audit_leaks_no_slot(model_dirs: tuple[Path, Path]) -> None:
    """Units an audited request pinned and a reset dropped are freed when the audit
    skips them: a dropped unit keeps its slot only while something pins it."""
    eng = engine(model_dirs, extra_config={"audit_recompute_fraction": 1.0})
    sched = sched_of(eng)
    tokens = prompt(7, 20 * CHUNK + 3)  # longer than one step's 512-token budget
    eng.add_request("a", tokens, max_tokens=1)
    eng.run_until_done()
    assert len(sched.index) == 20
    eng.evict_gpu_kv()
    eng.add_request("b", tokens, max_tokens=1)
    eng.step()  # diverted: recomputes what fits in a step, pins the chunks after it
    pinned = sum(entry.pins > 0 for entry in sched.index)
    assert pinned >= 4
    sched.reset_cache()
    assert sched.index.num_doomed == pinned
    eng.run_until_done()
    assert sched.index.num_doomed == 0
    assert sched.index.num_used_slots == len(sched.index)


def test_load_failed_on_one_rank_publishes_no_store_of_that_request(
    model_dirs: tuple[Path, Path],
) -> None:
    """1.4 with TP > 1 (or async scheduling): one rank's load failed, another ran the
    request's stores of that step. Under tensor parallelism every rank's new KV
    depends on every rank's prefix, so none of those stores may become visible."""
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata

    eng = engine(model_dirs)
    sched = sched_of(eng)
    tokens = prompt(8, 4 * CHUNK + 5)
    eng.add_request("a", tokens[: 2 * CHUNK + 3], max_tokens=1)
    eng.run_until_done()
    eng.evict_gpu_kv()
    sched.jobs.world_size = 2
    eng.add_request("b", tokens, max_tokens=4)
    meta = eng.step().kv_connector_metadata  # the simulated rank: load and stores ran
    (load,) = [job.job_id for job in meta.loads]
    stores = [job.job_id for job in meta.stores]
    assert stores and all(store > load for store in stores)
    other_rank = DraftOffloadWorkerMetadata(
        failed_jobs={load: 1}, completed_jobs=dict.fromkeys(stores, 1)
    )
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=other_rank))
    units = _chunk_units(sched, tokens)
    assert [sched.index.get(unit) for unit in units] == [None] * 4
    assert sched.index.num_used_slots == 0


def test_no_store_on_blocks_shared_with_a_failed_load(model_dirs: tuple[Path, Path]) -> None:
    """1.4 across requests: "x" reuses, through vLLM's prefix cache, the blocks "r" is
    loading in the same step. r's load fails, so x computed on a wrong prefix: x's
    stores of that step are dropped too, and stored again once recomputed."""
    eng = engine(model_dirs, extra_config={"audit": True})
    sched = sched_of(eng)
    shared = prompt(9, 2 * CHUNK)
    eng.add_request("a", [*shared, 5, 6, 7], max_tokens=1)
    eng.run_until_done()
    first = next(iter(sched.index))
    eng.worker.worker.pool.unit_view(first.slot)[:64] ^= 0x55  # r's load fails its audit
    eng.evict_gpu_kv()

    x_tokens = [*shared, *prompt(11, 2 * CHUNK + 5)]
    eng.add_request("r", [*shared, *prompt(10, 2 * CHUNK + 5)], max_tokens=2)
    eng.add_request("x", x_tokens, max_tokens=2)
    meta = eng.step().kv_connector_metadata
    assert [job.req_id for job in meta.loads] == ["r"]  # x shares r's blocks instead
    assert any(job.req_id == "x" for job in meta.stores)
    x_units = _chunk_units(sched, x_tokens)
    for unit_id in x_units[2:4]:
        entry = sched.index.get(unit_id)
        assert entry is None or not entry.ready, "KV computed on a failed load was stored"
    eng.run_until_done()

    eng.evict_gpu_kv()
    eng.add_request("x2", x_tokens, max_tokens=1)
    eng.run_prefill("x2")
    assert eng.external_hits["x2"] == 4 * CHUNK
    assert eng.mismatched_positions("x2") == []
