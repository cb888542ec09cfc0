"""L3 prefetch at the connector level: a waiting request's own CPU hit stays put,
TP ranks must agree, storage errors never reach the scheduler, lookups overlap.

Real Scheduler and connector halves (kv_sim), real LMCache fs:// and Redis backends.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from kv_sim import prompt
from l3_throttle import throttle
from test_l3_cost import SESSION13_UNIT_BYTES, session13_estimates
from test_l3_tier import CHUNK, L3_EXTRA, fill_l3, finish_l3_writes, l3_engine
from vllm.v1.outputs import KVConnectorOutput

from vllm_draft_offload.chunk_keys import ChunkKeyChain
from vllm_draft_offload.config import L3Config
from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.l3_decisions import L3Decision
from vllm_draft_offload.l3_lookup import SchedulerL3
from vllm_draft_offload.l3_objects import object_key
from vllm_draft_offload.l3_prefetch import L3Prefetch
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.unit_codec import (
    LayerSpec,
    UnitIdentity,
    encode_unit,
    layer_view,
    make_header,
    pack_unit,
    read_header,
)


def test_fetch_never_evicts_the_requests_own_cpu_hit(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Head in the CPU tier (at the LRU front), tail only in storage, tier full."""
    url = f"fs://{tmp_path / 'l3'}"
    # Every unit of the tier may wait for its L3 write (the default is half of it,
    # which would drop P2, P3 from storage under this 4-unit tier).
    l3 = {"enabled": True, "timeout_s": 2.0, "hit_policy": "always"}
    l3["max_pending_write_bytes"] = 1 << 30
    eng = l3_engine(model_dirs, url, cpu_units=4, extra_config={"l3": l3})
    full = prompt(31, 4 * CHUNK + 5)
    eng.add_request("full", full, max_tokens=1)
    eng.run_until_done()
    finish_l3_writes(eng)
    # A request that reuses the head moves P0, P1 behind P2, P3 in LRU order...
    eng.evict_gpu_kv()
    eng.add_request("head", full[: 2 * CHUNK + 5], max_tokens=1)
    eng.run_until_done()
    # ... so another prompt's stores evict P2, P3: the tier is P0, P1, Q0, Q1.
    eng.evict_gpu_kv()
    eng.add_request("other", prompt(32, 2 * CHUNK + 5), max_tokens=1)
    eng.run_until_done()
    finish_l3_writes(eng)
    sched = eng.scheduler.connector.scheduler
    evictions_before = sched.index.num_evictions

    eng.evict_gpu_kv()
    eng.add_request("again", full, max_tokens=2)
    eng.run_prefill("again")
    # P0, P1 from the CPU tier, P2, P3 fetched into the slots of Q0, Q1.
    assert eng.external_hits["again"] == 4 * CHUNK
    assert eng.mismatched_positions("again") == []
    assert sched.index.num_evictions - evictions_before == 2
    published = eng.take_published()
    assert published["chunks"].get("load/l3") == 2
    eng.run_until_done()
    assert sched.l3 is not None and sched.l3.pinned_units("again") == []
    assert all(sched.index.get(u).pins == 0 for u in list(sched.index._entries))


def _prefetch(url: str, world_size: int = 1, **l3: object) -> L3Prefetch:
    config = L3Config(
        enabled=True,
        timeout_s=5.0,
        lmcache={"remote_url": url, "extra_config": L3_EXTRA},
        **l3,  # type: ignore[arg-type]
    )
    ids = itertools.count(1)
    return L3Prefetch(
        SchedulerL3(config, world_size),
        CpuTierIndex(64),
        CHUNK,
        config,
        DraftOffloadStats(),
        lambda: next(ids),
        unit_bytes=4096,
    )


