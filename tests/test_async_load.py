"""Asynchronous loads for layouts with more than one KV-cache group.

vLLM 0.33 maps block-level load errors (`get_block_ids_with_load_errors`) back to
requests only with a single KV-cache group (block ids are per group); with more
groups it raises. There a failed load must be reported per request through
`failed_recving`, which vLLM honours only for requests waiting on an
asynchronous load. These tests drive the real Scheduler (tests/kv_sim.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kv_sim import SimEngine, SimSetup, prompt
from vllm.v1.request import RequestStatus

from vllm_draft_offload.scheduler_side import DraftOffloadScheduler

CHUNK = 32


def engine(model_dirs: tuple[Path, Path], **kwargs: object) -> SimEngine:
    return SimEngine(*model_dirs, SimSetup(**kwargs))


def sched_of(eng: SimEngine) -> DraftOffloadScheduler:
    return eng.scheduler.connector.scheduler


def _lookups(eng: SimEngine) -> list[tuple[int | None, bool]]:
    """Record what every lookup of the connector answers vLLM."""
    sched = sched_of(eng)
    real = sched.get_num_new_matched_tokens
    answers: list[tuple[int | None, bool]] = []

    def recording(request, num_computed_tokens):  # noqa: ANN001, ANN202
        answer = real(request, num_computed_tokens)
        answers.append(answer)
        return answer

    sched.get_num_new_matched_tokens = recording
    return answers


def _fail_by_eviction(eng: SimEngine) -> None:
    """The second of three units disappears between lookup and allocation."""
    sched = sched_of(eng)
    real = sched.get_num_new_matched_tokens

    def lookup_then_evict_second(request, num_computed_tokens):  # noqa: ANN001, ANN202
        result = real(request, num_computed_tokens)
        sched.get_num_new_matched_tokens = real  # once
        match = sched._requests[request.request_id].pending_match
        sched.index.remove(match.chunks[1][1].handle)
        return result

    sched.get_num_new_matched_tokens = lookup_then_evict_second


def _fail_by_corruption(eng: SimEngine) -> None:
    """The first unit's bytes change after its store: the audit refuses the load."""
    sched = sched_of(eng)
    first = min(sched.index._entries.values(), key=lambda e: e.slot)
    eng.worker.worker.pool.unit_view(first.slot)[:64] ^= 0x55


def _fail_by_refused_plan(eng: SimEngine) -> None:
    """The load plan handed to the worker cannot be executed."""
    sched = sched_of(eng)
    real = sched.update_state_after_alloc

    def sabotage(request, blocks, num_external_tokens):  # noqa: ANN001, ANN202
        real(request, blocks, num_external_tokens)
        sched.update_state_after_alloc = real  # once
        for job in sched._pending_loads:
            job.host_pages[0][0] = 10**9

    sched.update_state_after_alloc = sabotage


