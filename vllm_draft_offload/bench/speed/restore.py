"""TTFT of a restored prefix vs recompute, at real KV sizes (Llama-3-8B and 1B shapes).

    vllm-draft-offload restore-speed --out results/restore_speed.json [--tokens 16384]
        [--shape llama8b|small|small,llama8b] [--copy-path auto|memcpy|kernel]

Weights are random (`load_format="dummy"`): this measures bytes moved and time,
not acceptance. Every configuration runs in its own subprocess, one after
another, on the same prompts:

* `recompute`: prefix caching off, every prompt is prefilled;
* `native`: vLLM's OffloadingConnector, CPU tier;
* `ours`: DraftOffloadConnector, CPU tier;
* `ours_l3`: DraftOffloadConnector with an LMCache `fs://` tier, restarted: one
  engine (`ours_l3_fill`) prefills the prompts and waits for its L3 writes; then a
  fresh engine (empty CPU tier) hits every prompt from L3, and once more from the
  CPU tier. That restart runs twice: `ours_l3_cold` after the units' files were
  evicted from the page cache, `ours_l3` (warm) with them cached.

The L3 tier runs with the connector's DEFAULT settings; `--l3-io-threads`,
`--l3-backlog-gib`, `--l3-staging-mb` and `--l3-hit-policy` override them. Only
`l3.log_decisions` is turned on (it changes no behaviour): each config's entry in
the report keeps the connector's per-request storage decisions (`l3_decisions`:
what the CPU tier and storage held, fetched or declined and why, estimated load and
recompute times, the probe) and the tail of the child's output (`log_tail`). The
fill engine's first request (its warm-up, a fresh engine's first 16k prefill) is
the baseline of a restarted engine's first prompt (`first_request_s`), since a
fresh engine's first request is slower than its later ones. For `ours_l3` the report
has the units found in storage once writes settle against the units expected
(whole chunks of every prompt), the connector's own stored/dropped counters, the
sustained L3 write throughput (bytes of the unit files over the time from the
first to the last file's write), and, in the same run on the same directory, the
raw disk bandwidth (`disk_baseline`: O_DIRECT write with fsync; O_DIRECT, cold
and warm buffered reads).

Each runs with a `draft_model` drafter (a small Llama shape, same vocabulary),
so the drafter's KV is offloaded and restored too. For a hit, a prompt is
prefilled once, the GPU prefix cache is emptied, and the same prompt is sent
again with max_tokens=1: its latency is the restored TTFT. The pinned
host->device and device->host copy bandwidths are measured in the same run, as
the physical limits of restores and stores; the connector's own copies are timed
with CUDA events (its `transfer_seconds` counter): restores while hitting, stores
while prefilling fresh prompts.

Shapes (`--shape`, several comma-separated in one run): `llama8b` (32 layers,
8 KV heads x 128, 64 KiB pages per block of 16 tokens, 4-layer drafter) and
`small` (a Llama-3.2-1B shape: 16 layers, 8 KV heads x 64, 32 KiB pages, 2-layer
drafter). `table` holds one row per shape: restore and store GB/s / pinned
memcpy, hit TTFT (first and steady) / recompute and / native, and the first hit
over the steady ones (`first_over_steady`, ours and native). With one shape
the report keeps its single-shape layout; with several, each shape's report is
under `shapes`. `--copy-path` sets the connector's `copy_path` (default: the
connector's default, `auto`); `vllm-draft-offload copy-speed` measures the paths
page size by page size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import add_child_args, command_parser
from vllm_draft_offload.bench.progress import progress
from vllm_draft_offload.bench.speed.copy import pinned_memcpy_gbps
from vllm_draft_offload.bench.speed.disk_baseline import evict, measure

LLAMA8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
DRAFT_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
# Llama-3.2-1B's KV geometry (16 layers, 8 KV heads x 64, hidden 2048), drafter of 2 layers.
SMALL = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}
SMALL_DRAFT = {**SMALL, "num_hidden_layers": 2}
TINY = {  # a smoke-test shape (CPU dry run), not a benchmark
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
SHAPES = {"llama8b": (LLAMA8B, DRAFT_SHAPE), "small": (SMALL, SMALL_DRAFT), "tiny": (TINY, TINY)}
BLOCK_SIZE = 16  # vLLM's default on CUDA: a page holds K and V of 16 tokens
VOCAB = 128256
STORED_BYTES = "vllm:draft_offload_stored_bytes_total"
EXAMPLES = """examples:
  vllm-draft-offload restore-speed --enforce-eager --out $OUT/restore_speed.json
  vllm-draft-offload restore-speed --enforce-eager --shape small,llama8b --reps 3 \\
      --configs recompute,native,ours --out $OUT/restore_speed_shapes.json
  vllm-draft-offload restore-speed --enforce-eager --configs recompute,ours_l3 --reps 3 \\
      --l3-dir /root/l3 --drop-caches --out $OUT/restore_speed_l3.json
