"""GB/s of the connector's copies by page size, per copy path, against pinned memcpy.

    vllm-draft-offload copy-speed --out $OUT/copy_speed.json [--pages-kib 2,4,8,...]

For each page size, ``--total-mib`` of pages move between a page-locked host pool
(registered like the connector's, with vLLM's ``host_register``) and every other
device block of twice as many, in random order, so no two pages merge into one copy: the
worst case for DMA, and what small models and drafters meet once the GPU's free-block
queue is shuffled. Each batch runs the way the connector runs a CPU-tier copy: as
(host page, GPU block) pairs through its ``PairCopier`` (the pair kernel, or
``CopyEngine``'s descriptors where ``route_layers`` says so), with
``copy_path`` ``memcpy``, ``kernel`` and ``auto``, loads (host -> device) and stores
(device -> host), timed with CUDA events on a side stream, best of ``--reps``; every
path's bytes are checked bit for bit after its first pass. The limit is a pinned
``copy_`` of the same number of bytes in one piece, each direction, in the same run.
The pool, the device buffer and the batches are ``copy_rig``'s (``Rig``,
``LayerBatch``); this module runs them and writes the report.

``memcpy`` and ``kernel`` run first, for every page size; ``auto``'s table is then
derived from them (``copy_rules.rules_from_rows``: per direction, the largest page
size up to which the kernel was at least as fast as DMA at every size) and ``auto``
runs with it, so its rows show the measured chooser (``auto_rules``, with its source;
the shipped table when ``memcpy`` or ``kernel`` did not run). ``--write-rules`` stores
the derived entry under this GPU's name in the table ``auto`` reads at start
(``vllm_draft_offload/copy_rules.json`` by default). ``--kernel-programs`` sets the
kernel's grid (programs in flight).

Each batch is timed twice per rep: as a hit meets it (the GPU waits while the host
plans the split and the kernel's tile table: ``GBps``, ``vs_pinned_memcpy``,
``host_enqueue_ms``) and the copy alone (the stream spins until the host has enqueued
everything: ``device_GBps``, ``device_vs_pinned_memcpy``), so a shortfall is placed on
the host or on the copy. ``--kernel-block-kib`` and ``--kernel-warps`` try other
kernel shapes (``scripts/gpu/copy_sweep.sh`` sweeps them).

``summary.<direction>.auto_min_vs_pinned_from_4KiB`` is the issue's goal (>= 0.8);
``kernel_faster_up_to_bytes`` is the largest page size where the kernel beat DMA.
``--dry-run-cpu`` runs the same code on CPU tensors (the DMA share as memmove, the
kernel's share through its CPU fallback; no timing worth reading).

``--layers N`` splits the same bytes between N layers, the shape the connector moves:
each layer ``1/N`` of the pages, all at the SAME scattered block ids, each layer its
own host and device region (``copy_rig.LayerBatch`` has the layout). Copies run
through the worker's entry points: loads of several layers by
``PairCopier.run_layers`` (launches cut into segments with an event each, as in
``start_load_kv``), stores by ``PairCopier.run`` (one launch of every layer). One
layer (the default) runs as copy-speed always ran: ``run`` both ways.

The worker checks the job's (host page, GPU block) lists into a ``PairBatch`` before it
calls the entry point, and that host work is not pipelined with any copy, so each row
also times it (``host_build_ms``) and the batch from the lists on
(``GBps_from_pairs``, ``vs_pinned_memcpy_from_pairs``): the planning-included figure of
a real step, comparable with the descriptor path's (which builds every layer's
descriptors there).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.speed.copy_rig import (
    DIRECTIONS,
    LayerBatch,
    Rig,
    host_memcpy_gbps,
    pinned_memcpy_gbps,
)
from vllm_draft_offload.copy_paths import CopyEngine
from vllm_draft_offload.copy_rules import (
    RULES_FILE,
    AutoRule,
    auto_rules,
    rule_source,
    rules_from_rows,
    write_rules,
)
from vllm_draft_offload.metric_defs import Direction
from vllm_draft_offload.page_kernel import BLOCK_BYTES, DEFAULT_PROGRAMS, NUM_WARPS

EXAMPLES = """examples:
  vllm-draft-offload copy-speed --out $OUT/copy_speed.json
  vllm-draft-offload copy-speed --pages-kib 4,8,32 --total-mib 64 --reps 3 --out /tmp/c.json
  vllm-draft-offload copy-speed --write-rules --out $OUT/copy_speed.json
  vllm-draft-offload copy-speed --kernel-programs 64 --paths kernel --out /tmp/k64.json
  vllm-draft-offload copy-speed --layers 16 --pages-kib 2,4,8,16 --out $OUT/copy_l16.json
  vllm-draft-offload copy-speed --dry-run-cpu --total-mib 4 --out /tmp/copy_cpu.json
