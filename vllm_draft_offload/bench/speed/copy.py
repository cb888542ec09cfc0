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
each layer ``1/N`` of the pages, all at the SAME scattered block ids (a step's blocks
are every layer's), the pool's one unit holding the layers' pages one layer after the
other (``geometry.build_unit_layout``'s layout), the device buffer cut into N layer
regions of twice as many blocks (vLLM's tensor per layer). Copies run through the
worker's entry points: its pairs checked by ``UnitCopies.pairs``, loads of several
layers by ``PairCopier.run_layers`` (every layer, launches cut into segments with an
event each, as in ``start_load_kv``), stores by ``PairCopier.run`` (one launch of
every layer). One layer (the default) runs as copy-speed always ran: ``run`` both
ways.

The worker checks the job's (host page, GPU block) lists into a ``PairBatch`` before it
calls the entry point, and that host work is not pipelined with any copy, so each row
also times it (``host_build_ms``) and the batch from the lists on
(``GBps_from_pairs``, ``vs_pinned_memcpy_from_pairs``): the planning-included figure of
a real step, comparable with the descriptor path's (which builds every layer's
descriptors there).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.copy_paths import CopyEngine, plan_layers
from vllm_draft_offload.copy_routes import PairCopier, route_layers
from vllm_draft_offload.copy_rules import (
    RULES_FILE,
    AutoRule,
    auto_rules,
    rule_source,
    rules_from_rows,
    write_rules,
)
from vllm_draft_offload.geometry import LayerSlot
from vllm_draft_offload.metric_defs import Direction
from vllm_draft_offload.page_kernel import BLOCK_BYTES, DEFAULT_PROGRAMS, NUM_WARPS
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    PairBatch,
    UnitCopies,
)

EXAMPLES = """examples:
  vllm-draft-offload copy-speed --out $OUT/copy_speed.json
  vllm-draft-offload copy-speed --pages-kib 4,8,32 --total-mib 64 --reps 3 --out /tmp/c.json
  vllm-draft-offload copy-speed --write-rules --out $OUT/copy_speed.json
  vllm-draft-offload copy-speed --kernel-programs 64 --paths kernel --out /tmp/k64.json
  vllm-draft-offload copy-speed --layers 16 --pages-kib 2,4,8,16 --out $OUT/copy_l16.json
  vllm-draft-offload copy-speed --dry-run-cpu --total-mib 4 --out /tmp/copy_cpu.json
"""
SETTINGS = ("memcpy", "kernel", "auto")
DIRECTIONS: tuple[Direction, ...] = ("load", "store")
GOAL_FROM_BYTES = 4096
# A held batch's stream spins (torch.cuda._sleep) twice the host's slowest enqueue of
# the same batch plus this, so the host is done before the GPU reaches the batch.
HOLD_MARGIN_S = 0.005
# What a timed batch enqueues on the stream it is given (None: CPU, done on return);
# returns the tensors to keep alive until the stream passes.
Enqueue = Callable[[torch.cuda.Stream | None], list[torch.Tensor]]


def pinned_memcpy_gbps(nbytes: int, to_device: bool, reps: int = 5) -> float:
    """Best of ``reps`` one-piece copies between a pinned host tensor and the GPU."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst, src = (device, host) if to_device else (host, device)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 0.0
    for _ in range(reps):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, nbytes / (start.elapsed_time(end) / 1000) / 1e9)
    return best


def _host_memcpy_gbps(nbytes: int, reps: int) -> float:
    """The CPU dry run's stand-in for the limit: one memmove of the same size."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # warm-up: pages faulted in
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, nbytes / max(time.perf_counter() - start, 1e-9) / 1e9)
    return best


def scattered_blocks(count: int, seed: int) -> np.ndarray:
    """Every other block of ``2 * count`` in random order (no two ever adjacent, so no
    pages merge; odd ones, as block 0 is vLLM's null block, which the connector never
    copies and ``UnitCopies`` refuses)."""
    return 2 * np.random.default_rng(seed).permutation(count).astype(np.int64) + 1


