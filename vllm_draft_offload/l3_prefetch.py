"""Scheduler-side L3 hits: look chunks up in storage and fetch them into the CPU tier.

While a request's lookup or fetch is in flight, `get_num_new_matched_tokens`
answers "ask again" (None), so vLLM schedules other work and the request is
admitted once the units sit in host slots; then it is an ordinary CPU hit. With
`l3.overlap_restore` a request whose fetch is under way and on pace is admitted
before that, as an asynchronous load restoring each unit as it lands
(restore_overlap.py); the allowance below still rules after that admission. A
fetched unit gets its identity (chunk key plus successor tokens) from the
object's header, so the EAGLE successor rule applies to L3 hits unchanged.

While a request waits, the CPU units of its matched prefix (and units fetched
for it) are pinned, so the placeholders of its own fetches, or other requests'
stores, cannot evict its head. `l3.hit_policy` decides how much of a storage
hit is fetched (l3_cost.py). Under `cost`, `CostModel.may_wait` decides how long
a request waits, counted from its lookup: always within 5 % of the estimated
recompute of what it looks up plus what the chunks that landed save (all it gets
while the storage is unmeasured, i.e. for the probe; a probe whose first round the
lookup found not wholly in the page cache is not waited on at all: it runs in the
background while the request recomputes), and once the storage is
measured also in bounded bets past it: a slow lookup, a fetch's first round within
1.5 x its estimated time if that is short (within 3 x and 15 % of the recompute if the
lookup found the round in the page cache: l3_residency.py; a probe of resident files
too), a fetch that keeps the pace its landings show (l3_cost.py
states the worst case). When it stops waiting it is
admitted with the leading chunks that landed; its other fetches finish in the
background into the CPU tier, except after a fetch (not a probe) it gave up as too
slow: then the reads not yet started are cancelled. Without any recompute estimate (a start with no
calibration, l3_calibration.py) nothing bounds a wait: the request does not wait,
and the lookup goes on in the background (l3_background.py) to probe the storage.
Every decision is logged (l3_decisions.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.l3_background import BackgroundProbe
from vllm_draft_offload.l3_calibration import Calibration
from vllm_draft_offload.l3_cost import PROBE_UNITS, CostModel
from vllm_draft_offload.l3_decisions import DecisionLog, L3Decision
from vllm_draft_offload.l3_fetches import FetchBook
from vllm_draft_offload.l3_request import L3RequestState
from vllm_draft_offload.l3_tier import SchedulerL3
from vllm_draft_offload.metadata import FETCH_CANCELLED, FetchJob
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.restore_overlap import OverlapRestores
from vllm_draft_offload.switch_interval import WaitingSwitchInterval

logger = logging.getLogger(__name__)

# Refusal cause of a unit whose TP ranks' objects disagree.
RANK_MISMATCH = "rank_mismatch"
# Decline causes (metrics.L3_DECLINE_CAUSES): storage hits estimated to load slower
# than recompute; chunks not even looked up because a full hit would be; chunks not
# looked up because the engine's prefill speed is unknown; fetches (or a lookup) that
# did not land within the request's wait allowance.
SLOWER_THAN_RECOMPUTE = "slower_than_recompute"
NOT_LOOKED_UP = "not_looked_up"
SPEED_UNKNOWN = "speed_unknown"
FETCH_TOO_SLOW = "fetch_too_slow"
# Hits on storage not timed yet whose first round the page cache does not hold: the
# request recomputes at once while a probe times the storage in the background.
COLD_UNMEASURED = "cold_unmeasured"
# Chosen chunks that found no CPU-tier slot (every slot storing, loading, pinned for a
# waiting request or queued for an L3 write) by the time the request stopped waiting.
NO_FREE_SLOT = "no_free_slot"
# Phases in which a request waits on storage.
_WAITING = frozenset({"lookup", "probe", "fetch"})


def _units(count: int) -> str:
    return f"{count} unit" if count == 1 else f"{count} units"


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
        salt: bytes | None = None,
        overlap: bool = False,
    ) -> None:
        self.lookup = lookup
        self.index = index
        self.chunk_size = chunk_size
        self.timeout_s = config.timeout_s
        self.hit_policy = config.hit_policy
        self.stats = stats
        self.cost = CostModel(
            chunk_size,
            unit_bytes,
            config.io_threads,
            wait_past_allowance=config.wait_past_allowance,
        )
        self.log = DecisionLog(config.log_decisions)
        # The prefill speed of an earlier engine like this one (None: not shared).
        self.calibration: Calibration | None = None
        if salt is not None and config.hit_policy == "cost" and lookup.store is not None:
            self.calibration = Calibration(lookup, salt, config.timeout_s)
            self.calibration.load_into(self.cost.prefill)
        # Told which chunk keys a lookup found in storage, and which of those could
        # not be fetched after all (the write planner: found units are not rewritten).
        self.on_found: Callable[[Sequence[bytes]], None] | None = None
        self.on_unusable: Callable[[bytes], None] | None = None
        self._requests: dict[str, L3RequestState] = {}
        # Requests waiting on a lookup or fetch (read every step: any_waiting).
        self._waiting: set[str] = set()
        # Lowered from the moment a lookup starts in this process (its answer, then the
        # fetches' landings, take the GIL on other threads), not a step later when the
        # workers hear of it: beside a long prefill step that is a whole step.
        self.switch_interval = WaitingSwitchInterval.for_config(config)
        # Units pinned for a request while it waits on its lookup or fetches.
        self._pins: dict[str, list[UnitId]] = {}
        # Chunk keys of the units fetched from storage for a request while it waited:
        # where its hit came from (vLLM's hits by source).
        self._fetched_for: dict[str, set[bytes]] = {}
        self._warned_small_tier = False
        self.fetches = FetchBook(index, new_job_id, self.cost.storage)
        # Hits admitted while their units still land (restore_overlap.py).
        self.overlap = OverlapRestores(self, overlap)
        # Told when a fetched unit gets its final identity (its load's pin moves along).
        self.on_rekey: Callable[[UnitId, UnitId], None] | None = None
        # Lookups no request waits for any more, kept to measure the storage.
        self.background = BackgroundProbe(
            self.cost.storage,
            lambda chunk_keys: self.fetches.reserve(None, chunk_keys),
            self._found,
        )

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
        state = self._requests.get(req_id)
        if state is not None and state.phase != "done":
            matched = match.chunks[-1][0] + 1 if match.chunks else num_computed // self.chunk_size
            landed = max(0, matched - state.first_chunk)
            if first is None or first >= last:
                # Everything it can use is in the CPU tier (or the match ends inside
                # a chunk): admit it; anything still coming lands in the background.
                self._finish(state, self._outcome(state, landed), landed)
                return False
        if first is None or first >= last:
            return False
        if state is None or not state.first_chunk <= first <= state.covered_until:
            if state is not None and state.phase != "done":
                self._finish(state, "superseded", 0)
            state = self._begin(req_id, match, keys, first, last, num_computed)
        if state.phase == "done":
            return False
        landed = first - state.first_chunk
        if state.phase == "lookup":
            assert state.lookup is not None
            if not state.lookup.done():
                if self._may_wait(state, 0):
                    return True
                if self.hit_policy == "cost":
                    self.stats.record_l3_declined(FETCH_TOO_SLOW, state.end_chunk - first)
                    keys_looked_up = list(keys[state.first_chunk : state.end_chunk])
                    self.background.keep(state.lookup, keys_looked_up)
                else:
                    self.stats.record_fallback("l3_unavailable")
                self._finish(state, "lookup_too_slow", 0)
                return False
            try:
                present = state.lookup.result()
            except Exception:  # a storage bug must never reach the scheduler thread
                logger.exception("DraftOffloadConnector: unexpected L3 lookup error; recomputing")
                self.stats.record_fallback("l3_lookup_failed")
                self._finish(state, "lookup_failed", 0)
                return False
            state.decision.lookup_s = time.perf_counter() - state.lookup_started
            state.decision.first_round = getattr(present, "first_round", None)
            self.cost.storage.observe_round_trip(state.decision.lookup_s)
            self._start_fetches(req_id, state, keys, present)
        if state.phase == "fetch" and state.short:
            self._fetch_more(req_id, state, keys)
        if state.phase in ("probe", "fetch") and state.jobs:
            if self._may_wait(state, landed):
                # On pace: admitted now, each unit restored as it lands (an overlapped
                # restore), or asked about again.
                return not self.overlap.offer(state)
            self._give_up(state, landed)
            return False
        if state.phase == "probe":
            self._after_probe(req_id, state, keys, landed)
            if state.phase == "fetch":
                return True  # its fetches start with this step
        if state.phase == "fetch":
            self._finish(state, self._outcome(state, landed), landed)
        return False

    @staticmethod
    def _outcome(state: L3RequestState, landed: int) -> str:
        """How a lookup that stops waiting with `landed` leading chunks in ended."""
        if not state.hits:
            return "superseded"  # the CPU tier got the chunks meanwhile
        if landed >= state.hits:
            return "fetched"
        return "partial" if landed else "fetch_failed"

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
        self._requests[req_id] = state
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
                self._finish(state, "declined:" + SPEED_UNKNOWN, 0)
                return state
            if not storage.stale() and not self.cost.chunks_worth_loading(first, count, True):
                # Even a full hit would load slower than recompute: skip the round trip.
                self.stats.record_l3_declined(NOT_LOOKED_UP, count)
                decision.load_s = storage.load_s(count) + storage.round_trip_s
                state.covered_until = last
                self._finish(state, "declined:" + NOT_LOOKED_UP, 0)
                return state
        # Pin the head before the lookup's answer reserves placeholders.
        self._pin(req_id, (view.handle for _, view in match.chunks))  # type: ignore[misc]
        state.lookup_started = time.perf_counter()
        state.lookup = self.lookup.lookup(list(keys[first:last]))
        self._waiting.add(req_id)
        self.switch_interval.set_waiting(True)
        return state

    def _may_wait(self, state: L3RequestState, landed: int) -> bool:
        """May the request wait on storage any longer, with `landed` chunks in?
        `always`: the lookup, then the fetches, each within l3.timeout_s; `cost`:
        CostModel.may_wait."""
        now = time.monotonic()
        poll_s, state.polled = now - state.polled, now
        if landed > state.landed:
            state.landed, state.progress = landed, now
        if self.hit_policy != "cost":
            return now - state.started < self.timeout_s * (1 if state.phase == "lookup" else 2)
        wait, state.decision.allowance_s = self.cost.may_wait(
            state.phase,
            waited_s=now - state.started,
            stalled_s=now - state.progress,
            first_chunk=state.first_chunk,
            num_chunks=state.end_chunk - state.first_chunk,
            landed=landed,
            coming=state.decision.wanted - landed,
            poll_s=poll_s,
            first_round_resident=state.decision.first_round_resident,
            **self._fetch_pace(state, now),
        )
        return wait

    @staticmethod
    def _fetch_pace(state: L3RequestState, now: float) -> dict[str, float]:
        """Units the fetch landed (any order), seconds since its first landed, and units
        still out (none before the fetch)."""
        if state.phase != "fetch" or state.fetch_started is None:
            return {}
        first = state.first_landing
        return {
            "landing_s": 0.0 if first is None else now - first,
            "fetched": state.fetched,
            "outstanding": len(state.jobs),
        }

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
            self._finish(state, "miss", 0)
            return
        storage = self.cost.storage
        if self.hit_policy != "cost":
            self._fetch_chunks(req_id, state, keys, first, hits, "fetch")
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
            self._finish(state, "declined:" + COLD_UNMEASURED, 0)
            return
        if storage.samples == 0:
            # Storage speed unknown: the probe is a round of PROBE_UNITS units, few
            # enough to land within the wait allowance on fast storage, and two, to
            # show whether reads share a bandwidth (a disk: two at once take twice as
            # long). The wait allowance bounds what it may cost.
            size = min(PROBE_UNITS, storage.parallel, hits)
            if self._fetch_chunks(req_id, state, keys, first, size, "probe"):
                state.decision.probe = f"{_units(state.decision.wanted)} sent"
            return
        wanted = self.cost.chunks_worth_loading(first, hits, round_trip=False)
        self._note_estimate(state, wanted or hits)
        if wanted < hits:
            self.stats.record_l3_declined(SLOWER_THAN_RECOMPUTE, hits - wanted)
        if not wanted:
            if storage.stale():
                self._probe_in_background(state, keys[first : first + hits])
            self._finish(state, "declined:" + SLOWER_THAN_RECOMPUTE, 0)
            return
        self._fetch_chunks(req_id, state, keys, first, wanted, "fetch")

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
            self._finish(state, "probe_failed", landed)  # refused or failed: counted there
            return
        rest = state.hits - landed
        wanted = self.cost.chunks_worth_loading(
            state.first_chunk + landed, rest, False, state.end_chunk - state.first_chunk
        )
        self._note_estimate(state, wanted or rest)
        if wanted < rest:
            self.stats.record_l3_declined(SLOWER_THAN_RECOMPUTE, rest - wanted)
        if not wanted:
            self._finish(state, "fetched" if not rest else "partial", landed)
            return
        state.progress = time.monotonic()
        self._fetch_chunks(req_id, state, keys, state.first_chunk + landed, wanted, "fetch")

    def _note_estimate(self, state: L3RequestState, units: int) -> None:
        storage = self.cost.storage
        state.decision.load_s = storage.load_s(units)
        state.decision.unit_s = storage.unit_s

    def _give_up(self, state: L3RequestState, landed: int) -> None:
        """The wait allowance ran out: admit with what landed; the rest finish in the
        background (and time the storage for later requests)."""
        # A probe's abandon gives up the whole hit; later, only the chunks chosen (the
        # rest were counted as slower when chosen).
        chosen = state.hits if state.phase == "probe" else state.decision.wanted
        given_up = max(0, chosen - landed)
        if given_up:
            self.stats.record_l3_declined(FETCH_TOO_SLOW, given_up)
        if state.decision.probe.endswith("sent"):
            state.decision.probe = f"abandoned with {landed}/{state.decision.wanted} landed"
        if state.phase == "fetch":
            # Storage is slower than it was priced: the rest is recomputed, and reads
            # still queued would only compete with that recompute. (A probe round's
            # reads all run at once, and its landing times the storage.)
            self.fetches.cancel(state.jobs)
            state.jobs.clear()
        outcome = "partial" if landed else "declined:" + FETCH_TOO_SLOW
        self._finish(state, outcome, landed)

    def _finish(self, state: L3RequestState, outcome: str, landed: int) -> None:
        """The request stops waiting: fetches still in flight finish in the background
        (into the CPU tier, timing the storage); the decision is logged."""
        self.fetches.orphan(state.jobs)
        state.jobs.clear()
        state.landed = max(state.landed, landed)
        state.phase = "done"
        decision = state.decision
        self._waiting.discard(decision.req_id)
        self.switch_interval.set_waiting(bool(self._waiting))
        if state.fetch_started is not None:
            decision.fetch_s = time.monotonic() - state.fetch_started
        decision.outcome = outcome
        decision.landed = landed
        if state.short:
            self._report_short(state)
        if self.cost.storage.samples and decision.unit_s is None:
            decision.unit_s = self.cost.storage.unit_s
        self.log.record(decision)

    def _fetch_chunks(
        self,
        req_id: str,
        state: L3RequestState,
        keys: Sequence[bytes],
        first: int,
        count: int,
        phase: str,
    ) -> bool:
        """Fetch chunks [first, first + count) for the request, as far as slots allow,
        and wait on them in `phase`; False (the request stops waiting): no free slot.
        Short of free slots, a prefix of them: the rest is reserved as slots free up
        while the fetch runs (`_fetch_more`), and what is still short when the request
        stops waiting is recomputed."""
        self._reserve(req_id, state, keys, first, count)
        if phase != "fetch":
            state.short = 0  # a probe is a timing round, not the hit: no tail waits
        if not state.jobs:
            landed = first - state.first_chunk
            self._finish(state, "partial" if landed else "no_free_slot", landed)
            return False
        if phase == "fetch" and state.fetch_started is None:
            state.fetch_started = time.monotonic()
        state.phase = phase
        return True

    def _reserve(
        self, req_id: str, state: L3RequestState, keys: Sequence[bytes], first: int, count: int
    ) -> None:
        """Reserve fetches of chunks [first, first + count) in order, as far as slots
        allow; those without a slot are `short`, from `next_fetch` on."""
        jobs = self.fetches.reserve(req_id, keys[first : first + count])
        state.jobs.update(jobs)
        state.job_chunks.update(zip(jobs, range(first, first + len(jobs)), strict=False))
        state.decision.wanted += len(jobs)
        state.short = count - len(jobs)
        state.next_fetch = first + len(jobs)

    def _fetch_more(self, req_id: str, state: L3RequestState, keys: Sequence[bytes]) -> None:
        """Reserve more of the fetch's chosen chunks that had no slot: slots held by
        stores, loads and L3 writes in flight, or by other requests' waits, free up
        as those end. Tried only while the fetch still has reads out (a request never
        waits on slots alone), and in order from the first missing one."""
        self._reserve(req_id, state, keys, state.next_fetch, state.short)

    def _report_short(self, state: L3RequestState) -> None:
        """The request stopped waiting with chosen chunks that never found a slot: count
        them, name them in its decision, and say once when the CPU tier is smaller than
        the hit itself (then no hit is ever taken deeper than the tier's slots)."""
        decision = state.decision
        decision.no_slot = state.short
        self.stats.record_l3_declined(NO_FREE_SLOT, state.short)
        chosen = decision.wanted + state.short
        if chosen > self.index.num_slots and not self._warned_small_tier:
            self._warned_small_tier = True
            logger.warning(
                "DraftOffloadConnector: a storage hit of %d units does not fit the CPU "
                "tier (%d units): storage hits are taken at most that deep, the rest is "
                'recomputed (l3_declined_chunks{cause="%s"}); raise cpu_bytes_to_use '
                "to at least %d units' bytes to restore whole prompts",
                chosen,
                self.index.num_slots,
                NO_FREE_SLOT,
                chosen,
            )
        state.short = 0

    def _found(self, chunk_keys: Sequence[bytes]) -> None:
        if self.on_found is not None:
            self.on_found(chunk_keys)

    def take_fetch_jobs(self) -> list[FetchJob]:
        return self.fetches.take_unsent()

    def take_fetch_cancels(self) -> list[int]:
        return self.fetches.take_cancels()

    def fetch_timings(self, seconds: dict[int, float], since_queued: dict[int, float]) -> None:
        """Fetch jobs' times on the workers: the read, decode and copy of each unit, and
        from queueing it to its landing (what times a round)."""
        for unit_s in seconds.values():
            self.cost.storage.observe_fetch(unit_s)
        for job_id, landed_s in since_queued.items():
            self.fetches.landed_after(job_id, landed_s)

    def fetch_finished(self, job_id: int, successors: list[int] | None, cause: str | None) -> None:
        """All workers answered a fetch: publish the unit, or drop it and say why."""
        cancelled = cause == FETCH_CANCELLED
        req_id, placeholder = self.fetches.finished(
            job_id, successors is not None and not cause, cancelled
        )
        self.background.fetch_finished(job_id)
        state = self._requests.get(req_id) if req_id is not None else None
        if state is not None:
            state.jobs.discard(job_id)
        if successors is None or cause is not None:
            self.index.remove(placeholder)
            if cancelled:
                return  # skipped, not refused: storage still holds the unit
            self.stats.record_refused(cause or "l3_corrupt")
            if self.on_unusable is not None:
                self.on_unusable(placeholder[0])  # storage does not hold it usably
            if cause == RANK_MISMATCH:
                # Ranks hold different units under one name: never fetch it again.
                self.lookup.mark_broken(placeholder[0])
            return
        final: UnitId = (placeholder[0], tuple(successors))
        if self.index.get(final) is not None:
            self.index.remove(placeholder)  # the CPU tier got the same unit meanwhile
        elif self.index.rekey(placeholder, final):
            self.index.commit(final)
            if self.on_rekey is not None:
                self.on_rekey(placeholder, final)
        if req_id is not None and state is not None and state.phase in ("probe", "fetch"):
            if (chunk := state.job_chunks.get(job_id)) is not None:
                state.landed_chunks.add(chunk)
            if self.overlap.landed_pin_needed(state):
                # Keep it until the request is admitted: later fetches must not evict it.
                self._pin(req_id, [final])
            # Any unit landing is progress, not only the next leading one.
            state.progress = time.monotonic()
            if state.phase == "fetch":
                state.fetched += 1
                if state.first_landing is None:
                    state.first_landing = state.progress
            self._fetched_for.setdefault(req_id, set()).add(placeholder[0])

    def _pin(self, req_id: str, units: Iterable[UnitId]) -> None:
        pinned = self._pins.setdefault(req_id, [])
        for unit_id in units:
            if unit_id not in pinned and self.index.get(unit_id) is not None:
                self.index.pin(unit_id)
                pinned.append(unit_id)

    def _unpin_all(self, req_id: str) -> None:
        for unit_id in self._pins.pop(req_id, ()):
            self.index.unpin(unit_id)

    def take_fetched_chunk_keys(self, req_id: str) -> set[bytes]:
        """Chunk keys of the units storage supplied for the request while it waited,
        once (at its admission): a later admission (after a preemption) finds them in
        the CPU tier."""
        return self._fetched_for.pop(req_id, set())

    def pinned_units(self, req_id: str) -> list[UnitId]:
        return list(self._pins.get(req_id, ()))

    def waiting(self, req_id: str) -> bool:
        """The request waits on a lookup or a fetch (for invariant checks)."""
        state = self._requests.get(req_id)
        return state is not None and state.phase in _WAITING

    def any_waiting(self) -> bool:
        """Some request waits on a lookup or a fetch."""
        return bool(self._waiting)

    def forget(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is not None and state.phase != "done":
            self._finish(state, "aborted", 0)  # finished while it waited
        self._unpin_all(req_id)
        self._fetched_for.pop(req_id, None)

    def on_step_output(self) -> None:
        """A step's output came back: time it, and share the prefill fit when new."""
        self.cost.step_output()
        self.background.poll()
        if self.calibration is not None:
            self.calibration.maybe_save(self.cost.prefill)

    def close(self) -> None:
        """Engine shutdown: write this engine's prefill calibration, summarise."""
        self.switch_interval.close()
        if self.calibration is not None:
            self.calibration.save_now(self.cost.prefill)
        self.log.summary()

    def reset(self) -> None:
        """Forget what this engine learnt about storage contents (cache reset)."""
        self.lookup.reset()
