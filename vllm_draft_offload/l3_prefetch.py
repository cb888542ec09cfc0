"""Scheduler-side L3 hits: look chunks up in storage and fetch them into the CPU tier.

While a request's lookup or fetch is in flight, `get_num_new_matched_tokens`
answers "ask again" (None), so vLLM schedules other work and the request is
admitted once the units sit in host slots; then it is an ordinary CPU hit. A
fetched unit gets its identity (chunk key plus successor tokens) from the
object's header, so the EAGLE successor rule applies to L3 hits unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.l3_tier import SchedulerL3
from vllm_draft_offload.metadata import FetchJob
from vllm_draft_offload.metrics import DraftOffloadStats

# Successor tuple of a unit whose header has not been read yet; token ids are >= 0.
PLACEHOLDER = -1


@dataclass
class L3RequestState:
    first_chunk: int
    phase: str = "lookup"  # lookup -> fetch -> done
    lookup: Future[list[bool]] | None = None
    jobs: set[int] = field(default_factory=set)
    deadline: float = 0.0
    # Chunks below this were already looked up for this request: don't ask again.
    checked_until: int = 0


class L3Prefetch:
    def __init__(
        self,
        lookup: SchedulerL3,
        index: CpuTierIndex,
        chunk_size: int,
        timeout_s: float,
        stats: DraftOffloadStats,
        new_job_id: Callable[[], int],
    ) -> None:
        self.lookup = lookup
        self.index = index
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self.stats = stats
        self.new_job_id = new_job_id
        self._requests: dict[str, L3RequestState] = {}
        self._pending_fetches: list[FetchJob] = []
        # fetch job id -> (request id, placeholder unit)
        self.fetch_units: dict[int, tuple[str, UnitId]] = {}

    def _first_missing_chunk(self, match: PrefixMatch, num_computed: int) -> int | None:
        """First chunk the CPU tier lacks, or None when L3 cannot extend the match."""
        if not match.chunks:
            return num_computed // self.chunk_size
        last_chunk = match.chunks[-1][0]
        if match.end_token != (last_chunk + 1) * self.chunk_size:
            return None  # stopped inside a chunk: successors differ or the prompt ends
        return last_chunk + 1

    def must_wait(
        self,
        req_id: str,
        match: PrefixMatch,
        keys: Sequence[bytes],
        num_tokens: int,
        num_computed: int,
    ) -> bool:
        """Drive the request's L3 lookup/fetch; True while vLLM should ask again later."""
        first = self._first_missing_chunk(match, num_computed)
        last = min(len(keys), num_tokens // self.chunk_size)
        if first is None or first >= last:
            return False
        state = self._requests.get(req_id)
        if state is not None and state.first_chunk < first < state.checked_until:
            # Part of a range already looked up: the rest failed or is still coming.
            return bool(state.jobs) and time.monotonic() < state.deadline + self.timeout_s
        if state is None or state.first_chunk != first:
            state = L3RequestState(first, deadline=time.monotonic() + self.timeout_s)
            state.lookup = self.lookup.lookup(list(keys[first:last]))
            self._requests[req_id] = state
        if state.phase == "lookup":
            assert state.lookup is not None
            if not state.lookup.done():
                if time.monotonic() < state.deadline:
                    return True
                state.phase = "done"
                self.stats.record_fallback("l3_unavailable")
                return False
            self._start_fetches(req_id, state, keys, state.lookup.result())
        if state.phase == "fetch":
            if state.jobs and time.monotonic() < state.deadline + self.timeout_s:
                return True
            state.phase = "done"
        return False

    def _start_fetches(
        self, req_id: str, state: L3RequestState, keys: Sequence[bytes], present: list[bool]
    ) -> None:
        hits = 0
        for found in present:
            if not found:
                break
            hits += 1
        self.stats.record_lookup("l3", hits, len(present) - hits)
        state.phase = "fetch" if hits else "done"
        state.checked_until = state.first_chunk + max(hits, 1)
        for chunk in range(state.first_chunk, state.first_chunk + hits):
            job_id = self.new_job_id()
            placeholder: UnitId = (keys[chunk], (PLACEHOLDER, job_id))
            entry = self.index.reserve(placeholder)
            if entry is None:
                break  # no free slot: fetch what fits, recompute the rest
            self._pending_fetches.append(FetchJob(job_id, entry.slot, keys[chunk]))
            self.fetch_units[job_id] = (req_id, placeholder)
            state.jobs.add(job_id)
        if not state.jobs:
            state.phase = "done"

    def take_fetch_jobs(self) -> list[FetchJob]:
        jobs, self._pending_fetches = self._pending_fetches, []
        return jobs

    def fetch_finished(self, job_id: int, successors: list[int] | None, cause: str | None) -> None:
        """All workers answered a fetch: publish the unit, or drop it and say why."""
        req_id, placeholder = self.fetch_units.pop(job_id)
        state = self._requests.get(req_id)
        if state is not None:
            state.jobs.discard(job_id)
        if successors is None or cause is not None:
            self.index.remove(placeholder)
            self.stats.record_refused(cause or "l3_corrupt")
            return
        final: UnitId = (placeholder[0], tuple(successors))
        if self.index.get(final) is not None:
            self.index.remove(placeholder)  # the CPU tier got the same unit meanwhile
            return
        self.index.rekey(placeholder, final)
        self.index.commit(final)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
