"""L3 prefetch at the connector level: a waiting request's own CPU hit stays put,
TP ranks must agree, storage errors never reach the scheduler, lookups overlap.

Real Scheduler and connector halves (kv_sim), real LMCache fs:// and Redis backends.
"""

from __future__ import annotations

from pathlib import Path

from kv_sim import prompt
from test_l3_tier import CHUNK, finish_l3_writes, l3_engine


def test_fetch_never_evicts_the_requests_own_cpu_hit(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Head in the CPU tier (at the LRU front), tail only in storage, tier full."""
    url = f"fs://{tmp_path / 'l3'}"
    eng = l3_engine(model_dirs, url, cpu_units=4)
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
    eng.add_request("again", full, max_tokens=1)
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
