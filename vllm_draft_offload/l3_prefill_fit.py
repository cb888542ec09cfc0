"""The engine's prefill step time, fitted online: what recomputing tokens costs.

`PrefillEstimate`: the engine's step time (from when a step was scheduled, or
the previous step's output arrived if later, until its output arrives; timed by
`l3_cost.CostModel`), fitted as t = a + b * tokens + c * attention, where
attention = sum over the step's requests of n * (context + n / 2) (query-key
pairs of n new tokens after `context` cached ones). Fitted by least squares with
non-negative coefficients over the last WINDOW steps, after dropping outliers (a
step that waited on I/O or followed an idle engine) by the median absolute
residual. Recomputing tokens [s, s + n) of one request then costs about
b * n + c * n * (s + n / 2): the back of a long prefix costs most.

A restarted engine has timed no step yet. The prefill samples of an earlier
engine of the same model and device (shared through storage, l3_calibration.py)
stand in as a prior until the engine has its own fit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import combinations

import numpy as np

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
