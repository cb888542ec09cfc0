"""What the scheduler keeps about one request's storage lookup and fetch while it waits
(l3_waits.py, l3_hit_driver.py), and while an overlapped restore still loads it
(restore_overlap.py)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_draft_offload.l3_decisions import L3Decision


@dataclass
class L3RequestState:
    first_chunk: int
    end_chunk: int  # chunks [first_chunk, end_chunk) are looked up
    decision: L3Decision
    phase: str = "lookup"  # lookup -> [probe ->] fetch -> done
    hits: int = 0  # leading chunks storage holds
    # A later call whose first missing chunk is in [first_chunk, covered_until] is
    # this same lookup, further along; past it a new lookup starts.
    covered_until: int = 0
    lookup: Future[list[bool]] | None = None
    lookup_started: float = 0.0
    jobs: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)  # the wait clock
    # Leading chunks landed so far, and when the fetch last made progress.
    landed: int = 0
    progress: float = field(default_factory=time.monotonic)
    # When the scheduler last asked about it: the gap is the step cadence the request
    # waits at (an answer reaches it only with a step), not the engine's mean step time.
    polled: float = field(default_factory=time.monotonic)
    # When the (non-probe) fetch began, and its units landed since, in any order: the
    # pace it makes prices the rest of it. Reads on several threads land out of order,
    # so the leading count alone can stand still while the fetch is on pace (on an H100
    # a warm fetch of 64 units was given up with 5 leading ones in after 46 ms, priced
    # from them at 0.54 s where the whole fetch takes about 0.2 s).
    fetch_started: float | None = None
    fetched: int = 0
    # When its first unit landed: the pace is timed from there, since a round's reads
    # land together one read's time after they start (an H100 host: 1 of 64 in after
    # 29 ms priced the rest at 1.8 s, where the whole fetch took 0.19 s).
    first_landing: float | None = None
    # Chunks chosen for the fetch that found no CPU-tier slot yet, from `next_fetch` on:
    # reserved in order as slots free up while the fetch runs (never past a gap, so a
    # full tier drops tails, never heads).
    short: int = 0
    next_fetch: int = 0
    # Fetch job -> the chunk it fetches, and the chunks whose fetch landed (any order):
    # an overlapped restore's leading landed chunks, once the request is admitted.
    job_chunks: dict[int, int] = field(default_factory=dict)
    landed_chunks: set[int] = field(default_factory=set)
    # Overlapped restore (restore_overlap.py): admitted with its fetches still landing
    # (offered: told to the scheduler, not yet bound), and the load job that restores it.
    overlap_offered: bool = False
    load_job: int | None = None

    def leading_landed(self) -> int:
        """Chunks from first_chunk on whose fetches all landed."""
        count = 0
        while self.first_chunk + count in self.landed_chunks:
            count += 1
        return count
