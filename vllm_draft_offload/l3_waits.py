"""Requests waiting on storage: their states, pins, wait allowance and fetch slots.

Holds each request's storage lookup (`L3RequestState`, kept until vLLM forgets the
request) and ends its wait. The decisions that start and steer a wait (what is
looked up, probed and fetched) are l3_hit_driver.py's; an overlapped restore keeps
asking this module after its request is admitted (restore_overlap.py).

While a request waits, the CPU units of its matched prefix (and units fetched
for it) are pinned, so the placeholders of its own fetches, or other requests'
stores, cannot evict its head. Under `l3.hit_policy: cost`, `CostModel.may_wait`
decides how long a request waits, counted from its lookup: always within 5 % of the
estimated recompute of what it looks up plus what the chunks that landed save (all
it gets while the storage is unmeasured, i.e. for the probe), and once the storage
is measured also in bounded bets past it: a slow lookup, a fetch's first round within
1.5 x its estimated time if that is short (within 3 x and 15 % of the recompute if the
lookup found the round in the page cache: l3_residency.py; a probe of resident files
too), a fetch that keeps the pace its landings show (l3_cost.py states the worst
case). When it stops waiting it is admitted with the leading chunks that landed; its
other fetches finish in the background into the CPU tier, except after a fetch (not
a probe) it gave up as too slow: then the reads not yet started are cancelled and
those reading stop before their next piece (fs://). Every
decision is logged (l3_decisions.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.l3_cost import CostModel
from vllm_draft_offload.l3_decisions import DecisionLog
from vllm_draft_offload.l3_fetches import FetchBook
from vllm_draft_offload.l3_request import L3RequestState
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.switch_interval import WaitingSwitchInterval

logger = logging.getLogger(__name__)

# Decline causes (metrics.L3_DECLINE_CAUSES) of a wait that ends (l3_hit_driver.py
# holds those of a hit not waited on): fetches (or a lookup) that did not land within
# the request's wait allowance.
FETCH_TOO_SLOW = "fetch_too_slow"
# Chosen chunks that found no CPU-tier slot (every slot storing, loading, pinned for a
# waiting request or queued for an L3 write) by the time the request stopped waiting.
NO_FREE_SLOT = "no_free_slot"
# Phases in which a request waits on storage.
_WAITING = frozenset({"lookup", "probe", "fetch"})


class L3Waits:
    """Every request's storage lookup, and the waits of those still waiting on it."""

    def __init__(
        self,
        index: CpuTierIndex,
        cost: CostModel,
        hit_policy: str,
        timeout_s: float,
        stats: DraftOffloadStats,
        fetches: FetchBook,
        log: DecisionLog,
        switch_interval: WaitingSwitchInterval,
    ) -> None:
        self.index = index
        self.cost = cost
        self.hit_policy = hit_policy
        self.timeout_s = timeout_s
        self.stats = stats
        self.fetches = fetches
        self.log = log
        self.switch_interval = switch_interval
        self.states: dict[str, L3RequestState] = {}
        # Requests waiting on a lookup or fetch (read every step: any_waiting).
        self._waiting: set[str] = set()
        # Units pinned for a request while it waits on its lookup or fetches.
        self._pins: dict[str, list[UnitId]] = {}
        # Chunk keys of the units fetched from storage for a request while it waited:
        # where its hit came from (vLLM's hits by source).
        self._fetched_for: dict[str, set[bytes]] = {}
        self._warned_small_tier = False

    def start_waiting(self, req_id: str) -> None:
        """The request's lookup was sent: it waits from now on."""
        self._waiting.add(req_id)
        self.switch_interval.set_waiting(True)

    def may_wait(self, state: L3RequestState, landed: int) -> bool:
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

    @staticmethod
    def outcome(state: L3RequestState, landed: int) -> str:
        """How a lookup that stops waiting with `landed` leading chunks in ended."""
        if not state.hits:
            return "superseded"  # the CPU tier got the chunks meanwhile
        if landed >= state.hits:
            return "fetched"
        return "partial" if landed else "fetch_failed"

    def give_up(self, state: L3RequestState, landed: int) -> None:
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
        self.finish(state, outcome, landed)

    def finish(self, state: L3RequestState, outcome: str, landed: int) -> None:
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
            if state.first_landing is not None:
                decision.first_landing_s = state.first_landing - state.fetch_started
        decision.outcome = outcome
        decision.landed = landed
        if state.short:
            self._report_short(state)
        if self.cost.storage.samples and decision.unit_s is None:
            decision.unit_s = self.cost.storage.unit_s
        self.log.record(decision)

    def fetch_chunks(
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
        while the fetch runs (`fetch_more`), and what is still short when the request
        stops waiting is recomputed."""
        self._reserve(req_id, state, keys, first, count)
        if phase != "fetch":
            state.short = 0  # a probe is a timing round, not the hit: no tail waits
        if not state.jobs:
            landed = first - state.first_chunk
            self.finish(state, "partial" if landed else "no_free_slot", landed)
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

    def fetch_more(self, req_id: str, state: L3RequestState, keys: Sequence[bytes]) -> None:
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

    def pin(self, req_id: str, units: Iterable[UnitId]) -> None:
        pinned = self._pins.setdefault(req_id, [])
        for unit_id in units:
            if unit_id not in pinned and self.index.get(unit_id) is not None:
                self.index.pin(unit_id)
                pinned.append(unit_id)

    def unpin_all(self, req_id: str) -> None:
        for unit_id in self._pins.pop(req_id, ()):
            self.index.unpin(unit_id)

    def note_fetched(self, req_id: str, chunk_key: bytes) -> None:
        """Storage supplied the unit of `chunk_key` while the request waited."""
        self._fetched_for.setdefault(req_id, set()).add(chunk_key)

    def take_fetched_chunk_keys(self, req_id: str) -> set[bytes]:
        """Chunk keys of the units storage supplied for the request while it waited,
        once (at its admission): a later admission (after a preemption) finds them in
        the CPU tier."""
        return self._fetched_for.pop(req_id, set())

    def pinned_units(self, req_id: str) -> list[UnitId]:
        return list(self._pins.get(req_id, ()))

    def waiting(self, req_id: str) -> bool:
        """The request waits on a lookup or a fetch (for invariant checks)."""
        state = self.states.get(req_id)
        return state is not None and state.phase in _WAITING

    def any_waiting(self) -> bool:
        """Some request waits on a lookup or a fetch."""
        return bool(self._waiting)

    def forget(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None and state.phase != "done":
            self.finish(state, "aborted", 0)  # finished while it waited
        self.unpin_all(req_id)
        self._fetched_for.pop(req_id, None)
