"""Is a storage hit worth it? Online estimates of load time and recompute time.

Two estimators, fed by what the connector sees anyway:

* `StorageEstimate` (l3_storage_estimate.py): seconds per unit fetch, the pace rounds
  of fetches made (seconds per unit with many in flight), the lookup round trip.
* `PrefillEstimate`: the engine's step time (from when a step was scheduled, or
  the previous step's output arrived if later, until its output arrives), fitted as
  t = a + b * tokens + c * attention, where attention = sum over the step's
  requests of n * (context + n / 2) (query-key pairs of n new tokens after
  `context` cached ones). Fitted by least squares with non-negative
  coefficients over the last WINDOW steps, after dropping outliers (a step
  that waited on I/O or followed an idle engine) by the median absolute
  residual. Recomputing tokens [s, s + n) of one request then costs about
  b * n + c * n * (s + n / 2): the back of a long prefix costs most.

`CostModel.chunks_worth_loading` picks how many leading chunks of a storage
hit to load: the count that saves the most time, or none. The CPU tier is not
involved: its hits are always taken. `CostModel.wait_allowance_s` is what a
request may always wait on storage (l3_waits.py; all it gets while the storage
is unmeasured): PROBE_WAIT_FRACTION of the estimated recompute R of the chunks it
looks up, plus the estimated recompute of the leading chunks that have already
landed (those it no longer has to compute). Admitted at any moment within that
allowance, the request finishes no later than recomputing everything would plus
that fraction, however slow the storage turns out to be.

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

A restarted engine has timed no step yet. The prefill samples of an earlier
engine of the same model and device (shared through storage, l3_calibration.py)
stand in as a prior until the engine has its own fit.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import combinations

import numpy as np

from vllm_draft_offload.l3_first_landing import (
    RESIDENT_WAIT_FRACTION,
    may_wait_for_first_landing,
    may_wait_for_resident_probe,
)
from vllm_draft_offload.l3_storage_estimate import PROBE_UNITS, StorageEstimate

__all__ = ["PROBE_UNITS", "CostModel", "PrefillEstimate", "StorageEstimate", "fit_steps"]

# Weight of a new sample in the step duration.
STEP_ALPHA = 0.3
# A request waits on storage for at most this share of the estimated recompute of
# the chunks it looks up (beyond what landed chunks save): worst case recompute + 5 %.
PROBE_WAIT_FRACTION = 0.05
# Step samples kept for the prefill fit, and the fewest that make a fit.
WINDOW = 256
MIN_SAMPLES = 4
REFIT_EVERY = 8
# A step counts as a prefill sample when it computes at least this many tokens.
MIN_PREFILL_TOKENS = 16


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best of all column subsets (3 columns)."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y * y))
    for size in range(1, x.shape[1] + 1):
        for cols in combinations(range(x.shape[1]), size):
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((x[:, cols] @ coef - y) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(x.shape[1])
                best[list(cols)] = coef
    return best


Sample = tuple[float, float, float]  # (tokens, attention, seconds) of one step


def fit_steps(samples: Iterable[Sample]) -> np.ndarray | None:
    """Coefficients (a, b, c) of t = a + b * tokens + c * attention, or None while the
    samples cannot make a fit (fewer than MIN_SAMPLES, or no prefill step).

    Prefill steps timed far faster per token than the median large prefill are
    dropped first: no device computes a step that fast, so its timing is wrong,
    and the relative-error fit would otherwise follow that one step (its error
    term dominates) and price every recompute near zero."""
    samples = list(samples)
    rate = median_prefill_rate(samples)
    if rate is not None:
        floor = MISTIMED_RATE_FRACTION * rate
        samples = [s for s in samples if s[0] < MIN_PREFILL_TOKENS or s[2] / s[0] >= floor]
    data = np.array(samples, dtype=float).reshape(-1, 3)
    if len(data) < MIN_SAMPLES or not np.any(data[:, 0] >= MIN_PREFILL_TOKENS):
        return None
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    # Columns on one scale, so no coefficient is favoured by its units.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    # Errors relative to each step's own time: the few long prefill steps among many
    # short ones (what prices a recompute) count as much as the rest, and a step that
    # waited on I/O or an idle engine, off by a multiple, weighs at most 1.
    seconds = data[:, 2]
    xw = x / scale / seconds[:, None]
    coef = _nonneg_lstsq(xw, np.ones(len(data)))
    residual = xw @ coef - 1.0
    mad = float(np.median(np.abs(residual - np.median(residual))))
    keep = np.abs(residual) <= 3 * 1.4826 * mad + 1e-9
    prefill_kept = np.any(data[keep, 0] >= MIN_PREFILL_TOKENS)
    if keep.sum() >= MIN_SAMPLES and not keep.all() and prefill_kept:
        coef = _nonneg_lstsq(xw[keep], np.ones(int(keep.sum())))
    return coef / scale


# This engine's own fit prices recomputes of up to this many times the largest step
# it was fit on; larger ones are priced by an earlier engine's calibration when there
# is one. On an H100 (session 11) a fit of a 255-token warm-up and decode steps priced
# a 16k-token recompute at 9.5 s against 0.45 s, and so let a request wait on storage
# for up to 9.9 s.
OWN_FIT_REACH = 4.0
# A prefill step whose per-token time is below this fraction of the median large
# prefill's is taken as mistimed and left out of the fit.
MISTIMED_RATE_FRACTION = 0.25
# A fit may not price a recompute below this fraction of what the median per-token
# rate of the large prefill steps says: one step timed wrong (seen on an H100: a
# 16k-token step "taking" 2 ms) would otherwise pull the fit to near zero, and every
# storage hit would then look slower than recomputing.
RATE_FLOOR_FRACTION = 0.5


def prefill_rates(samples: Iterable[Sample]) -> list[tuple[float, float]]:
    """(tokens, seconds per token) of the prefill steps among `samples`."""
    return [(t, s / t) for t, _, s in samples if t >= MIN_PREFILL_TOKENS]


def median_prefill_rate(samples: Iterable[Sample]) -> float | None:
    """Median seconds per token of the larger prefill steps (at least a quarter of
    the largest seen), or None without a prefill step."""
    prefills = prefill_rates(samples)
    if not prefills:
        return None
    largest = max(t for t, _ in prefills)
    return float(np.median([rate for t, rate in prefills if t >= largest / 4]))


class PrefillEstimate:
    def __init__(self) -> None:
        self._samples: deque[Sample] = deque(maxlen=WINDOW)
        self._new = 0  # samples taken since the last fit (or try at one)
        self._coef: np.ndarray | None = None  # a, b, c: this engine's own fit (see coef)
        # Fit of an earlier engine's samples (same model and device): used until
        # this engine has its own fit.
        self.prior_coef: np.ndarray | None = None
        self._prior_rate: float | None = None  # median_prefill_rate of those samples
        self._prior_samples: list[Sample] = []
        # median_prefill_rate of this engine's samples, computed when first needed
        # after a new sample: recompute_s runs once per candidate chunk count of
        # every lookup, a sample comes once per step.
        self._rate: float | None = None
        self._rate_stale = False
        self.observed = 0  # step samples taken so far (the calibration saves new ones)
        # The largest step (tokens) among the samples of this engine's current fit.
        self._fit_largest = 0.0

    def observe(self, tokens: int, attention: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((float(tokens), attention, seconds))
        self._rate_stale = True
        self.observed += 1
        self._new += 1

    @property
    def coef(self) -> np.ndarray | None:
        """This engine's own fit, (a, b, c), refit when asked after REFIT_EVERY new samples
        (at once while there is none). Fit when a price is asked for, not as each step's
        sample comes: a fit takes about a millisecond of the scheduler thread, vLLM steps
        tens of times a second, and prices are asked for only by storage lookups (py-spy
        on an H100, session 23: refitting as samples came took 1.8 % of the busy engine thread)."""
        if self._new and (self._coef is None or self._new >= REFIT_EVERY):
            self._new = 0
            coef = fit_steps(self._samples)
            if coef is not None:
                self._coef = coef
                self._fit_largest = max(t for t, _, _ in self._samples)
        return self._coef

    def set_prior(self, samples: Iterable[Sample]) -> bool:
        """Take an earlier engine's step samples as the estimate until this engine has
        its own fit (too few for a fit: their fastest per-token prefill rate); False
        when they hold no prefill step."""
        samples = list(samples)
        self._prior_samples = samples[-WINDOW:]
        self._prior_rate = median_prefill_rate(samples)
        coef = fit_steps(samples)
        if coef is None:
            rates = [rate for _, rate in prefill_rates(samples)]
            coef = np.array([0.0, min(rates), 0.0]) if rates else None
        self.prior_coef = coef
        return coef is not None

    def own_samples(self) -> list[Sample]:
        return list(self._samples)

    def samples_to_share(self) -> list[Sample]:
        """What the next engine should start from: the prior's samples, then this
        engine's own, the newest WINDOW. A restarted engine that timed only a few
        short steps must not replace the long prefills it was given."""
        return [*self._prior_samples, *self._samples][-WINDOW:]

    @property
    def has_prefill(self) -> bool:
        """A prefill step was timed: the samples say something about recompute."""
        return any(t >= MIN_PREFILL_TOKENS for t, _, _ in self._samples)

    def _own_fit_prices(self, tokens: int) -> bool:
        """Does this engine's own fit price a recompute of `tokens`? Not beyond
        OWN_FIT_REACH times the largest step it was fit on while an earlier engine's
        calibration can."""
        if self.coef is None:
            return False
        return self.prior_coef is None or tokens <= OWN_FIT_REACH * self._fit_largest

    def source_for(self, tokens: int) -> str:
        """Where the estimate of a recompute of `tokens` comes from (decision log)."""
        if self._own_fit_prices(tokens):
            return "fit"
        if self.prior_coef is not None:
            return "calibration"
        return "rate" if self.has_prefill else "none"

    @property
    def source(self) -> str:
        """Where recompute estimates of short steps come from now."""
        return self.source_for(0)

    def recompute_s(self, start: int, tokens: int, span: int = 0) -> float | None:
        """Seconds to compute tokens [start, start + tokens) of one request; None: unknown.

        Without a fit of this engine's own steps that reaches `tokens` (OWN_FIT_REACH
        times its largest step), an earlier engine's (the calibration) stands in;
        without either, the fastest per-token rate of the prefill steps seen so far:
        it ignores the attention term, so it underestimates a long prefix's recompute
        and errs towards recomputing.

        `span`: the tokens of the whole range these are part of, when a caller weighs
        parts of one range against each other (how many chunks to load, what landed
        ones save). The estimate is then the one that prices the whole range, for
        every part: two estimates disagree by a factor, and comparing parts priced by
        different ones picks the part the dearer one prices (H100, session 13: an own
        fit of a 255-token warm-up priced 3 chunks at 0.36 s, the calibration 64 at
        0.45 s, and 3 of 64 units were fetched)."""
        own = self._own_fit_prices(max(tokens, span))
        coef = self.coef if own else self.prior_coef
        if coef is None:
            rates = [rate for _, rate in prefill_rates(self._samples)]
            return min(rates) * tokens if rates else None
        _, b, c = coef
        fitted = float(b * tokens + c * tokens * (start + tokens / 2))
        if not own:
            rate = self._prior_rate
        else:
            if self._rate_stale:
                self._rate, self._rate_stale = median_prefill_rate(self._samples), False
            rate = self._rate
        floor = RATE_FLOOR_FRACTION * rate * tokens if rate is not None else 0.0
        return max(fitted, floor)


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
        if waited_s < allowance:
            return True, allowance
        storage = self.storage
        if not self.wait_past_allowance:
            return False, allowance
        if phase == "probe" or storage.samples == 0:
            whole = self.recompute_chunks_s(first_chunk, num_chunks) or 0.0
            return may_wait_for_resident_probe(
                waited_s, first_round_resident, RESIDENT_WAIT_FRACTION * whole
            ), allowance
        step_s = self.step_s if poll_s is None else poll_s
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
