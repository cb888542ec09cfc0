"""The restart-from-storage plan (``accept --restart-from-storage``).

Parity of KV restored from DraftOffloadConnector's storage tier (L3, an LMCache
``fs://`` directory) by an engine that was restarted:

  engine 0  its own process: ``fresh``, the base prompts; the connector writes their
            units to storage. The engine waits until those writes settle (no new
            unit file and no change of its write counters for SETTLE_S while it
            keeps stepping), then shuts down; the shutdown flushes what is still
            queued (``l3.flush_timeout_s``).
  engine 1  a new process on the same directory, CPU tier and GPU prefix cache
            empty: ``restored_storage``, the same prompts. One prompt per group,
            so no prompt hits another's prefix: every cached token came through
            storage. Outputs and acceptance are compared with engine 0's ``fresh``.

Storage runs with ``l3.hit_policy: always`` unless the given config says otherwise:
the plan measures whether KV read back from storage is right, not whether the
cost model would fetch it (on small fixtures it would recompute instead). The
summary's ``storage_reads`` says where the restarted engine's hits came from.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.accept.plans import RESTORED_STORAGE
from vllm_draft_offload.bench.accept.schema import (
    AcceptCheckResult,
    PhaseResult,
    RunConfig,
    StorageReads,
    StorageRun,
    StorageWrites,
)
from vllm_draft_offload.bench.speed.l3_dir import unit_files
from vllm_draft_offload.bench.workloads.summary import sum_prefix

CONNECTOR = "DraftOffloadConnector"
PREFIX = "vllm:draft_offload_"
SETTLE_S = 2.0  # writes settled: nothing changed for this long while stepping
SETTLE_LIMIT_S = 300.0
DECISION_MARK = "L3 decision"  # the connector's per-request storage decision lines
MAX_DECISIONS = 200

# ------------------------------------------------------------------ config


def storage_transfer_config(kv: dict[str, Any] | None, l3_dir: str) -> dict[str, Any]:
    """``kv`` (DraftOffloadConnector's config) with its storage tier on, in ``l3_dir``.

    Raises ValueError for another connector, or a config that already names its
    storage (the plan owns it: ``--l3-dir``)."""
    if not kv or kv.get("kv_connector") != CONNECTOR:
        raise ValueError(
            f"--restart-from-storage needs --kv-transfer-config with "
            f'"kv_connector": "{CONNECTOR}" (the plan restarts from its storage tier)'
        )
    extra = dict(kv.get("kv_connector_extra_config") or {})
    l3 = dict(extra.get("l3") or {})
    named = [f"l3.{k}" for k in ("config_file",) if k in l3]
    named += [f"l3.lmcache.{k}" for k in (l3.get("lmcache") or {}) if k == "remote_url"]
    named += [k for k in extra if k == "lmcache.remote_url"]
    if named:
        raise ValueError(
            f"kv_connector_extra_config.{named[0]}: --restart-from-storage sets the "
            "storage itself (an fs:// directory: --l3-dir); drop it"
        )
    l3.update(enabled=True)
    l3.setdefault("hit_policy", "always")
    l3.setdefault("log_decisions", True)  # the decisions go into the result; no behaviour
    extra["l3"] = l3
    extra["lmcache.remote_url"] = f"fs://{l3_dir}"
    return {**kv, "kv_connector_extra_config": extra}


def check_l3_dir(path: str) -> None:
    """A given ``--l3-dir`` must be new or empty: engine 0 must run fresh, not hit
    what an earlier run stored there (and the plan never deletes a given dir)."""
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise ValueError(
            f"--l3-dir {path} is not an empty directory: engine 0 would hit what is "
            "stored there; give a new or empty one"
        )


def needs_storage(cfg: RunConfig) -> bool:
    return any(p.engine > 0 for p in cfg.phases)


@contextlib.contextmanager
def storage_dir(cfg: RunConfig) -> Iterator[tuple[RunConfig, bool]]:
    """(cfg with its storage resolved, whether the directory is kept). Without
    ``l3_dir`` a temporary directory is used and removed afterwards."""
    if not needs_storage(cfg):
        yield cfg, False
        return
    kept = cfg.l3_dir is not None
    path = Path(cfg.l3_dir) if kept else Path(tempfile.mkdtemp(prefix="accept_l3_"))
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    kv = storage_transfer_config(cfg.kv_transfer_config, str(path))
    try:
        yield cfg.model_copy(update={"l3_dir": str(path), "kv_transfer_config": kv}), kept
    finally:
        if not kept:
            shutil.rmtree(path, ignore_errors=True)


def engine_configs(cfg: RunConfig) -> list[RunConfig]:
    """One config per engine process, in order, each with its own phases; every
    engine but the last waits for its storage writes before it shuts down."""
    engines = sorted({p.engine for p in cfg.phases}) or [0]
    if engines == [0]:
        return [cfg]
    return [
        cfg.model_copy(
            update={
                "phases": [p for p in cfg.phases if p.engine == e],
                "wait_l3_writes": e != engines[-1],
            }
        )
        for e in engines
    ]


# ------------------------------------------------------------------ engine 0 (writes)


def storage_units(l3_dir: Path) -> tuple[int, int]:
    """(unit objects, their bytes) in an fs:// directory (the calibration is none)."""
    files = unit_files(l3_dir)
    return len(files), sum(f.stat().st_size for f in files)


def write_counters(counters: dict[str, float]) -> tuple[float, float, float]:
    """(units written to storage, dropped, failed) from the connector's counters."""
    return (
        sum_prefix(counters, PREFIX + "stored_chunks", tier="l3"),
        sum_prefix(counters, PREFIX + "fallbacks", cause="l3_write_dropped"),
        sum_prefix(counters, PREFIX + "fallbacks", cause="store_failed"),
    )


def settle_writes(
    l3_dir: Path,
    step: Callable[[], object],
    counters: Callable[[], dict[str, float]],
    settle_s: float = SETTLE_S,
    limit_s: float = SETTLE_LIMIT_S,
) -> StorageWrites:
    """Step the engine until its storage writes stop: the unit files and the write
    counters unchanged for ``settle_s`` (a write's verdict reaches the workers with
    a step, and counters arrive with a step's output, so the engine must step)."""
    start = time.monotonic()
    last: tuple[float, ...] | None = None
    since, settled = start, False
    while (now := time.monotonic()) - start < limit_s:
        state = (float(storage_units(l3_dir)[0]), *write_counters(counters()))
        if state != last:
            last, since = state, now
        elif now - since >= settle_s:
            settled = True
            break
        step()
        time.sleep(0.2)
    stored, dropped, failed = write_counters(counters())
    return StorageWrites(
        settle_s=round(time.monotonic() - start, 2),
        settled=settled,
        stored_chunks=stored,
        write_dropped=dropped,
        store_failed=failed,
    )


# ------------------------------------------------------------------ engine 1 (reads)


def _by_label(counters: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in counters.items():
        base, _, rest = key.partition("{")
        if base != name or not value:
            continue
        labels = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
        out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
    return out


def storage_reads(phase: PhaseResult) -> StorageReads:
    """Where the restarted engine's hits came from. Its CPU tier started empty and
    no two prompts share a prefix, so a unit it restored (loaded from the CPU tier)
    must have been fetched from storage before: hits came from storage when every
    request hit and no more units were restored than fetched."""
    c = phase.connector_counters
    cached = [r.num_cached_tokens or 0 for r in phase.requests]
    fetched = sum_prefix(c, PREFIX + "loaded_chunks", tier="l3")
    restored = sum_prefix(c, PREFIX + "loaded_chunks", tier="cpu")
    hit = sum(n > 0 for n in cached)
    return StorageReads(
        requests=len(cached),
        requests_hit=hit,
        hit_tokens=sum(cached),
        prompt_tokens=sum(r.prompt_len for r in phase.requests),
        lookup_hit_chunks=sum_prefix(c, PREFIX + "lookup_hit_chunks", tier="l3"),
        fetched_chunks=fetched,
        restored_chunks=restored,
        fetched_bytes=_by_label(
            {k: v for k, v in c.items() if "tier=l3" in k}, PREFIX + "loaded_bytes", "part"
        ),
        device_cached_tokens=phase.cached_tokens_by_source.get("device", 0.0),
        declined_chunks=_by_label(c, PREFIX + "l3_declined_chunks", "cause"),
        fallbacks=_by_label(c, PREFIX + "fallbacks", "cause"),
        refusals=_by_label(c, PREFIX + "refusals", "cause"),
        from_storage=hit == len(cached) > 0 and 0 < restored <= fetched,
    )


def restored_storage_phase(phases: list[PhaseResult]) -> PhaseResult | None:
    return next((p for p in phases if p.spec.name == RESTORED_STORAGE), None)


def decision_lines(output: str) -> list[str]:
    """The connector's storage decisions in an engine's output (the last ones)."""
    lines = [line.strip() for line in output.splitlines() if DECISION_MARK in line]
    return lines[-MAX_DECISIONS:]


# ------------------------------------------------------------------ both


def merge_results(
    cfg: RunConfig, results: list[AcceptCheckResult], outputs: list[str], kept: bool
) -> AcceptCheckResult:
    """Engine 0's result with the later engines' phases, the storage record, and the
    first error (naming the engine that failed). The summary is left to the caller."""
    merged = results[0].model_copy(deep=True)
    merged.config = {"run": cfg.model_dump(), "llm_kwargs": merged.config.get("llm_kwargs")}
    storage = merged.storage or StorageRun(l3_url=f"fs://{cfg.l3_dir}")
    storage.l3_dir_kept = kept
    if merged.error:
        merged.error = f"engine 0: {merged.error}"
    for engine, (result, output) in enumerate(zip(results[1:], outputs[1:], strict=True), 1):
        merged.phases += result.phases
        storage.restart_init_s = result.init_s
        storage.decisions = decision_lines(output)
        if result.error and merged.error is None:
            merged.error = f"engine {engine} (restarted): {result.error}"
    merged.storage = storage
    return merged
