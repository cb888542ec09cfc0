"""The scheduler's job book: a job completes when every rank reported, and a failed
load fails the stores computed on it even when all arrive in one step's reports. The
fetch book: cancelled fetches and the rounds they leave."""

from __future__ import annotations

import pytest

from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.job_book import STORE_AFTER_LOAD_FAILURE, JobBook, JobRecord
from vllm_draft_offload.l3_cost import StorageEstimate
from vllm_draft_offload.l3_fetches import FetchBook
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata


def test_a_job_completes_once_every_rank_reported() -> None:
    book = JobBook(world_size=2)
    book.add(1, JobRecord("r", "store", []))
    done: list[tuple[int, bool]] = []
    book.apply(
        DraftOffloadWorkerMetadata(completed_jobs={1: 1}), lambda j, r: done.append((j, r.failed))
    )
    assert done == [] and len(book) == 1
    book.apply(
        DraftOffloadWorkerMetadata(failed_jobs={1: 1}), lambda j, r: done.append((j, r.failed))
    )
    assert done == [(1, True)] and not book  # one rank failed: the job failed


def test_a_failed_load_fails_the_stores_computed_on_it_in_the_same_reports() -> None:
    book = JobBook(world_size=1)
    book.add(1, JobRecord("a", "load", []))
    book.add(2, JobRecord("b", "store", [], after_loads=(1,)))  # read the load's blocks
    book.add(3, JobRecord("a", "store", []))  # the same request, a later step
    book.add(4, JobRecord("c", "store", []))  # unrelated
    done: dict[int, JobRecord] = {}

    def complete(job_id: int, record: JobRecord) -> None:
        done[job_id] = record
        if record.direction == "load" and record.failed:
            book.fail_stores_computed_on(job_id, record)

    book.apply(
        DraftOffloadWorkerMetadata(
            failed_jobs={1: 1}, completed_jobs={2: 1, 3: 1, 4: 1}, failure_causes={1: "bad"}
        ),
        complete,
    )
    assert done[1].cause == "bad"
    assert done[2].failed and done[2].cause == STORE_AFTER_LOAD_FAILURE
    assert done[3].failed and done[3].cause == STORE_AFTER_LOAD_FAILURE
    assert not done[4].failed


def test_ranks_reporting_different_successors_fail_the_fetch() -> None:
    book = JobBook(world_size=2)
    book.add(7, JobRecord("", "fetch", []))
    done: list[JobRecord] = []
    book.apply(
        DraftOffloadWorkerMetadata(completed_jobs={7: 1}, fetched_successors={7: [5]}),
        lambda j, r: done.append(r),
    )
    book.apply(
        DraftOffloadWorkerMetadata(completed_jobs={7: 1}, fetched_successors={7: [6]}),
        lambda j, r: done.append(r),
    )
    assert done[0].failed and done[0].cause == "rank_mismatch"


def test_fetch_timings_of_several_ranks_are_the_slowest_ranks() -> None:
    """A unit is in when every rank's part landed: its times, and a round's, are the
    slowest rank's (vLLM's KVOutputAggregator folds the ranks' metadata pairwise)."""
    rank0 = DraftOffloadWorkerMetadata(
        completed_jobs={3: 1}, fetch_seconds={3: 0.02}, fetch_since_queued={3: 0.05}
    )
    rank1 = DraftOffloadWorkerMetadata(
        completed_jobs={3: 1}, fetch_seconds={3: 0.03}, fetch_since_queued={3: 0.04}
    )
    merged = rank0.aggregate(rank1)
    assert merged.completed_jobs == {3: 2}
    assert merged.fetch_seconds == {3: 0.03} and merged.fetch_since_queued == {3: 0.05}
    assert rank1.aggregate(rank0).fetch_since_queued == {3: 0.05}


def test_cancelled_fetches_leave_the_book_and_their_round_times_what_landed() -> None:
    """A request gave its fetch up: unsent jobs are dropped with their placeholders, sent
    ones go to the workers to skip; the round is timed by the units that landed."""
    index = CpuTierIndex(8)
    storage = StorageEstimate(unit_bytes=1 << 20, parallel=2)
    ids = iter(range(100))
    book = FetchBook(index, lambda: next(ids), storage)
    sent = book.reserve("r", [b"k0", b"k1", b"k2", b"k3"])
    assert [job.job_id for job in book.take_unsent()] == sent
    later = book.reserve("r", [b"k4", b"k5"])  # reserved, not yet sent
    book.cancel(sent[2:] + later)
    assert book.take_unsent() == [] and book.take_cancels() == sent[2:]
    assert set(book.units) == set(sent)  # the unsent two left the book...
    assert {unit_id[0] for unit_id in index._entries} == {
        b"k0",
        b"k1",
        b"k2",
        b"k3",
    }  # ...and the tier
    # Workers: two landed (0.04 s and 0.06 s after queueing), two skipped.
    for job_id, seconds in zip(sent[:2], (0.04, 0.06), strict=True):
        book.landed_after(job_id, seconds)
        assert book.finished(job_id, landed=True)[0] == "r"  # still its request's
    assert storage.pace_s == 0.0  # two of the round still out
    for job_id in sent[2:]:
        book.finished(job_id, landed=False, cancelled=True)
    assert storage.pace_s == pytest.approx(0.06 / 2)  # the two that landed, at once
    assert not book.units
