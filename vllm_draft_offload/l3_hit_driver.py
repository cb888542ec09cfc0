"""One request's storage hit, driven each time vLLM asks about it: lookup, probe, fetch.

`L3HitDriver.drive` answers whether the request still waits on storage (l3_prefetch.py
then asks vLLM to ask again); the waits themselves, their allowance and their end are
l3_waits.py's. `l3.hit_policy` decides how much of a storage hit is fetched
(l3_cost.py). Under `cost`, while the storage is unmeasured the request waits on a
probe round that times it (within the wait allowance, l3_waits.py); a probe whose
first round the lookup found not wholly in the page cache is not waited on at all: it
runs in the background while the request recomputes. Without any recompute estimate
(a start with no calibration, l3_calibration.py) nothing bounds a wait: the request
does not wait, and the lookup goes on in the background (l3_background.py) to probe
the storage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.l3_background import BackgroundProbe
from vllm_draft_offload.l3_cost import PROBE_UNITS, CostModel
from vllm_draft_offload.l3_decisions import L3Decision
from vllm_draft_offload.l3_lookup import SchedulerL3
from vllm_draft_offload.l3_request import L3RequestState
from vllm_draft_offload.l3_waits import FETCH_TOO_SLOW, L3Waits
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.restore_overlap import OverlapRestores

logger = logging.getLogger(__name__)

# Decline causes (metrics.L3_DECLINE_CAUSES) of a hit not waited on (l3_waits.py holds
# those of a wait that ends): storage hits estimated to load slower than recompute;
# chunks not even looked up because a full hit would be; chunks not looked up because
# the engine's prefill speed is unknown.
SLOWER_THAN_RECOMPUTE = "slower_than_recompute"
NOT_LOOKED_UP = "not_looked_up"
SPEED_UNKNOWN = "speed_unknown"
# Hits on storage not timed yet whose first round the page cache does not hold: the
# request recomputes at once while a probe times the storage in the background.
COLD_UNMEASURED = "cold_unmeasured"


def _units(count: int) -> str:
    return f"{count} unit" if count == 1 else f"{count} units"


class L3HitDriver:
    """Moves each request's storage hit along: lookup -> [probe ->] fetch -> done."""

    def __init__(
        self,
        lookup: SchedulerL3,
        waits: L3Waits,
        cost: CostModel,
        stats: DraftOffloadStats,
        background: BackgroundProbe,
        overlap: OverlapRestores,
        chunk_size: int,
        hit_policy: str,
        found: Callable[[Sequence[bytes]], None],
    ) -> None:
        self.lookup = lookup
        self.waits = waits
        self.cost = cost
        self.stats = stats
        self.background = background
        self.overlap = overlap
        self.chunk_size = chunk_size
        self.hit_policy = hit_policy
        # Told which chunk keys a lookup found in storage.
        self._found = found

    def _first_missing_chunk(self, match: PrefixMatch, num_computed: int) -> int | None:
        """First chunk the CPU tier lacks, or None when L3 cannot extend the match."""
        if not match.chunks:
            return num_computed // self.chunk_size
        last_chunk = match.chunks[-1][0]
        if match.end_token != (last_chunk + 1) * self.chunk_size:
            return None  # stopped inside a chunk: successors differ or the prompt ends
        return last_chunk + 1

    def drive(
        self,
        req_id: str,
        match: PrefixMatch,
        keys: Sequence[bytes],
        num_tokens: int,
        num_computed: int,
    ) -> bool:
        """Move the request's lookup/fetch along; True while it waits on storage."""
        if self.hit_policy == "never":
            return False
        waits = self.waits
        first = self._first_missing_chunk(match, num_computed)
        last = min(len(keys), num_tokens // self.chunk_size)
        state = waits.states.get(req_id)
        if state is not None and state.phase != "done":
            matched = match.chunks[-1][0] + 1 if match.chunks else num_computed // self.chunk_size
            landed = max(0, matched - state.first_chunk)
            if first is None or first >= last:
                # Everything it can use is in the CPU tier (or the match ends inside
                # a chunk): admit it; anything still coming lands in the background.
                waits.finish(state, waits.outcome(state, landed), landed)
                return False
        if first is None or first >= last:
            return False
        if state is None or not state.first_chunk <= first <= state.covered_until:
            if state is not None and state.phase != "done":
                waits.finish(state, "superseded", 0)
            state = self._begin(req_id, match, keys, first, last, num_computed)
        if state.phase == "done":
            return False
        landed = first - state.first_chunk
        if state.phase == "lookup":
            assert state.lookup is not None
            if not state.lookup.done():
                if waits.may_wait(state, 0):
                    return True
                if self.hit_policy == "cost":
                    self.stats.record_l3_declined(FETCH_TOO_SLOW, state.end_chunk - first)
                    keys_looked_up = list(keys[state.first_chunk : state.end_chunk])
                    self.background.keep(state.lookup, keys_looked_up)
                else:
                    self.stats.record_fallback("l3_unavailable")
                waits.finish(state, "lookup_too_slow", 0)
                return False
            try:
                present = state.lookup.result()
            except Exception:  # a storage bug must never reach the scheduler thread
                logger.exception("DraftOffloadConnector: unexpected L3 lookup error; recomputing")
                self.stats.record_fallback("l3_lookup_failed")
                waits.finish(state, "lookup_failed", 0)
                return False
            state.decision.lookup_s = time.perf_counter() - state.lookup_started
            answered_at = getattr(present, "answered_at", None)
            if answered_at is not None:
                state.decision.lookup_answered_s = answered_at - state.lookup_started
            state.decision.first_round = getattr(present, "first_round", None)
            self.cost.storage.observe_round_trip(state.decision.lookup_s)
            self._start_fetches(req_id, state, keys, present)
        if state.phase == "fetch" and state.short:
            waits.fetch_more(req_id, state, keys)
        if state.phase in ("probe", "fetch") and state.jobs:
            if waits.may_wait(state, landed):
                # On pace: admitted now, each unit restored as it lands (an overlapped
                # restore), or asked about again.
                return not self.overlap.offer(state)
            waits.give_up(state, landed)
            return False
        if state.phase == "probe":
            self._after_probe(req_id, state, keys, landed)
            if state.phase == "fetch":
                return True  # its fetches start with this step
        if state.phase == "fetch":
            waits.finish(state, waits.outcome(state, landed), landed)
        return False

    def _begin(
        self,
        req_id: str,
        match: PrefixMatch,
        keys: Sequence[bytes],
        first: int,
        last: int,
        num_computed: int,
    ) -> L3RequestState:
        count = last - first
        decision = L3Decision(
            req_id,
            self.hit_policy,
            cpu_chunks=first - num_computed // self.chunk_size,
            first_chunk=first,
            range_chunks=count,
            recompute_s=self.cost.recompute_chunks_s(first, count),
            estimate_source=self.cost.prefill.source_for(count * self.chunk_size),
        )
        state = L3RequestState(first, last, decision, covered_until=first)
        self.waits.states[req_id] = state
        if self.hit_policy == "cost":
            storage = self.cost.storage
            if decision.recompute_s is None:
                # Nothing to weigh a wait against: recompute (the first prefill step
                # measures the engine; a calibration would have told it). Storage is
                # still looked up and measured in the background, for later requests.
                self.stats.record_l3_declined(SPEED_UNKNOWN, count)
                state.covered_until = last
                if storage.stale():
                    self.background.look_up(self.lookup.lookup, list(keys[first:last]))
                self.waits.finish(state, "declined:" + SPEED_UNKNOWN, 0)
                return state
            if not storage.stale() and not self.cost.chunks_worth_loading(first, count, True):
                # Even a full hit would load slower than recompute: skip the round trip.
                self.stats.record_l3_declined(NOT_LOOKED_UP, count)
                decision.load_s = storage.load_s(count) + storage.round_trip_s
                state.covered_until = last
                self.waits.finish(state, "declined:" + NOT_LOOKED_UP, 0)
                return state
        # Pin the head before the lookup's answer reserves placeholders.
        self.waits.pin(req_id, (view.handle for _, view in match.chunks))  # type: ignore[misc]
        state.lookup_started = time.perf_counter()
        state.lookup = self.lookup.lookup(list(keys[first:last]))
        self.waits.start_waiting(req_id)
        return state

    def _start_fetches(
        self, req_id: str, state: L3RequestState, keys: Sequence[bytes], present: list[bool]
    ) -> None:
        hits = 0
        for found in present:
            if not found:
                break
            hits += 1
        self.stats.record_lookup("l3", hits, len(present) - hits)
        first = state.first_chunk
        state.hits = state.decision.found = hits
        state.covered_until = first + hits
        if hits:
            self._found(keys[first : first + hits])
        if not hits:
            self.waits.finish(state, "miss", 0)
            return
        storage = self.cost.storage
        if self.hit_policy != "cost":
            self.waits.fetch_chunks(req_id, state, keys, first, hits, "fetch")
            return
        state.progress = time.monotonic()
        if storage.samples == 0 and state.decision.first_round_resident is False:
            # Storage speed unknown and the page cache lacks the first round: a probe
            # the request waited on would most likely cost it the whole allowance
            # (H100, session 23: the first cold prompt after a restart took 1.05-1.07 x
            # recompute). Recompute at once; the probe times the storage for later
            # requests and its units land in the CPU tier.
            self._probe_in_background(state, keys[first : first + hits])
            self.stats.record_l3_declined(COLD_UNMEASURED, hits)
            self.waits.finish(state, "declined:" + COLD_UNMEASURED, 0)
            return
        if storage.samples == 0:
            # Storage speed unknown: the probe is a round of PROBE_UNITS units, few
            # enough to land within the wait allowance on fast storage, and two, to
            # show whether reads share a bandwidth (a disk: two at once take twice as
            # long). The wait allowance bounds what it may cost.
            size = min(PROBE_UNITS, storage.parallel, hits)
            if self.waits.fetch_chunks(req_id, state, keys, first, size, "probe"):
                state.decision.probe = f"{_units(state.decision.wanted)} sent"
            return
        wanted = self.cost.chunks_worth_loading(first, hits, round_trip=False)
        self._note_estimate(state, wanted or hits)
        if wanted < hits:
            self.stats.record_l3_declined(SLOWER_THAN_RECOMPUTE, hits - wanted)
        if not wanted:
            if storage.stale():
                self._probe_in_background(state, keys[first : first + hits])
            self.waits.finish(state, "declined:" + SLOWER_THAN_RECOMPUTE, 0)
            return
        self.waits.fetch_chunks(req_id, state, keys, first, wanted, "fetch")

    def _probe_in_background(self, state: L3RequestState, chunk_keys: Sequence[bytes]) -> None:
        """Time the storage with a round of `chunk_keys` no request waits for (its units
        land in the CPU tier); the decision says so if one was sent."""
        sent = self.background.probe(chunk_keys)
        if sent:
            state.decision.probe = f"{_units(sent)} in the background"

    def _after_probe(
        self, req_id: str, state: L3RequestState, keys: Sequence[bytes], landed: int
    ) -> None:
        """The probe round landed: fetch what the measured speed pays for."""
        decision = state.decision
        decision.probe = (
            f"{landed}/{decision.wanted} landed in {time.monotonic() - decision.started:.4f} s"
        )
        if not landed or self.cost.storage.samples == 0:
            self.waits.finish(state, "probe_failed", landed)  # refused or failed: counted there
            return
        rest = state.hits - landed
        wanted = self.cost.chunks_worth_loading(
            state.first_chunk + landed, rest, False, state.end_chunk - state.first_chunk
        )
        self._note_estimate(state, wanted or rest)
        if wanted < rest:
            self.stats.record_l3_declined(SLOWER_THAN_RECOMPUTE, rest - wanted)
        if not wanted:
            self.waits.finish(state, "fetched" if not rest else "partial", landed)
            return
        state.progress = time.monotonic()
        self.waits.fetch_chunks(req_id, state, keys, state.first_chunk + landed, wanted, "fetch")

    def _note_estimate(self, state: L3RequestState, units: int) -> None:
        storage = self.cost.storage
        state.decision.load_s = storage.load_s(units)
        state.decision.unit_s = storage.unit_s
        if storage.samples:
            state.decision.first_landing_est_s = storage.first_landing_s(units)
