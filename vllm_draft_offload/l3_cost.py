"""Is a storage hit worth it? Online estimates of load time and recompute time.

Two estimators, fed by what the connector sees anyway:

* `StorageEstimate`: seconds per unit fetch (a worker thread's read, decode and
  copy into a host slot, as workers report it) and the lookup round trip. A
  fetch of k units on `parallel` read threads takes about ceil(k / parallel)
  unit times. Exponentially weighted, so it follows a backend that slows down
  or warms up.
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
involved: its hits are always taken. Until a storage timing exists, the first
storage hit fetches one unit as a probe and waits for it at most
PROBE_WAIT_FRACTION of the hit's estimated recompute time (l3_prefetch.py); then
it decides with the measured speed, or gives up and recomputes. So a hit on an
unmeasured storage costs at most that fraction more than recomputing.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import combinations

import numpy as np

# Placeholder until the first fetch is timed (never used for a decision: no
# hit is taken before then): 5 ms per request plus 0.25 GB/s per read thread.
PRIOR_LATENCY_S = 0.005
PRIOR_BYTES_PER_S = 0.25e9
# Weight of a new sample in the storage averages.
EWMA_ALPHA = 0.2
# A first storage hit waits on its probe fetch for at most this share of its
# estimated recompute time: the worst case is recompute + 5 %.
PROBE_WAIT_FRACTION = 0.05
# Storage estimates older than this are refreshed by a probe fetch.
REPROBE_S = 30.0
# Step samples kept for the prefill fit, and the fewest that make a fit.
WINDOW = 256
MIN_SAMPLES = 4
REFIT_EVERY = 8
# A step counts as a prefill sample when it computes at least this many tokens.
MIN_PREFILL_TOKENS = 16


class StorageEstimate:
    def __init__(self, unit_bytes: int, parallel: int) -> None:
        self.parallel = max(1, parallel)
        self.unit_s = PRIOR_LATENCY_S + unit_bytes / PRIOR_BYTES_PER_S
        self.round_trip_s = PRIOR_LATENCY_S
        self.samples = 0
        self.last_sample = -math.inf
        self._lock = threading.Lock()

    def observe_fetch(self, seconds: float) -> None:
        with self._lock:
            # The first sample replaces the prior outright: it is a guess, this is data.
            alpha = 1.0 if self.samples == 0 else EWMA_ALPHA
            self.unit_s += alpha * (seconds - self.unit_s)
            self.samples += 1
            self.last_sample = time.monotonic()

    def observe_round_trip(self, seconds: float) -> None:
        with self._lock:
            self.round_trip_s += EWMA_ALPHA * (seconds - self.round_trip_s)

    def load_s(self, units: int) -> float:
        return math.ceil(units / self.parallel) * self.unit_s

    def stale(self) -> bool:
        return self.samples == 0 or time.monotonic() - self.last_sample > REPROBE_S


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


class PrefillEstimate:
    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._new = 0
        self.coef: np.ndarray | None = None  # a, b, c

    def observe(self, tokens: int, attention: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((float(tokens), attention, seconds))
        self._new += 1
        if self._new >= REFIT_EVERY or self.coef is None:
            self._fit()

    def _fit(self) -> None:
        data = np.array(self._samples)
        if len(data) < MIN_SAMPLES or not np.any(data[:, 0] >= MIN_PREFILL_TOKENS):
            return
        self._new = 0
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        # Columns on one scale, so no coefficient is favoured by its units.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        coef = _nonneg_lstsq(x / scale, data[:, 2])
        residual = x / scale @ coef - data[:, 2]
        mad = float(np.median(np.abs(residual - np.median(residual))))
        keep = np.abs(residual) <= 3 * 1.4826 * mad + 1e-9
        if keep.sum() >= MIN_SAMPLES and not keep.all():
            coef = _nonneg_lstsq(x[keep] / scale, data[keep, 2])
        self.coef = coef / scale

    def recompute_s(self, start: int, tokens: int) -> float | None:
        """Seconds to compute tokens [start, start + tokens) of one request; None: unknown.

        Before the fit exists (fewer than MIN_SAMPLES steps), the fastest per-token
        rate of the prefill steps seen so far stands in: it ignores the attention
        term, so it underestimates a long prefix's recompute and errs towards
        recomputing."""
        if self.coef is None:
            rates = [s / t for t, _, s in self._samples if t >= MIN_PREFILL_TOKENS]
            return min(rates) * tokens if rates else None
        _, b, c = self.coef
        return float(b * tokens + c * tokens * (start + tokens / 2))


class CostModel:
    def __init__(
        self,
        chunk_size: int,
        unit_bytes: int,
        parallel: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.chunk_size = chunk_size
        self._clock = clock
        self.storage = StorageEstimate(unit_bytes, parallel)
        self.prefill = PrefillEstimate()
        # Scheduled steps whose output has not come back: (time, tokens, attention).
        # Bounded: if vLLM ever skips an output, old entries fall off.
        self._open_steps: deque[tuple[float, int, float]] = deque(maxlen=4)
        self._last_output = -math.inf

    # ------------------------------------------------------------- step timing

    def step_scheduled(self, work: list[tuple[int, int]]) -> None:
        """A step was scheduled: (new tokens, context before them) per request."""
        tokens = sum(n for n, _ in work)
        attention = float(sum(n * (ctx + n / 2) for n, ctx in work))
        self._open_steps.append((self._clock(), tokens, attention))

    def step_output(self) -> None:
        """The oldest scheduled step's output was processed.

        Steps run one after another on the device, so a step ran from when it was
        scheduled or the previous one ended, whichever is later, until its output
        arrived. This holds with async scheduling too (vLLM schedules step k+1
        before step k's output comes back), and an idle engine adds no time.
        """
        now = self._clock()
        if not self._open_steps:
            return
        scheduled, tokens, attention = self._open_steps.popleft()
        started = max(scheduled, self._last_output)
        self._last_output = now
        if tokens:
            self.prefill.observe(tokens, attention, now - started)

    # ---------------------------------------------------------------- decision

    def probe_wait_s(self, first_chunk: int, num_chunks: int) -> float:
        """How long a first hit may wait on its probe fetch; 0: no estimate to bound it."""
        compute = self.prefill.recompute_s(
            first_chunk * self.chunk_size, num_chunks * self.chunk_size
        )
        return PROBE_WAIT_FRACTION * compute if compute else 0.0

    def chunks_worth_loading(self, first_chunk: int, num_chunks: int, round_trip: bool) -> int:
        """How many of chunks [first_chunk, first_chunk + num_chunks) to load from storage.

        `round_trip`: a lookup is still to be paid. Returns the count that saves the
        most time over recomputing them, 0 when none saves any or speed is unknown.
        """
        if self.storage.samples == 0:
            return 0  # storage speed unknown: the prefetch probes it first
        best, best_gain = 0, 0.0
        extra = self.storage.round_trip_s if round_trip else 0.0
        start = first_chunk * self.chunk_size
        for count in range(1, num_chunks + 1):
            compute = self.prefill.recompute_s(start, count * self.chunk_size)
            if compute is None:
                return 0
            gain = compute - self.storage.load_s(count) - extra
            if gain > best_gain:
                best, best_gain = count, gain
        return best
