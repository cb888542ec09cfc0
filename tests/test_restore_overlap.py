"""Overlapped restores (l3.overlap_restore): a storage hit is admitted while its units
still land, as an asynchronous load that copies each unit as soon as it lands.

Real Scheduler and connector halves (kv_sim), a real LMCache fs:// directory written by
an engine that has stopped; reads slowed or held on their own threads, never mocked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kv_sim import SimEngine, prompt
from l3_throttle import throttle
from test_l3_tier import CHUNK, fill_l3, finish_l3_writes, l3_engine

from vllm_draft_offload.chunk_keys import ChunkKeyChain
from vllm_draft_offload.config import ConfigError, parse_config
from vllm_draft_offload.l3_objects import object_key
from vllm_draft_offload.l3_worker import WorkerL3
from vllm_draft_offload.worker_side import DraftOffloadWorker

# Waiting on the storage is bounded by the test, not by the wait allowance.
PATIENT = {
    "enabled": True,
    "timeout_s": 30.0,
    "hit_policy": "always",
    "io_threads": 2,
    "overlap_restore": True,
}


def restarted(model_dirs: tuple[Path, Path], url: str, tp: int = 1, **l3: Any) -> SimEngine:
    eng = l3_engine(model_dirs, url, eagle=True, tp=tp, extra_config={"l3": {**PATIENT, **l3}})
    set_world_size(eng, tp)
    return eng


def set_world_size(eng: SimEngine, tp: int) -> None:
    """kv_sim runs TP ranks in one process, where vLLM's parallel config says 1."""
    sched = eng.scheduler.connector.scheduler
    assert sched.l3 is not None and sched.l3_writes is not None
    sched.jobs.world_size = sched.l3_writes.world_size = sched.l3.lookup.world_size = tp


def chunk_keys(eng: SimEngine, tokens: list[int]) -> list[bytes]:
    return ChunkKeyChain(eng.scheduler.connector.scheduler.salt, CHUNK).extend(tokens)


def hook_reads(
    eng: SimEngine, before: Callable[[int, bytes], None], rank: int = 0
) -> list[tuple[str, bytes]]:
    """Run `before(slot, chunk_key)` on the read thread ahead of each of the rank's
    fetches; returns the ("landed", chunk key) log its landings append to."""
    l3 = eng.workers[rank].worker.l3
    assert isinstance(l3, WorkerL3)
    log: list[tuple[str, bytes]] = []
    real = l3._fetch_timed

    def fetch(job_id: int, slot: int, chunk_key: bytes, queued: float) -> None:
        before(slot, chunk_key)
        real(job_id, slot, chunk_key, queued)
        log.append(("landed", chunk_key))

    l3._fetch_timed = fetch  # type: ignore[method-assign]
    return log


def load_copy_slots(eng: SimEngine, on_copy: Callable[[set[int]], None]) -> None:
    """Call `on_copy(host slots)` for every host-to-GPU copy batch of rank 0."""
    worker: DraftOffloadWorker = eng.worker.worker
    assert worker.pair_copier is not None
    copier = worker.pair_copier
    real = copier.run_layers

    def run_layers(batch: Any, order: Any, direction: str, stream: Any) -> Any:
        if direction == "load":
            per_unit = [r.pages_per_unit for r in worker.regions]
            on_copy(
                {
                    int(page) // per_unit[rows[0]]
                    for pages, rows in zip(batch.host_pages, copier.copies.group_rows, strict=True)
                    for page in pages
                }
            )
        return real(batch, order, direction, stream)

    copier.run_layers = run_layers  # type: ignore[method-assign]


