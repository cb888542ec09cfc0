"""Scheduler side of overlapped restores: admit a storage hit while its units still land.

Without it, a request whose chunks are fetched from storage waits (vLLM is told "ask
again") until the units sit in host slots, and only then is admitted and restored:
the fetch and the host-to-GPU copy run one after the other. With `l3.overlap_restore`
a request whose fetch is under way, with a slot for every chunk chosen, is admitted
as soon as it may wait on that fetch at all (the cost policy found the hit worth
loading, and the wait is within its allowance or on pace), as an ASYNCHRONOUS load:
vLLM allocates its blocks and parks it in WAITING_FOR_REMOTE_KVS, so no forward
waits on storage, and each worker copies every unit to the GPU as soon as its fetch
lands there (overlap_loads.py). The load's units are pinned until it is reported on
every rank; a fetch's placeholder keeps its slot until that fetch has reported too.

The wait allowance still applies after admission: every step the scheduler asks the
cost model whether the request may wait on the fetches still out (`check`). When it
may not, the reads not started are cancelled and the load is abandoned
(`DraftOffloadMetadata.abandon_loads`): workers report the blocks of units that have
not landed as load errors, and vLLM recomputes from the first of them, as it would
have recomputed the chunks that had not landed when a waiting request gave up.

The placeholders a hit is admitted with have no successor tokens yet (a fetched
unit's header carries them): the hit is admitted as if they were the request's own,
and each worker checks the header against the tokens the hit relies on when the unit
lands; a unit stored with others is not copied and its blocks are recomputed.

`OverlapRestores` (owned by `l3_prefetch.L3Prefetch`) watches the requests and their
fetches (kept by `l3_waits.L3Waits`); `OverlappedLoads` (owned by
`scheduler_side.DraftOffloadScheduler`) keeps the load jobs: the placeholders each
pinned, the loads to abandon, and what a request is left with once its load is
reported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm_draft_offload.cpu_index import UnitId
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.job_book import JobBook, JobRecord
from vllm_draft_offload.l3_request import L3RequestState
from vllm_draft_offload.request_state import RequestState

if TYPE_CHECKING:
    # Only named: at runtime this module stays free of the cost model's imports (the
    # scheduler imports it with no storage tier configured).
    from vllm_draft_offload.l3_waits import L3Waits


class OverlapRestores:
    """Requests admitted with their fetches in flight, and the loads restoring them.

    It drives `L3Waits`' request states and decisions."""

    def __init__(self, waits: L3Waits, enabled: bool) -> None:
        self.waits = waits
        self.enabled = enabled
        # Request -> its overlapped load job, while its fetches are still watched.
        self._bound: dict[str, int] = {}
        # Of those, requests whose load every rank reported (decided at the next check).
        self._loaded: set[str] = set()

    def offer(self, state: L3RequestState) -> bool:
        """The request may go on waiting on its fetch: admit it now instead? Only a
        fetch (not a probe, which times the storage) with a slot for every chosen
        chunk (else the tail would wait on slots freeing up first)."""
        if not self.enabled or state.phase != "fetch" or state.short or not state.jobs:
            return False
        state.overlap_offered = True
        return True

    def pending_units(self, req_id: str) -> dict[bytes, tuple[UnitId, int]]:
        """Chunk key -> (placeholder, fetch job) of the units the request's admitted
        hit may take before they land (empty: it is not admitted that way)."""
        state = self.waits.states.get(req_id)
        if state is None or not state.overlap_offered or state.phase != "fetch":
            return {}
        units = self.waits.fetches.units
        return {units[job][1][0]: (units[job][1], job) for job in state.jobs}

    def release(self, req_id: str) -> None:
        """The request was offered but is admitted otherwise (its hit ends before the
        units still landing, an audit recomputes it, vLLM took no external tokens): it
        stops waiting, as a request admitted with what landed does."""
        state = self.waits.states.get(req_id)
        if state is None or not state.overlap_offered or state.load_job is not None:
            return
        state.overlap_offered = False
        if state.phase != "done":
            landed = state.leading_landed()
            self.waits.finish(state, self.waits.outcome(state, landed), landed)

    def bind(self, req_id: str, load_job: int) -> None:
        """vLLM admitted the request; `load_job` restores it as its units land."""
        state = self.waits.states[req_id]
        state.load_job = load_job
        self._bound[req_id] = load_job

    def landed_pin_needed(self, state: L3RequestState) -> bool:
        """A landed unit is pinned for a waiting request; a bound one's load pins it."""
        return state.load_job is None

    def check(self) -> list[int]:
        """Every step: the loads to abandon, whose fetches fell behind their allowance.
        Requests whose fetches all reported stop being watched (decision logged)."""
        abandon = []
        waits = self.waits
        for req_id, load_job in list(self._bound.items()):
            state = waits.states.get(req_id)
            if state is None or state.phase == "done":
                del self._bound[req_id]
                self._loaded.discard(req_id)
                continue
            landed = state.leading_landed()
            if not state.jobs or req_id in self._loaded:
                # Fetches still out after the load (one failed, so the load stopped
                # waiting for the later ones) land in the background.
                waits.finish(state, waits.outcome(state, landed), landed)
                del self._bound[req_id]
                self._loaded.discard(req_id)
            elif not waits.may_wait(state, landed):
                # As a waiting request gives up: the reads not started are cancelled,
                # the chunks that have not landed are recomputed.
                waits.give_up(state, landed)
                abandon.append(load_job)
                del self._bound[req_id]
        return abandon

    def load_done(self, req_id: str) -> None:
        """The request's load was reported on every rank. Its decision is taken at the
        next `check`: the fetch reports of the step that completed it may come after it
        in that step's output."""
        if req_id in self._bound:
            self._loaded.add(req_id)


