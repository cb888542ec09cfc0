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
"""

from __future__ import annotations

from typing import Final

# A request waits for its fetch's first landing up to this many times the estimate from
# the fetch's start. On an H100 a warm round of 8 units of 37.7 MB, estimated at 19 ms,
# landed 20-25 ms after its start.
FIRST_LANDING_FACTOR: Final = 1.5


def may_wait_for_first_landing(
    stalled_s: float,
    first_landing_s: float,
    cold_limit_s: float,
    load_beats_recompute: bool,
    first_round_resident: bool | None,
) -> bool:
    """May a request keep waiting for its fetch's first landing, `stalled_s` after the
    fetch started, past its allowance?

    `first_landing_s`: the estimated first landing (one round's load); `cold_limit_s`:
    the most that estimate may be for a first round not known to be resident;
    `first_round_resident`: True when every file of the first round was in the page
    cache, False when one was not, None when that is unknown (treated as not)."""
    if not load_beats_recompute or stalled_s >= FIRST_LANDING_FACTOR * first_landing_s:
        return False
    return first_round_resident is True or first_landing_s <= cold_limit_s
