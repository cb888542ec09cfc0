"""Scheduler-side L3 hits: look chunks up in storage and fetch them into the CPU tier.

While a request's lookup or fetch is in flight, `get_num_new_matched_tokens`
answers "ask again" (None), so vLLM schedules other work and the request is
admitted once the units sit in host slots; then it is an ordinary CPU hit. With
`l3.overlap_restore` a request whose fetch is under way and on pace is admitted
before that, as an asynchronous load restoring each unit as it lands
(restore_overlap.py); the wait allowance (l3_waits.py) still rules after that
admission. A fetched unit gets its identity (chunk key plus successor tokens) from
the object's header, so the EAGLE successor rule applies to L3 hits unchanged.

`L3Prefetch` is what the scheduler holds: it builds the parts and answers the
scheduler, the workers' fetch reports and the engine's steps. Each request's hit is
moved along by l3_hit_driver.py (what is looked up, probed and fetched); the waiting
requests, their pins, wait allowance, fetch slots and the end of their waits are
l3_waits.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.l3_background import BackgroundProbe
from vllm_draft_offload.l3_calibration import Calibration
from vllm_draft_offload.l3_cost import CostModel
from vllm_draft_offload.l3_decisions import DecisionLog
from vllm_draft_offload.l3_fetches import FetchBook
from vllm_draft_offload.l3_hit_driver import L3HitDriver
from vllm_draft_offload.l3_lookup import SchedulerL3
from vllm_draft_offload.l3_waits import L3Waits
from vllm_draft_offload.metadata import FETCH_CANCELLED, FetchJob
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.restore_overlap import OverlapRestores
from vllm_draft_offload.switch_interval import WaitingSwitchInterval

# Refusal cause of a unit whose TP ranks' objects disagree.
RANK_MISMATCH = "rank_mismatch"


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
        self.stats = stats
        self.cost = CostModel(
            chunk_size,
            unit_bytes,
            config.units_in_flight,
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
        # Lowered from the moment a lookup starts in this process (its answer, then the
        # fetches' landings, take the GIL on other threads), not a step later when the
        # workers hear of it: beside a long prefill step that is a whole step.
        self.switch_interval = WaitingSwitchInterval.for_config(config)
        self.fetches = FetchBook(index, new_job_id, self.cost.storage)
        self.waits = L3Waits(
            index,
            self.cost,
            config.hit_policy,
            config.timeout_s,
            stats,
            self.fetches,
            self.log,
            self.switch_interval,
        )
        # Hits admitted while their units still land (restore_overlap.py).
        self.overlap = OverlapRestores(self.waits, overlap)
        # Told when a fetched unit gets its final identity (its load's pin moves along).
        self.on_rekey: Callable[[UnitId, UnitId], None] | None = None
        # Lookups no request waits for any more, kept to measure the storage.
        self.background = BackgroundProbe(
            self.cost.storage,
            lambda chunk_keys: self.fetches.reserve(None, chunk_keys),
            self._found,
        )
        self.driver = L3HitDriver(
            lookup,
            self.waits,
            self.cost,
            stats,
            self.background,
            self.overlap,
            chunk_size,
            config.hit_policy,
            self._found,
        )

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
        if self.driver.drive(req_id, match, keys, num_tokens, num_computed):
            self.waits.pin(req_id, (view.handle for _, view in match.chunks))  # type: ignore[misc]
            return True
        self.waits.unpin_all(req_id)
        return False

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
        state = self.waits.states.get(req_id) if req_id is not None else None
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
                self.waits.pin(req_id, [final])
            # Any unit landing is progress, not only the next leading one.
            state.progress = time.monotonic()
            if state.phase == "fetch":
                state.fetched += 1
                if state.first_landing is None:
                    state.first_landing = state.progress
            self.waits.note_fetched(req_id, placeholder[0])

    def take_fetched_chunk_keys(self, req_id: str) -> set[bytes]:
        """Chunk keys of the units storage supplied for the request while it waited,
        once (at its admission)."""
        return self.waits.take_fetched_chunk_keys(req_id)

    def pinned_units(self, req_id: str) -> list[UnitId]:
        return self.waits.pinned_units(req_id)

    def waiting(self, req_id: str) -> bool:
        """The request waits on a lookup or a fetch (for invariant checks)."""
        return self.waits.waiting(req_id)

    def any_waiting(self) -> bool:
        """Some request waits on a lookup or a fetch."""
        return self.waits.any_waiting()

    def forget(self, req_id: str) -> None:
        self.waits.forget(req_id)

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