def scattered_pages(
    host_base: int, device_base: int, page_bytes: int, count: int, seed: int
) -> tuple[np.ndarray, Descriptors, Descriptors]:
    """``count`` host pages back to back, paired with ``scattered_blocks``: (blocks,
    load descriptors, store descriptors) of one layer."""
    blocks = scattered_blocks(count, seed)
    host = host_base + np.arange(count, dtype=np.int64) * page_bytes
    device = device_base + blocks * page_bytes
    sizes = np.full(count, page_bytes, dtype=np.int64)
    return blocks, Descriptors(host, device, sizes), Descriptors(device, host, sizes)


class Rig:
    """A host pool and a device tensor twice its size, reused for every page size and
    cut into as many layers as asked (``layer_regions``)."""

    def __init__(self, total_bytes: int, on_device: bool) -> None:
        self.on_device = on_device
        self.total = total_bytes
        self.pool = HostPool(1, total_bytes, pin=on_device)
        where = "cuda" if on_device else "cpu"
        self.device = torch.empty(2 * total_bytes, dtype=torch.uint8, device=where)
        self.stream = torch.cuda.Stream() if on_device else None
        self._source = torch.from_numpy(
            np.random.default_rng(0).integers(0, 256, total_bytes, dtype=np.uint8)
        )

    def close(self) -> None:
        self.pool.close()

    def layer_regions(self, page: int, layers: int) -> list[LayerRegion]:
        """``layers`` layers of one KV-cache group, ``total // page // layers`` pages
        each: in the pool's one unit each layer's pages back to back after the previous
        layer's (the connector's unit layout), on the device each layer a region of
        twice as many blocks at its own base (vLLM's tensor per layer)."""
        per_layer = self.total // page // layers
        return [
            LayerRegion(
                slot=LayerSlot(
                    f"copy-speed.{layer}",
                    0,
                    page,
                    layer * per_layer * page,
                    per_layer * page,
                    is_draft=False,
                ),
                group_index=0,
                pages_per_unit=per_layer,
                device_base=self.device.data_ptr() + layer * 2 * per_layer * page,
                device_block_stride=page,
                num_blocks=2 * per_layer,
            )
            for layer in range(layers)
        ]

    def run(self, enqueue: Enqueue, hold_s: float = 0.0) -> tuple[float | None, float]:
        """(seconds, host seconds) of one batch. Seconds: GPU time between events on
        the side stream, or wall time on CPU. Without a hold the GPU waits for the
        host's planning (splits, tile tables), which then counts, as it does for a
        hit. With ``hold_s`` the stream first spins that long, so the events time the
        copy alone; seconds are None when the spin ended before the host had enqueued
        the batch (the time would include the host's)."""
        if self.stream is None:
            start = time.perf_counter()
            enqueue(None)
            seconds = time.perf_counter() - start
            return seconds, seconds
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold_s > 0:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(int(hold_s * self.spin_cycles_per_s()))
        begin.record(self.stream)
        started = time.perf_counter()
        keepalive = enqueue(self.stream)
        host = time.perf_counter() - started
        covered = hold_s <= 0 or not begin.query()
        end.record(self.stream)
        end.synchronize()
        del keepalive
        return (begin.elapsed_time(end) / 1000 if covered else None), host

    @functools.cache  # noqa: B019 - one rig per run
    def spin_cycles_per_s(self) -> float:
        """torch.cuda._sleep's cycles per second on this GPU, timed once."""
        cycles = 20_000_000
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(cycles)  # warm-up
            begin.record()
            torch.cuda._sleep(cycles)
            end.record()
        end.synchronize()
        return cycles / (begin.elapsed_time(end) / 1000)

    def bit_exact(
        self,
        enqueue: Enqueue,
        direction: str,
        blocks: np.ndarray,
        page: int,
        layers: int = 1,
    ) -> bool:
        """One pass from known bytes into zeroed destinations, compared page by page in
        every layer (``layer_regions``' layout, ``blocks`` in each): a load's device
        pages equal the host's and its other blocks stay zero, a store's host pages
        equal the source."""
        per_layer = len(blocks)
        count = layers * per_layer
        host = self.pool.buffer[: count * page].view(layers, per_layer, page)
        device = self.device[: 2 * count * page].view(layers, 2 * per_layer, page)
        index = torch.from_numpy(blocks).to(device.device)
        source = self._source[: count * page].view(layers, per_layer, page)
        if direction == "load":
            host.copy_(source)
            device.zero_()
        else:
            device[:, index] = source.to(device.device)
            host.zero_()
        self.run(enqueue)
        untouched = torch.ones(2 * per_layer, dtype=torch.bool, device=device.device)
        untouched[index] = False
        return (
            bool(torch.equal(device[:, index].cpu(), host))
            and bool(torch.equal(host, source))
            and not (direction == "load" and bool(device[:, untouched].any()))
        )


