"""Scheduler-side L3 hits: look chunks up in storage and fetch them into the CPU tier.

While a request's lookup or fetch is in flight, `get_num_new_matched_tokens`
answers "ask again" (None), so vLLM schedules other work and the request is
admitted once the units sit in host slots; then it is an ordinary CPU hit. A
fetched unit gets its identity (chunk key plus successor tokens) from the
object's header, so the EAGLE successor rule applies to L3 hits unchanged.

While a request waits, the CPU units of its matched prefix (and units fetched
for it) are pinned, so the placeholders of its own fetches, or other requests'
stores, cannot evict its head. `l3.hit_policy` decides how much of a storage
hit is fetched (l3_cost.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.l3_cost import CostModel
from vllm_draft_offload.l3_tier import SchedulerL3
from vllm_draft_offload.metadata import FetchJob
from vllm_draft_offload.metrics import DraftOffloadStats

logger = logging.getLogger(__name__)

# Successor tuple of a unit whose header has not been read yet; token ids are >= 0.
PLACEHOLDER = -1
# Refusal cause of a unit whose TP ranks' objects disagree.
RANK_MISMATCH = "rank_mismatch"
# Decline causes: storage hits that would load slower than recompute, and chunks
# not even looked up because a full hit would (they may or may not be stored).
SLOWER_THAN_RECOMPUTE = "slower_than_recompute"
NOT_LOOKED_UP = "not_looked_up"


@dataclass
class L3RequestState:
    first_chunk: int
    phase: str = "lookup"  # lookup -> [probe ->] fetch -> done
    # Storage hits found by the lookup, and the probe's deadline (first hit only).
    hits: int = 0
    probe_deadline: float = 0.0
    lookup: Future[list[bool]] | None = None
    lookup_started: float = 0.0
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
        config: L3Config,
        stats: DraftOffloadStats,
        new_job_id: Callable[[], int],
        unit_bytes: int,
    ) -> None:
        self.lookup = lookup
        self.index = index
        self.chunk_size = chunk_size
        self.timeout_s = config.timeout_s
        self.hit_policy = config.hit_policy
        self.stats = stats
        self.new_job_id = new_job_id
        self.cost = CostModel(chunk_size, unit_bytes, config.io_threads)
        self._requests: dict[str, L3RequestState] = {}
        # Units pinned for a request while it waits on its lookup or fetches.
        self._pins: dict[str, list[UnitId]] = {}
        self._pending_fetches: list[FetchJob] = []
        # fetch job id -> (request id or None for a probe, placeholder unit)
        self.fetch_units: dict[int, tuple[str | None, UnitId]] = {}

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
        """Drive the request's L3 lookup/fetch; True while vLLM should ask again later.

        While True, the CPU units of `match` stay pinned; they are unpinned as soon
        as it answers False (the caller then matches again and admits the request).
        """
        if self._drive(req_id, match, keys, num_tokens, num_computed):
            self._pin(req_id, (view.handle for _, view in match.chunks))  # type: ignore[misc]
            return True
        self._unpin_all(req_id)
        return False

    def _drive(
        self,
        req_id: str,
        match: PrefixMatch,
        keys: Sequence[bytes],
        num_tokens: int,
        num_computed: int,
    ) -> bool:
        if self.hit_policy == "never":
            return False
        first = self._first_missing_chunk(match, num_computed)
        last = min(len(keys), num_tokens // self.chunk_size)
        if first is None or first >= last:
            return False
        state = self._requests.get(req_id)
        in_range = state is not None and state.first_chunk < first < state.checked_until
        if in_range and state.phase != "probe":
            # Part of a range already looked up: the rest failed or is still coming.
            return bool(state.jobs) and time.monotonic() < state.deadline + self.timeout_s
        if not in_range and (state is None or state.first_chunk != first):
            state = L3RequestState(first, deadline=time.monotonic() + self.timeout_s)
            self._requests[req_id] = state
            if (
                self.hit_policy == "cost"
                and not self.cost.storage.stale()
                and not self.cost.chunks_worth_loading(first, last - first, round_trip=True)
            ):
                # Even a full hit would load slower than recompute: skip the round trip.
                state.phase = "done"
                state.checked_until = last
                self.stats.record_l3_declined(NOT_LOOKED_UP, last - first)
                return False
            # Pin the head before the lookup's answer reserves placeholders.
            self._pin(req_id, (view.handle for _, view in match.chunks))  # type: ignore[misc]
            state.lookup_started = time.perf_counter()
            state.lookup = self.lookup.lookup(list(keys[first:last]))
        if state.phase == "lookup":
            assert state.lookup is not None
            if not state.lookup.done():
                if time.monotonic() < state.deadline:
                    return True
                state.phase = "done"
                self.stats.record_fallback("l3_unavailable")
                return False
            try:
                present = state.lookup.result()
            except Exception:  # a storage bug must never reach the scheduler thread
                logger.exception("DraftOffloadConnector: unexpected L3 lookup error; recomputing")
                self.stats.record_fallback("l3_lookup_failed")
                state.phase = "done"
                return False
            self.cost.storage.observe_round_trip(time.perf_counter() - state.lookup_started)
            self._start_fetches(req_id, state, keys, present)
        if state.phase == "probe":
            if state.jobs and time.monotonic() < state.probe_deadline:
                return True
            self._after_probe(req_id, state, keys)
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
        wanted = hits
        state.hits = hits
        if self.hit_policy == "cost" and hits and self.cost.storage.samples == 0:
            # Storage speed unknown: fetch this request's first chunk as a probe and
            # wait for it briefly (a bounded share of the recompute it would save).
            wait_s = self.cost.probe_wait_s(state.first_chunk, hits)
            job_id = self._reserve_fetch(req_id, keys[state.first_chunk]) if wait_s else None
            if job_id is not None:
                state.phase = "probe"
                state.probe_deadline = time.monotonic() + wait_s
                state.checked_until = state.first_chunk + hits
                state.jobs.add(job_id)
                return
        if self.hit_policy == "cost" and hits:
            wanted = self.cost.chunks_worth_loading(state.first_chunk, hits, round_trip=False)
            if wanted < hits:
                self.stats.record_l3_declined(SLOWER_THAN_RECOMPUTE, hits - wanted)
            if not wanted and self.cost.storage.stale():
                # Measure the storage with one unit, in the background: the request
                # recomputes, and the unit lands in the CPU tier for later requests.
                self._reserve_fetch(None, keys[state.first_chunk])
        state.phase = "fetch" if wanted else "done"
        state.checked_until = state.first_chunk + max(hits, 1)
        self._fetch_chunks(req_id, state, keys, state.first_chunk, wanted)

    def _after_probe(self, req_id: str, state: L3RequestState, keys: Sequence[bytes]) -> None:
        """The probe landed (or its wait ran out): fetch what the measured speed pays for."""
        # The probe chunk sits in the CPU tier now, unless it failed or is still coming.
        probed = 1 if not state.jobs and self.cost.storage.samples else 0
        if state.jobs:
            # Too slow to wait for: recompute. The fetch finishes in the background
            # and still times the storage for later requests.
            for job_id in state.jobs:
                self.fetch_units[job_id] = (None, self.fetch_units[job_id][1])
            state.jobs.clear()
        wanted = 0
        if probed and self.cost.storage.samples:
            wanted = self.cost.chunks_worth_loading(state.first_chunk, state.hits, False)
        taken = max(probed, wanted)
        if taken < state.hits:
            self.stats.record_l3_declined(SLOWER_THAN_RECOMPUTE, state.hits - taken)
        state.phase = "done"
        if wanted <= 1:
            return
        state.phase = "fetch"
        self._fetch_chunks(req_id, state, keys, state.first_chunk + 1, wanted - 1)

    def _fetch_chunks(
        self,
        req_id: str,
        state: L3RequestState,
        keys: Sequence[bytes],
        first: int,
        count: int,
    ) -> None:
        """Fetch chunks [first, first + count) for the request, as far as slots allow."""
        for chunk in range(first, first + count):
            job_id = self._reserve_fetch(req_id, keys[chunk])
            if job_id is None:
                break  # no free slot that is not this request's own: recompute the rest
            state.jobs.add(job_id)
        if not state.jobs:
            state.phase = "done"

    def _reserve_fetch(self, req_id: str | None, chunk_key: bytes) -> int | None:
        job_id = self.new_job_id()
        placeholder: UnitId = (chunk_key, (PLACEHOLDER, job_id))
        # Evicts only unpinned, ready units: never a waiting request's head.
        entry = self.index.reserve(placeholder)
        if entry is None:
            return None
        self._pending_fetches.append(FetchJob(job_id, entry.slot, chunk_key))
        self.fetch_units[job_id] = (req_id, placeholder)
        return job_id

    def take_fetch_jobs(self) -> list[FetchJob]:
        jobs, self._pending_fetches = self._pending_fetches, []
        return jobs

    def fetch_timing(self, seconds: float) -> None:
        """One rank's fetch of one unit took `seconds` (read, decode, copy)."""
        self.cost.storage.observe_fetch(seconds)

    def fetch_finished(self, job_id: int, successors: list[int] | None, cause: str | None) -> None:
        """All workers answered a fetch: publish the unit, or drop it and say why."""
        req_id, placeholder = self.fetch_units.pop(job_id)
        state = self._requests.get(req_id) if req_id is not None else None
        if state is not None:
            state.jobs.discard(job_id)
        if successors is None or cause is not None:
            self.index.remove(placeholder)
            self.stats.record_refused(cause or "l3_corrupt")
            if cause == RANK_MISMATCH:
                # Ranks hold different units under one name: never fetch it again.
                self.lookup.mark_broken(placeholder[0])
            return
        final: UnitId = (placeholder[0], tuple(successors))
        if self.index.get(final) is not None:
            self.index.remove(placeholder)  # the CPU tier got the same unit meanwhile
        else:
            self.index.rekey(placeholder, final)
            self.index.commit(final)
        if req_id is not None and state is not None and state.phase in ("probe", "fetch"):
            # Keep it until the request is admitted: later fetches must not evict it.
            self._pin(req_id, [final])

    def _pin(self, req_id: str, units: Iterable[UnitId]) -> None:
        pinned = self._pins.setdefault(req_id, [])
        for unit_id in units:
            if unit_id not in pinned and self.index.get(unit_id) is not None:
                self.index.pin(unit_id)
                pinned.append(unit_id)

    def _unpin_all(self, req_id: str) -> None:
        for unit_id in self._pins.pop(req_id, ()):
            self.index.unpin(unit_id)

    def pinned_units(self, req_id: str) -> list[UnitId]:
        return list(self._pins.get(req_id, ()))

    def waiting(self, req_id: str) -> bool:
        """The request waits on a lookup or a fetch (for invariant checks)."""
        state = self._requests.get(req_id)
        return state is not None and state.phase in ("lookup", "probe", "fetch")

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._unpin_all(req_id)

    def reset(self) -> None:
        """Forget what this engine learnt about storage contents (cache reset)."""
        self.lookup.reset()