"""
# Every configuration runs in a child: this module again, as ``python -m``, with --child.
MODULE = "vllm_draft_offload.bench.speed.restore"


def write_config(path: Path, shape: dict[str, int], max_len: int) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        **shape,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    """K and V, bf16, every layer."""
    return 2 * 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]


def page_bytes(shape: dict[str, int]) -> int:
    """One layer's page: K and V of a block, bf16."""
    return kv_bytes_per_token({**shape, "num_hidden_layers": 1}) * BLOCK_SIZE


def pinned_h2d_gbps(gib: float) -> float:
    return pinned_memcpy_gbps(int(gib * 2**30), to_device=True)


def pinned_d2h_gbps(gib: float) -> float:
    return pinned_memcpy_gbps(int(gib * 2**30), to_device=False)


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


def unit_files(directory: Path) -> list[Path]:
    """Whole units in an fs:// directory (temp files of writes in flight end in .tmp;
    the engines' prefill calibration is not a unit)."""
    from vllm_draft_offload.l3_calibration import is_calibration_file

    return sorted(p for p in directory.glob("*.data") if not is_calibration_file(p.name))


# Lines of a child's output worth keeping in the report: the connector's storage
# decisions and calibration, and anything it warned about.
LOG_MARKERS = ("L3 decision", "prefill calibration", "DraftOffloadConnector")
LOG_TAIL_CHARS = 4000


def connector_log(stdout: str, stderr: str = "") -> dict[str, Any]:
    """The connector's lines from a child's output (vLLM logs to stdout by default),
    and the tail of each stream."""
    lines = (stdout + "\n" + stderr).splitlines()
    return {
        "l3_decisions": [line for line in lines if any(m in line for m in LOG_MARKERS)][-400:],
        "log_tail": {"stdout": stdout[-LOG_TAIL_CHARS:], "stderr": stderr[-LOG_TAIL_CHARS:]},
    }


def calibration_samples(directory: Path) -> list[list[float]]:
    """The prefill calibration's (tokens, attention, seconds) samples found in an
    fs:// directory (the JSON document inside LMCache's file), [] without one."""
    from vllm_draft_offload.l3_calibration import is_calibration_file

    for path in sorted(directory.glob("*.data")):
        if not is_calibration_file(path.name):
            continue
        blob = path.read_bytes()
        start = blob.find(b'{"version"')
        try:
            return json.loads(blob[start : blob.rindex(b"}") + 1])["samples"]
        except (ValueError, KeyError):
            return []
    return []


def write_throughput(files: list[Path]) -> dict[str, Any]:
    """Sustained L3 write rate from the files themselves: the bytes of every file but the
    first, over the time from the first file's last write to the last one's."""
    if len(files) < 2:
        return {"files": len(files), "GBps": None}
    stats = sorted((f.stat() for f in files), key=lambda st: st.st_mtime_ns)
    span_s = (stats[-1].st_mtime_ns - stats[0].st_mtime_ns) / 1e9
    nbytes = sum(st.st_size for st in stats[1:])
    return {
        "files": len(files),
        "bytes": nbytes + stats[0].st_size,
        "first_to_last_s": span_s,
        "GBps": nbytes / span_s / 1e9 if span_s > 0 else None,
    }


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


