"""The L3 commit gate: a store's KV reaches storage only once the scheduler has
confirmed the store job on every rank and no failure behind it was found.

Real Scheduler and connector halves (kv_sim) with a real fs:// LMCache backend. A
second TP rank is played by injected worker metadata, as in test_tier_faults.py.
"""

from __future__ import annotations

from pathlib import Path

from kv_sim import SimEngine, prompt
from test_l3_tier import CHUNK, l3_engine
from test_l3_writes import chunk_keys, settle_writes, store_for
from vllm.v1.outputs import KVConnectorOutput

from vllm_draft_offload.l3_objects import object_key
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata
from vllm_draft_offload.scheduler_side import DraftOffloadScheduler


def sched_of(eng: SimEngine) -> DraftOffloadScheduler:
    return eng.scheduler.connector.scheduler


def objects_in_storage(url: str, keys: list[bytes], ranks: int = 2) -> list[tuple[int, int]]:
    store = store_for(url)
    try:
        return [
            (chunk, rank)
            for chunk, key in enumerate(keys)
            for rank in range(ranks)
            if store.contains(object_key(key, rank))
        ]
    finally:
        store.close()


def test_store_failed_after_it_ran_never_reaches_storage(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """TP=2, rank 1 a step behind (what async scheduling looks like to the scheduler):
    rank 1's load of "b" failed, so b's store of that step (S1, refused by rank 1) and
    of the next step (S2, run by both ranks before the failure was known) hold KV of
    a wrong prefix. Rank 0 ran both; none of it may ever be written to storage."""
    url = f"fs://{tmp_path / 'l3'}"
    l3 = {"enabled": True, "timeout_s": 2.0, "hit_policy": "never"}
    eng = l3_engine(model_dirs, url, extra_config={"l3": l3})
    sched = sched_of(eng)
    planner = sched.l3_writes
    assert planner is not None and sched.l3 is not None
    rank0 = eng.worker.worker.l3
    assert rank0 is not None
    # b: a 2-chunk CPU hit, then 16 chunks computed in its first step (512-token
    # budget) and 2 more in its second.
    tokens = prompt(60, 2 * CHUNK + 512 + 2 * CHUNK + 5)
    eng.add_request("a", tokens[: 2 * CHUNK + 3], max_tokens=1)
    eng.run_until_done()
    settle_writes(eng)
    keys = chunk_keys(eng, tokens)[:20]
    assert objects_in_storage(url, keys, ranks=1) == [(0, 0), (1, 0)]
    eng.evict_gpu_kv()
    sched.jobs.world_size = planner.world_size = sched.l3.lookup.world_size = 2

    eng.add_request("b", tokens, max_tokens=2)
    first = eng.step().kv_connector_metadata
    (load,) = [job.job_id for job in first.loads]
    (s1,) = [job for job in first.stores if job.req_id == "b"]
    second = eng.step().kv_connector_metadata
    (s2,) = [job for job in second.stores if job.req_id == "b"]
    assert s1.l3_units and s2.l3_units
    assert rank0.flush(10)
    # Rank 0's copies completed, but no rank has the scheduler's word yet.
    assert objects_in_storage(url, keys[2:], ranks=1) == [], "written before confirmed"

    # Rank 1 catches up: its load failed, it refused S1 (and dropped S1's writes), it ran S2.
    behind = DraftOffloadWorkerMetadata(
        completed_jobs={s2.job_id: 1},
        failed_jobs={load: 1, s1.job_id: 1},
        failure_causes={s1.job_id: "store_after_load_failure"},
        l3_writes_released={order.write_id: 1 for order in s1.l3_units},
        l3_writes_failed={order.write_id: 1 for order in s1.l3_units},
    )
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=behind))
    # From here on rank 1 does what rank 0 does.
    build = eng.worker.build_connector_worker_meta

    def both_ranks() -> DraftOffloadWorkerMetadata | None:
        meta = build()
        return None if meta is None else meta.aggregate(meta)

    eng.worker.build_connector_worker_meta = both_ranks  # type: ignore[method-assign]
    verdict = eng.step().kv_connector_metadata
    assert sorted(verdict.l3_abort_jobs) == [s1.job_id, s2.job_id]
    assert not {s1.job_id, s2.job_id} & set(verdict.l3_commit_jobs)
    assert rank0.flush(10)
    eng.run_until_done()
    settle_writes(eng)
    assert objects_in_storage(url, keys[2:]) == [], "KV computed on a failed load was written"
    aborted = {order.write_id for order in (*s1.l3_units, *s2.l3_units)}
    assert not aborted & set(planner._writes)
    assert all(entry.pins == 0 for entry in sched.index)
    assert not sched.keeps_engine_busy()
    eng.worker.shutdown()


def test_unconfirmed_writes_at_shutdown_are_lost_not_written(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    # No storage reads: the request is admitted, and stores, in its first step.
    l3 = {"enabled": True, "timeout_s": 2.0, "hit_policy": "never"}
    eng = l3_engine(model_dirs, url, extra_config={"l3": l3})
    tokens = prompt(61, 3 * CHUNK + 1)
    eng.add_request("r", tokens, max_tokens=1)
    meta = eng.step().kv_connector_metadata  # the store ran; its verdict comes next step
    assert sum(len(job.l3_units) for job in meta.stores) == 3
    worker = eng.worker.worker
    eng.worker.shutdown()
    assert worker.l3 is not None and worker.l3.lost_at_shutdown == 3
    assert worker.stats.data["fallbacks"]["l3_write_lost_shutdown"] == 3
    assert objects_in_storage(url, chunk_keys(eng, tokens)[:3], ranks=1) == []
