"""Which of the connector's containers grew over a soak (their sizes: stress/state.py):
under a steady load a leak, unless the container filled to a bound and stayed there."""

from __future__ import annotations

from typing import Any

# Connector containers listed in the summary: those that grew most after the warm-up.
STATE_GROWTH_TOP = 8


def state_growth(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Containers of the connector (samples' ``state``, stress/state.py) with more entries
    at the end than after the warm-up (the first count at 60 s or a quarter of the run),
    most growth first: under a steady load, a leak. ``flat_since_t``: from when on the
    count held its last value, at its peak (None while it still rose at the end): a
    container that fills to a bound it is built with (a cache of one entry per slot)
    and stays there is no leak, and this tells the two apart over a long enough run."""
    counted = [s for s in samples if "state" in s]
    if len(counted) < 2:
        return []
    start = min(60.0, counted[-1]["t"] / 4)
    base = next(s for s in counted if s["t"] >= start or s is counted[-1])
    later = counted[counted.index(base) :]
    peak: dict[str, int] = {}
    for s in later:
        for path, n in s["state"].items():
            peak[path] = max(n, peak.get(path, 0))
    first, last = base["state"], counted[-1]["state"]
    grew = [
        {
            "path": p,
            "t0": base["t"],
            "first": first.get(p, 0),
            "last": n,
            "max": peak[p],
            "flat_since_t": _flat_since(later, p, n) if n == peak[p] else None,
        }
        for p, n in last.items()
        if n > first.get(p, 0)
    ]
    grew.sort(key=lambda g: g["last"] - g["first"], reverse=True)
    return grew[:STATE_GROWTH_TOP]


def _flat_since(counted: list[dict[str, Any]], path: str, value: int) -> float | None:
    """The time of the first of the trailing samples whose count of ``path`` is
    ``value`` (None when only the last one is: nothing to call flat yet)."""
    since = None
    for sample in reversed(counted):
        if sample["state"].get(path, 0) != value:
            break
        since = sample["t"]
    return since if since is not None and since < counted[-1]["t"] else None
