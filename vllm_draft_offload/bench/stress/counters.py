"""What the runs' prometheus counters say: hit tokens by the tier that held them,
fallbacks and refusals by cause, the storage threads' seconds, and hit rates over time.

Counter keys are prometheus sample names as `workloads.worker.snapshot_metrics` writes
them, e.g. ``vllm:draft_offload_loaded_chunks_total{tier=cpu}``.
"""

from __future__ import annotations

import re
from typing import Any

LOADED = "vllm:draft_offload_loaded_chunks_total{{tier={}}}"
HIT = "vllm:draft_offload_lookup_hit_chunks_total{{tier={}}}"
MISS = "vllm:draft_offload_lookup_miss_chunks_total{{tier={}}}"
SPEC_DRAFTS = "vllm:draft_offload_spec_drafts_total{{restored={}}}"
SPEC_ACC = "vllm:draft_offload_spec_accepted_tokens_total{{restored={}}}"
EXT_HITS, EXT_QUERIES = (
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
)
GPU_HITS, GPU_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
# vLLM's hit tokens by the tier that supplied them, counted at admission (the connector
# files storage hits under disk for fs://, external_unspecified for remote stores).
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total{{source={}}}"
SOURCES = {"cpu": ("host",), "l3": ("disk", "external_unspecified")}
_CAUSE = re.compile(r"^vllm:draft_offload_(fallbacks|refusals)_total\{cause=([^}]*)\}$")
TIERS = ("cpu", "l3")


_THREAD_SECONDS = re.compile(
    r"vllm:draft_offload_l3_thread_seconds_total\{clock=(?P<clock>\w+),op=(?P<op>\w+)\}"
)


def causes(counters: dict[str, float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"fallbacks": {}, "refusals": {}}
    for key, value in counters.items():
        m = _CAUSE.match(key)
        if m and value:
            out[m.group(1)][m.group(2)] = value
    return out


def tier_tokens(counters: dict[str, float], chunk: int) -> dict[str, Any]:
    """Hit tokens by the tier that held them.

    From vLLM's ``prompt_tokens_cached_by_source`` (``by_source``): what each request
    was admitted with. Runs recorded without it (before session 9) fall back to the
    connector's loads (``loaded_chunks``): ``loaded_chunks{tier=l3}`` counts units
    fetched from storage into a CPU slot, and every restore to the GPU counts under
    ``cpu``, so the CPU tier's own hits are ``cpu - l3``. That holds only while every
    fetched unit is restored once: fetched units that a small CPU tier evicts before
    use (or that finish in the background after their request stopped waiting) make
    it wrong. Where it visibly is (fewer CPU-tier loads than fetches, or more fetched
    tokens than external hits), both are None (unknown).
    """
    loaded = {t: int(counters.get(LOADED.format(t), 0)) for t in TIERS}
    by_source = {
        tier: sum(int(counters.get(BY_SOURCE.format(s), 0)) for s in sources)
        for tier, sources in SOURCES.items()
    }
    hit_tokens: dict[str, int | None]
    if any(by_source.values()):
        method, hit_tokens = "by_source", dict(by_source)
    else:
        own, fetched = loaded["cpu"] - loaded["l3"], loaded["l3"] * chunk
        method = "loaded_chunks"
        if own < 0 or fetched > int(counters.get(EXT_HITS, 0)):
            hit_tokens = {"cpu": None, "l3": None}
        else:
            hit_tokens = {"cpu": own * chunk, "l3": fetched}
    return {
        "hit_tokens": hit_tokens,
        "hit_tokens_method": method,
        "loaded_chunk_tokens": {t: int(counters.get(LOADED.format(t), 0) * chunk) for t in TIERS},
        "lookup_hit_chunks": {t: int(counters.get(HIT.format(t), 0)) for t in TIERS},
        "external_hit_tokens": int(counters.get(EXT_HITS, 0)),
        "gpu_prefix_hit_tokens": int(counters.get(GPU_HITS, 0)),
    }


def thread_seconds(counters: dict[str, float]) -> dict[str, float]:
    """The storage threads' ``{op}/{clock}`` seconds (``l3_thread_seconds``) in counters."""
    out: dict[str, float] = {}
    for key, value in counters.items():
        m = _THREAD_SECONDS.match(key)
        if m:
            out[f"{m.group('op')}/{m.group('clock')}"] = value
    return out


def hit_rate_series(samples: list[dict[str, Any]], window_s: float = 5.0) -> list[dict[str, Any]]:
    """Per window: chunk hit rate per tier, and token hit rates of vLLM's two caches."""
    out: list[dict[str, Any]] = []
    prev = samples[0] if samples else None
    for s in samples[1:]:
        if s["t"] - prev["t"] < window_s and s is not samples[-1]:
            continue
        a, b = prev["counters"], s["counters"]

        def d(key: str, a: dict[str, float] = a, b: dict[str, float] = b) -> float:
            return b.get(key, 0.0) - a.get(key, 0.0)

        point: dict[str, Any] = {"t": s["t"]}
        for tier in TIERS:
            looked = d(HIT.format(tier)) + d(MISS.format(tier))
            point[tier] = d(HIT.format(tier)) / looked if looked else None
        point["external"] = d(EXT_HITS) / d(EXT_QUERIES) if d(EXT_QUERIES) else None
        point["gpu"] = d(GPU_HITS) / d(GPU_QUERIES) if d(GPU_QUERIES) else None
        out.append(point)
        prev = s
    return out