# fault -> (injector, fallback cause, what the lookup after the failure finds)
FAULTS = {
    # The first chunk is still stored: the new lookup loads it (asynchronously).
    "evicted": (_fail_by_eviction, "load_error", (CHUNK, True)),
    # A unit that failed to load is dropped with its job's others: nothing left.
    "audit": (_fail_by_corruption, "audit_mismatch", (0, False)),
    "refused": (_fail_by_refused_plan, "load_error", (0, False)),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_failed_load_with_separate_draft_group_recomputes(
    model_dirs: tuple[Path, Path], fault: str
) -> None:
    """A drafter in its own KV-cache group: a failed load recomputes (it used to
    stop the engine with vLLM's RuntimeError about invalid_block_ids)."""
    eng = engine(model_dirs, draft_layout="separate_group", extra_config={"audit": True})
    tokens = prompt(31, 3 * CHUNK + 3)
    eng.add_request("fresh", tokens, max_tokens=3)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.take_published()
    inject, cause, relookup = FAULTS[fault]
    answers = _lookups(eng)
    inject(eng)
    eng.add_request("restored", tokens, max_tokens=3)
    eng.run_prefill("restored")
    assert answers[0] == (3 * CHUNK, True), "multi-group hits load asynchronously"
    # vLLM recomputes a failed asynchronous load from token 0, after a new lookup.
    assert answers[1:] == [relookup]
    sched = sched_of(eng)
    assert sched.restored_tokens("restored") == relookup[0]
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    assert eng.take_published()["fallbacks"] == {cause: 1}
    assert not sched.has_inflight_jobs()
    assert all(entry.pins == 0 for entry in sched.index._entries.values())
    # What the request recomputed was stored again: the whole prefix restores.
    eng.evict_gpu_kv()
    eng.add_request("again", tokens, max_tokens=2)
    eng.run_prefill("again")
    assert eng.external_hits["again"] == 3 * CHUNK
    assert eng.mismatched_positions("again") == []


@pytest.mark.parametrize("eagle", [False, True])
def test_async_restore_is_bit_exact_for_every_layer(
    model_dirs: tuple[Path, Path], eagle: bool
) -> None:
    eng = engine(model_dirs, draft_layout="separate_group", eagle=eagle)
    tokens = prompt(32, 4 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=4)
    eng.run_until_done()
    eng.evict_gpu_kv()
    answers = _lookups(eng)
    eng.add_request("restored", tokens, max_tokens=4)
    first = eng.step()  # the copies are issued; the request does not run
    assert answers == [(4 * CHUNK, True)]
    assert first.num_scheduled_tokens == {}
    assert eng.scheduler.requests["restored"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    eng.run_prefill("restored")  # it runs once the load is reported
    assert eng.external_hits["restored"] == 4 * CHUNK
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    sched = sched_of(eng)
    assert all(entry.pins == 0 for entry in sched.index._entries.values())


def test_single_group_layout_loads_synchronously(model_dirs: tuple[Path, Path]) -> None:
    """One KV-cache group keeps the restore that overlaps the forward layer by layer."""
    eng = engine(model_dirs, draft_layout="shared_group")
    tokens = prompt(33, 2 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    answers = _lookups(eng)
    eng.add_request("restored", tokens, max_tokens=2)
    first = eng.step()
    assert answers == [(2 * CHUNK, False)]
    assert first.has_sync_kv_loads and "restored" in first.num_scheduled_tokens
    assert eng.mismatched_positions("restored") == []


class _HeldCopy:
    """A load stream event that has not completed (there is no GPU here)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _hold_async_copies(eng: SimEngine, rank: int = 0) -> _HeldCopy:
    async_loads = eng.workers[rank].worker._async
    held, real = _HeldCopy(), async_loads.issued
    async_loads.issued = lambda jobs, event, keepalive: real(jobs, held, keepalive)
    return held


def test_request_waits_until_its_copies_complete(model_dirs: tuple[Path, Path]) -> None:
    eng = engine(model_dirs, draft_layout="separate_group")
    tokens = prompt(34, 2 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    held = _hold_async_copies(eng)
    eng.add_request("restored", tokens, max_tokens=2)
    for _ in range(3):
        assert eng.step().num_scheduled_tokens == {}
    sched = sched_of(eng)
    assert sum(entry.pins for entry in sched.index._entries.values()) == 2  # still read
    held.done = True
    eng.run_prefill("restored")
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    assert all(entry.pins == 0 for entry in sched.index._entries.values())


@pytest.mark.parametrize("copies", ["completed", "in_flight"])
def test_request_aborted_while_waiting_for_its_load(
    model_dirs: tuple[Path, Path], copies: str
) -> None:
    """vLLM holds the blocks of a request aborted in WAITING_FOR_REMOTE_KVS until the
    load is reported in finished_recving; the connector adds no store of its own
    (a second release of the same blocks)."""
    eng = engine(model_dirs, draft_layout="separate_group")
    tokens = prompt(35, 2 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    held = _hold_async_copies(eng)
    held.done = copies == "completed"
    pool = eng.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    eng.add_request("aborted", tokens, max_tokens=2)
    sched_out = eng.scheduler.schedule()  # allocates blocks and plans the load
    eng.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    eng.execute(sched_out)  # the copies into the held blocks run
    eng.step()
    assert ("aborted" in eng.scheduler.requests) == (copies == "in_flight")
    held.done = True
    eng.run_until_done()
    assert "aborted" not in eng.scheduler.requests
    assert pool.get_num_free_blocks() == free_before
    sched = sched_of(eng)
    assert not sched.has_inflight_jobs()
    assert all(entry.pins == 0 for entry in sched.index._entries.values())
    # The tier still serves the prefix.
    eng.add_request("again", tokens, max_tokens=2)
    eng.run_prefill("again")
    assert eng.external_hits["again"] == 2 * CHUNK
    assert eng.mismatched_positions("again") == []


def test_tp_request_waits_for_every_rank(model_dirs: tuple[Path, Path]) -> None:
    """vLLM's aggregator releases a request once every worker reported it; the
    units stay pinned until every worker's copies are done."""
    eng = engine(model_dirs, draft_layout="separate_group", tp=2)
    tokens = prompt(36, 2 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    held = _hold_async_copies(eng, rank=1)  # rank 0's copies complete at once
    eng.add_request("restored", tokens, max_tokens=2)
    for _ in range(3):
        assert eng.step().num_scheduled_tokens == {}
    sched = sched_of(eng)
    assert sum(entry.pins for entry in sched.index._entries.values()) == 2
    held.done = True
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 2 * CHUNK
    assert eng.mismatched_positions("restored", rank=0) == []
    assert eng.mismatched_positions("restored", rank=1) == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    assert all(entry.pins == 0 for entry in sched.index._entries.values())


def test_tp_load_failing_on_one_rank_recomputes(model_dirs: tuple[Path, Path]) -> None:
    """Rank 1's copy of a unit is damaged: only its audit fails, and vLLM (through
    its aggregator) recomputes the request on every rank."""
    eng = engine(model_dirs, draft_layout="separate_group", tp=2, extra_config={"audit": True})
    tokens = prompt(37, 2 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    sched = sched_of(eng)
    first = min(sched.index._entries.values(), key=lambda e: e.slot)
    eng.workers[1].worker.pool.unit_view(first.slot)[:64] ^= 0x55
    held = _hold_async_copies(eng, rank=0)  # the healthy rank is still copying
    answers = _lookups(eng)
    eng.add_request("restored", tokens, max_tokens=2)
    for _ in range(2):
        assert eng.step().num_scheduled_tokens == {}  # rank 1 failed, rank 0 busy
    held.done = True
    eng.run_prefill("restored")
    assert answers == [(2 * CHUNK, True), (0, False)]  # the failed units were dropped
    assert sched.restored_tokens("restored") == 0
    for rank in (0, 1):
        assert eng.mismatched_positions("restored", rank=rank) == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    assert eng.take_published()["fallbacks"] == {"audit_mismatch": 1}
    assert not sched.has_inflight_jobs()
