"""Scheduler-side storage fetches in flight: the placeholder each one reserves in the CPU
tier, the jobs the workers are still to be sent, the request each one is for (None:
nobody waits for it any more, it lands in the background), and the rounds that time
the storage's pace.

A request that gives storage up as too slow cancels its fetches (``cancel``): those not
yet sent are dropped here, the others go to the workers, which skip the ones they have not
started and stop those they are reading within a piece (fs://). The recompute that follows
then does not compete with dozens of reads for the cores and the GIL, which made it
0.03–0.08 s slower than the engine's other prefills on an H100 (session 9). On an H200
strict's quiet declines took 7–18 ms longer from scheduling to first token than fresh
prompts with the reads in flight left running (sessions 29–30) and 9–18 ms with them
stopped (session 31), so those reads were not what cost that.

A round is the fetches sent together. Once all of them landed, the round's time over
its size is the pace the storage sustains with that many reads in flight: a disk
bounded by bandwidth reads k units at once in k times one unit's time, not in one.
Rounds of a single unit are not timed (one read says nothing about reads together);
a round smaller than the read threads (the probe: two units) is timed only when its
reads were served one after another (StorageEstimate.round_pace). The round's time
is the workers' own, from queueing its reads to the last landing (slowest rank): the
scheduler hears of a landing only after the engine step it happened in, and a round
abandoned to a long prefill would otherwise be timed by that prefill (on an H100: 64
units of 37.7 MB priced at 5.5 s, where `l3-stages` fetched from the same page cache at 11-18 GB/s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.l3_storage_estimate import StorageEstimate
from vllm_draft_offload.metadata import FetchJob

# Successor tuple of a unit whose header has not been read yet; token ids are >= 0.
PLACEHOLDER = -1


@dataclass
class FetchRound:
    size: int
    pending: set[int]
    # the slowest and the fastest of its landed units, by the workers' clocks
    slowest_s: float = 0.0
    fastest_s: float = float("inf")


class FetchBook:
    def __init__(
        self, index: CpuTierIndex, new_job_id: Callable[[], int], storage: StorageEstimate
    ) -> None:
        self.index = index
        self.new_job_id = new_job_id
        self.storage = storage
        # fetch job id -> (request id or None, placeholder unit in the CPU tier)
        self.units: dict[int, tuple[str | None, UnitId]] = {}
        self._unsent: list[FetchJob] = []
        self._cancels: list[int] = []
        self._rounds: dict[int, FetchRound] = {}
        # fetch job id -> seconds from a worker queueing it to its landing (slowest rank;
        # every landed fetch's report carries it: worker_l3.L3Link.drain)
        self._since_queued: dict[int, float] = {}

    def reserve(self, req_id: str | None, chunk_keys: Sequence[bytes]) -> list[int]:
        """Reserve fetches of `chunk_keys` in order, for the request (None: for nobody),
        until a slot is lacking; their job ids, sent with the next step as one round."""
        jobs = []
        for chunk_key in chunk_keys:
            job_id = self.new_job_id()
            placeholder: UnitId = (chunk_key, (PLACEHOLDER, job_id))
            # Evicts only unpinned, ready units: never a waiting request's head.
            entry = self.index.reserve(placeholder)
            if entry is None:
                break
            self._unsent.append(FetchJob(job_id, entry.slot, chunk_key))
            self.units[job_id] = (req_id, placeholder)
            jobs.append(job_id)
        if self.storage.times_round(len(jobs)):
            fetch_round = FetchRound(len(jobs), set(jobs))
            self._rounds.update(dict.fromkeys(jobs, fetch_round))
        return jobs

    def take_unsent(self) -> list[FetchJob]:
        jobs, self._unsent = self._unsent, []
        return jobs

    def orphan(self, job_ids: Iterable[int]) -> None:
        """Their request stopped waiting: they land in the background."""
        for job_id in job_ids:
            self.units[job_id] = (None, self.units[job_id][1])

    def cancel(self, job_ids: Iterable[int]) -> None:
        """Their request gave storage up: drop those not sent yet (their placeholders
        leave the CPU tier), and have the workers skip the others they have not started
        (``take_cancels``); what lands anyway lands in the background."""
        cancelled = set(job_ids)
        self.orphan(cancelled)
        for job in [job for job in self._unsent if job.job_id in cancelled]:
            self._unsent.remove(job)
            cancelled.discard(job.job_id)
            _, placeholder = self.units.pop(job.job_id)
            self._leave_round(job.job_id)
            self.index.remove(placeholder)
        self._cancels += sorted(cancelled)

    def take_cancels(self) -> list[int]:
        cancels, self._cancels = self._cancels, []
        return cancels

    def _leave_round(self, job_id: int) -> None:
        """A cancelled fetch leaves its round, which is timed by the units that land."""
        fetch_round = self._rounds.pop(job_id, None)
        if fetch_round is not None:
            fetch_round.pending.discard(job_id)
            fetch_round.size -= 1
            self._maybe_time(fetch_round)

    def _maybe_time(self, fetch_round: FetchRound) -> None:
        if fetch_round.pending:
            return
        pace = self.storage.round_pace(
            fetch_round.size, fetch_round.fastest_s, fetch_round.slowest_s
        )
        if pace is not None:
            self.storage.observe_pace(pace, fetch_round.size)

    def landed_after(self, job_id: int, seconds: float) -> None:
        """A worker's fetch of the job landed `seconds` after that worker queued it."""
        self._since_queued[job_id] = max(seconds, self._since_queued.get(job_id, 0.0))

    def finished(
        self, job_id: int, landed: bool, cancelled: bool = False
    ) -> tuple[str | None, UnitId]:
        """Every worker answered the fetch: who it was for and its placeholder. The last
        of a round whose every unit landed (or was cancelled) times the storage's pace
        by the units that landed; a round with a unit that failed says nothing about
        speed."""
        owner = self.units.pop(job_id)
        since_queued = self._since_queued.pop(job_id, 0.0)
        if cancelled:
            self._leave_round(job_id)
            return owner
        fetch_round = self._rounds.pop(job_id, None)
        if fetch_round is not None:
            fetch_round.pending.discard(job_id)
            fetch_round.slowest_s = max(fetch_round.slowest_s, since_queued)
            fetch_round.fastest_s = min(fetch_round.fastest_s, since_queued)
            if not landed:
                for other in fetch_round.pending:
                    del self._rounds[other]
            else:
                self._maybe_time(fetch_round)
        return owner
