"""What an in-process engine did during a timed batch (decode-overhead ``--time-hooks``):
its decode steps' wall times and the garbage collector's pauses.

A batch's decode tokens/s alone cannot tell a batch whose every step ran slower from
one that stalled a few times (H200, sessions 30-31: pairs of batches 0.57-1.46 apart
with the GPU 56-100 % busy). Step times tell them apart, and their tail is what a
user sees as inter-token latency: a store whose copy call holds the engine's thread
(session 31, decode-step stores by DMA: a storing batch's longest ``wait_for_save``
call 22.6-42.5 ms, of which steps not recorded) shows as a slow step, which a batch's
mean rate spreads thin. GC pauses are timed from ``gc.callbacks``.

A decode step's time is the interval between the engine's outputs (each step that
returns a finished batch's results), so it holds the engine loop's own work around the
step too, as a user's inter-token latency does, and it reads the same whether the engine
steps one batch at a time or keeps a queue of two (async scheduling: each call either
schedules one more batch and returns at once, or waits for the oldest). A step is a
decode step when no request in the batch it finished was scheduled more than
``1 + num_speculative`` tokens (no prompt chunk in it).
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

# A decode step this many times the batch's median decode step is a stall.
STALL_FACTOR = 3.0
# Stalls listed with their place in the batch (stalls_at), at most.
STALLS_LISTED = 16


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
        self.max_decode_tokens = max_decode_tokens
        self._on = False
        # Whether each batch scheduled and not yet finished is a decode batch, oldest
        # first (kept while off too, so it stays aligned with the engine's queue).
        self._scheduled: deque[bool] = deque()
        self._last_output: float | None = None
        self._steps: list[tuple[float, bool]] = []
        self._gc: list[tuple[int, float]] = []
        self._gc_started: float | None = None
        self._restore: list[Callable[[], None]] = []
        self._wrap(core, step_attr, self._timed_step)
        self._wrap(core.scheduler, "schedule", self._classified_schedule)
        gc.callbacks.append(self._on_gc)

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        """Timing starts afresh: the first output after this begins the first interval."""
        self._on, self._last_output = value, None

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:  # noqa: ANN401
        original = getattr(owner, name)
        had_own = name in vars(owner)  # else a method of its class: delete the wrapper
        setattr(owner, name, make(original))
        self._restore.append(
            lambda: setattr(owner, name, original) if had_own else delattr(owner, name)
        )

    def _timed_step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:  # noqa: ANN401
            result = step()
            # EngineCore's steps return (outputs, executed); outputs None: it only
            # scheduled one more batch, which finishes at a later call.
            if isinstance(result, tuple) and result and result[0] is None:
                return result
            decode = self._scheduled.popleft() if self._scheduled else False
            if self._on:
                now = time.perf_counter()
                if self._last_output is not None:
                    self._steps.append((now - self._last_output, decode))
                self._last_output = now
            return result

        return timed

    def _classified_schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        def classified(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            output = schedule(*args, **kwargs)
            tokens = output.num_scheduled_tokens.values()
            self._scheduled.append(bool(tokens) and max(tokens) <= self.max_decode_tokens)
            return output

        return classified

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self._on:
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
    and GC pauses (count, generation-2 count, total and longest ms).

    Where the longest step and the first ``STALLS_LISTED`` stalls fell (``*_at``): each
    as [decode steps before it since the batch's last step with prompt tokens, or since
    timing began, ms]. A step right after the prompts (0, 1, ...) is one behind their
    stores; one a chunk's worth of decode steps later is behind a decode-built chunk's."""
    decode_ms: list[float] = []
    since_prompt: list[int] = []
    run = 0
    for seconds, is_decode in steps:
        if not is_decode:
            run = 0
            continue
        decode_ms.append(1e3 * seconds)
        since_prompt.append(run)
        run += 1
    decode = np.array(decode_ms)
    summary: dict[str, Any] = {"engine_steps": len(steps), "decode_steps": int(decode.size)}
    if decode.size:
        median = float(np.median(decode))
        is_stall = decode > STALL_FACTOR * median
        stalls = decode[is_stall]
        longest = int(decode.argmax())
        summary.update(
            decode_step_median_ms=median,
            decode_step_p99_ms=float(np.percentile(decode, 99)),
            decode_step_max_ms=float(decode[longest]),
            decode_step_max_at=since_prompt[longest],
            stall_steps=int(stalls.size),
            stall_ms=float((stalls - median).sum()),
            stalls_at=[[since_prompt[i], float(decode[i])] for i in np.flatnonzero(is_stall)][
                :STALLS_LISTED
            ],
        )
    seconds = [s for _, s in pauses]
    summary.update(
        gc_collections=len(pauses),
        gc_gen2=sum(1 for generation, _ in pauses if generation == 2),
        gc_pause_ms=1e3 * sum(seconds),
        gc_longest_ms=1e3 * max(seconds, default=0.0),
    )
    return summary
