"""A fetch given up stops its reads in flight (l3_worker.cancel_fetches): queued ones were
skipped already, and one reading an fs:// object now stops before its next piece,
reported FETCH_CANCELLED with nothing published. Real fs:// storage through the worker's
own fetch path; the throttle holds a read at its start, so the cancel comes while it is
in flight."""

from __future__ import annotations

import time
from pathlib import Path

from kv_sim import prompt
from l3_throttle import throttle
from test_l3_tier import fill_l3, l3_engine
from test_l3_writes import chunk_keys

from vllm_draft_offload.l3_worker import FetchResult
from vllm_draft_offload.metadata import FETCH_CANCELLED


def _result(l3, timeout_s: float = 10.0) -> FetchResult:  # noqa: ANN001 - WorkerL3
    return l3.fetches_done.get(timeout=timeout_s)


def test_a_cancel_stops_a_read_in_flight(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(31, 3 * 32 + 3)
    fill_l3(model_dirs, url, tokens)
    eng = l3_engine(model_dirs, url)
    l3 = eng.worker.worker.l3
    assert l3 is not None and l3.store is not None
    keys = chunk_keys(eng, tokens)
    # Not cancelled: the unit lands.
    l3.fetch_unit(1, 0, keys[0])
    landed = _result(l3)
    assert (landed.job_id, landed.cause) == (1, None) and landed.successors is not None
    slow = throttle(l3.store, get=0.3)
    l3.fetch_unit(2, 1, keys[1])
    deadline = time.monotonic() + 5
    while slow.gets_in_flight == 0:  # its read has started (held at the throttle)
        assert time.monotonic() < deadline, "the read never started"
        time.sleep(0.001)
    l3.cancel_fetches([2])
    stopped = _result(l3)
    assert (stopped.job_id, stopped.cause, stopped.successors) == (2, FETCH_CANCELLED, None)
    # The read pool is free again: a later fetch lands as before.
    l3.fetch_unit(3, 2, keys[2])
    after = _result(l3)
    assert (after.job_id, after.cause) == (3, None)
    eng.shutdown()