def wait_for_l3_files(directory: Path, settle_s: float = 3.0, limit_s: float = 300.0) -> int:
    """Wait until the L3 directory stops growing: the write-behind queue has drained."""
    deadline = time.monotonic() + limit_s
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = len(unit_files(directory))
        if count != last:
            last, stable_since = count, time.monotonic()
        elif count > 0 and time.monotonic() - stable_since >= settle_s:
            break
        time.sleep(0.5)
    return last


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
    if args.config in ("ours_l3", "ours_l3_cold"):
        # Prompts neither the fill engine nor the other restart wrote to storage.
        fresh_seed = 100 if args.config == "ours_l3_cold" else 200
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
        results["units_expected"] = args.reps * (args.tokens // args.chunk_size)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("restore-speed", __doc__, EXAMPLES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--cpu-gib", type=int, default=24)
    parser.add_argument(
        "--configs",
        default="recompute,native,ours",
        help="of recompute, native, ours, ours_l3 (a fill engine, then a restarted one)",
    )
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument("--gpu-mem", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--shape",
        default="llama8b",
        help=f"one or more (comma-separated) of {', '.join(sorted(SHAPES))}",
    )
    parser.add_argument(
        "--copy-path",
        choices=("auto", "memcpy", "kernel"),
        help="the connector's copy_path for ours configs (default: its default)",
    )
    parser.add_argument("--l3-dir", help="LMCache fs:// directory for ours_l3 (default: temp)")
    parser.add_argument("--l3-io-threads", type=int, help="override l3.io_threads")
    parser.add_argument("--l3-backlog-gib", type=float, help="override l3.max_pending_write_bytes")
    parser.add_argument("--l3-staging-mb", type=int, help="override draft_offload.l3_staging_mb")
    parser.add_argument(
        "--l3-hit-policy", choices=("cost", "always", "never"), help="override l3.hit_policy"
    )
    parser.add_argument(
        "--raw-gib", type=float, default=4.0, help="size of the raw disk baseline file"
    )
    parser.add_argument("--raw-threads", default="1,4", help="thread counts of the raw reads")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="cold passes drop the whole host's page cache (root) instead of the unit files'",
    )
    add_child_args(parser)
    args = parser.parse_args(argv)
    if args.child:
        Path(args.child).write_text(json.dumps(run_config(args)))
        return
    shapes = args.shape.split(",")
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown or len(set(shapes)) != len(shapes):
        parser.error(f"--shape: give distinct names of {', '.join(sorted(SHAPES))}")

    import torch
    import vllm

    work = Path(tempfile.mkdtemp(prefix="restore-speed-"))
    cuda = torch.cuda.is_available()
    # The limits, once per run: every shape's ratios use the same figures.
    common: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "pinned_h2d_GBps": pinned_h2d_gbps(1.0) if cuda else None,
        "pinned_d2h_GBps": pinned_d2h_gbps(1.0) if cuda else None,
    }
    l3_root = Path(args.l3_dir) if args.l3_dir else work / "l3"
    reports: dict[str, dict[str, Any]] = {}
    raw_disk: dict[str, Any] | None = None
    for name in shapes:
        # Each shape fills its own L3 directory: units of another shape never hit.
        l3_dir = l3_root if len(shapes) == 1 else l3_root / name
        reports[name] = run_shape(args, name, work / name, l3_dir, common, raw_disk)
        raw_disk = reports[name].get("raw_disk", raw_disk)
    out = combine(reports, common)
    print(json.dumps(out["table"], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


def run_shape(
    args: argparse.Namespace,
    name: str,
    work: Path,
    l3_dir: Path,
    common: dict[str, Any],
    raw_disk: dict[str, Any] | None,
) -> dict[str, Any]:
    """Every configuration's engine at one shape, one after another; the shape's report."""
    l3_dir.mkdir(parents=True, exist_ok=True)
    target_shape, draft_shape = SHAPES[name]
    target = write_config(work / "target", target_shape, args.tokens + 64)
    draft = None if args.no_draft else write_config(work / "draft", draft_shape, args.tokens + 64)
    report: dict[str, Any] = {
        **common,
        "shape_name": name,
        "shape": {"target": target_shape, "draft": None if draft is None else draft_shape},
        "page_bytes": {
            "target": page_bytes(target_shape),
            "draft": None if draft is None else page_bytes(draft_shape),
        },
        "copy_path": args.copy_path or "auto (connector default)",
        "tokens": args.tokens,
        "chunk_size": args.chunk_size,
        "enforce_eager": args.enforce_eager,
        "kv_bytes_per_token": kv_bytes_per_token(target_shape)
        + (0 if draft is None else kv_bytes_per_token(draft_shape)),
        "configs": {},
    }
    engines = []
    for config in args.configs.split(","):
        engines += ["ours_l3_fill", "ours_l3_cold", "ours_l3"] if config == "ours_l3" else [config]
    if "ours_l3_fill" in engines and unit_files(l3_dir):
        # Units of an earlier run would count as written and hit after the restart.
        raise SystemExit(f"--l3-dir {l3_dir} already holds units: give an empty directory")
    if "ours_l3_fill" in engines:
        # Before any unit is written: the directory's raw bandwidth, same run, same disk
        # (measured once per run).
        report["raw_disk"] = raw_disk or measure(
            l3_dir,
            int(args.raw_gib * 2**30),
            [int(t) for t in args.raw_threads.split(",")],
            args.drop_caches,
        )
        print("raw_disk", json.dumps(report["raw_disk"]), flush=True)
    for config in progress(engines, f"restore-speed {name}"):
        if config == "ours_l3_cold":
            report["l3_cold_method"] = evict(unit_files(l3_dir), args.drop_caches)
        child_out = work / f"{config}.json"
        cmd = [
            sys.executable, "-m", MODULE, "--out", args.out, "--child", str(child_out),
            "--target", target, "--config", config, "--tokens", str(args.tokens),
            "--reps", str(args.reps), "--chunk-size", str(args.chunk_size),
            "--cpu-gib", str(args.cpu_gib), "--gpu-mem", str(args.gpu_mem),
            "--l3-dir", str(l3_dir),
        ]  # fmt: skip
        for flag, value in (
            ("--l3-io-threads", args.l3_io_threads),
            ("--l3-backlog-gib", args.l3_backlog_gib),
            ("--l3-staging-mb", args.l3_staging_mb),
            ("--l3-hit-policy", getattr(args, "l3_hit_policy", None)),
            ("--copy-path", args.copy_path),
        ):
            if value:
                cmd += [flag, str(value)]
        if draft:
            cmd += ["--draft", draft]
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        proc = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True)
        if proc.returncode != 0 or not child_out.exists():
            report["configs"][config] = {"error": proc.stderr[-3000:]}
        else:
            report["configs"][config] = json.loads(child_out.read_text())
        report["configs"][config].update(connector_log(proc.stdout, proc.stderr))
        if config.startswith("ours_l3"):
            # What this engine left for the next one: the step samples the restarted
            # engines price recompute with (the decision log shows the estimate only).
            report["configs"][config]["calibration_samples"] = calibration_samples(l3_dir)
        print(name, config, json.dumps(report["configs"][config])[:400], flush=True)
    summarize(report)
    return report


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def summarize(report: dict[str, Any]) -> None:
    configs = report["configs"]
    recompute = configs.get("recompute", {})
    base = _median(recompute["fresh_s"]) if recompute.get("fresh_s") else None
    summary: dict[str, Any] = {"recompute_ttft_s": base}
    hits = {
        "native": configs.get("native", {}),
        "ours": configs.get("ours", {}),
        "ours_l3_restart": configs.get("ours_l3", {}),
        "ours_l3_restart_cold": configs.get("ours_l3_cold", {}),
    }
    for name, result in hits.items():
        hit = result.get("hit_s")
        if not hit:
            continue
        # After a restart every hit is a first hit of its prompt: no warm-up to drop.
        restart = name.startswith("ours_l3_restart")
        steady = _median(hit if restart else hit[1:] or hit)
        cached = result["hit_cached"][-1]
        metric = result.get("restore_GBps_metric") or []
        summary[name] = {
            "hit_ttft_s_steady": steady,
            "hit_ttft_s_first": hit[0],
            "cached_tokens": cached,
            "ratio_to_recompute": steady / base if base else None,
            "ratio_to_recompute_first": hit[0] / base if base else None,
            # A lower bound on restore bandwidth: the whole hit TTFT counted as copy time.
            "restore_GBps_lower_bound": cached * report["kv_bytes_per_token"] / steady / 1e9,
            # GPU time of the connector's own host->device copies (CUDA events).
            "restore_GBps_connector": _median(metric) if metric else None,
        }
        if result.get("cpu_hit_s"):
            summary[name]["cpu_hit_after_l3_ttft_s"] = _median(result["cpu_hit_s"])
        if restart:
            # Every prompt: tokens hit after the restart, and TTFT against this engine's
            # own recompute of prompts it has never seen (and the recompute config's).
            own = _median(result["fresh_s"]) if result.get("fresh_s") else None
            summary[name]["hit_tokens_per_prompt"] = result["hit_cached"]
            summary[name]["prompt_tokens"] = report["tokens"]
            summary[name]["hit_ttft_s_per_prompt"] = hit
            summary[name]["recompute_ttft_s_same_engine"] = own
            summary[name]["ttft_vs_recompute_per_prompt"] = (
                [h / (base or own) for h in hit] if (base or own) else None
            )
            # The first prompt is this engine's first request: against another fresh
            # engine's first request (the fill engine's warm-up), same prompt length.
            first = configs.get("ours_l3_fill", {}).get("first_request_s")
            summary[name]["first_request_recompute_s"] = first
            summary[name]["first_prompt_vs_first_request_recompute"] = (
                hit[0] / first if first else None
            )
            summary[name]["storage_decisions"] = [
                line[line.index("L3 decision") :]
                for line in result.get("l3_decisions", [])
                if "L3 decision req=" in line
            ]
    pinned = report.get("pinned_h2d_GBps")
    if "ours" in summary and pinned and summary["ours"]["restore_GBps_connector"]:
        summary["ours"]["restore_vs_pinned_memcpy"] = (
            summary["ours"]["restore_GBps_connector"] / pinned
        )
    if "ours" in summary:
        # GPU time of the connector's own device->host copies of the fresh prompts.
        stores = configs["ours"].get("store_GBps_metric") or []
        store = _median(stores) if stores else None
        pinned_d2h = report.get("pinned_d2h_GBps")
        summary["ours"]["store_GBps_connector"] = store
        summary["ours"]["store_vs_pinned_memcpy"] = (
            store / pinned_d2h if store and pinned_d2h else None
        )
    if "native" in summary and "ours" in summary:
        summary["ours_vs_native_ttft"] = (
            summary["ours"]["hit_ttft_s_steady"] / summary["native"]["hit_ttft_s_steady"]
        )
        summary["ours_vs_native_ttft_first"] = (
            summary["ours"]["hit_ttft_s_first"] / summary["native"]["hit_ttft_s_first"]
        )
    fill = configs.get("ours_l3_fill", {})
    if "units_expected" in fill:
        raw = report.get("raw_disk", {})
        written = fill.get("l3_write", {})
        summary["ours_l3_writes"] = {
            "units_in_storage": fill["l3_files"],
            "units_expected": fill["units_expected"],
            "written_fraction": fill["l3_files"] / fill["units_expected"],
            **fill.get("l3_counters", {}),
            "sustained_write_GBps": written.get("GBps"),
            "raw_write_GBps": raw.get("write_GBps"),
            "write_vs_raw": written["GBps"] / raw["write_GBps"]
            if written.get("GBps") and raw.get("write_GBps")
            else None,
        }
    if "raw_disk" in report:
        raw = report["raw_disk"]
        summary["raw_disk"] = {
            k: raw[k]
            for k in ("write_GBps", "read_direct_GBps", "read_cold_GBps", "read_warm_GBps")
        }
    report["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)


def combine(reports: dict[str, dict[str, Any]], common: dict[str, Any]) -> dict[str, Any]:
    """The run's report: one shape keeps the single-shape layout, several go under
    ``shapes``; both get the ``table`` of every shape."""
    table = [table_row(name, report) for name, report in reports.items()]
    if len(reports) == 1:
        return {**next(iter(reports.values())), "table": table}
    return {**common, "shapes": reports, "table": table}


def table_row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """One shape's line of the speed table, from its summary (None where a
    configuration did not run or failed)."""
    summary = report.get("summary", {})
    ours, native = summary.get("ours", {}), summary.get("native", {})
    return {
        "shape": name,
        "page_bytes": report.get("page_bytes", {}).get("target"),
        "copy_path": report.get("copy_path"),
        "restore_GBps": ours.get("restore_GBps_connector"),
        "restore_vs_pinned_memcpy": ours.get("restore_vs_pinned_memcpy"),
        "store_GBps": ours.get("store_GBps_connector"),
        "store_vs_pinned_memcpy": ours.get("store_vs_pinned_memcpy"),
        "recompute_ttft_s": summary.get("recompute_ttft_s"),
        "hit_ttft_s_first": ours.get("hit_ttft_s_first"),
        "hit_ttft_s_steady": ours.get("hit_ttft_s_steady"),
        "first_vs_recompute": ours.get("ratio_to_recompute_first"),
        "steady_vs_recompute": ours.get("ratio_to_recompute"),
        "native_first_vs_recompute": native.get("ratio_to_recompute_first"),
        "native_steady_vs_recompute": native.get("ratio_to_recompute"),
        "first_vs_native": summary.get("ours_vs_native_ttft_first"),
        "steady_vs_native": summary.get("ours_vs_native_ttft"),
        # Issue 13's item 4: the engine's first hit as fast as its steady ones (~1).
        "first_over_steady": _over(ours.get("hit_ttft_s_first"), ours.get("hit_ttft_s_steady")),
        "native_first_over_steady": _over(
            native.get("hit_ttft_s_first"), native.get("hit_ttft_s_steady")
        ),
    }


def _over(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


if __name__ == "__main__":
    main()