class OverlappedLoads:
    """The scheduler's overlapped load jobs: the placeholders each pinned, the loads to
    abandon, and the request's restore once its load is reported. Idle without
    storage (`restores` None) or `l3.overlap_restore`."""

    def __init__(self, restores: OverlapRestores | None, jobs: JobBook, chunk_size: int) -> None:
        self.restores = restores
        self.jobs = jobs
        self.chunk_size = chunk_size
        # Overlapped loads in flight: load job -> placeholders of units still landing
        # when it was planned, and loads to abandon (sent with the next step).
        self._loads: dict[int, set[UnitId]] = {}
        self._abandon: list[int] = []

    def landing(self, req_id: str) -> dict[bytes, tuple[UnitId, int]]:
        """Chunk key -> (placeholder, fetch job) of the units still landing that the
        request's hit may take (`OverlapRestores.pending_units`)."""
        assert self.restores is not None
        return self.restores.pending_units(req_id)

    def taken(
        self, req_id: str, landing: dict[bytes, tuple[UnitId, int]], match: PrefixMatch
    ) -> dict[UnitId, int] | None:
        """Placeholder -> fetch job of the landing units `match` takes (None: it takes
        none, and the request stops being offered an overlapped admission)."""
        used = {view.handle for _, view in match.chunks}
        taken = {placeholder: job for placeholder, job in landing.values() if placeholder in used}
        if not taken and self.restores is not None:
            self.restores.release(req_id)
        return taken or None

    def release(self, state: RequestState) -> None:
        """The request is not admitted with units still landing after all."""
        if state.pending_fetches is not None and self.restores is not None:
            state.pending_fetches = None
            self.restores.release(state.request.request_id)

    def bind(
        self,
        req_id: str,
        load_job: int,
        landing: Iterable[UnitId],
        units: Iterable[UnitId],
    ) -> None:
        """vLLM admitted the request; `load_job` loads `units`, of them the `landing`
        placeholders as they land."""
        assert self.restores is not None
        self.restores.bind(req_id, load_job)
        self._loads[load_job] = set(landing) & set(units)

    def check(self) -> None:
        """Every step: overlapped restores whose fetches fell behind are abandoned
        (recompute what has not landed)."""
        if self.restores is not None:
            self._abandon += self.restores.check()

    def abandon(self, load_jobs: Iterable[int]) -> None:
        """The requests of these loads finished while waiting on them (aborted): an
        overlapped load stops waiting for its fetches, so vLLM gets the blocks back."""
        self._abandon += [job for job in load_jobs if job in self._loads]

    def take_abandoned(self) -> list[int]:
        """The loads to abandon, sent with this step (`DraftOffloadMetadata.abandon_loads`)."""
        abandoned, self._abandon = self._abandon, []
        return abandoned

    def rekey(self, placeholder: UnitId, final: UnitId) -> None:
        """A unit an overlapped load pinned as a placeholder got its final identity."""
        for job_id, placeholders in self._loads.items():
            if placeholder in placeholders and (record := self.jobs.get(job_id)) is not None:
                placeholders.discard(placeholder)
                record.units = [final if unit == placeholder else unit for unit in record.units]

    def reported(self, job_id: int, state: RequestState | None, record: JobRecord) -> None:
        """Every rank reported the job; nothing to do unless it is an overlapped load.
        vLLM has already cut the request's computed tokens at the first block any rank
        reported as not loaded (it handles those before this output's connector
        report): what it recomputes from there is computed on a sound prefix, so it is
        stored again."""
        if job_id not in self._loads:
            return
        del self._loads[job_id]
        if self.restores is not None:
            self.restores.load_done(record.req_id)
        if state is None:
            return
        computed = state.request.num_computed_tokens
        state.restored_tokens = min(state.restored_tokens, max(0, computed - state.hit_start))
        state.storage_tokens = min(state.storage_tokens, state.restored_tokens)
        state.next_store_chunk = min(state.next_store_chunk, computed // self.chunk_size)
