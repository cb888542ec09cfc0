"""Names of the draft-offload telemetry: label values, causes and metric definitions.

Import-free on purpose (standard library only): the stats payload (``metrics.py``)
and its Prometheus rendering (``metrics_prom.py``) both read these names, and
tests and dashboards can read them without loading vLLM or prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

Direction = Literal["store", "load"]
Tier = Literal["cpu", "l3"]
Part = Literal["target", "draft"]

DIRECTIONS: Final[tuple[Direction, ...]] = get_args(Direction)
TIERS: Final[tuple[Tier, ...]] = get_args(Tier)
PARTS: Final[tuple[Part, ...]] = get_args(Part)

# Known causes. Other strings are accepted (a new failure mode must not crash the
# serving path), but each distinct cause becomes a Prometheus series, so callers
# should stick to a fixed vocabulary. The known ones are pre-created at 0 so that
# rate()/alerts work before the first occurrence.
REFUSAL_CAUSES: Final[tuple[str, ...]] = (
    "draft_part_missing",
    "drafter_mismatch",
    "geometry_mismatch",
    "successor_mismatch",
    "checksum_mismatch",
    "truncated",
    "rank_mismatch",  # TP ranks' objects of one unit disagree (then deleted, never refetched)
)
FALLBACK_CAUSES: Final[tuple[str, ...]] = (
    "load_error",
    "l3_unavailable",
    "l3_corrupt",
    "audit_mismatch",
    "audit_recompute_mismatch",
    "store_failed",
    # A store whose copy plan could not be built (worker_side); the job is dropped.
    "store_error",
    # Stores of a request whose load failed in the same step: KV computed on top
    # of a prefix that was not restored is never stored.
    "store_after_load_failure",
    "l3_lookup_failed",  # a storage lookup raised something unexpected; treated as a miss
)
# Why storage hits were not fetched (l3.hit_policy=cost).
# not_looked_up: the lookup was skipped since even a full hit would be slower;
# speed_unknown: not looked up since the engine's prefill speed is not known yet;
# fetch_too_slow: the lookup or fetch did not land within the request's wait allowance;
# cold_unmeasured: storage not timed yet and the fetch's first round not in the page
# cache: recomputed at once while a probe times the storage in the background;
# no_free_slot: chunks a fetch chose that found no CPU-tier slot while the request
# waited (any hit policy; a tier smaller than the hit is also warned about in the log).
L3_DECLINE_CAUSES: Final[tuple[str, ...]] = (
    "slower_than_recompute",
    "not_looked_up",
    "speed_unknown",
    "fetch_too_slow",
    "cold_unmeasured",
    "no_free_slot",
)
# Storage-tier thread work (l3_thread_seconds): what the threads did, and which clock.
L3_THREAD_OPS: Final[tuple[str, ...]] = ("read", "write")
L3_THREAD_CLOCKS: Final[tuple[str, ...]] = ("wall", "cpu")
# Outcomes of the sampled recompute audit, per stored unit compared.
AUDIT_RESULTS: Final[tuple[str, ...]] = ("ok", "mismatch", "error")

PREFIX: Final = "vllm:draft_offload_"

# Restore of a few chunks from pinned CPU is ~ms; from remote L3 it can take seconds.
RESTORE_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# A hit normally recomputes at most the partial tail chunk (+1 token), so the low
# buckets are fine-grained; large values mean the restore was mostly wasted.
RECOMPUTED_TOKENS_BUCKETS: Final[tuple[float, ...]] = (
    0, 1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384,
)  # fmt: skip


@dataclass(frozen=True)
class MetricDef:
    name: str  # full name as given to prometheus_client (counters get "_total" appended)
    kind: str  # "counter" | "histogram"
    documentation: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


def _counter(short: str, doc: str, *labels: str) -> MetricDef:
    return MetricDef(PREFIX + short, "counter", doc, labels)


STORED_CHUNKS = _counter("stored_chunks", "Chunks (target+draft units) stored, by tier.", "tier")
LOADED_CHUNKS = _counter("loaded_chunks", "Chunks (target+draft units) restored, by tier.", "tier")
STORED_BYTES = _counter("stored_bytes", "Bytes stored, by tier and KV part.", "tier", "part")
LOADED_BYTES = _counter("loaded_bytes", "Bytes restored, by tier and KV part.", "tier", "part")
TRANSFER_SECONDS = _counter(
    "transfer_seconds",
    "Wall time of timed transfers; bytes/this = throughput if every transfer is timed.",
    "direction",
    "tier",
)
HIT_CHUNKS = _counter("lookup_hit_chunks", "Chunks found on lookup, by tier.", "tier")
MISS_CHUNKS = _counter("lookup_miss_chunks", "Chunks not found on lookup, by tier.", "tier")
REFUSALS = _counter(
    "refusals", "Stored units refused because the draft part was missing/mismatched.", "cause"
)
FALLBACKS = _counter("fallbacks", "Restores that fell back to recompute, by cause.", "cause")
L3_DECLINED = _counter(
    "l3_declined_chunks",
    "Storage (L3) chunks recomputed instead of fetched under l3.hit_policy=cost, by "
    "cause: estimated slower, not looked up, engine speed unknown, fetch too slow.",
    "cause",
)
L3_THREAD_SECONDS = _counter(
    "l3_thread_seconds",
    "Storage (L3) read and write threads: wall time per unit read or written, and the "
    "thread's own CPU time. Wall well above CPU means the threads wait: for the GIL, "
    "a core or the device.",
    "op",
    "clock",
)
AUDIT_RECOMPUTE = _counter(
    "audit_recompute_units",
    "Stored units compared with a recompute of their prefix (sampled audit), by result.",
    "result",
)
SPEC_DRAFTS = _counter(
    "spec_drafts", "Drafting steps, by whether the request's prefix was restored.", "restored"
)
SPEC_ACCEPTED = _counter(
    "spec_accepted_tokens",
    "Accepted draft tokens, by whether the prefix was restored. Acceptance length = "
    "1 + rate(accepted_tokens) / rate(drafts).",
    "restored",
)
RESTORE_LATENCY = MetricDef(
    PREFIX + "restore_latency_seconds",
    "histogram",
    "Latency of restore (load) operations, by tier.",
    ("tier",),
    RESTORE_LATENCY_BUCKETS,
)
RECOMPUTED_PER_HIT = MetricDef(
    PREFIX + "recomputed_tokens_per_hit",
    "histogram",
    "Prompt tokens recomputed despite an offload hit, one sample per hit.",
    (),
    RECOMPUTED_TOKENS_BUCKETS,
)

ALL_METRICS: Final[tuple[MetricDef, ...]] = (
    STORED_CHUNKS,
    LOADED_CHUNKS,
    STORED_BYTES,
    LOADED_BYTES,
    TRANSFER_SECONDS,
    HIT_CHUNKS,
    MISS_CHUNKS,
    REFUSALS,
    FALLBACKS,
    L3_DECLINED,
    L3_THREAD_SECONDS,
    AUDIT_RECOMPUTE,
    SPEC_DRAFTS,
    SPEC_ACCEPTED,
    RESTORE_LATENCY,
    RECOMPUTED_PER_HIT,
)