def test_cold_lookups_of_many_requests_overlap(tmp_path: Path) -> None:
    """32 cold requests, 50 ms per storage round trip: a few round trips, not 32."""
    prefetch = _prefetch(f"fs://{tmp_path / 'l3'}", hit_policy="always")
    throttle(prefetch.lookup.store, exists=0.05)
    no_match = PrefixMatch(0, 0, [])
    keys = {f"r{i}": [bytes([i, c]) * 16 for c in range(4)] for i in range(32)}
    waiting = set(keys)
    started = time.monotonic()
    while waiting:
        for req_id in list(waiting):
            if not prefetch.must_wait(req_id, no_match, keys[req_id], 4 * CHUNK + 1, 0):
                waiting.discard(req_id)
        time.sleep(0.005)
    elapsed = time.monotonic() - started
    # One lookup thread would take 32 x 50 ms = 1.6 s.
    assert elapsed < 0.8, elapsed
    assert prefetch.stats.data["misses"] == {"l3": 32 * 4}
    assert not prefetch.stats.data["fallbacks"]  # no lookup ran into its timeout
    prefetch.lookup.close()


def _put_unit(store: L3Store, chunk_key: bytes, rank: int, successors: tuple[int, ...]) -> None:
    payload = np.zeros(64, dtype=np.uint8)
    header = make_header(
        UnitIdentity(
            key=chunk_key.hex(),
            geometry_fingerprint="g",
            drafter_id="d",
            num_tokens=CHUNK,
            successor_tokens=successors,
        ),
        (LayerSpec("layer", False, 64),),
        payload,
    )
    store.put(object_key(chunk_key, rank), encode_unit(header, payload))


def _stored_prompt(prefetch: L3Prefetch, tag: int, chunks: int) -> list[bytes]:
    """The chunk keys of a prompt of `chunks` units, every one written to storage."""
    store = prefetch.lookup.store
    assert store is not None
    keys = [bytes([tag, c]) * 16 for c in range(chunks)]
    for key in keys:
        _put_unit(store, key, 0, ())
    return keys


