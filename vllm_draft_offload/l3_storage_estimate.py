"""How fast storage serves a fetch: the estimate the cost policy prices hits with
(l3_cost.py), fed by the workers' timings of the units they fetch.

`StorageEstimate` keeps seconds per unit fetch (a worker thread's read, decode and
copy into a host slot, as workers report it) and the lookup round trip. A fetch of
k units on `parallel` read threads takes about ceil(k / parallel) unit times, and at
least k times the pace (seconds per unit) that rounds of units sent together made
(l3_fetches.py; PROBE_UNITS or more): storage bound by bandwidth reads units in
parallel no faster than one after another. Exponentially weighted, so it follows a
backend that slows down or warms up.

A fetch's first units land together, one round's time after it starts: the reads on
every thread share the device, so the first landing comes no sooner than the first
round's load (`first_landing_s`), however early the first read began.
"""

from __future__ import annotations

import math
import threading
import time

# Placeholder until the first fetch is timed (never used for a decision: no
# hit is taken before then): 5 ms per request plus 0.25 GB/s per read thread.
PRIOR_LATENCY_S = 0.005
PRIOR_BYTES_PER_S = 0.25e9
# Weight of a new sample in the storage averages.
EWMA_ALPHA = 0.2
# Units of the probe, the first fetch from storage an engine makes (its speed unknown).
# It must be able to land within the wait allowance (5 % of the recompute): a round of
# one unit per read thread shares the device's bandwidth, so all of its units land
# together, after as many units' worth of reading (on an H100 host, 8 units of 37.7 MB
# in 20-25 ms against a 22 ms allowance: no restarted engine's first request ever took
# a storage hit, sessions 9-11). Two units land in about a quarter of that, and still
# show whether reads in flight share a bandwidth (a disk reading one at a time takes
# twice as long for them as for one).
PROBE_UNITS = 2
# A round smaller than the read threads was served one read after another when its last
# unit landed this many times later than its first (two reads at once on a disk that
# one read saturates: 2 x).
SERIAL_RATIO = 1.5
# Storage estimates older than this are refreshed by a probe fetch.
REPROBE_S = 30.0


class StorageEstimate:
    def __init__(self, unit_bytes: int, parallel: int) -> None:
        self.parallel = max(1, parallel)
        self.unit_s = PRIOR_LATENCY_S + unit_bytes / PRIOR_BYTES_PER_S
        self.round_trip_s = PRIOR_LATENCY_S
        # Seconds per unit landed while many were fetched at once (0: not measured).
        # Storage bounded by bandwidth (a disk) does not read `parallel` units in one
        # unit's time: this is what a long fetch really costs per unit.
        self.pace_s = 0.0
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

    def observe_pace(self, seconds_per_unit: float, units: int = 1) -> None:
        """`units` landed at this pace: weighed as that many samples, so one round
        (every read thread's unit) moves the average as far as its units' own times
        move unit_s, and a storage that warmed up is believed after a round or two."""
        with self._lock:
            alpha = 1.0 if self.pace_s == 0.0 else 1.0 - (1.0 - EWMA_ALPHA) ** units
            self.pace_s += alpha * (seconds_per_unit - self.pace_s)

    def times_round(self, units: int) -> bool:
        """Can a round of `units` fetches sent together time the storage's pace? A
        single unit says nothing about reads in flight together."""
        return units >= min(PROBE_UNITS, self.parallel)

    def round_pace(self, units: int, fastest_s: float, slowest_s: float) -> float | None:
        """Seconds per unit that a round of `units` (its units landing `fastest_s` to
        `slowest_s` after they were queued) says the storage sustains, or None when it
        says nothing. A round of `parallel` or more units: its time over its size. A
        smaller one (the probe) only when its reads were served one after another (the
        last landed SERIAL_RATIO times later than the first: a disk whose bandwidth one
        read takes); units that landed together say only that the storage reads that
        many at once, and their time over their number would price a storage that reads
        `parallel` at once several times too high (on an H100 host: 62 warm units priced
        at 0.47 s, above recompute, where they took 0.17-0.27 s)."""
        if units >= self.parallel or (
            units >= PROBE_UNITS and slowest_s >= SERIAL_RATIO * fastest_s
        ):
            return slowest_s / units
        return None

    def load_s(self, units: int) -> float:
        return max(math.ceil(units / self.parallel) * self.unit_s, units * self.pace_s)

    def first_landing_s(self, units: int) -> float:
        """Seconds from the start of a fetch of `units` to its first landing: the first
        round (one unit per read thread) is read together and lands together, so its
        load, one unit time or its units at the pace, whichever is longer."""
        return self.load_s(min(units, self.parallel))

    def stale(self) -> bool:
        return self.samples == 0 or time.monotonic() - self.last_sample > REPROBE_S
