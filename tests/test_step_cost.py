"""What the connector does on a decode step with nothing to move, through the real vLLM
Scheduler (tests/kv_sim.py): work only for the requests a step completes a chunk of."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from kv_sim import SimEngine, SimSetup, prompt

CHUNK = 32


class BlockTableReads:
    """The KV cache manager the connector's scheduler half sees, counting which
    requests' block tables it reads; everything else goes to vLLM's own."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self.reads: Counter[str] = Counter()

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        self.reads[req_id] += 1
        return self._manager.get_block_ids(req_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def test_decode_steps_read_only_block_tables_of_requests_with_a_chunk_to_store(
    model_dirs: tuple[Path, Path],
) -> None:
    eng = SimEngine(*model_dirs, SimSetup())
    sched = eng.scheduler.connector.scheduler
    reads = BlockTableReads(sched._kv_cache_manager)
    sched._kv_cache_manager = reads
    # Two requests decoding over several chunk ends, at different offsets.
    eng.add_request("a", prompt(1, CHUNK + 5), max_tokens=3 * CHUNK)
    eng.add_request("b", prompt(2, 2 * CHUNK - 3), max_tokens=3 * CHUNK)
    steps = 0
    while eng.scheduler.has_requests() or sched.has_inflight_jobs():
        reads.reads.clear()
        out = eng.step()
        steps += 1
        stored = Counter(job.req_id for job in out.kv_connector_metadata.stores)
        # A request's table is read in a step exactly when a store job of it is planned
        # (request_finished reads none: vLLM hands the finished request's blocks over).
        assert reads.reads == stored, f"step {steps}"
    assert steps > 3 * CHUNK  # one token a step: mostly steps that complete no chunk
    # Nothing was skipped: every whole chunk of both requests is in the tier (the last
    # sampled token has no KV).
    whole = (CHUNK + 5 + 3 * CHUNK - 1) // CHUNK + (2 * CHUNK - 3 + 3 * CHUNK - 1) // CHUNK
    assert len(sched.index) == whole


def test_a_steps_store_jobs_go_as_one_copy_and_restore_exactly(
    model_dirs: tuple[Path, Path],
) -> None:
    """Three requests prefilled in one step store their chunks in one copy (one plan,
    one launch on a GPU), timed as one transfer; every unit restores bit for bit."""
    eng = SimEngine(*model_dirs, SimSetup())
    worker = eng.worker.worker
    copies: list[tuple[str, int]] = []
    copier = worker.pair_copier
    run = copier.run
    copier.run = lambda pairs, direction, stream, path=None: (
        copies.append((direction, copier.batch_bytes(pairs)[0]))
        or run(pairs, direction, stream, path)
    )
    prompts = {f"r{i}": prompt(20 + i, 2 * CHUNK + 3) for i in range(3)}
    for req_id, tokens in prompts.items():
        eng.add_request(req_id, tokens, max_tokens=2)
    eng.take_published()
    out = eng.step()
    assert len(out.kv_connector_metadata.stores) == 3  # a job per request
    unit = worker.layout.unit_bytes
    assert copies == [("store", 3 * 2 * unit)]
    eng.run_until_done()
    published = eng.take_published()
    assert published["chunks"]["store/cpu"] == 3 * 2
    assert published["timed_bytes"]["store/cpu"] == 3 * 2 * unit
    eng.evict_gpu_kv()
    for req_id, tokens in prompts.items():
        eng.add_request(f"again-{req_id}", tokens, max_tokens=1)
        eng.run_prefill(f"again-{req_id}")
        assert eng.external_hits[f"again-{req_id}"] == 2 * CHUNK
        assert eng.mismatched_positions(f"again-{req_id}") == []
