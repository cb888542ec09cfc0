"""What an in-process engine did during a timed batch (decode-overhead ``--time-hooks``):
its decode steps' wall times and the garbage collector's pauses.

A batch's decode tokens/s alone cannot tell a batch whose every step ran slower from
one that stalled a few times (H200, sessions 30-31: pairs of batches 0.57-1.44 apart
with the GPU 56-100 % busy). Step times tell them apart, and their tail is what a
user sees as inter-token latency: a store whose copy call holds the engine's thread
(session 31: up to 42.5 ms in one ``wait_for_save`` call) shows as a slow step, which a
batch's mean rate spreads thin. GC pauses are timed from ``gc.callbacks``.

A decode step is one where no request was scheduled more than ``1 + num_speculative``
tokens (no prompt chunk in it). With a batch queue (pipeline parallelism) a step is
classed by the batch scheduled last, not the one it finished.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# A decode step this many times the batch's median decode step is a stall.
STALL_FACTOR = 3.0


class EngineTimeline:
    """Times an in-process EngineCore's steps and the process's GC pauses while ``on``."""

    def __init__(
        self,
        core: Any,  # noqa: ANN401 - vLLM's EngineCore
        max_decode_tokens: int,
        step_attr: str = "step_fn",
    ) -> None:
        """``core.<step_attr>`` is what the engine calls once a step (EngineCore's
        ``step_fn``), ``core.scheduler`` its Scheduler."""
        self.on = False
        self.max_decode_tokens = max_decode_tokens
        self._decode_step = False
        self._steps: list[tuple[float, bool]] = []
        self._gc: list[tuple[int, float]] = []
        self._gc_started: float | None = None
        self._restore: list[Callable[[], None]] = []
        self._wrap(core, step_attr, self._timed_step)
        self._wrap(core.scheduler, "schedule", self._classified_schedule)
        gc.callbacks.append(self._on_gc)

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:  # noqa: ANN401
        original = getattr(owner, name)
        had_own = name in vars(owner)  # else a method of its class: delete the wrapper
        setattr(owner, name, make(original))
        self._restore.append(
            lambda: setattr(owner, name, original) if had_own else delattr(owner, name)
        )

    def _timed_step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:  # noqa: ANN401
            if not self.on:
                return step()
            start = time.perf_counter()
            try:
                return step()
            finally:
                self._steps.append((time.perf_counter() - start, self._decode_step))

        return timed

    def _classified_schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        def classified(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            output = schedule(*args, **kwargs)
            tokens = output.num_scheduled_tokens.values()
            self._decode_step = bool(tokens) and max(tokens) <= self.max_decode_tokens
            return output

        return classified

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc.append((int(info["generation"]), time.perf_counter() - self._gc_started))
            self._gc_started = None

    def take(self) -> dict[str, Any]:
        """The summary of what was timed since the last take."""
        steps, pauses = self._steps, self._gc
        self._steps, self._gc = [], []
        return summarize(steps, pauses)

    def close(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def summarize(steps: list[tuple[float, bool]], pauses: list[tuple[int, float]]) -> dict[str, Any]:
    """Decode steps' count, median, 99th percentile and longest (ms), the stalls among
    them (over ``STALL_FACTOR`` x the median: how many, and their ms beyond the median),
    and GC pauses (count, generation-2 count, total and longest ms)."""
    decode = np.array([seconds for seconds, is_decode in steps if is_decode]) * 1e3
    summary: dict[str, Any] = {"engine_steps": len(steps), "decode_steps": int(decode.size)}
    if decode.size:
        median = float(np.median(decode))
        stalls = decode[decode > STALL_FACTOR * median]
        summary.update(
            decode_step_median_ms=median,
            decode_step_p99_ms=float(np.percentile(decode, 99)),
            decode_step_max_ms=float(decode.max()),
            stall_steps=int(stalls.size),
            stall_ms=float((stalls - median).sum()),
        )
    seconds = [s for _, s in pauses]
    summary.update(
        gc_collections=len(pauses),
        gc_gen2=sum(1 for generation, _ in pauses if generation == 2),
        gc_pause_ms=1e3 * sum(seconds),
        gc_longest_ms=1e3 * max(seconds, default=0.0),
    )
    return summary