"""
SETTINGS = ("memcpy", "kernel", "auto")
GOAL_FROM_BYTES = 4096
# A held batch's stream spins (torch.cuda._sleep) twice the host's slowest enqueue of
# the same batch plus this, so the host is done before the GPU reaches the batch.
HOLD_MARGIN_S = 0.005


def measure(args: Any) -> dict[str, Any]:
    on_device = torch.cuda.is_available() and not args.dry_run_cpu
    total = int(args.total_mib * 2**20)
    gpu = torch.cuda.get_device_name() if on_device else None
    report: dict[str, Any] = {
        "gpu": gpu or "cpu (dry run)",
        "on_device": on_device,
        "torch": torch.__version__,
        "total_bytes": total,
        "layers": args.layers,
        "reps": args.reps,
        "kernel_programs": args.kernel_programs,
        "kernel_block_bytes": args.kernel_block_kib * 1024,
        "kernel_warps": args.kernel_warps,
        "pinned_memcpy_GBps": {
            "load": pinned_memcpy_gbps(total, True) if on_device else host_memcpy_gbps(total, 3),
            "store": pinned_memcpy_gbps(total, False) if on_device else host_memcpy_gbps(total, 3),
        },
        "rows": [],
    }
    rig = Rig(total, on_device)
    try:
        forced = [setting for setting in args.paths if setting != "auto"]
        for kib in args.pages_kib:
            for setting in forced:
                measure_page(args, rig, report, kib, setting, None)
        rules, source = auto_rules(gpu), f"table: {rule_source(gpu)}"
        if {"memcpy", "kernel"} <= set(forced):
            rules, source = rules_from_rows(report["rows"]), "derived from this run"
        report["auto_rules"] = {d: rule.to_dict() for d, rule in rules.items()}
        report["auto_rules_source"] = source
        if "auto" in args.paths:
            for kib in args.pages_kib:
                measure_page(args, rig, report, kib, "auto", rules)
    finally:
        rig.close()
    summarize(report)
    return report


def measure_page(
    args: Any,
    rig: Rig,
    report: dict[str, Any],
    kib: float,
    setting: str,
    rules: dict[Direction, AutoRule] | None,
) -> None:
    """Loads and stores of one page size by one setting: a row each."""
    page = int(kib * 1024)
    engine = CopyEngine(
        setting,  # type: ignore[arg-type]
        rig.pool,
        [page],
        rig.on_device,
        programs=args.kernel_programs,
        rules=rules,
        kernel_block_bytes=args.kernel_block_kib * 1024,
        kernel_warps=args.kernel_warps,
    )
    batch = LayerBatch(rig, engine, page, args.layers)
    for direction in DIRECTIONS:
        kernel_copies, memcpy_copies = batch.kernel_and_memcpy_copies(direction)
        enqueue = batch.enqueue(direction)
        exact = rig.bit_exact(enqueue, direction, batch.blocks, page, batch.layers)
        timed = [rig.run(enqueue) for _ in range(args.reps)]
        hold_s = 2 * max(host for _, host in timed) + HOLD_MARGIN_S
        held = [rig.run(enqueue, hold_s)[0] for _ in range(args.reps)]
        from_pairs = [
            rig.run(batch.enqueue(direction, from_pairs=True))[0] for _ in range(args.reps)
        ]
        builds = [batch.build_seconds(direction) for _ in range(args.reps)]
        gbps = [batch.num_bytes / s / 1e9 for s, _ in timed if s]
        covered = [batch.num_bytes / s / 1e9 for s in held if s]
        device_gbps = max(covered) if covered else None
        pairs_all = [batch.num_bytes / s / 1e9 for s in from_pairs if s]
        pairs_gbps = max(pairs_all)
        limit = report["pinned_memcpy_GBps"][direction]
        row = {
            "page_bytes": page,
            "layers": args.layers,
            "direction": direction,
            "setting": setting,
            "path": engine.path if rig.on_device else f"{engine.path} (cpu)",
            # The pair kernel moves every page of every layer (no address table), else
            # the descriptor path's split; the layers here share one shape, so all or none.
            "pair_kernel": all(batch.pair_kernel_layers(direction)),
            "kernel_copies": kernel_copies,
            "memcpy_copies": memcpy_copies,
            "GBps": max(gbps),
            "GBps_median": statistics.median(gbps),
            "vs_pinned_memcpy": max(gbps) / limit,
            # The copy alone, the host's planning enqueued before the GPU reached it.
            "device_GBps": device_gbps,
            "device_vs_pinned_memcpy": device_gbps / limit if device_gbps else None,
            "held_reps_covered": len(covered),
            "host_enqueue_ms": 1e3 * statistics.median(host for _, host in timed),
            # The worker's host work before its entry point (descriptors or pairs from
            # the job's lists), then the batch timed from those lists on: a real step.
            "host_build_ms": 1e3 * statistics.median(builds),
            "GBps_from_pairs": pairs_gbps,
            "vs_pinned_memcpy_from_pairs": pairs_gbps / limit,
            # The median rep as well: a best of many reps flatters a noisy host.
            "vs_pinned_memcpy_from_pairs_median": statistics.median(pairs_all) / limit,
            "bit_exact": exact,
        }
        report["rows"].append(row)
        print(
            f"{page // 1024:>5} KiB x{args.layers:<3} {direction:5} {setting:6} -> "
            f"{row['kernel_copies']:>6} kernel {row['memcpy_copies']:>6} memcpy  "
            f"{row['GBps']:7.2f} GB/s  {row['vs_pinned_memcpy']:.2f} x pinned  "
            f"(copy alone {row['device_vs_pinned_memcpy'] or 0:.2f} x, host "
            f"{row['host_enqueue_ms']:.2f} ms; from pairs "
            f"{row['vs_pinned_memcpy_from_pairs']:.2f} x, build {row['host_build_ms']:.2f} ms)"
            f"  exact={exact}",
            flush=True,
        )


def _worst_from_goal(rows: list[dict[str, Any]], setting: str, key: str) -> float | None:
    """The lowest ``key`` of ``setting``'s rows of pages from 4 KiB up, or None."""
    ratios = [
        row[key]
        for row in rows
        if row["setting"] == setting
        and row["page_bytes"] >= GOAL_FROM_BYTES
        and row[key] is not None
    ]
    return min(ratios) if ratios else None


