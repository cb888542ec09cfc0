"""RunPool serves work in ticket order (the earliest unit's runs first), finishes what was
queued before a shutdown, and refuses work after it."""

from __future__ import annotations

import threading

import pytest

from vllm_draft_offload.run_pool import RunPool


def test_the_lowest_ticket_waiting_is_served_first() -> None:
    pool = RunPool(1, "order-test")
    gate = threading.Event()
    served: list[tuple[int, int]] = []
    pool.submit(pool.ticket(), gate.wait, 10)  # holds the one thread while work queues
    late, early = pool.ticket(), pool.ticket()
    late, early = max(late, early), min(late, early)
    # Submitted interleaved, later ticket first, as two units' readers might.
    futures = [
        pool.submit(ticket, served.append, (ticket, i))
        for i in range(3)
        for ticket in (late, early)
    ]
    gate.set()
    for future in futures:
        future.result(timeout=10)
    assert served == [(early, 0), (early, 1), (early, 2), (late, 0), (late, 1), (late, 2)]
    pool.shutdown()


def test_errors_reach_the_caller_and_shutdown_drains_then_refuses() -> None:
    pool = RunPool(2, "drain-test")

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        pool.submit(pool.ticket(), fail).result(timeout=10)
    gate = threading.Event()
    blocked = pool.submit(pool.ticket(), gate.wait, 10)
    queued = [pool.submit(pool.ticket(), lambda i=i: i) for i in range(5)]
    threading.Timer(0.05, gate.set).start()
    pool.shutdown()  # returns once the queued work ran
    assert blocked.done() and [f.result(timeout=0) for f in queued] == list(range(5))
    with pytest.raises(RuntimeError):
        pool.submit(pool.ticket(), lambda: None)
    assert not any(t.is_alive() for t in pool._threads)
