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
  engine (`ours_l3_fill`) prefills two sets of prompts and waits for its L3 writes;
  then a fresh engine (empty CPU tier) serves a short request (so the measured ones
  are not its first), and per rep: with no storage write in flight, hits a prompt
  of the first set from L3 (`hit_s`) and once more from the CPU tier; with no write
  in flight, prefills a new prompt (`fresh_s`, its recompute baseline), right after
  it another one (`fresh_busy_s`, behind the first one's storage writes), and right
  after that hits a prompt of the second set from L3 (`busy_hit_s`, behind the
  writes of the one before). `phases` splits each of those requests' TTFT with
  vLLM's request stats (waiting to be scheduled, i.e. on storage; scheduled to
  first token) and the storage threads' wall and CPU seconds meanwhile (the
  connector's `l3_thread_seconds`). That restart runs twice: `ours_l3_cold` after
  the units' files were evicted from the page cache, `ours_l3` (warm) after every
  unit file was read back into it (`l3_warm`: files, bytes and the read's GB/s).
  `--l3-variants` adds more warm restarts after it, each with other settings
  (`spread`: `l3.spread_reads` on; `strict`: `l3.wait_past_allowance` off;
  `interval5`: Python's 5 ms GIL switch interval instead of `l3.switch_interval_ms`;
  `writes2`: `l3.write_threads` 2; `overlap`: `l3.overlap_restore` on; `split4`:
  `l3.threads_per_unit` 4; `+` joins
  them), so they are measured side by side against the same stored units and page
  cache.

The L3 tier runs with the connector's DEFAULT settings; `--l3-io-threads`,
`--l3-backlog-gib`, `--l3-staging-mb`, `--l3-hit-policy` and `--l3-spread-reads` override
them. Only `l3.log_decisions` is turned on (it changes no behaviour): each config's entry in
the report keeps the connector's per-request storage decisions (`l3_decisions`:
what the CPU tier and storage held, fetched or declined and why, estimated load and
recompute times, the probe) and the tail of the child's output (`log_tail`). For
`ours_l3` the report
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
8 KV heads x 128, 64 KiB pages per block of 16 tokens, 4-layer drafter), `small`
(a Llama-3.2-1B shape: 16 layers, 8 KV heads x 64, 32 KiB pages, 2-layer drafter)
and `gptoss20b` (gpt-oss-20b's attention layout as a dense Llama: 24 layers
alternating 128-token sliding windows and full attention, 8 KV heads x 64, an MLP
as wide as its 4 active experts; a 4-layer drafter of its KV geometry; its
`kv_bytes_per_token` counts the full-attention layers only). `table` holds one row
per shape: restore and store GB/s / pinned memcpy, hit TTFT (first and steady) /
recompute and / native, and the first hit over the steady ones
(`first_over_steady`, ours and native). With one shape the report keeps its
single-shape layout; with several, each shape's report is under `shapes`.
`--copy-path` sets the connector's `copy_path` (default: the connector's default,
`auto`); `vllm-draft-offload copy-speed` measures the paths page size by page size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import add_child_args, command_parser
from vllm_draft_offload.bench.procs import run_child
from vllm_draft_offload.bench.progress import progress
from vllm_draft_offload.bench.provenance import provenance
from vllm_draft_offload.bench.speed.copy_rig import pinned_memcpy_gbps
from vllm_draft_offload.bench.speed.disk_baseline import cache, evict, measure
from vllm_draft_offload.bench.speed.l3_dir import calibration_samples, unit_files
from vllm_draft_offload.bench.speed.restore_engine import VARIANT_SETTINGS, run_config
from vllm_draft_offload.bench.speed.restore_report import combine, connector_log, summarize
from vllm_draft_offload.bench.speed.shapes import (
    SHAPES,
    kv_bytes_per_token,
    page_bytes,
    write_config,
)

EXAMPLES = """examples:
  vllm-draft-offload restore-speed --enforce-eager --out $OUT/restore_speed.json
  vllm-draft-offload restore-speed --enforce-eager --shape small,llama8b --reps 3 \\
      --configs recompute,native,ours --out $OUT/restore_speed_shapes.json
  vllm-draft-offload restore-speed --enforce-eager --configs recompute,ours_l3 --reps 3 \\
      --l3-dir /root/l3 --drop-caches --out $OUT/restore_speed_l3.json
"""
# Every configuration runs in a child: this module again, as ``python -m``, with --child.
MODULE = "vllm_draft_offload.bench.speed.restore"


def pinned_h2d_gbps(gib: float) -> float:
    return pinned_memcpy_gbps(int(gib * 2**30), to_device=True)