def test_a_unit_is_present_only_when_every_rank_holds_it(tmp_path: Path) -> None:
    prefetch = _prefetch(f"fs://{tmp_path / 'l3'}", world_size=2)
    lookup = prefetch.lookup
    store = lookup.store
    assert store is not None
    half, whole = b"h" * 32, b"w" * 32
    _put_unit(store, half, 0, (7,))
    _put_unit(store, whole, 0, (7,))
    _put_unit(store, whole, 1, (7,))
    assert lookup.lookup([half, whole]).result(5) == [False, True]
    # A broken unit is never looked up as present again, and fs:// deletes it.
    lookup.mark_broken(whole)
    assert lookup.lookup([whole]).result(5) == [False]
    deadline = time.monotonic() + 5
    while store.contains(object_key(whole, 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.contains(object_key(whole, 0)) and not store.contains(object_key(whole, 1))
    # A cache reset forgets it: a unit written again afterwards is served.
    prefetch.reset()
    _put_unit(store, whole, 0, (7,))
    _put_unit(store, whole, 1, (7,))
    assert lookup.lookup([whole]).result(5) == [True]
    lookup.close()


def test_ranks_with_different_successors_mean_recompute_and_deletion(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """TP=2 where rank 1's object of chunk 1 holds other successors than rank 0's.

    kv_sim runs one worker (rank 0); rank 1's report of each fetch is the message a
    second worker sends, built from rank 1's real object in storage.
    """
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(33, 3 * CHUNK + 5)
    fill_l3(model_dirs, url, tokens, eagle=True)  # EAGLE: units carry one successor token
    # The scheduler's check, on a request that waits for its units to land: an
    # overlapped restore has each worker check its own header as its unit lands (rank
    # 1's report here is only a scheduler message), test_restore_overlap.py.
    l3 = {"enabled": True, "timeout_s": 2.0, "hit_policy": "always", "overlap_restore": False}
    eng = l3_engine(model_dirs, url, eagle=True, extra_config={"l3": l3})
    sched = eng.scheduler.connector.scheduler
    assert sched.l3 is not None
    store = sched.l3.lookup.store
    assert store is not None
    sched.jobs.world_size = sched.l3.lookup.world_size = 2
    keys = ChunkKeyChain(sched.salt, CHUNK).extend(tokens)
    rank1_successors = {}
    for chunk, key in enumerate(keys[:3]):
        blob = store.get(object_key(key, 0))
        assert blob is not None
        header = read_header(blob)[0]
        successors = tuple(header.successor_tokens)
        assert len(successors) == 1
        if chunk == 1:
            successors = tuple(t + 1 for t in successors)  # a write that disagrees
        store.put(object_key(key, 1), _with_successors(blob, successors))
        rank1_successors[key] = list(successors)

    eng.add_request("tp2", tokens, max_tokens=1)
    reported: set[int] = set()
    deadline = time.monotonic() + 20
    while eng.scheduler.requests["tp2"].num_computed_tokens < len(tokens):
        assert time.monotonic() < deadline
        eng.step()
        for job_id, (_, placeholder) in list(sched.l3.fetches.units.items()):
            if job_id not in reported:  # rank 1 answers in a later step than rank 0
                reported.add(job_id)
                rank1 = DraftOffloadWorkerMetadata(
                    completed_jobs={job_id: 1},
                    fetched_successors={job_id: rank1_successors[placeholder[0]]},
                )
                sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=rank1))
        time.sleep(0.005)
    assert eng.external_hits["tp2"] == CHUNK  # chunk 0 only
    assert eng.mismatched_positions("tp2") == []
    assert eng.take_published()["refused"] == {"rank_mismatch": 1}
    assert sched.l3.lookup.is_broken(keys[1])
    # Both ranks' objects were deleted; rank 0's may be back already, since the
    # recomputed chunk is stored again (by the one worker here, as rank 0).
    deadline = time.monotonic() + 5
    while store.contains(object_key(keys[1], 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.contains(object_key(keys[1], 1))
    eng.worker.shutdown()


def _with_successors(blob: bytes, successors: tuple[int, ...]) -> bytes:
    header, payload = read_header(blob)
    layers = [(e.name, e.is_draft, layer_view(payload, e)) for e in header.layers]
    return pack_unit(replace(header.identity, successor_tokens=successors), layers)[1]


def test_unexpected_lookup_error_is_a_counted_miss(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    eng = l3_engine(model_dirs, f"fs://{tmp_path / 'l3'}")
    sched = eng.scheduler.connector.scheduler
    store = sched.l3.lookup.store

    def broken_backend(names: object) -> list[bool]:
        raise RuntimeError("backend bug: not an L3Error")

    store.contains_many = broken_backend  # the storage client fails in an unforeseen way
    tokens = prompt(34, 2 * CHUNK + 3)
    eng.add_request("r", tokens, max_tokens=2)
    eng.run_until_done()
    assert len(eng.outputs["r"]) == 2
    assert eng.take_published()["fallbacks"].get("l3_lookup_failed") == 1
    eng.worker.shutdown()


def test_fetches_of_one_request_run_in_parallel(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(35, 4 * CHUNK + 3)
    fill_l3(model_dirs, url, tokens)
    l3 = {"enabled": True, "hit_policy": "always", "io_threads": 4}
    eng = l3_engine(model_dirs, url, extra_config={"l3": l3})
    slow = throttle(eng.worker.worker.l3.store, get=0.2)
    eng.add_request("r", tokens, max_tokens=2)
    eng.run_prefill("r")
    assert eng.external_hits["r"] == 4 * CHUNK
    assert slow.max_gets_in_flight == 4  # one per read thread, all at once
    eng.worker.shutdown()


def test_cold_requests_are_all_scheduled_within_a_few_round_trips(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """The engine view of the test above: real Scheduler, 32 cold requests at once."""
    eng = l3_engine(model_dirs, f"fs://{tmp_path / 'l3'}", num_gpu_blocks=256)
    sched = eng.scheduler.connector.scheduler
    slow = throttle(sched.l3.lookup.store, exists=0.05)
    for i in range(32):
        eng.add_request(f"cold{i}", prompt(100 + i, CHUNK + 2), max_tokens=1)
    scheduled: set[str] = set()
    # Wall time of steps in which nothing could run because every request waited
    # on storage: the engine-visible cost of the lookups.
    waiting_s = 0.0
    started = time.monotonic()
    while len(scheduled) < 32:
        assert time.monotonic() - started < 10
        step_started = time.monotonic()
        out = eng.step()
        scheduled |= {new.req_id for new in out.scheduled_new_reqs}
        if not out.num_scheduled_tokens:
            time.sleep(0.005)
            waiting_s += time.monotonic() - step_started
    # A few 50 ms round trips (bound loose for a loaded 2-core CI box); one lookup
    # thread would make it 32 of them (1.6 s).
    assert waiting_s < 0.8, waiting_s
    # Many requests' lookups were on the wire at once (one at a time before).
    assert slow.max_exists_in_flight >= 8
    assert not eng.take_published()["fallbacks"].get("l3_unavailable")
    eng.worker.shutdown()


def test_units_landing_out_of_order_are_the_fetch_pace(tmp_path: Path) -> None:
    """Reads on several threads land out of order. The pace that prices the rest of a
    fetch counts every unit that landed, timed from the first landing, and any landing
    is progress; the leading count alone stood at 5 of 64 while more had landed, and a
    warm fetch on pace was given up (H100, session 13)."""
    prefetch = _prefetch(f"fs://{tmp_path / 'l3'}", hit_policy="cost", io_threads=4)
    keys = _stored_prompt(prefetch, 7, 8)
    for tokens in (CHUNK, 2 * CHUNK, 4 * CHUNK, 8 * CHUNK):  # the engine's prefill speed
        prefetch.cost.prefill.observe(tokens, tokens * tokens / 2, 0.01 * tokens)
    prefetch.cost.storage.observe_fetch(0.001)  # measured: no probe
    no_match = PrefixMatch(0, 0, [])
    deadline = time.monotonic() + 10
    while (state := prefetch.waits.states.get("r")) is None or state.phase != "fetch":
        assert time.monotonic() < deadline
        assert prefetch.must_wait("r", no_match, keys, 8 * CHUNK + 1, 0)
        time.sleep(0.005)
    jobs = sorted(state.jobs)
    assert len(jobs) == 8
    before = state.progress
    time.sleep(0.002)
    for job in jobs[1:4]:  # chunks 1-3 land; chunk 0, the leading one, has not
        prefetch.fetch_finished(job, [], None)
    pace = prefetch.waits._fetch_pace(state, time.monotonic())
    assert pace["fetched"] == 3 and pace["outstanding"] == 5
    assert state.progress > before and state.landed == 0
    assert state.first_landing is not None and 0 < pace["landing_s"] < 1
    prefetch.lookup.close()


def _session13_prefetch(url: str, slots: int) -> L3Prefetch:
    """The scheduler side of the session-13 restart: 256-token chunks, 8 read threads,
    its calibration, own first steps and storage timing (test_l3_cost), `slots` in the
    CPU tier."""
    config = L3Config(
        enabled=True,
        timeout_s=5.0,
        io_threads=8,
        lmcache={"remote_url": url, "extra_config": L3_EXTRA},
    )
    ids = itertools.count(1)
    prefetch = L3Prefetch(
        SchedulerL3(config, 1),
        CpuTierIndex(slots),
        256,
        config,
        DraftOffloadStats(),
        lambda: next(ids),
        unit_bytes=SESSION13_UNIT_BYTES,
    )
    session13_estimates(prefetch.cost)
    return prefetch


def _until_fetching(prefetch: L3Prefetch, req_id: str, keys: list[bytes]) -> L3Decision:
    """Drive the request's lookup until its fetch is sent (or it stopped waiting)."""
    deadline = time.monotonic() + 10
    while (state := prefetch.waits.states.get(req_id)) is None or state.phase == "lookup":
        assert time.monotonic() < deadline
        if not prefetch.must_wait(req_id, PrefixMatch(0, 0, []), keys, 64 * 256 + 2, 0):
            break
        time.sleep(0.005)
    state = prefetch.waits.states[req_id]
    return state.decision


def test_a_warm_restart_fetches_the_whole_hit(tmp_path: Path) -> None:
    """H100, session 13: a restarted engine's request found all 64 units of its prompt in
    storage, with the CPU tier mostly free, and fetched 3 ("fetch 3, landed 3"). The
    cost model priced 1-3 chunks with the engine's own fit of its warm-up (which
    reaches 3 chunks) and 4-64 with the calibration, so 3 chunks looked the best buy."""
    prefetch = _session13_prefetch(f"fs://{tmp_path / 'l3'}", slots=682)
    keys = _stored_prompt(prefetch, 9, 64)
    decision = _until_fetching(prefetch, "r", keys)
    assert decision.found == 64
    assert decision.wanted == 64, decision.line()
    assert len(prefetch.take_fetch_jobs()) == 64
    assert not prefetch.stats.data["l3_declined"], decision.line()
    prefetch.lookup.close()


def test_a_fetch_takes_slots_freed_while_it_runs(tmp_path: Path) -> None:
    """Slots held by other transfers (here: stores in flight) leave a fetch short at
    first; as they complete and become evictable, the fetch reserves the rest of its
    chosen chunks, in order, while its reads are out, and the whole hit is taken."""
    prefetch = _session13_prefetch(f"fs://{tmp_path / 'l3'}", slots=64)
    keys = _stored_prompt(prefetch, 10, 64)
    storing = [(bytes([11, c]) * 16, (1,)) for c in range(30)]
    for unit_id in storing:
        assert prefetch.index.reserve(unit_id) is not None  # another prompt's stores
    decision = _until_fetching(prefetch, "r", keys)
    assert decision.wanted == 34, decision.line()
    first_jobs = prefetch.take_fetch_jobs()
    assert [job.chunk_key for job in first_jobs] == keys[:34]
    for unit_id in storing:
        prefetch.index.commit(unit_id)  # stored: evictable now
    assert prefetch.must_wait("r", PrefixMatch(0, 0, []), keys, 64 * 256 + 2, 0)
    assert decision.wanted == 64, decision.line()
    assert [job.chunk_key for job in prefetch.take_fetch_jobs()] == keys[34:]
    assert prefetch.index.num_evictions == 30
    prefetch.forget("r")
    assert decision.no_slot == 0 and not prefetch.stats.data["l3_declined"]
    prefetch.lookup.close()


def test_a_tier_smaller_than_the_hit_takes_its_head_and_says_so(
    model_dirs: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A CPU tier of 5 units, a stored prompt of 8: the hit is the 5 leading units, and
    the 3 it could not hold are counted (no_free_slot), named in the decision line and
    warned about, as is the tier smaller than one max_model_len prompt at start."""
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(36, 8 * CHUNK + 5)
    fill_l3(model_dirs, url, tokens)
    with caplog.at_level(logging.WARNING, logger="vllm_draft_offload"):
        eng = l3_engine(model_dirs, url, cpu_units=5)
        assert "the CPU tier holds 5 units" in caplog.text
        eng.add_request("r", tokens, max_tokens=1)
        eng.run_prefill("r")
        assert eng.external_hits["r"] == 5 * CHUNK
        assert eng.mismatched_positions("r") == []
        published = eng.take_published()
        eng.run_until_done()
    assert published["chunks"].get("load/l3") == 5
    assert published["l3_declined"] == {"no_free_slot": 3}
    decision = eng.scheduler.connector.scheduler.l3.log.recent[-1]
    assert decision.outcome == "partial" and decision.no_slot == 3, decision.line()
    assert "fetch 5 (no CPU-tier slot for 3 more), landed 5" in decision.line()
    assert "does not fit the CPU tier (5 units)" in caplog.text
    eng.worker.shutdown()
