"""May a fetch with nothing landed yet still be waited for, past the wait allowance?

Reads sent together land together, one round's time after the fetch starts
(StorageEstimate.first_landing_s), so before that nothing can be seen. The bet is to
wait for that landing up to FIRST_LANDING_FACTOR times its estimate from the fetch's
start, and only when the estimated load of the whole fetch beats recomputing it.

Which first rounds are worth that bet depends on whether the storage is warm:

* Known resident (every page of the first round's files in the page cache when the
  lookup found them, l3_residency.py): the units land at memory speed, so the bet is
  made however the estimate compares to the allowance. H100, session 18: a warm
  restart's first round of 8 units of 37.7 MB, estimated at 38 ms from a 34 ms unit
  time against a 28 ms allowance, was given up 22 ms into its fetch, just before it
  would have landed: 64 units that load in 0.30 s against 0.56 s of recompute.
* Not resident, or unknown (a backend without files, a kernel that would not tell):
  only when the estimate is itself within the cold limit (PROBE_WAIT_FRACTION of the
  recompute looked up, l3_cost.py), so the bet costs no more than the allowance did.
  A cold disk priced from reads that landed together is exactly what the estimate
  overrates (H100, session 16: 64 units priced from a 45 ms unit time, nothing landed,
  given up 0.12 s in, 1.26 x recompute).

A resident first round gets more slack than the estimate's 1.5 x, bounded by a share
of the recompute instead: RESIDENT_LANDING_FACTOR times the estimate, but never past
RESIDENT_WAIT_FRACTION of R. H100, session 18 (lease 2): with the 1.5 x slack, a warm
resident round estimated at 16 ms (a 64-unit load priced at 0.13 s against 0.56 s of
recompute) had not landed 26 ms into its fetch and was given up; the whole fetch of
the next warm prompt took 0.21 s, 26 ms a round. The same run's first request after
the restart, a two-unit probe of resident files, had not landed within the 28 ms
allowance either (the probe rounds of lease 1 landed in 29 ms): a resident probe may
wait up to RESIDENT_WAIT_FRACTION of R too (``may_wait_for_resident_probe``). A
resident bet that turns slow (pages evicted between the lookup and the reads, or a
stalled host) therefore costs at most that share of R and a poll.
"""

from __future__ import annotations

from typing import Final

# A request waits for its fetch's first landing up to this many times the estimate from
# the fetch's start. On an H100 a warm round of 8 units of 37.7 MB, estimated at 19 ms,
# landed 20-25 ms after its start.
FIRST_LANDING_FACTOR: Final = 1.5
# A first round known resident may be waited for up to this many times its estimate
# (H100, session 18: rounds estimated at 16 ms took 26 ms, 1.6 x) ...
RESIDENT_LANDING_FACTOR: Final = 3.0
# ... and never past this share of the recompute looked up: the bound of a resident bet.
RESIDENT_WAIT_FRACTION: Final = 0.15


def may_wait_for_first_landing(
    stalled_s: float,
    first_landing_s: float,
    cold_limit_s: float,
    load_beats_recompute: bool,
    first_round_resident: bool | None,
    resident_limit_s: float,
) -> bool:
    """May a request keep waiting for its fetch's first landing, `stalled_s` after the
    fetch started, past its allowance?

    `first_landing_s`: the estimated first landing (one round's load); `cold_limit_s`:
    the most that estimate may be for a first round not known to be resident;
    `first_round_resident`: True when every file of the first round was in the page
    cache, False when one was not, None when that is unknown (treated as not);
    `resident_limit_s`: the most a resident first round is waited for
    (RESIDENT_WAIT_FRACTION of the recompute)."""
    if not load_beats_recompute:
        return False
    if first_round_resident is True:
        return stalled_s < min(RESIDENT_LANDING_FACTOR * first_landing_s, resident_limit_s)
    return stalled_s < FIRST_LANDING_FACTOR * first_landing_s and first_landing_s <= cold_limit_s


def may_wait_for_resident_probe(
    waited_s: float, first_round_resident: bool | None, resident_limit_s: float
) -> bool:
    """May a request whose storage is not yet measured keep waiting for its probe past
    the allowance? Only when the probe's files are resident, up to `resident_limit_s`
    in all: with no estimate there is nothing else to bet on."""
    return first_round_resident is True and waited_s < resident_limit_s
