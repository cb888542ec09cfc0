"""The ``copy-speed`` rig: the pool, device buffer and batches it times, and the limit.

``Rig`` holds a page-locked host pool (a ``HostPool``, as the connector's) and a device
tensor of twice its size, reused for every page size. A batch's pages are every other
device block in random order (``scattered_blocks``, ``scattered_pages``), so no two
pages merge into one copy. ``Rig.run`` times one batch
with CUDA events on a side stream (wall time on CPU): as a hit meets it, or held (the
stream spins until the host has enqueued everything) to time the copy alone;
``Rig.bit_exact`` checks one pass page by page.

``LayerBatch`` is one page size's batch as the connector's worker issues it, split
between N layers (``Rig.layer_regions``): each layer ``1/N`` of the pages, all at the
SAME scattered block ids (a step's blocks are every layer's), the pool's one unit
holding the layers' pages one layer after the other (``geometry.build_unit_layout``'s
layout), the device buffer cut into N layer regions of twice as many blocks (vLLM's
tensor per layer). Its job's (host page, GPU block) lists are checked into a
``PairBatch`` by ``UnitCopies.pairs`` (``build``, the worker's host work before its
entry point) and copied by ``PairCopier``: loads of several layers by ``run_layers``
(every layer, launches cut into segments with an event each, as in ``start_load_kv``),
stores and one layer by ``run`` (one launch of every layer).

``pinned_memcpy_gbps`` is the limit a copy is measured against (a pinned ``copy_`` of
the same number of bytes in one piece; ``restore-speed``'s too), ``host_memcpy_gbps``
its stand-in on a CPU dry run (one memmove).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch

from vllm_draft_offload.copy_paths import CopyEngine, plan_layers
from vllm_draft_offload.copy_routes import PairCopier, route_layers
from vllm_draft_offload.geometry import LayerSlot
from vllm_draft_offload.metric_defs import Direction
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    PairBatch,
    UnitCopies,
)

DIRECTIONS: tuple[Direction, ...] = ("load", "store")
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


def host_memcpy_gbps(nbytes: int, reps: int) -> float:
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
