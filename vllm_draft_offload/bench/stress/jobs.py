"""Parent side of the pressure run and the soak: engine arguments and engine subprocesses.

Engine arguments come from `workloads.specs.engine_kwargs` (the benchmark's
configurations ``none``, ``gpu_prefix``, ``ours_cpu``, ``ours_disk``), so every
configuration differs only in caching and connector; this module then fixes the GPU
KV capacity and the tier sizes of a run. Subprocess handling is the benchmark's
(`workloads.run.run_subprocess`, its log-error scan and versions).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.workloads.run import (
    child_env,
    error_lines,
    run_subprocess,
    tail,
    versions,
)
from vllm_draft_offload.bench.workloads.specs import (
    MIB,
    Drafter,
    Sizes,
    engine_kwargs,
    with_overrides,
)

# The engine side, run as ``python -m`` in a subprocess per engine.
WORKER: list[str] = ["-m", "vllm_draft_offload.bench.stress.worker"]


@dataclass(frozen=True)
class EngineShape:
    """What every engine of a run shares (only caching/connector/tier sizes differ)."""

    model: str
    drafter: Drafter
    block_size: int
    chunk_size: int
    num_spec_tokens: int
    dtype: str
    enforce_eager: bool
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_model_len: int
    gpu_blocks: int  # num_gpu_blocks_override: fixes the GPU KV capacity
    seed: int = 0


def build_kwargs(
    config: str,
    shape: EngineShape,
    *,
    cpu_bytes: int | None = None,
    l3_url: str | None = None,
    staging_mb: int = 256,
    l3_timeout_s: float = 2.0,
    l3_hit_policy: str | None = None,
    l3_switch_interval_ms: float | str | None = None,
) -> dict[str, Any]:
    """``vllm.LLM`` kwargs of ``none`` | ``gpu_prefix`` | ``ours_cpu`` | ``ours_disk``."""
    sizes = with_overrides(
        Sizes(),
        chunk_size=shape.chunk_size,
        block_size=shape.block_size,
        num_spec_tokens=shape.num_spec_tokens,
        dtype=shape.dtype,
        enforce_eager=shape.enforce_eager,
        gpu_memory_utilization=shape.gpu_memory_utilization,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        cpu_bytes=cpu_bytes,
        disk_cpu_bytes=cpu_bytes,
        disk_mode="small-cpu",
        l3_staging_mb=staging_mb,
        seed=shape.seed,
    )
    kw = engine_kwargs(config, shape.model, shape.drafter, sizes, l3_url)
    kw["max_model_len"] = shape.max_model_len
    kw["num_gpu_blocks_override"] = shape.gpu_blocks
    if config == "ours_disk":
        extra = kw["kv_transfer_config"]["kv_connector_extra_config"]
        lm = dict(extra["lmcache.extra_config"])
        lm["draft_offload.l3_timeout_s"] = l3_timeout_s
        lm["draft_offload.l3_retry_interval_s"] = 1.0
        if l3_url and not l3_url.startswith("fs://"):
            lm.pop("save_chunk_meta", None)  # fs:// only (its files keep the metadata)
        extra["lmcache.extra_config"] = lm
        extra["l3"] = {"enabled": True, "timeout_s": l3_timeout_s}
        if l3_hit_policy is not None:  # else the connector's default (cost)
            extra["l3"]["hit_policy"] = l3_hit_policy
        if l3_switch_interval_ms is not None:  # "none": leave Python's own interval
            extra["l3"]["switch_interval_ms"] = (
                None if l3_switch_interval_ms == "none" else l3_switch_interval_ms
            )
    return kw


def worker_env(dry_run: bool, batch_invariant: bool) -> dict[str, str]:
    extra = {
        # connector_memory is sent to the workers by collective_rpc as a callable
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
    }
    if dry_run:
        extra["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if batch_invariant:
        extra["VLLM_BATCH_INVARIANT"] = "1"
    return child_env(dry_run, extra)


def run_job(
    job: dict[str, Any], name: str, out: Path, env: dict[str, str], timeout: float
) -> dict[str, Any]:
    """Run one engine job; a process that dies without a result is recorded as a crash."""
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    job = {**job, "out": str(out / "jobs" / f"{name}.result.json")}
    path = out / "jobs" / f"{name}.job.json"
    path.write_text(json.dumps(job))
    log = out / "logs" / f"{name}.log"
    print(f"[stress] {name}: starting", flush=True)
    started = time.time()
    rc, wall = run_subprocess([sys.executable, *WORKER, str(path)], env, log, timeout)
    res_path = Path(job["out"])
    rec: dict[str, Any] = (
        json.loads(res_path.read_text()) if res_path.exists() else {"status": "starting"}
    )
    if rc != 0 and rec.get("status") in ("starting", "running", "ok"):
        rec["status"] = "timeout" if rc == -9 else "crashed"
        rec["error"] = f"subprocess exit code {rc}"
        rec["crashes"] = rec.get("crashes", 0) + (rec["status"] == "crashed")
    rec.update(rc=rc, started_at=started, wall_s_total=wall, log=str(log.relative_to(out)))
    rec["log_errors"] = error_lines(log)
    if rec.get("status") != "ok":
        rec["log_tail"] = tail(log)
    print(f"[stress] {name}: {rec['status']} in {wall:.0f}s", flush=True)
    return rec


def cpu_tier_bytes(fraction: float, tokens: int, bytes_per_token: int, chunk: int) -> int:
    """``fraction`` of ``tokens`` of KV, whole units, at least 2 units (and >= 1 MiB)."""
    unit = bytes_per_token * chunk
    units = max(2, int(fraction * tokens) // chunk)
    return max(units * unit, MIB)


def run_header(
    kind: str, script: str, argv: list[str] | None, dry: bool, batch_invariant: bool
) -> dict[str, Any]:
    """The fields every result JSON starts with (the GPU name comes from the engines)."""
    return {
        "schema": 1,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv if argv is None else [script, *argv],
        "dry_run": dry,
        "batch_invariant": batch_invariant,
        "versions": versions(),
    }