def test_storage_hit_is_admitted_while_its_units_land_and_restores_bit_exact(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """The request is admitted (blocks allocated, WAITING_FOR_REMOTE_KVS) with fetches
    still out, its forward never waits on them, and what it restores is every target
    and draft layer's KV of a fresh prefill, bit for bit."""
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(71, 6 * CHUNK + 5)
    first = fill_l3(model_dirs, url, tokens, max_tokens=3, eagle=True)
    eng = restarted(model_dirs, url)
    throttle(eng.worker.worker.l3.store, disk=0.05)  # one read at a time: units trickle in
    sched = eng.scheduler.connector.scheduler
    assert sched.l3 is not None
    admissions: list[tuple[int, int]] = []
    real_alloc = sched.update_state_after_alloc

    def alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            # Fetches not yet reported by every rank, when vLLM allocates the hit.
            admissions.append((num_external_tokens, len(sched.l3.fetches.units)))
        real_alloc(request, blocks, num_external_tokens)

    sched.update_state_after_alloc = alloc  # type: ignore[method-assign]
    eng.add_request("restart", tokens, max_tokens=3)
    eng.run_prefill("restart")
    assert len(admissions) == 1
    hit, still_landing = admissions[0]
    assert hit == 6 * CHUNK
    assert still_landing > 0, "admitted only once every unit had landed"
    assert eng.external_hits["restart"] == 6 * CHUNK
    assert eng.mismatched_positions("restart") == []
    eng.run_until_done()
    assert eng.outputs["restart"] == first.outputs["fresh"]
    published = eng.take_published()
    assert published["chunks"]["load/l3"] == 6
    decision = sched.l3.log.recent[-1]
    assert decision.outcome == "fetched", decision.line()
    assert sched.index.num_slots - sched.index.num_used_slots >= 0
    assert all(entry.pins == 0 for entry in sched.index), "a pin outlived the load"
    eng.shutdown()


def test_first_unit_is_copied_before_the_last_one_lands(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Ordering, not timing: the last unit's read is held until the first unit's copy
    to the GPU has started. A restore that starts only once every unit landed would
    let the read go only when the hold times out, and copy the first unit after it."""
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(72, 4 * CHUNK + 3)
    first = fill_l3(model_dirs, url, tokens, max_tokens=2, eagle=True)
    eng = restarted(model_dirs, url)
    keys = chunk_keys(eng, tokens)
    first_copied = threading.Event()
    slots: dict[bytes, int] = {}

    def before_read(slot: int, chunk_key: bytes) -> None:
        slots[chunk_key] = slot
        if chunk_key == keys[3]:
            first_copied.wait(10)

    def on_copy(copied: set[int]) -> None:
        if slots.get(keys[0]) in copied and not first_copied.is_set():
            log.append(("copy", keys[0]))  # one log, appended in the order things happen
            first_copied.set()

    log = hook_reads(eng, before_read)
    load_copy_slots(eng, on_copy)
    eng.add_request("restart", tokens, max_tokens=2)
    eng.run_prefill("restart")
    order = [event for event in log if event in (("copy", keys[0]), ("landed", keys[3]))]
    assert order == [("copy", keys[0]), ("landed", keys[3])], order
    assert eng.external_hits["restart"] == 4 * CHUNK
    assert eng.mismatched_positions("restart") == []
    eng.run_until_done()
    assert eng.outputs["restart"] == first.outputs["fresh"]
    eng.shutdown()


def fill_tp(model_dirs: tuple[Path, Path], url: str, tokens: list[int], tp: int) -> SimEngine:
    """An engine of `tp` ranks serves "fresh" (each rank writes its own shard), stops."""
    eng = l3_engine(model_dirs, url, eagle=True, tp=tp)
    set_world_size(eng, tp)
    eng.add_request("fresh", tokens, max_tokens=3)
    eng.run_until_done()
    for worker in eng.workers:
        assert worker.worker.l3 is not None and worker.worker.l3.flush(10)
    finish_l3_writes(eng)
    for worker in eng.workers:
        worker.shutdown()
    return eng


@pytest.mark.parametrize("tp", [1, 2])
def test_fetch_failing_after_admission_recomputes_from_there(
    model_dirs: tuple[Path, Path], tmp_path: Path, tp: int
) -> None:
    """Chunk 2's object disappears after the request was admitted, before its read (on
    the last rank only, with TP=2: the other rank lands it). The restore keeps chunks
    0-1, vLLM recomputes from chunk 2 on every rank, the output is a fresh prefill's,
    and what the CPU tier keeps afterwards is sound: served again from it, every
    layer's KV is bit-exact."""
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(73, 5 * CHUNK + 7)
    first = fill_tp(model_dirs, url, tokens, tp)
    eng = restarted(model_dirs, url, tp=tp)
    keys = chunk_keys(eng, tokens)
    rank = tp - 1
    admitted = threading.Event()
    sched = eng.scheduler.connector.scheduler
    real_alloc = sched.update_state_after_alloc

    def alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
        real_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            admitted.set()

    sched.update_state_after_alloc = alloc  # type: ignore[method-assign]
    store = eng.workers[rank].worker.l3.store
    assert store is not None

    def before_read(slot: int, chunk_key: bytes) -> None:
        if chunk_key == keys[2]:
            assert admitted.wait(10), "never admitted with units still landing"
            assert store.remove(object_key(chunk_key, rank))

    hook_reads(eng, before_read, rank=rank)
    eng.add_request("restart", tokens, max_tokens=3)
    eng.run_prefill("restart")
    assert eng.external_hits["restart"] == 2 * CHUNK
    for r in range(tp):
        assert eng.mismatched_positions("restart", rank=r) == []
    eng.run_until_done()
    assert eng.outputs["restart"] == first.outputs["fresh"]
    published = eng.take_published()
    assert published["refused"] == {"object_missing": 1}
    # Chunk 2 was recomputed on the sound prefix and stored. Chunks 3-4 are recomputed
    # too (vLLM cut the hit at chunk 2). Whether their fetched units sit in the CPU tier
    # before the recompute's stores are planned is timing: usually they do and are not
    # stored again, but with three runs of this file at once on 2 cores one run stored
    # 2. Either way the CPU tier then holds all five, sound (below).
    assert 1 <= published["chunks"]["store/cpu"] <= 3

    eng.evict_gpu_kv()
    eng.add_request("again", tokens, max_tokens=3)
    eng.run_prefill("again")
    assert eng.hit_sources["again"] == {"host": 5 * CHUNK}
    for r in range(tp):
        assert eng.mismatched_positions("again", rank=r) == []
    eng.run_until_done()
    assert eng.outputs["again"] == first.outputs["fresh"]
    eng.shutdown()


def test_overlap_can_be_turned_off(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """l3.overlap_restore false: the request waits until its units sit in the CPU tier,
    then loads them like any CPU hit (synchronously, with one KV-cache group)."""
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(74, 3 * CHUNK + 5)
    fill_l3(model_dirs, url, tokens, max_tokens=2, eagle=True)
    eng = restarted(model_dirs, url, overlap_restore=False)
    sched = eng.scheduler.connector.scheduler
    real_lookup, answers = sched.get_num_new_matched_tokens, []

    def lookup(request: Any, num_computed_tokens: int) -> Any:
        answers.append(real_lookup(request, num_computed_tokens))
        return answers[-1]

    sched.get_num_new_matched_tokens = lookup  # type: ignore[method-assign]
    eng.add_request("restart", tokens, max_tokens=2)
    eng.run_prefill("restart")
    assert answers[-1] == (3 * CHUNK, False)
    assert eng.mismatched_positions("restart") == []
    eng.shutdown()


def test_a_bad_overlap_setting_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"l3\.overlap_restore"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "l3": {"overlap_restore": "sometimes"}})


def test_a_drain_does_not_hide_landings_from_overlapped_loads(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """A fetch that lands between a step's get_transfer_results and its worker-metadata
    drain is reported to the scheduler by the drain and must still reach the overlapped
    loads at the next step (a real CPU engine waited forever on such a unit)."""
    from vllm_draft_offload.l3_worker import FetchResult
    from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata

    eng = l3_engine(model_dirs, f"fs://{tmp_path / 'l3'}")
    link = eng.worker.worker._l3_link
    assert link is not None
    link.l3.fetches_done.put(FetchResult(7, 0, (11,)))  # as a read thread reports one
    meta = DraftOffloadWorkerMetadata()
    link.drain(meta, None, True)
    assert meta.completed_jobs == {7: 1}
    assert [result.job_id for result in link.take_landings()] == [7]
    assert link.take_landings() == []
    eng.shutdown()
