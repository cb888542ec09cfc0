"""store_thread: each step's store copies issued on a thread of their own (store_issuer.py).

A store is complete only once its copy was issued and has run: while the issuer holds a
batch, nothing of it is reported (no finished request freed, no unit committed), and
what it stores is bit-exact once it is. A batch that fails to issue fails its stores
(their units dropped), never reports them done. Through the real vLLM Scheduler on CPU
tensors (kv_sim), where the copies are host memmoves on the issuer's thread.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kv_sim import SimEngine, SimSetup, prompt

from vllm_draft_offload.metadata import TransferJob
from vllm_draft_offload.store_issuer import StoreBatch, StoreIssuer
from vllm_draft_offload.transfers import PairBatch
from vllm_draft_offload.worker_stores import InflightStore, StoreTracker

CHUNK = 32


def _store(job_id: int, req_id: str = "r", finishing: bool = True) -> InflightStore:
    job = TransferJob(job_id, req_id, "store", [[job_id]], [[job_id + 1]], finishing=finishing)
    return InflightStore(job, None)


def _batch(*stores: InflightStore) -> StoreBatch:
    return StoreBatch(list(stores), PairBatch([], []), None)


def test_a_store_is_not_done_before_its_batch_is_issued() -> None:
    """The tracker holds a request until its store's copy was issued, however long the
    issuer takes; batches are issued in the order they were queued."""
    gate = threading.Event()
    issued: list[int] = []

    def issue(batch: StoreBatch) -> None:
        gate.wait(timeout=10)
        issued.extend(store.job.job_id for store in batch.stores)

    issuer = StoreIssuer(issue, _cpu())
    tracker = StoreTracker()
    first, second = _store(1, "a"), _store(2, "b")
    tracker.expect([first.job, second.job])
    for store in (first, second):
        issuer.submit(_batch(store))
        tracker.add(store)
    retired: list[int] = []
    assert tracker.poll(lambda s: retired.append(s.job.job_id)) == set()
    assert retired == [] and not first.issued
    gate.set()
    issuer.drain()
    assert issued == [1, 2]
    assert tracker.poll(lambda s: retired.append(s.job.job_id)) == {"a", "b"}
    assert retired == [1, 2]
    issuer.close()


def test_a_batch_that_fails_to_issue_fails_its_stores() -> None:
    def issue(batch: StoreBatch) -> None:
        raise RuntimeError("driver said no")

    issuer = StoreIssuer(issue, _cpu())
    store = _store(7)
    issuer.submit(_batch(store))
    issuer.drain()
    assert store.issued and store.failed_cause == "store_error" and store.event is None
    issuer.close()


def test_close_issues_what_is_queued() -> None:
    gate = threading.Event()
    issued: list[int] = []

    def issue(batch: StoreBatch) -> None:
        gate.wait(timeout=10)
        issued.append(batch.stores[0].job.job_id)

    issuer = StoreIssuer(issue, _cpu())
    stores = [_store(i) for i in range(3)]
    for store in stores:
        issuer.submit(_batch(store))
    gate.set()
    issuer.close()
    assert issued == [0, 1, 2] and all(store.issued for store in stores)


def _cpu():  # noqa: ANN202 - torch.device
    import torch

    return torch.device("cpu")


def test_held_issuer_holds_commits_then_restores_bit_exact(
    model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the issuer held, a finished request's stores are not reported and its units
    not committed; released, every layer restores bit for bit (target and draft)."""
    eng = SimEngine(*model_dirs, SimSetup(extra_config={"store_thread": True}))
    worker = eng.worker.worker
    assert worker._issuer is not None
    gate = threading.Event()
    copy = worker._copy_stores

    def held(batch: StoreBatch) -> None:
        gate.wait(timeout=30)
        copy(batch)

    monkeypatch.setattr(worker._issuer, "_issue", held)
    index = eng.scheduler.connector.scheduler.index
    tokens = prompt(5, 3 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=2)
    for _ in range(8):
        eng.step()
    # Reserved, not committed, while the copies wait to be issued; the request, done
    # decoding, is still held for its stores.
    assert len(index) == 3 and not any(entry.ready for entry in index)
    assert eng.scheduler.has_requests()
    assert eng.take_published().get("timed_bytes", {}).get("store/cpu", 0) == 0
    gate.set()
    eng.run_until_done()
    assert len(index) == 3 and all(entry.ready for entry in index)
    eng.evict_gpu_kv()
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 3 * CHUNK
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
