"""Threads that serve work in ticket order: the runs of the earliest unit first.

A fetch spreads each unit's layers over these threads (unit_fetch.py). With several
units in flight, a first-in-first-out pool serves their runs interleaved, in the order
their readers happened to submit them, so the units all land late and together. Here
each unit takes a ticket when its reader starts, and a free thread always takes a run
of the lowest ticket waiting: units land one after another, as early as the threads
allow, while the next unit's runs fill any thread the current one leaves idle.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# Sorts after every ticket: a stop sentinel runs once the work queued before it is done.
_STOP = float("inf")


class RunPool:
    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.PriorityQueue[tuple[float, int, Any]] = queue.PriorityQueue()
        self._tickets = itertools.count()
        self._order = itertools.count()  # ties: submission order
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def ticket(self) -> int:
        """A unit's place in line: lower tickets are served first."""
        return next(self._tickets)

    def submit(self, ticket: int, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on a pool thread, before any work of a later ticket.
        Raises RuntimeError once the pool is shut down."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("RunPool is shut down")
            self._queue.put((ticket, next(self._order), (fn, args, future)))
        return future

    def _work(self) -> None:
        while True:
            ticket, _, item = self._queue.get()
            if ticket == _STOP:
                return
            fn, args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Finish the work queued so far, then stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put((_STOP, next(self._order), None))
        for thread in self._threads:
            thread.join()