class LayerBatch:
    """One page size's batch as the connector's worker issues it: one job whose (host
    page, GPU block) pairs every one of ``layers`` layers moves (``Rig.layer_regions``),
    checked by ``UnitCopies.pairs`` and copied by the worker's ``PairCopier`` entry
    points (``run``)."""

    def __init__(self, rig: Rig, engine: CopyEngine, page: int, layers: int) -> None:
        self.engine = engine
        self.layers = layers
        per_layer = rig.total // page // layers
        self.num_bytes = layers * per_layer * page
        self.blocks = scattered_blocks(per_layer, seed=page)
        self.copier = PairCopier(UnitCopies(rig.layer_regions(page, layers), rig.pool), engine)
        # The job's pairs as the scheduler's metadata hands them to the worker: Python
        # lists, one per KV-cache group.
        self.host_pages = [list(range(per_layer))]
        self.gpu_blocks = [self.blocks.tolist()]
        self.inputs = {direction: self.build(direction) for direction in DIRECTIONS}

    def build(self, direction: Direction) -> PairBatch:
        """What the worker builds from the job's pairs before its entry point, either
        way (``_valid_loads`` and ``wait_for_save``, then the step's jobs joined)."""
        pairs = self.copier.copies.pairs(self.host_pages, self.gpu_blocks)
        return PairBatch.concat([pairs], len(self.copier.copies.group_rows))

    def run(
        self, pairs: PairBatch, direction: Direction, stream: torch.cuda.Stream | None
    ) -> list[torch.Tensor]:
        """The worker's entry point: ``run_layers`` for loads of several layers (its
        ``_run_loads``, every layer in order), ``run`` for stores and for one layer (as
        copy-speed always ran one layer)."""
        if direction == "load" and self.layers > 1:
            order = list(range(self.layers))
            return self.copier.run_layers(pairs, order, direction, stream)[0]
        return self.copier.run(pairs, direction, stream)

    def run_from_pairs(
        self, direction: Direction, stream: torch.cuda.Stream | None
    ) -> list[torch.Tensor]:
        """``build``, then ``run``: the step's host work from the job's lists on."""
        return self.run(self.build(direction), direction, stream)

    def enqueue(self, direction: Direction, from_pairs: bool = False) -> Enqueue:
        """The batch for ``Rig.run``: from the prebuilt pairs (the entry point's own
        routing, uploads and launches), or ``from_pairs`` (the worker's check as well)."""
        if from_pairs:
            return functools.partial(self.run_from_pairs, direction)
        return functools.partial(self.run, self.inputs[direction], direction)

    def pair_kernel_layers(self, direction: Direction) -> list[bool]:
        """Per layer: whether the pair kernel moves it whole (``route_layers``)."""
        return route_layers(self.copier, self.inputs[direction], direction)

    def kernel_and_memcpy_copies(self, direction: Direction) -> tuple[int, int]:
        """Copies of the whole batch by a kernel (a page each for the pair kernel's
        layers, else the descriptor path's kernel share) and by DMA."""
        picks = self.pair_kernel_layers(direction)
        per_layer = len(self.blocks)
        descs = self.copier.copies.layers(self.host_pages, self.gpu_blocks, direction == "store")
        engine = self.engine
        plans = plan_layers(
            [desc for desc, pick in zip(descs, picks, strict=True) if not pick],
            direction,
            engine.path,
            engine.tile,
            engine.rules,
        )
        return (
            per_layer * sum(picks) + sum(len(plan.kernel.sizes) for plan in plans),
            sum(len(plan.memcpy.sizes) for plan in plans),
        )

    def build_seconds(self, direction: Direction) -> float:
        """Host seconds of one ``build``."""
        started = time.perf_counter()
        self.build(direction)
        return time.perf_counter() - started


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
            "load": pinned_memcpy_gbps(total, True) if on_device else _host_memcpy_gbps(total, 3),
            "store": pinned_memcpy_gbps(total, False) if on_device else _host_memcpy_gbps(total, 3),
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
