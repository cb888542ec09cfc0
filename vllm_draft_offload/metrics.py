"""Telemetry of the draft-offload connector: the stats payload and its log summary.

Flow in vLLM 0.33 (see ``metrics_prom.py`` for the Prometheus side):

* worker side: ``KVConnectorModelRunnerMixin`` / ``gpu/kv_connector.py`` call
  ``connector.get_kv_connector_stats()`` after every step and put the object on
  ``KVConnectorOutput``. It is pickled to the scheduler process (shm MessageQueue),
  where ``KVOutputAggregator`` folds the workers together with ``aggregate()``.
* scheduler side: ``Scheduler.update_from_output`` calls the scheduler-side
  ``get_kv_connector_stats()`` and aggregates it into the worker payload (skipped
  when ``is_empty()``), then ``make_stats`` ships ``to_dict()`` (= ``data``) inside
  ``SchedulerStats`` over msgspec/msgpack to the frontend.
* frontend: ``KVConnectorLogging`` rebuilds the object with the connector class's
  ``build_kv_connector_stats(data)``, aggregates across steps and logs ``reduce()``
  as ``KV Transfer metrics: k=v, ...``; ``KVConnectorProm`` hands the same dict to
  ``DraftOffloadPromMetrics.observe(data, engine_idx)``.

Because ``data`` crosses both pickle and msgpack, it holds only str-keyed dicts,
lists and numbers: no tuple keys (msgpack would turn them into lists) and no
custom objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from vllm_draft_offload.metric_defs import (
    AUDIT_RESULTS,
    DIRECTIONS,
    L3_THREAD_CLOCKS,
    L3_THREAD_OPS,
    PARTS,
    TIERS,
    Direction,
    Tier,
)

logger = init_logger(__name__)

_GB: Final = 1e9

# Sections of ``data``. Keys inside a section are plain strings; compound keys
# are joined with "/" (tiers, directions and parts never contain it).
# section -> {key: int|float}, summed on aggregate
NUMBER_SECTIONS: Final[tuple[str, ...]] = (
    "chunks",  # "store/cpu" -> chunks (a chunk = target+draft unit)
    "bytes",  # "store/cpu/target" -> bytes
    "timed_bytes",  # "load/cpu" -> bytes of transfers that came with a duration
    "seconds",  # "load/cpu" -> summed duration of those transfers
    "hits",  # "cpu" -> hit chunks
    "misses",  # "cpu" -> miss chunks
    "refused",  # cause -> units
    "fallbacks",  # cause -> occurrences
    "drafts",  # "true"/"false" (prefix restored?) -> drafting steps
    "accepted",  # "true"/"false" -> accepted draft tokens
    "audit_recompute",  # result -> stored units compared with their recomputed prefix
    "l3_declined",  # cause -> storage chunks not fetched because recompute is faster
    "l3_thread_seconds",  # "read/wall", "read/cpu", ... -> seconds of storage threads
)
# section -> {key: [samples]}, concatenated on aggregate
SAMPLE_MAP_SECTIONS: Final[tuple[str, ...]] = ("restore_s",)  # tier -> load seconds
# section -> [samples], concatenated on aggregate
SAMPLE_LIST_SECTIONS: Final[tuple[str, ...]] = ("recomputed",)  # tokens recomputed per hit


def _key(*parts: str) -> str:
    return "/".join(parts)


def _bool_label(flag: bool) -> str:
    # Same spelling as the Prometheus label value, so one key serves both.
    return "true" if flag else "false"


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _check_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return value


def _check_cause(cause: str) -> str:
    if not isinstance(cause, str) or not cause:
        raise ValueError(f"cause must be a non-empty str, got {cause!r}")
    return cause


def _check_number(section: str, key: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"stats {section}[{key!r}] must be a number, got {value!r}")
    return value


@dataclass
class DraftOffloadStats(KVConnectorStats):
    """Counters and samples of one interval, from one or more workers/steps.

    Construct with ``DraftOffloadStats()`` to record, or ``DraftOffloadStats(data=d)``
    to rebuild a received payload: the payload is validated and deep-copied, so the
    new object never aliases a dict that another consumer (e.g. the Prometheus logger
    in the same process) still reads.
    """

    def __post_init__(self) -> None:
        received = self.data
        self.reset()
        if received:
            self._merge_data(received)

    # ----------------------------------------------------------- recording API
    def record_transfer(
        self,
        direction: Direction,
        tier: Tier,
        target_bytes: int,
        draft_bytes: int,
        chunks: int,
        seconds: float | None,
    ) -> None:
        """One store (GPU->tier) or load (tier->GPU) operation.

        ``seconds`` is the wall time of the operation when known; for loads it is a
        restore-latency sample. Throughput (GB/s) only uses transfers that were timed,
        so untimed ones do not inflate it.
        """
        _check_choice("direction", direction, DIRECTIONS)
        _check_choice("tier", tier, TIERS)
        _check_count("target_bytes", target_bytes)
        _check_count("draft_bytes", draft_bytes)
        _check_count("chunks", chunks)
        # Validate everything before mutating: a rejected call must leave no trace.
        if seconds is not None:
            _check_seconds("seconds", seconds)
        dt = _key(direction, tier)
        self._inc("chunks", dt, chunks)
        self._inc("bytes", _key(dt, "target"), target_bytes)
        self._inc("bytes", _key(dt, "draft"), draft_bytes)
        if seconds is None:
            return
        # Recorded even when 0 bytes moved, so a timed no-op still shows up as a
        # latency sample rather than silently vanishing.
        self.data["timed_bytes"][dt] = self.data["timed_bytes"].get(dt, 0) + (
            target_bytes + draft_bytes
        )
        self.data["seconds"][dt] = self.data["seconds"].get(dt, 0.0) + float(seconds)
        if direction == "load":
            self.data["restore_s"].setdefault(tier, []).append(float(seconds))

    def record_lookup(self, tier: Tier, hit_chunks: int, miss_chunks: int) -> None:
        """Result of looking a prompt's chunks up in one tier."""
        _check_choice("tier", tier, TIERS)
        self._inc("hits", tier, _check_count("hit_chunks", hit_chunks))
        self._inc("misses", tier, _check_count("miss_chunks", miss_chunks))

    def record_refused(self, cause: str, units: int = 1) -> None:
        """Stored units refused at restore because the draft part was missing/wrong."""
        self._inc("refused", _check_cause(cause), _check_count("units", units))

    def record_fallback(self, cause: str, count: int = 1) -> None:
        """A restore that fell back to recompute."""
        self._inc("fallbacks", _check_cause(cause), _check_count("count", count))

    def record_l3_declined(self, cause: str, chunks: int) -> None:
        """Storage chunks the hit policy chose to recompute rather than fetch."""
        self._inc("l3_declined", _check_cause(cause), _check_count("chunks", chunks))

    def record_l3_thread_time(self, op: str, wall_s: float, cpu_s: float) -> None:
        """One unit read or written by a storage thread: its wall and thread CPU time."""
        _check_choice("op", op, L3_THREAD_OPS)
        times = tuple(zip(L3_THREAD_CLOCKS, (wall_s, cpu_s), strict=True))
        for clock, seconds in times:  # all checked first: a rejected call leaves no trace
            _check_seconds(f"{clock} seconds", seconds)
        for clock, seconds in times:
            self._inc("l3_thread_seconds", _key(op, clock), float(seconds))

    def record_audit_recompute(self, result: str, units: int = 1) -> None:
        """Stored units compared with a recompute of their prefix (sampled audit)."""
        self._inc(
            "audit_recompute",
            _check_choice("result", result, AUDIT_RESULTS),
            _check_count("units", units),
        )

    def record_acceptance(self, restored: bool, num_drafts: int, num_accepted: int) -> None:
        """Speculative-decoding outcome of a request, split by whether its prefix was
        restored, so acceptance length (1 + accepted/drafts) can be compared."""
        label = _bool_label(bool(restored))
        self._inc("drafts", label, _check_count("num_drafts", num_drafts))
        self._inc("accepted", label, _check_count("num_accepted", num_accepted))

    def record_recomputed_tokens(self, n: int) -> None:
        """Prompt tokens recomputed despite a hit (one sample per hit)."""
        self.data["recomputed"].append(_check_count("n", n))

    def take(self) -> DraftOffloadStats | None:
        """Hand the interval's stats over and start a new interval.

        Meant for ``get_kv_connector_stats()``: returns None when nothing was
        recorded, so idle steps add no payload to ``KVConnectorOutput``.
        """
        if self.is_empty():
            return None
        out = DraftOffloadStats()
        out.data, self.data = self.data, out.data
        return out

    # ------------------------------------------------------- KVConnectorStats
    def reset(self) -> None:
        data: dict[str, Any] = {s: {} for s in NUMBER_SECTIONS}
        data.update({s: {} for s in SAMPLE_MAP_SECTIONS})
        data.update({s: [] for s in SAMPLE_LIST_SECTIONS})
        self.data = data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum ``other`` into self (in place, like vLLM's native stats) and return self.

        ``other`` is only read, never aliased, so it stays usable by its owner.
        """
        if other.is_empty():
            return self
        if not isinstance(other, DraftOffloadStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into DraftOffloadStats")
        self._merge_data(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Human summary for the periodic ``KV Transfer metrics`` log line.

        Keys only appear for tiers/sections that saw activity, to keep the line short;
        refusals and fallbacks always appear because their being 0 is the news.
        """
        d = self.data
        out: dict[str, int | float] = {}
        for tier in TIERS:
            hits = d["hits"].get(tier, 0)
            misses = d["misses"].get(tier, 0)
            if hits + misses:
                out[f"{tier}_hit_rate"] = round(hits / (hits + misses), 4)
            for direction, verb in (("store", "stored"), ("load", "loaded")):
                dt = _key(direction, tier)
                chunks = d["chunks"].get(dt, 0)
                nbytes = sum(d["bytes"].get(_key(dt, part), 0) for part in PARTS)
                if chunks or nbytes:
                    out[f"{tier}_{verb}_chunks"] = chunks
                    out[f"{tier}_{verb}_GB"] = round(nbytes / _GB, 4)
            load = _key("load", tier)
            load_s = d["seconds"].get(load, 0.0)
            if load_s > 0:
                out[f"{tier}_restore_GBps"] = round(d["timed_bytes"].get(load, 0) / load_s / _GB, 3)
            samples = d["restore_s"].get(tier)
            if samples:
                out[f"{tier}_restore_ms_mean"] = round(1e3 * sum(samples) / len(samples), 3)

        stored_draft = sum(d["bytes"].get(_key("store", t, "draft"), 0) for t in TIERS)
        stored_all = stored_draft + sum(
            d["bytes"].get(_key("store", t, "target"), 0) for t in TIERS
        )
        if stored_all:
            # Sanity check for operators: a draft share of 0 means drafts aren't stored.
            out["stored_draft_frac"] = round(stored_draft / stored_all, 4)

        for flag, name in (("true", "restored"), ("false", "fresh")):
            drafts = d["drafts"].get(flag, 0)
            if drafts:
                # vLLM's convention (spec_decode/metrics.py): includes the bonus token.
                out[f"accept_len_{name}"] = round(1 + d["accepted"].get(flag, 0) / drafts, 3)

        recomputed = d["recomputed"]
        if recomputed:
            out["recomputed_tokens_per_hit"] = round(sum(recomputed) / len(recomputed), 2)
        for result, units in sorted(d["audit_recompute"].items()):
            out[f"audit_recompute_{result}"] = units
        for op in L3_THREAD_OPS:
            wall = d["l3_thread_seconds"].get(_key(op, "wall"), 0.0)
            if wall > 0:
                cpu = d["l3_thread_seconds"].get(_key(op, "cpu"), 0.0)
                out[f"l3_{op}_cpu_of_wall"] = round(cpu / wall, 3)
        declined = sum(d["l3_declined"].values())
        if declined:
            out["l3_declined_chunks"] = declined
        out["refusals"] = sum(d["refused"].values())
        out["fallbacks"] = sum(d["fallbacks"].values())
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(s) for s in self._sections())

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _sections() -> tuple[str, ...]:
        return NUMBER_SECTIONS + SAMPLE_MAP_SECTIONS + SAMPLE_LIST_SECTIONS

    def _inc(self, section: str, key: str, value: int | float) -> None:
        # Zero increments are dropped so that is_empty() stays meaningful.
        if value:
            sec = self.data[section]
            sec[key] = sec.get(key, 0) + value

    def _merge_data(self, src: dict[str, Any]) -> None:
        """Sum/concatenate a payload into self.data, copying every container.

        Unknown sections are skipped (a mixed-version deployment must not break the
        stats path) with a one-time warning.
        """
        unknown = set(src) - set(self._sections())
        if unknown:
            logger.warning_once(
                "DraftOffloadStats: ignoring unknown sections %s", tuple(sorted(unknown))
            )
        for section in NUMBER_SECTIONS:
            dst = self.data[section]
            for key, value in (src.get(section) or {}).items():
                dst[key] = dst.get(key, 0) + _check_number(section, key, value)
        for section in SAMPLE_MAP_SECTIONS:
            dst = self.data[section]
            for key, samples in (src.get(section) or {}).items():
                dst.setdefault(key, []).extend(_check_number(section, key, v) for v in samples)
        for section in SAMPLE_LIST_SECTIONS:
            self.data[section].extend(
                _check_number(section, str(i), v) for i, v in enumerate(src.get(section) or ())
            )


def build_kv_connector_stats(data: dict[str, Any] | None = None) -> DraftOffloadStats | None:
    """Body of ``DraftOffloadConnector.build_kv_connector_stats`` (a classmethod in
    ``KVConnectorBase_V1`` with signature ``(cls, data: dict[str, Any] | None = None)``).

    ``None`` yields an empty object, as the native connectors do, so MultiConnector
    and the frontend logger always get a usable accumulator.
    """
    return DraftOffloadStats(data=data) if data is not None else DraftOffloadStats()
