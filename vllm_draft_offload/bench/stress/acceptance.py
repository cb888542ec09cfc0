"""Acceptance length restored vs fresh: from the connector's own spec counters, and
from the requests' records (ours' requests that hit vs the same requests computed fresh)."""

from __future__ import annotations

from typing import Any

from vllm_draft_offload.bench.stress.counters import SPEC_ACC, SPEC_DRAFTS


def _al(accepted: float, steps: float) -> float | None:
    return 1.0 + accepted / steps if steps else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def connector_acceptance(counters: dict[str, float]) -> dict[str, float | None]:
    """Acceptance length restored / fresh from the connector's own spec counters."""
    restored = _al(
        counters.get(SPEC_ACC.format("true"), 0), counters.get(SPEC_DRAFTS.format("true"), 0)
    )
    fresh = _al(
        counters.get(SPEC_ACC.format("false"), 0), counters.get(SPEC_DRAFTS.format("false"), 0)
    )
    return {"al_restored": restored, "al_fresh": fresh, "ratio": _ratio(restored, fresh)}


def request_acceptance(ours: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """AL of ours on its requests that had a cache hit vs the same requests computed fresh."""
    hit = [i for i, q in enumerate(ours) if q.get("cached", 0) > 0 and q.get("spec")]

    def al(reqs: list[dict[str, Any]]) -> float | None:
        acc = sum(reqs[i]["spec"]["accepted"] for i in hit if reqs[i].get("spec"))
        steps = sum(reqs[i]["spec"]["steps"] for i in hit if reqs[i].get("spec"))
        return _al(acc, steps)

    restored, fresh = al(ours), al(ref)
    return {
        "hit_requests": len(hit),
        "al_restored": restored,
        "al_fresh": fresh,
        "ratio": _ratio(restored, fresh),
    }
