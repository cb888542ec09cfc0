"""One `restore-speed` configuration's engine (the child process): fresh and hit TTFT
over several prompts, and the connector's own copy and L3 counters."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.kv_configs import native_offloading_config
from vllm_draft_offload.bench.speed.l3_dir import unit_files, wait_for_l3_files, write_throughput
from vllm_draft_offload.bench.speed.shapes import VOCAB, draft_model_config
from vllm_draft_offload.metric_defs import AUDIT_RESULTS, L3_THREAD_CLOCKS, L3_THREAD_OPS

STORED_BYTES = "vllm:draft_offload_stored_bytes_total"
L3_THREAD_SECONDS = "vllm:draft_offload_l3_thread_seconds_total"
AUDIT_RECOMPUTE_UNITS = "vllm:draft_offload_audit_recompute_units_total"
# restore-speed --l3-variants: the l3 settings each variant's warm restart changes.
VARIANT_SETTINGS: dict[str, dict[str, Any]] = {
    "spread": {"spread_reads": True},
    "strict": {"wait_past_allowance": False},
    # Python's own GIL switch interval (5 ms) instead of the tier's 0.5 ms.
    "interval5": {"switch_interval_ms": None},
    # Two writes in flight instead of the host-sized default.
    "writes2": {"write_threads": 2},
    # Overlapped restores (experimental, off by default): admitted while units land.
    "overlap": {"overlap_restore": True},
    # Twelve threads for reads and twelve for writes.
    "threads12": {"io_threads": 12, "write_threads": 12},
    # Twelve read threads, writes at eight: the default on a 16-core host since
    # session 27 (before it, 8 and 8), where it beat 8 and 8 in every restart.
    "reads12": {"io_threads": 12, "write_threads": 8},
    # Eight and eight: the default on a 16-core host before session 27.
    "reads8": {"io_threads": 8, "write_threads": 8},
    # Each unit's layers split over four threads in one read call (l3.threads_per_unit):
    # a quarter as many units at a time, each landing in about a quarter of the time.
    "split4": {"threads_per_unit": 4},
}


def is_restart(config: str) -> bool:
    """A restarted engine (`ours_l3_cold`, `ours_l3` or a warm variant `ours_l3_<v>`):
    hits every prompt from storage, then from its CPU tier."""
    return config.startswith("ours_l3") and config != "ours_l3_fill"


def connector_config(args: argparse.Namespace) -> dict[str, Any] | None:
    cpu_bytes = args.cpu_gib * 2**30
    if args.config == "native":
        return native_offloading_config(cpu_bytes)
    if args.config.startswith("ours"):
        extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "chunk_size": args.chunk_size}
        if getattr(args, "copy_path", None):
            extra["copy_path"] = args.copy_path
        if getattr(args, "store_staging_units", None) is not None:
            extra["store_staging_units"] = args.store_staging_units
        if args.config == "ours_audit":
            # Every hit recomputes instead and compares the stored units, every layer,
            # with what it computed: what the GPU's store path wrote, checked (on the host).
            extra["audit_recompute_fraction"] = 1.0
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


def _audit_counts() -> dict[str, float]:
    """Stored units the recompute audit compared, by result (ok, mismatch, error)."""
    from vllm_draft_offload.bench.workloads.summary import sum_prefix
    from vllm_draft_offload.bench.workloads.worker import snapshot_metrics

    counters = snapshot_metrics()
    return {
        result: sum_prefix(counters, AUDIT_RECOMPUTE_UNITS, result=result)
        for result in AUDIT_RESULTS
    }


def _l3_thread_seconds() -> dict[str, float]:
    """Storage threads' summed wall and CPU seconds so far ("read_wall", "read_cpu", ...)."""
    from vllm_draft_offload.bench.workloads.summary import sum_prefix
    from vllm_draft_offload.bench.workloads.worker import snapshot_metrics

    counters = snapshot_metrics()
    return {
        f"{op}_{clock}": sum_prefix(counters, L3_THREAD_SECONDS, op=op, clock=clock)
        for op in L3_THREAD_OPS
        for clock in L3_THREAD_CLOCKS
    }


