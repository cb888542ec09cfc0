"""Python's GIL switch interval, lowered only while a request waits on storage.

A storage read thread takes the GIL back after each read-and-hash call, and each take
can wait out a whole switch interval of the engine thread's Python (Python's default:
5 ms). Lowering the interval (``sys.setswitchinterval``, process-wide) makes those takes
prompt: with the Python reader, fetches beside a busy engine loop ran 2.5 x faster at
0.5 ms (``l3-stages --switch-interval-ms``). But the engine thread then hands the GIL to
vLLM's other threads ten times as often too, on every engine step while the interval
stays low, for no gain when no request waits on storage (one pair of session 22's soaks
on an H100: an engine with the connector on and every request opting out of it at 0.94 x
the no-connector engine's output rate with the interval held at 0.5 ms, 1.02 x with
Python's 5 ms; a later soak's idle phase at 0.86 x with 5 ms kept, so how much of that
cost is the interval's is not settled).

So the interval is low only while some request waits on a storage lookup or fetch: the
scheduler lowers it as a lookup starts (``L3Prefetch``) and tells the workers with every
step (``l3_reads_waiting``; a worker that issues a fetch knows it too), and it goes back
to what the process had as soon as none waits. Several
storage tiers in one process (tests, benchmarks) share it: the lowest interval any of
them wants while its requests wait applies, and the process's own comes back once none
waits.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref

from vllm_draft_offload.config import L3Config

logger = logging.getLogger(__name__)

# Reentrant: a claim's finalizer (below) may run during a collection on a thread that
# holds the lock.
_lock = threading.RLock()
# Who wants the interval lowered now, and to how many seconds.
_wanted: dict[int, float] = {}
# The process's interval before the first lowering (None: not lowered now).
_normal: float | None = None


class WaitingSwitchInterval:
    """One storage tier's say on the interval: ``low_seconds`` while its requests wait
    on storage (``set_waiting(True)``), nothing otherwise. ``None`` never lowers it."""

    @classmethod
    def for_config(cls, config: L3Config) -> WaitingSwitchInterval:
        """The tier's ``l3.switch_interval_ms`` (scheduler and workers alike)."""
        low_ms = config.switch_interval_ms
        return cls(None if low_ms is None else low_ms / 1000)

    def __init__(self, low_seconds: float | None) -> None:
        self.low_seconds = low_seconds
        self._key = id(self)
        # A tier dropped without close() (an engine torn down while a request waited)
        # must not keep the interval low for the rest of the process.
        weakref.finalize(self, _withdraw, self._key)

    @property
    def lowered(self) -> bool:
        with _lock:
            return self._key in _wanted

    def set_waiting(self, waiting: bool) -> None:
        """Called with every step's verdict; changes the interval only on a change."""
        if self.low_seconds is None:
            return
        with _lock:
            if waiting == (self._key in _wanted):
                return
            if waiting:
                _wanted[self._key] = self.low_seconds
            else:
                del _wanted[self._key]
            _apply()

    def close(self) -> None:
        self.set_waiting(False)


def _withdraw(key: int) -> None:
    with _lock:
        if _wanted.pop(key, None) is not None:
            _apply()


def _apply() -> None:
    """Set the interval from ``_wanted``, under ``_lock``: never above the process's own."""
    global _normal
    if _wanted:
        if _normal is None:
            _normal = sys.getswitchinterval()
        target = min(min(_wanted.values()), _normal)
    elif _normal is not None:
        target, _normal = _normal, None
    else:
        return
    if target != sys.getswitchinterval():
        logger.debug("DraftOffloadConnector: GIL switch interval %.2f ms", target * 1000)
        sys.setswitchinterval(target)
