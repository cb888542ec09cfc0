"""One `restore-speed` configuration's engine (the child process): fresh and hit TTFT
over several prompts, and the connector's own copy and L3 counters."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.speed.l3_dir import unit_files, wait_for_l3_files, write_throughput
from vllm_draft_offload.bench.speed.shapes import VOCAB

STORED_BYTES = "vllm:draft_offload_stored_bytes_total"
# restore-speed --l3-variants: the l3 settings each variant's warm restart changes.
VARIANT_SETTINGS: dict[str, dict[str, Any]] = {
    "spread": {"spread_reads": True},
    "strict": {"wait_past_allowance": False},
}


def is_restart(config: str) -> bool:
    """A restarted engine (`ours_l3_cold`, `ours_l3` or a warm variant `ours_l3_<v>`):
    hits every prompt from storage, then from its CPU tier."""
    return config.startswith("ours_l3") and config != "ours_l3_fill"


def connector_config(args: argparse.Namespace) -> dict[str, Any] | None:
    cpu_bytes = args.cpu_gib * 2**30
    if args.config == "native":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
        }
    if args.config.startswith("ours"):
        extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "chunk_size": args.chunk_size}
        if getattr(args, "copy_path", None):
            extra["copy_path"] = args.copy_path
        if args.config.startswith("ours_l3"):
            # Defaults unless a flag says otherwise: the benchmark measures what a user
            # who only turns L3 on gets.
            # log_decisions: the per-request storage decisions at INFO (no behaviour).
            l3: dict[str, Any] = {"enabled": True, "log_decisions": True}
            if args.l3_io_threads:
                l3["io_threads"] = args.l3_io_threads
            if args.l3_backlog_gib:
                l3["max_pending_write_bytes"] = int(args.l3_backlog_gib * 2**30)
            if getattr(args, "l3_hit_policy", None):
                l3["hit_policy"] = args.l3_hit_policy
            if getattr(args, "l3_spread_reads", False):
                l3["spread_reads"] = True
            for part in filter(None, getattr(args, "l3_variant", "").split("+")):
                l3.update(VARIANT_SETTINGS[part])
            extra["l3"] = l3
            extra["lmcache.remote_url"] = f"fs://{args.l3_dir}"
            lmcache_extra: dict[str, Any] = {"save_chunk_meta": True}
            if args.l3_staging_mb:
                lmcache_extra["draft_offload.l3_staging_mb"] = args.l3_staging_mb
            extra["lmcache.extra_config"] = lmcache_extra
        return {
            "kv_connector": "DraftOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    return None


def _copied_by_connector(direction: str) -> tuple[float, float]:
    """(bytes, GPU seconds) of our connector's CPU-tier copies in one direction (load:
    CPU tier -> GPU, store: GPU -> CPU tier), from its counters."""
    from vllm_draft_offload.bench.workloads.summary import LOADED_BYTES, TRANSFER_S, sum_prefix
    from vllm_draft_offload.bench.workloads.worker import snapshot_metrics

    counters = snapshot_metrics()
    nbytes = LOADED_BYTES if direction == "load" else STORED_BYTES
    return (
        sum_prefix(counters, nbytes, tier="cpu"),
        sum_prefix(counters, TRANSFER_S, direction=direction, tier="cpu"),
    )


def _gbps_since(direction: str, before: tuple[float, float], into: list[float]) -> None:
    after = _copied_by_connector(direction)
    nbytes, seconds = after[0] - before[0], after[1] - before[1]
    if nbytes > 0 and seconds > 0:
        into.append(nbytes / seconds / 1e9)


def _l3_counters() -> dict[str, float]:
    """The connector's own L3 write counters."""
    from vllm_draft_offload.bench.workloads.summary import sum_prefix
    from vllm_draft_offload.bench.workloads.worker import snapshot_metrics

    counters = snapshot_metrics()
    return {
        "stored_chunks_l3": sum_prefix(
            counters, "vllm:draft_offload_stored_chunks_total", tier="l3"
        ),
        "l3_write_dropped": sum_prefix(
            counters, "vllm:draft_offload_fallbacks_total", cause="l3_write_dropped"
        ),
        "store_failed": sum_prefix(
            counters, "vllm:draft_offload_fallbacks_total", cause="store_failed"
        ),
    }


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """Child process: one engine, fresh vs hit TTFT over several prompts.

    ``ours_l3_fill`` prefills the prompts and waits for their L3 writes;
    ``ours_l3`` is the restarted engine: its first hit of each prompt comes from
    L3 (``hit_s``), a second one after a GPU-cache reset from the CPU tier the
    first one filled (``cpu_hit_s``); ``fresh_s`` there are new prompts (other
    ones in each restart: the first restart writes its own to storage).
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_draft_offload.bench.workloads.worker import reset_prefix_cache_after_stores

    llm = LLM(
        model=args.target,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.tokens + 64,
        max_num_batched_tokens=args.tokens + 64,
        gpu_memory_utilization=args.gpu_mem,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.config != "recompute",
        speculative_config={
            "method": "draft_model",
            "model": args.draft,
            "num_speculative_tokens": 3,
        }
        if args.draft
        else None,
        kv_transfer_config=connector_config(args),
        disable_log_stats=False,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ours = args.config.startswith("ours")

    def prompt(seed: int) -> TokensPrompt:
        return TokensPrompt(
            prompt_token_ids=[
                (seed * 7919 + i * 131) % (VOCAB - 1000) + 500 for i in range(args.tokens)
            ]
        )

    def step_engine() -> None:
        """A 2-token request: the engine does what it had pending, nothing is stored."""
        llm.generate([TokensPrompt(prompt_token_ids=[500, 501])], one, use_tqdm=False)

    def timed(p: TokensPrompt, gbps_into: list[float] | None = None) -> tuple[float, int]:
        before = _copied_by_connector("load") if ours and gbps_into is not None else None
        start = time.perf_counter()
        out = llm.generate([p], one, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        if before is not None and gbps_into is not None:
            step_engine()  # a load's copy time is read from CUDA events in a later step
            _gbps_since("load", before, gbps_into)
        return elapsed, int(out.num_cached_tokens or 0)

    def empty_gpu_cache() -> None:
        """Reset the GPU prefix cache once every store has landed."""
        if reset_prefix_cache_after_stores(llm, step_engine, attempts=200, pause_s=0.05) is None:
            raise RuntimeError("GPU prefix cache never emptied: stores did not complete")

    def hit(
        rep: int, into: dict[str, list], prefix: str = "", stores: tuple[float, float] | None = None
    ) -> None:
        empty_gpu_cache()
        if stores is not None:
            # Every store of the fresh prompt has completed (its blocks were freed).
            step_engine()
            _gbps_since("store", stores, into.setdefault("store_GBps_metric", []))
        hit_s, cached = timed(prompt(rep), into.setdefault(f"{prefix}restore_GBps_metric", []))
        into.setdefault(f"{prefix}hit_s", []).append(hit_s)
        into.setdefault(f"{prefix}hit_cached", []).append(cached)

    results: dict[str, Any] = {"config": args.config, "fresh_s": []}
    if is_restart(args.config):
        # Prompts neither the fill engine nor another restart wrote to storage.
        fresh_seed = 100 if args.config == "ours_l3_cold" else getattr(args, "fresh_seed", 200)
        for rep in range(args.reps):
            hit(rep, results)  # from L3: this engine's CPU tier starts empty
            hit(rep, results, "cpu_")
            results["fresh_s"].append(timed(prompt(fresh_seed + rep))[0])
        return results
    # Compile/warm-up; also the TTFT of a fresh engine's first request, the baseline
    # of a restarted engine's first prompt.
    results["first_request_s"] = timed(prompt(10_000))[0]
    if ours:
        empty_gpu_cache()  # the warm-up's stores land before any store is timed
    for rep in range(args.reps):
        stores = _copied_by_connector("store") if ours else None
        results["fresh_s"].append(timed(prompt(rep))[0])
        if args.config != "ours_l3_fill":
            hit(rep, results, stores=stores)
    if args.config == "ours_l3_fill":
        empty_gpu_cache()  # every store done: the L3 writes are queued
        results["l3_files"] = wait_for_l3_files(Path(args.l3_dir))
        for _ in range(3):  # the worker's write events reach the metrics in later steps
            step_engine()
        results["l3_counters"] = _l3_counters()
        results["l3_write"] = write_throughput(unit_files(Path(args.l3_dir)))
        # Whole chunks of the measured prompts and of the warm-up prompt (stored too).
        results["units_expected"] = (args.reps + 1) * (args.tokens // args.chunk_size)
    return results
