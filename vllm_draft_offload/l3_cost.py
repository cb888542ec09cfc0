"""Is a storage hit worth it? Online estimates of load time and recompute time.

Two estimators, fed by what the connector sees anyway:

* `StorageEstimate` (l3_storage_estimate.py): seconds per unit fetch, the pace rounds
  of fetches made (seconds per unit with many in flight), the lookup round trip.
* `PrefillEstimate` (l3_prefill_fit.py): the engine's step time, which `CostModel`
  times from when a step was scheduled, or the previous step's output arrived if
  later, until its output arrives, fitted to each step's tokens and attention. It
  prices recomputing tokens [s, s + n) of one request; an earlier engine's samples
  stand in until this engine has its own fit.

`CostModel.chunks_worth_loading` picks how many leading chunks of a storage
hit to load: the count that saves the most time, or none. The CPU tier is not
involved: its hits are always taken. `CostModel.wait_allowance_s` is what a
request may always wait on storage (l3_waits.py; all it gets while the storage
is unmeasured): PROBE_WAIT_FRACTION of the estimated recompute R of the chunks it
looks up, plus the estimated recompute of the leading chunks that have already
landed (those it no longer has to compute). Admitted at any moment within that
allowance, the request finishes no later than recomputing everything would plus
that fraction, however slow the storage turns out to be.

With `l3.wait_past_allowance` off, the allowance is the end: a request stops at the
last poll before it ends (its next poll, a step later, would come past it), so the
worst case is recompute + PROBE_WAIT_FRACTION whatever the storage speed.

`CostModel.may_wait` also lets a request wait past its allowance (unless
`l3.wait_past_allowance` is off), on what the estimates promise, in three bounded
bets: a lookup for two round trips and two polls; a fetch before its first landing
for FIRST_LANDING_FACTOR times the estimated first landing from its start, and only
when that estimate is at most PROBE_WAIT_FRACTION * R, or, when the page cache holds
the first round, for up to RESIDENT_LANDING_FACTOR times it within
RESIDENT_WAIT_FRACTION * R (l3_first_landing.py, l3_residency.py); a fetch whose units land
while the pace they make finishes it before recomputing what has not landed, and
the next landing comes within two unit times and polls.

Worst case, whatever the storage speed: a request that ends up recomputing after
waiting loses at most

    PROBE_WAIT_FRACTION * R                      (5 %: the allowance)
  + one poll                                     (it is looked at once per engine step)
  + max(0, 2 * (round trip + poll) - allowance)  (a lookup slower than the allowance)
  + FIRST_LANDING_FACTOR * PROBE_WAIT_FRACTION * R + one poll
                                                 (7.5 % and a step: the first-landing bet)

beyond what landed chunks save, and, once units land, at most two unit times and
polls after the storage stops keeping the pace it showed. A first round known
resident (or a probe of resident files) bets at most RESIDENT_WAIT_FRACTION * R (15 %)
and a poll instead of the last term (l3_first_landing.py says why the slack). Resident
data lands at memory speed, so that bet turns slow only when the pages are evicted
between the lookup and the reads or the host stalls. A storage that answers
its lookup within the allowance and whose first round, not known resident, the
estimate prices beyond PROBE_WAIT_FRACTION * R (a cold disk priced from reads that
landed together: the H100 cold restart, 45 ms a unit against a 29 ms allowance) gets
no bet: it is given up within the allowance and one poll, at most 5 % of R and a
step. The bet is what lets a warm hit whose lookup alone outlasted the allowance
(behind another prompt's storage writes) still be taken; no rule that waits on an
estimate can bound it tighter against storage that then turns out slower. The price
of the bound: storage whose first round takes longer than PROBE_WAIT_FRACTION * R
(high latency, or a bandwidth one round already fills) and is not known resident
(cold, or not fs://) serves a hit only when it lands within the allowance, even where
the whole fetch would beat recomputing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from vllm_draft_offload.l3_first_landing import (
    RESIDENT_WAIT_FRACTION,
    may_wait_for_first_landing,
    may_wait_for_resident_probe,
)
from vllm_draft_offload.l3_prefill_fit import PrefillEstimate
from vllm_draft_offload.l3_storage_estimate import PROBE_UNITS, StorageEstimate

__all__ = ["PROBE_UNITS", "CostModel", "StorageEstimate"]

# Weight of a new sample in the step duration.
STEP_ALPHA = 0.3
# A request waits on storage for at most this share of the estimated recompute of
# the chunks it looks up (beyond what landed chunks save): worst case recompute + 5 %.
PROBE_WAIT_FRACTION = 0.05


class CostModel:
    def __init__(
        self,
        chunk_size: int,
        unit_bytes: int,
        parallel: int,
        clock: Callable[[], float] = time.perf_counter,
        wait_past_allowance: bool = True,
    ) -> None:
        self.chunk_size = chunk_size
        self.wait_past_allowance = wait_past_allowance
        self._clock = clock
        self.storage = StorageEstimate(unit_bytes, parallel)
        self.prefill = PrefillEstimate()
        # Scheduled steps whose output has not come back: (time, tokens, attention,
        # empty). Bounded: if vLLM ever skips an output, old entries fall off.
        self._open_steps: deque[tuple[float, int, float, bool]] = deque(maxlen=4)
        self._last_output = -math.inf
        # Recent step duration (any step): a waiting request is looked at once per
        # step, and a fetch's result reaches the scheduler a step after it lands.
        self.step_s = 0.0

    # ------------------------------------------------------------- step timing

    def step_scheduled(self, work: list[tuple[int, int]], loads: bool = False) -> None:
        """A step was scheduled: (new tokens, context before them) per request.

        `loads`: the step also restores KV from the CPU tier. Its time is then not
        compute alone (a hit computing 2 tokens after 16k restored ones takes the
        load's time), and would teach the fit that attention over a long context
        costs what the copy did: such a step keeps the clock but is no sample."""
        computed = sum(n for n, _ in work)
        attention = float(sum(n * (ctx + n / 2) for n, ctx in work))
        empty = computed == 0 and not loads
        self._open_steps.append((self._clock(), 0 if loads else computed, attention, empty))

    def step_output(self) -> None:
        """The oldest scheduled step's output was processed.

        Steps run one after another on the device, so a step ran from when it was
        scheduled or the previous one ended, whichever is later, until its output
        arrived. This holds with async scheduling too (vLLM schedules step k+1
        before step k's output comes back), and an idle engine adds no time.

        An empty step (nothing computed, nothing loaded: a request waiting on
        storage) does not end the previous one's time: its output can come back
        late, once the step scheduled behind it has run on the device (seen on an
        H100, where that timed a 16k-token prefill at 2 ms).
        """
        now = self._clock()
        if not self._open_steps:
            return
        scheduled, tokens, attention, empty = self._open_steps.popleft()
        if empty:
            return
        started = max(scheduled, self._last_output)
        self._last_output = now
        self.step_s += STEP_ALPHA * (now - started - self.step_s)
        if tokens:
            self.prefill.observe(tokens, attention, now - started)

    # ---------------------------------------------------------------- decision

    def recompute_chunks_s(
        self, first_chunk: int, num_chunks: int, span_chunks: int = 0
    ) -> float | None:
        """Estimated seconds to recompute chunks [first_chunk, first_chunk + num_chunks),
        priced as part of a range of `span_chunks` (PrefillEstimate.recompute_s)."""
        return self.prefill.recompute_s(
            first_chunk * self.chunk_size,
            num_chunks * self.chunk_size,
            span_chunks * self.chunk_size,
        )

    def wait_allowance_s(self, first_chunk: int, num_chunks: int, landed: int) -> float:
        """How long a request may have waited on storage for chunks [first_chunk,
        first_chunk + num_chunks), of which the leading `landed` are in the CPU tier.

        PROBE_WAIT_FRACTION of the chunks' estimated recompute, plus the recompute
        the landed ones save: admitted at any moment within it, the request finishes
        at most that fraction later than recomputing would. 0 without an estimate."""
        whole = self.recompute_chunks_s(first_chunk, num_chunks)
        if not whole:
            return 0.0
        # Priced like the whole: an estimate that prices the landed chunks dearer would
        # let the request wait longer than they save.
        saved = self.recompute_chunks_s(first_chunk, landed, num_chunks) if landed > 0 else 0.0
        return PROBE_WAIT_FRACTION * whole + (saved or 0.0)

    def may_wait(
        self,
        phase: str,
        waited_s: float,
        stalled_s: float,
        first_chunk: int,
        num_chunks: int,
        landed: int,
        coming: int,
        landing_s: float = 0.0,
        fetched: int = 0,
        outstanding: int | None = None,
        poll_s: float | None = None,
        first_round_resident: bool | None = None,
    ) -> tuple[bool, float]:
        """May a request keep waiting on storage? (yes or no, its allowance)

        It waited `waited_s` in all, `stalled_s` since its fetch last progressed (its
        start, before any unit landed), for chunks [first_chunk, first_chunk +
        num_chunks): `landed` leading ones are in, `coming` more are being fetched.
        Always within wait_allowance_s. While the storage is unmeasured (a `probe`)
        only a probe of resident files, up to RESIDENT_WAIT_FRACTION of the recompute.
        Once it is measured, and unless `wait_past_allowance` is off, also (the bets
        the module docstring bounds):
        * a lookup within two round trips and two steps (an answer reaches the
          scheduler only with a step);
        * a fetch before any unit landed, when the estimated load beats recomputing: if
          `first_round_resident` (the page cache held every file of the first round when
          the lookup found it, l3_residency.py), for RESIDENT_LANDING_FACTOR times its
          estimated first landing (StorageEstimate.first_landing_s) from its start but
          at most RESIDENT_WAIT_FRACTION of the recompute looked up; otherwise for
          FIRST_LANDING_FACTOR times that estimate, and only when the estimate is at
          most PROBE_WAIT_FRACTION of the recompute (l3_first_landing.py). Reads sent
          together land together, so nothing can be seen sooner; but storage slower than
          its estimate is seen by that time, not after two unit times and steps of no
          progress (H100, session 16: a cold restart priced 64 units at 0.36 s from a 45
          ms unit time, saw nothing land, and gave up 0.12 s in against a 0.03 s
          allowance, 1.26 x recompute; a first round estimated past 5 % of the recompute
          is no bet);
        * a fetch whose units land while it keeps the pace (a landing within two unit
          times and steps) and finishing it at that pace beats recomputing what has
          not landed.

        `fetched` units of this fetch landed, in any order, the first of them
        `landing_s` seconds ago, and `outstanding` (default `coming`) have not landed
        yet. From the second landing on, the pace since the first (`landing_s` over
        `fetched` - 1) must finish the outstanding ones before recomputing what has not
        landed in order would (a fetch on storage that the estimate overrated stops at
        once, not after the estimate's time).

        A step is `poll_s`, the time since the scheduler last asked about this request
        (default: the engine's recent step time). While nothing else runs the engine
        steps every few ms; the mean of its computing steps, a 16k prefill's 0.5 s
        among them, let a request behind storage writes on an H100 (session 15) wait
        98 ms against a 33 ms allowance, at 1.31 x recompute."""
        allowance = self.wait_allowance_s(first_chunk, num_chunks, landed)
        step_s = self.step_s if poll_s is None else poll_s
        if not self.wait_past_allowance:
            # The allowance is the end, a poll's overshoot included: the request is looked
            # at again only a step from now (session 29, H200: waits that stopped at the
            # first poll past the allowance overshot it by up to 9 ms, 1.06-1.08 x).
            return waited_s + step_s < allowance, allowance
        if waited_s < allowance:
            return True, allowance
        storage = self.storage
        if phase == "probe" or storage.samples == 0:
            whole = self.recompute_chunks_s(first_chunk, num_chunks) or 0.0
            return may_wait_for_resident_probe(
                waited_s, first_round_resident, RESIDENT_WAIT_FRACTION * whole
            ), allowance
        if phase == "lookup":
            return waited_s < 2 * (storage.round_trip_s + step_s), allowance
        recompute = self.recompute_chunks_s(first_chunk + landed, coming, num_chunks)
        left = coming if outstanding is None else outstanding
        finish_s = storage.load_s(left)
        if fetched >= 2:
            finish_s = max(finish_s, left * landing_s / (fetched - 1))
        worth = recompute is not None and finish_s < recompute
        if not fetched and not landed:
            # Nothing landed yet: `stalled_s` runs from the fetch's start. Wait for the
            # first round, which lands together, no longer than the estimate's time for
            # it (with some slack), and only where it is resident or the estimate is
            # itself a bounded bet.
            whole = self.recompute_chunks_s(first_chunk, num_chunks) or 0.0
            wait = may_wait_for_first_landing(
                stalled_s,
                storage.first_landing_s(left),
                cold_limit_s=PROBE_WAIT_FRACTION * whole,
                load_beats_recompute=worth,
                first_round_resident=first_round_resident,
                resident_limit_s=RESIDENT_WAIT_FRACTION * whole,
            )
            return wait, allowance
        return worth and stalled_s < 2 * (storage.unit_s + step_s), allowance

    def chunks_worth_loading(
        self, first_chunk: int, num_chunks: int, round_trip: bool, span_chunks: int = 0
    ) -> int:
        """How many of chunks [first_chunk, first_chunk + num_chunks) to load from storage.

        `round_trip`: a lookup is still to be paid. Returns the count that saves the
        most time over recomputing them, 0 when none saves any or speed is unknown.
        Every count is priced by the estimate that prices all `num_chunks` (or the
        `span_chunks` they are the rest of): the counts are compared with each other,
        so they must be priced alike.
        """
        if self.storage.samples == 0:
            return 0  # storage speed unknown: the prefetch probes it first
        best, best_gain = 0, 0.0
        extra = self.storage.round_trip_s if round_trip else 0.0
        start = first_chunk * self.chunk_size
        span = max(num_chunks, span_chunks) * self.chunk_size
        for count in range(1, num_chunks + 1):
            compute = self.prefill.recompute_s(start, count * self.chunk_size, span)
            if compute is None:
                return 0
            gain = compute - self.storage.load_s(count) - extra
            if gain > best_gain:
                best, best_gain = count, gain
        return best