def summarize(report: dict[str, Any]) -> None:
    """Per direction: the worst ``auto`` ratio from 4 KiB pages up, and where the
    kernel stops beating DMA."""
    rows = report["rows"]
    summary: dict[str, Any] = {
        "all_bit_exact": all(row["bit_exact"] for row in rows),
    }
    for direction in DIRECTIONS:
        mine = [row for row in rows if row["direction"] == direction]
        by = {(row["setting"], row["page_bytes"]): row for row in mine}
        auto = _worst_from_goal(mine, "auto", "vs_pinned_memcpy")
        faster = [
            page
            for (setting, page), row in by.items()
            if setting == "kernel"
            and ("memcpy", page) in by
            and row["GBps"] > by[("memcpy", page)]["GBps"]
        ]
        summary[direction] = {
            "auto_min_vs_pinned_from_4KiB": auto,
            # Only a GPU run says anything about the goal.
            "goal_0.8_met": auto is not None and auto >= 0.8 if report["on_device"] else None,
            # The same, the copies alone (host planning enqueued ahead): what planning costs.
            "auto_device_min_vs_pinned_from_4KiB": _worst_from_goal(
                mine, "auto", "device_vs_pinned_memcpy"
            ),
            # The same, the worker's build of the batch from the job's lists included.
            "auto_from_pairs_min_vs_pinned_from_4KiB": _worst_from_goal(
                mine, "auto", "vs_pinned_memcpy_from_pairs"
            ),
            "kernel_device_min_vs_pinned_from_4KiB": _worst_from_goal(
                mine, "kernel", "device_vs_pinned_memcpy"
            ),
            "kernel_faster_up_to_bytes": max(faster) if faster else None,
            "vs_pinned_by_page": {
                str(page): {
                    setting: by[(setting, page)]["vs_pinned_memcpy"]
                    for setting in SETTINGS
                    if (setting, page) in by
                }
                for page in sorted({row["page_bytes"] for row in mine})
            },
        }
    report["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)


def measured_by(args: Any, report: dict[str, Any]) -> str:
    """The table entry's provenance: when, which run, which kernel grid."""
    when = time.strftime("%Y-%m-%d")
    layers = f" over {args.layers} layers" if args.layers > 1 else ""
    return (
        f"copy-speed {when} (torch {report['torch']}, {args.kernel_programs} kernel programs "
        f"of {args.kernel_block_kib} KiB and {args.kernel_warps} warps, "
        f"{report['total_bytes'] >> 20} MiB batches{layers}, best of {args.reps}): "
        f"{Path(args.out).name}"
    )


def layers_uneven(args: Any) -> str | None:
    """Why ``--layers`` cannot split every page size's batch evenly, or None."""
    if args.layers < 1:
        return "--layers: at least 1"
    total = int(args.total_mib * 2**20)
    counts = {kib: total // int(kib * 1024) for kib in args.pages_kib}
    uneven = [
        f"{kib:g} KiB: {count} pages"
        for kib, count in counts.items()
        if count % args.layers or count < args.layers
    ]
    if uneven:
        return (
            f"--layers: {args.layers} layers do not split the --total-mib {args.total_mib:g} "
            f"batch of every page size evenly ({', '.join(uneven)})"
        )
    return None


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("copy-speed", __doc__, EXAMPLES)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--pages-kib",
        default="2,4,8,16,24,32,48,64,256,1024",
        type=lambda text: [float(v) for v in text.split(",")],
        help="page sizes in KiB (default: 2 to 1024)",
    )
    parser.add_argument("--total-mib", type=float, default=256, help="bytes per batch")
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers the batch's bytes are split between, all at the same block ids "
        "(default 1; the page count of every page size must be a multiple)",
    )
    parser.add_argument(
        "--paths",
        default=",".join(SETTINGS),
        type=lambda text: text.split(","),
        help="copy_path settings to run (memcpy, kernel, auto)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--kernel-programs",
        type=int,
        default=DEFAULT_PROGRAMS,
        help=f"the kernel's programs in flight (default {DEFAULT_PROGRAMS}, the connector's)",
    )
    parser.add_argument(
        "--kernel-block-kib",
        type=int,
        default=BLOCK_BYTES // 1024,
        help=f"KiB one kernel program moves per iteration (default {BLOCK_BYTES // 1024})",
    )
    parser.add_argument(
        "--kernel-warps",
        type=int,
        default=NUM_WARPS,
        help=f"warps per kernel program (default {NUM_WARPS})",
    )
    parser.add_argument(
        "--write-rules",
        nargs="?",
        const=str(RULES_FILE),
        metavar="PATH",
        help="store the auto table derived from this run under this GPU's name "
        f"(default file: {RULES_FILE.name} in the package)",
    )
    parser.add_argument("--dry-run-cpu", action="store_true", help="CPU tensors (no GPU)")
    args = parser.parse_args(argv)
    unknown = set(args.paths) - set(SETTINGS)
    if unknown:
        parser.error(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(SETTINGS)}")
    if args.kernel_programs < 1:
        parser.error("--kernel-programs: at least 1")
    uneven = layers_uneven(args)
    if uneven:
        parser.error(uneven)
    if args.kernel_block_kib < 16 or args.kernel_block_kib & (args.kernel_block_kib - 1):
        parser.error("--kernel-block-kib: a power of two of at least 16")
    if args.kernel_warps < 1 or args.kernel_warps & (args.kernel_warps - 1):
        parser.error("--kernel-warps: a power of two")
    if args.write_rules and (args.dry_run_cpu or not {"memcpy", "kernel"} <= set(args.paths)):
        parser.error("--write-rules: needs a GPU run of both memcpy and kernel (not --dry-run-cpu)")
    report = measure(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if args.write_rules:
        rules = rules_from_rows(report["rows"])
        write_rules(report["gpu"], rules, measured_by(args, report), Path(args.write_rules))
        print(f"auto table for {report['gpu']} written to {args.write_rules}", flush=True)


if __name__ == "__main__":
    main()