def _phases(output: Any) -> dict[str, float | None]:
    """Where a request's TTFT went, from vLLM's own request stats (engine-core clock):
    waiting to be scheduled (in the waiting queue, or on the connector: a storage
    lookup or fetch), then from its first scheduling to its first token."""
    stats = getattr(output, "metrics", None)
    queued = getattr(stats, "queued_ts", 0.0) or 0.0
    scheduled = getattr(stats, "scheduled_ts", 0.0) or 0.0
    first = getattr(stats, "first_token_ts", 0.0) or 0.0
    return {
        "waiting_s": scheduled - queued if queued and scheduled else None,
        "scheduled_to_first_token_s": first - scheduled if scheduled and first else None,
    }


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """Child process: one engine, fresh vs hit TTFT over several prompts.

    ``ours_l3_fill`` prefills the prompts (two per rep: a restart hits one with no
    storage writes in flight, one right behind a fresh prompt's) and waits for its L3
    writes. A restarted engine (``ours_l3``, ``ours_l3_cold``, a variant) first serves
    a short request (it then is not the engine's first request, which is slower), then
    per rep: once no write is in flight, hits prompt ``rep`` from L3 (``hit_s``) and
    again from the CPU tier after a GPU-cache reset (``cpu_hit_s``); once no write is
    in flight, prefills a new prompt (``fresh_s``: the recompute baseline), right
    after it another (``fresh_busy_s``, behind the first one's storage writes), and
    right after that hits prompt ``reps + rep`` from L3 (``busy_hit_s``, behind the
    second one's writes). ``phases`` splits each timed request's TTFT (vLLM's request
    stats) and ``l3_thread_seconds`` the storage threads' wall and CPU time during it.
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
        speculative_config=draft_model_config(args.draft),
        kv_transfer_config=connector_config(args),
        disable_log_stats=False,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ours = args.config.startswith("ours")
    l3 = args.config.startswith("ours_l3")
    results: dict[str, Any] = {"config": args.config, "fresh_s": []}

    def prompt(seed: int, tokens: int | None = None) -> TokensPrompt:
        return TokensPrompt(
            prompt_token_ids=[
                (seed * 7919 + i * 131) % (VOCAB - 1000) + 500 for i in range(tokens or args.tokens)
            ]
        )

    def step_engine() -> None:
        """A 2-token request: the engine does what it had pending, nothing is stored."""
        llm.generate([TokensPrompt(prompt_token_ids=[500, 501])], one, use_tqdm=False)

    def timed(
        p: TokensPrompt, gbps_into: list[float] | None = None, label: str | None = None
    ) -> tuple[float, int]:
        before = _copied_by_connector("load") if ours and gbps_into is not None else None
        threads = _l3_thread_seconds() if l3 and label else None
        start = time.perf_counter()
        out = llm.generate([p], one, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        if label:
            record: dict[str, Any] = {"ttft_s": elapsed, **_phases(out)}
            if threads is not None:
                after = _l3_thread_seconds()
                record["l3_thread_seconds"] = {k: after[k] - threads[k] for k in after}
            results.setdefault("phases", {}).setdefault(label, []).append(record)
        if before is not None and gbps_into is not None:
            step_engine()  # a load's copy time is read from CUDA events in a later step
            _gbps_since("load", before, gbps_into)
        return elapsed, int(out.num_cached_tokens or 0)

    def empty_gpu_cache() -> None:
        """Reset the GPU prefix cache once every store has landed."""
        if reset_prefix_cache_after_stores(llm, step_engine, attempts=200, pause_s=0.05) is None:
            raise RuntimeError("GPU prefix cache never emptied: stores did not complete")

    def writes_expected() -> int:
        """Units the fresh prompts so far, the restart's warm-up and the short hits'
        computed chunks included, hand to storage (whole chunks of each)."""
        prompts = len(results["fresh_s"]) + len(results.get("fresh_busy_s", []))
        warmup_units = results.get("warmup_tokens", 0) // args.chunk_size
        return prompts * (args.tokens // args.chunk_size) + warmup_units + short_units[0]

    short_units = [0]  # computed (so stored and written) by the short hits and controls

    def settle_writes(timeout_s: float = 60.0) -> None:
        """Until every unit of the fresh prompts so far is written (or dropped or
        failed): the next request runs with no storage write in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            step_engine()  # the workers' write reports reach the counters with steps
            counters = _l3_counters()
            if sum(counters.values()) >= writes_expected():
                return
            if time.monotonic() > deadline:
                results["settle_timeouts"] = results.get("settle_timeouts", 0) + 1
                return
            time.sleep(0.05)

    def fresh(seed: int, into: str, tokens: int | None = None) -> None:
        results.setdefault(into, []).append(timed(prompt(seed, tokens), label=into)[0])

    def hit(
        rep: int, into: dict[str, list], prefix: str = "", stores: tuple[float, float] | None = None
    ) -> None:
        empty_gpu_cache()
        if stores is not None:
            # Every store of the fresh prompt has completed (its blocks were freed).
            step_engine()
            _gbps_since("store", stores, into.setdefault("store_GBps_metric", []))
        hit_s, cached = timed(
            prompt(rep), into.setdefault(f"{prefix}restore_GBps_metric", []), f"{prefix}hit_s"
        )
        into.setdefault(f"{prefix}hit_s", []).append(hit_s)
        into.setdefault(f"{prefix}hit_cached", []).append(cached)

    def short_hit(rep: int, chunks: int, fresh_seed: int) -> None:
        """A fresh prompt as long as what the short hit computes (``odd_fresh_s``), its
        writes let settle, then the short hit: a prompt whose first `chunks` chunks are
        prompt `rep`'s (in the CPU tier, not in the GPU cache) and whose other chunks are
        new (``short_hit_s``). Does a hit of a few chunks cost its prefill more than it
        saves? In this order an engine's first prefill of the new length (session 14: 27
        ms for a first 16k one) falls on the fresh prompt at rep 0, not on the hit, so a
        first-time cost the hit still shows is the partial hit's own (session 31 ran
        the hit first and could not tell the two apart)."""
        kept = chunks * args.chunk_size
        computed_units = (args.tokens - kept) // args.chunk_size
        fresh(fresh_seed + 90 + rep, "odd_fresh_s", args.tokens - kept)
        short_units[0] += computed_units
        settle_writes()
        empty_gpu_cache()
        head = prompt(rep)["prompt_token_ids"][:kept]
        tail = prompt(fresh_seed + 80 + rep)["prompt_token_ids"][kept:]
        hit_s, cached = timed(TokensPrompt(prompt_token_ids=head + tail), label="short_hit_s")
        results.setdefault("short_hit_s", []).append(hit_s)
        results.setdefault("short_hit_cached", []).append(cached)
        short_units[0] += computed_units

    if is_restart(args.config):
        # Prompts neither the fill engine nor another restart wrote to storage.
        fresh_seed = 100 if args.config == "ours_l3_cold" else getattr(args, "fresh_seed", 200)
        # An engine's first long prefill is slower whatever the cache (session 14: a
        # restart's first 16k request took 27 ms more than its later ones with nothing
        # loaded), so the first timed hit would carry it and the recompute baseline not.
        # The warm-up is a full-length prompt no engine wrote (a storage miss; its units
        # are written, counted in writes_expected and removed after the engine).
        # --restart-warmup-tokens below a chunk: nothing stored, nothing looked up.
        warmup_tokens = getattr(args, "restart_warmup_tokens", None) or args.tokens
        results["warmup_tokens"] = warmup_tokens if warmup_tokens >= args.chunk_size else 0
        results["warmup_s"] = timed(prompt(9_999, warmup_tokens))[0]
        for rep in range(args.reps):
            settle_writes()
            hit(rep, results)  # from L3: this engine's CPU tier starts empty
            hit(rep, results, "cpu_")
            if getattr(args, "short_hit_chunks", 0):
                short_hit(rep, args.short_hit_chunks, fresh_seed)
            settle_writes()
            fresh(fresh_seed + rep, "fresh_s")
            fresh(fresh_seed + 50 + rep, "fresh_busy_s")
            # From L3 too (a prompt this engine never saw), behind fresh_busy's writes.
            busy_s, busy_cached = timed(prompt(args.reps + rep), label="busy_hit_s")
            results.setdefault("busy_hit_s", []).append(busy_s)
            results.setdefault("busy_hit_cached", []).append(busy_cached)
        results["settled"] = _l3_counters()
        results["writes_expected"] = writes_expected()
        return results
    # Compile/warm-up; also the TTFT of a fresh engine's first request.
    results["first_request_s"] = timed(prompt(10_000))[0]
    if ours:
        empty_gpu_cache()  # the warm-up's stores land before any store is timed
    # The fill engine stores a second set of prompts: the restarts' busy hits.
    for rep in range(2 * args.reps if args.config == "ours_l3_fill" else args.reps):
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
        results["units_expected"] = (2 * args.reps + 1) * (args.tokens // args.chunk_size)
    if args.config == "ours_audit":
        step_engine()  # the last hit's comparisons reach the counters with a step
        results["audit_recompute_units"] = _audit_counts()
    return results
