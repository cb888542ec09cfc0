"""Per-step timing of the connector's hooks: wraps the hooks of both halves of
``DraftOffloadConnector`` and sums the seconds spent in each, step by step (used by
``hook-cost`` in CPU time and by ``decode-overhead --time-hooks`` in wall time)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",  # what vLLM calls on a SupportsHMA connector
    "get_kv_connector_stats",
    "has_pending_push_work",
    "has_pending_block_frees",
)
WORKER_HOOKS = (
    "handle_preemptions",
    "start_load_kv",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "wait_for_save",
)

# The engine thread's CPU time, not wall time: what other processes on a shared machine
# take from it does not count (what the engine does meanwhile, it does anyway).
cpu_time = time.thread_time


class Clock:
    """Seconds spent per name in the current step, then per step; ``timer`` is the
    engine thread's CPU time, or wall time where waiting counts (a GPU)."""

    def __init__(self, timer: Callable[[], float] = cpu_time) -> None:
        self.timer = timer
        self.step: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        # The longest single call per name: a stall of one call reads apart from many
        # slightly slower ones with the same sum.
        self.longest: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        timer = self.timer

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = timer()
            try:
                return func(*args, **kwargs)
            finally:
                elapsed = timer() - start
                self.step[name] += elapsed
                self.calls[name] += 1
                self.longest[name] = max(self.longest[name], elapsed)

        return timed

    def wrap_hooks(self, scheduler_connector: Any, worker_connector: Any) -> None:
        """Time the connector's hooks on these instances (None: that half is absent)."""
        for obj, prefix, names in (
            (scheduler_connector, "sched", SCHEDULER_HOOKS),
            (worker_connector, "worker", WORKER_HOOKS),
        ):
            if obj is not None:
                for name in names:
                    setattr(obj, name, self.wrap(f"{prefix}.{name}", getattr(obj, name)))

    def end_step(self, **tags: float) -> None:
        self.steps.append({**self.step, **tags})
        self.step = defaultdict(float)