def variant_engine(variant: str) -> str:
    """The engine name of a warm-restart variant ("spread+strict" -> ours_l3_spread_strict);
    ValueError names an unknown setting."""
    parts = variant.split("+")
    unknown = [part for part in parts if part not in VARIANT_SETTINGS]
    if unknown or len(set(parts)) != len(parts):
        raise ValueError(f"{variant!r}: give distinct settings of {', '.join(VARIANT_SETTINGS)}")
    return "ours_l3_" + "_".join(parts)


def remove_units_but(directory: Path, keep: set[Path]) -> int:
    """Delete the unit files in `directory` that are not in `keep`; how many."""
    removed = 0
    for path in unit_files(directory):
        if path not in keep:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def pinned_d2h_gbps(gib: float) -> float:
    return pinned_memcpy_gbps(int(gib * 2**30), to_device=False)


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
        help="of recompute, native, ours, ours_audit (ours whose hits recompute and compare "
        "the stored units with it, every layer), ours_l3 (a fill engine, then a restarted one)",
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
    parser.add_argument(
        "--store-staging-units",
        type=int,
        help="the connector's store_staging_units for ours configs (default: its default; "
        "0: stores unstaged)",
    )
    parser.add_argument("--l3-dir", help="LMCache fs:// directory for ours_l3 (default: temp)")
    parser.add_argument("--l3-io-threads", type=int, help="override l3.io_threads")
    parser.add_argument("--l3-backlog-gib", type=float, help="override l3.max_pending_write_bytes")
    parser.add_argument("--l3-staging-mb", type=int, help="override draft_offload.l3_staging_mb")
    parser.add_argument(
        "--l3-hit-policy", choices=("cost", "always", "never"), help="override l3.hit_policy"
    )
    parser.add_argument("--l3-spread-reads", action="store_true", help="turn l3.spread_reads on")
    parser.add_argument(
        "--l3-variants",
        default="",
        help="more warm restarts after ours_l3's, comma-separated, each a '+'-joined set "
        f"of {', '.join(VARIANT_SETTINGS)} (e.g. spread,spread+strict)",
    )
    parser.add_argument(
        "--restart-warmup-tokens",
        type=int,
        help="a restarted engine's untimed first request (default: --tokens, a full-length "
        "prompt no engine wrote, so the first timed hit does not carry the engine's first "
        "long prefill; below --chunk-size: nothing stored or looked up, the session-14 form)",
    )
    parser.add_argument(
        "--short-hit-chunks",
        type=int,
        default=0,
        help="each warm restart also times, per rep, a prompt whose first this many chunks "
        "are in the CPU tier and the rest new, and a fresh prompt as long as what it "
        "computes (short_hit_s, odd_fresh_s; default 0: not run)",
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
    parser.add_argument("--l3-variant", default="", help=argparse.SUPPRESS)
    parser.add_argument("--fresh-seed", type=int, default=200, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        variants = [variant_engine(v) for v in args.l3_variants.split(",") if v]
    except ValueError as e:
        parser.error(f"--l3-variants: {e}")
    if variants and "ours_l3" not in args.configs.split(","):
        parser.error("--l3-variants: they restart from ours_l3's units; add ours_l3 to --configs")
    if args.short_hit_chunks and not 0 < args.short_hit_chunks < args.tokens // args.chunk_size:
        parser.error(
            f"--short-hit-chunks: {args.short_hit_chunks} must leave a chunk to compute "
            f"(1 to {args.tokens // args.chunk_size - 1} at --tokens {args.tokens})"
        )
    if args.short_hit_chunks and args.reps > 10:
        # The short hits' new prompts take 20 seeds after each restart's fresh ones.
        parser.error("--short-hit-chunks: at most 10 --reps (each restart has 100 prompt seeds)")
    if args.child:
        Path(args.child).write_text(json.dumps(run_config(args)))
        return
    shapes = args.shape.split(",")
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown or len(set(shapes)) != len(shapes):
        parser.error(f"--shape: give distinct names of {', '.join(sorted(SHAPES))}")

    # The engines' model configs and results, and the L3 directory unless --l3-dir names
    # one: removed at the end, or every run left gigabytes of units in /tmp.
    with tempfile.TemporaryDirectory(prefix="restore-speed-") as work:
        run_shapes(args, shapes, Path(work))


def run_shapes(args: argparse.Namespace, shapes: list[str], work: Path) -> None:
    import torch

    cuda = torch.cuda.is_available()
    # The limits, once per run: every shape's ratios use the same figures.
    common: dict[str, Any] = {
        **provenance(),
        "pinned_h2d_GBps": pinned_h2d_gbps(1.0) if cuda else None,
        "pinned_d2h_GBps": pinned_d2h_gbps(1.0) if cuda else None,
    }
    l3_root = Path(args.l3_dir) if args.l3_dir else work / "l3"
    reports: dict[str, dict[str, Any]] = {}
    raw_disk: dict[str, Any] | None = None
    for name in shapes:
        # Each shape fills its own L3 directory: units of another shape never hit.
        l3_dir = l3_root if len(shapes) == 1 else l3_root / name
        reports[name] = run_shape(
            args,
            name,
            work / name,
            l3_dir,
            common,
            raw_disk,
            checkpoint=lambda partial, name=name: write_out(
                Path(args.out), {**reports, name: partial}, common, complete=False
            ),
        )
        raw_disk = reports[name].get("raw_disk", raw_disk)
    out = write_out(Path(args.out), reports, common, complete=True)
    print(json.dumps(out["table"], indent=1), flush=True)


def write_out(
    path: Path, reports: dict[str, dict[str, Any]], common: dict[str, Any], complete: bool
) -> dict[str, Any]:
    """The output file, rewritten after every engine: ``complete`` False while engines
    are still to run (a shape's summary and table line come after its last engine), so
    an engine that hangs or a lease that ends costs only what had not run."""
    out = {**combine(reports, common), "complete": complete}
    if not complete:
        out["table"] = []  # a shape's line needs its summary, made after its last engine
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def run_shape(
    args: argparse.Namespace,
    name: str,
    work: Path,
    l3_dir: Path,
    common: dict[str, Any],
    raw_disk: dict[str, Any] | None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every configuration's engine at one shape, one after another; the shape's report.
    ``checkpoint`` gets the report after every engine."""
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
        "store_staging_units": (
            "connector default" if args.store_staging_units is None else args.store_staging_units
        ),
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
    # Variant engine -> its settings and the seed of its fresh prompts: each restart
    # prefills prompts no other engine wrote to storage.
    variants = {
        variant_engine(v): (v, 300 + 100 * i)
        for i, v in enumerate(v for v in args.l3_variants.split(",") if v)
    }
    engines += list(variants)
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
            into_memory=True,  # a fetch lands in host slots: its limit is this read
        )
        print("raw_disk", json.dumps(report["raw_disk"]), flush=True)
    filled: set[Path] = set()
    for config in progress(engines, f"restore-speed {name}"):
        if config == "ours_l3_cold":
            report["l3_cold_method"] = evict(unit_files(l3_dir), args.drop_caches)
        if config == "ours_l3" or config in variants:
            # The cold restart left most files evicted: read them all back first, or
            # the "warm" restart reads cold files (seen on an H100: 175 ms per unit).
            report["l3_warm"] = cache(unit_files(l3_dir))
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
            ("--restart-warmup-tokens", args.restart_warmup_tokens),
            ("--short-hit-chunks", args.short_hit_chunks),
            ("--store-staging-units", args.store_staging_units),
        ):
            if value is not None:  # a 0 given is passed on (store_staging_units 0: off)
                cmd += [flag, str(value)]
        if getattr(args, "l3_spread_reads", False):
            cmd.append("--l3-spread-reads")
        if config in variants:
            variant, seed = variants[config]
            cmd += ["--l3-variant", variant, "--fresh-seed", str(seed)]
        if draft:
            cmd += ["--draft", draft]
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        proc = run_child(cmd, os.environ.copy(), args.engine_timeout)
        if proc.returncode != 0 or not child_out.exists():
            report["configs"][config] = {"error": proc.stderr[-3000:]}
        else:
            report["configs"][config] = json.loads(child_out.read_text())
        report["configs"][config].update(connector_log(proc.stdout, proc.stderr))
        if config.startswith("ours_l3"):
            # What this engine left for the next one: the step samples the restarted
            # engines price recompute with (the decision log shows the estimate only).
            report["configs"][config]["calibration_samples"] = calibration_samples(l3_dir)
        if config == "ours_l3_fill":
            filled = set(unit_files(l3_dir))
        elif config.startswith("ours_l3"):
            # A restart's fresh prompts are never hit again: their units only fill the
            # disk (session 11: five restarts of 6 x 2.4 GB filled a 64 GiB one).
            report["configs"][config]["units_removed"] = remove_units_but(l3_dir, filled)
        print(name, config, json.dumps(report["configs"][config])[:400], flush=True)
        if checkpoint is not None:
            checkpoint(report)
    summarize(report)
    return report


if __name__ == "__main__":
    main()
