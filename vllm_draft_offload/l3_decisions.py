"""What the storage tier decided for each request, in the log.

One line per storage lookup, once the request stops waiting: the chunks the CPU
tier had, the range looked up and what storage held, the `l3.hit_policy`
decision (fetched, or declined and why), the estimated load and recompute times
behind it, the probe's outcome, how much of the fetch's first round the page cache
held at the lookup (fs:// only, l3_residency.py: "resident 8/8"; "?" where unknown),
and how long the request waited against its allowance, with the lookup's round trip
and the fetch's time in it. Logged at DEBUG, or at INFO with `l3.log_decisions:
true`; every SUMMARY_INTERVAL_S a summary line at INFO counts the decisions since
the last.

The logger is `vllm.draft_offload.l3`: under vLLM's own logger, so vLLM's handler,
format and VLLM_LOGGING_LEVEL / VLLM_LOGGING_CONFIG_PATH apply to it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from vllm.logger import init_logger

from vllm_draft_offload.l3_residency import Residency

logger = init_logger("vllm.draft_offload.l3")

SUMMARY_INTERVAL_S = 60.0
# Decisions kept for inspection (tests, debugging).
KEEP = 256


@dataclass
class L3Decision:
    req_id: str
    policy: str
    cpu_chunks: int  # leading chunks the CPU tier had
    first_chunk: int  # first chunk looked up in storage
    range_chunks: int  # chunks looked up (to the prompt's last whole chunk)
    recompute_s: float | None  # estimated recompute of the range
    estimate_source: str  # fit | calibration | rate | none
    found: int | None = None  # leading chunks storage holds; None: not looked up
    outcome: str = "pending"  # fetched | partial | declined:<cause> | lookup_failed | ...
    wanted: int = 0  # chunks the policy chose to fetch (the probe included)
    landed: int = 0  # leading chunks in the CPU tier when the request stopped waiting
    # chosen chunks that found no CPU-tier slot before the request stopped waiting
    no_slot: int = 0
    load_s: float | None = None  # estimated load time of the wanted chunks
    unit_s: float | None = None  # storage seconds per unit fetch (estimate)
    probe: str = "none"
    # Page-cache residency of the fetch's first round when the lookup found it
    # (None: not looked up, not fs://, or the kernel would not tell).
    first_round: Residency | None = None
    allowance_s: float | None = None  # the wait allowance when it stopped waiting
    waited_s: float = 0.0
    # Of the wait: the lookup's round trip, and from the fetch's start (after the probe,
    # if any) until the request stopped waiting. None: not done.
    lookup_s: float | None = None
    fetch_s: float | None = None
    # Of lookup_s: until the lookup thread had its answer; the rest waited for the
    # scheduler's next look at the request (a step). None: not timed.
    lookup_answered_s: float | None = None
    # From the fetch's start to its first unit landing, as the scheduler saw it (None:
    # nothing landed), and the estimate of that a wait before any landing bets on
    # (StorageEstimate.first_landing_s; None: storage unmeasured). The bets' slack
    # (l3_first_landing.py) is read off these.
    first_landing_s: float | None = None
    first_landing_est_s: float | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def first_round_resident(self) -> bool | None:
        """Every file of the first round was in the page cache (None: unknown)."""
        return None if self.first_round is None else self.first_round.all_resident

    def line(self) -> str:
        found = "not looked up" if self.found is None else f"{self.found}"
        # A cut fetch says why, so it is not read as the cost policy's choice.
        no_slot = f" (no CPU-tier slot for {self.no_slot} more)" if self.no_slot else ""
        rng = f"[{self.first_chunk}, {self.first_chunk + self.range_chunks})"

        def secs(value: float | None) -> str:
            return "?" if value is None else f"{value:.4f}"

        return (
            f"L3 decision req={self.req_id} policy={self.policy}: cpu chunks {self.cpu_chunks}, "
            f"storage range {rng} found {found} -> {self.outcome}; "
            f"fetch {self.wanted}{no_slot}, landed {self.landed}; est load {secs(self.load_s)} s "
            f"(unit {secs(self.unit_s)} s) vs recompute {secs(self.recompute_s)} s "
            f"({self.estimate_source}); probe {self.probe}; "
            f"resident {'?' if self.first_round is None else self.first_round.label()}; "
            f"waited {self.waited_s:.4f} s of {secs(self.allowance_s)} s "
            f"(lookup {secs(self.lookup_s)} s, answered in {secs(self.lookup_answered_s)} s, "
            f"fetch {secs(self.fetch_s)} s); "
            f"first landing {secs(self.first_landing_s)} s "
            f"(est {secs(self.first_landing_est_s)} s)"
        )


class DecisionLog:
    def __init__(self, verbose: bool) -> None:
        self.level = logging.INFO if verbose else logging.DEBUG
        self.recent: deque[L3Decision] = deque(maxlen=KEEP)
        self._counts: Counter[str] = Counter()
        self._chunks: Counter[str] = Counter()
        self._last_summary = time.monotonic()

    def record(self, decision: L3Decision) -> None:
        decision.waited_s = time.monotonic() - decision.started
        self.recent.append(decision)
        if logger.isEnabledFor(self.level):
            logger.log(self.level, "%s", decision.line())
        self._counts[decision.outcome.split(":")[0]] += 1
        self._chunks["found"] += decision.found or 0
        self._chunks["landed"] += decision.landed
        now = time.monotonic()
        if now - self._last_summary >= SUMMARY_INTERVAL_S:
            self.summary(now)

    def summary(self, now: float | None = None) -> None:
        if not self._counts:
            return
        now = time.monotonic() if now is None else now
        logger.info(
            "L3 decisions in the last %.0f s: %s; storage chunks found %d, landed %d",
            now - self._last_summary,
            ", ".join(f"{k} {v}" for k, v in sorted(self._counts.items())),
            self._chunks["found"],
            self._chunks["landed"],
        )
        self._counts.clear()
        self._chunks.clear()
        self._last_summary = now
