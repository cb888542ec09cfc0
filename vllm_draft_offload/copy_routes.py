"""CPU-tier copies as (host page, GPU block) pairs: the pair kernel where it can, else
``CopyEngine``'s descriptors.

Every layer of a KV-cache group moves the same pairs, so a batch is planned per
group, not per layer: the pairs are checked, concatenated and uploaded once
(``UnitCopies.pairs``, ``PairBatch``), and the pair kernel (``pair_kernel.py``)
computes each layer's addresses on the device. Host work per batch is O(pairs); the
descriptor path's per-layer planning cost about 60 ns a page (0.71 x pinned memcpy for
4 KiB loads on an H100, 0.87-0.90 x for the copy alone).

A layer goes to the pair kernel (``route_layers``) when the setting's path lets the
kernel move it: not ``memcpy`` (or no kernel), its pages whole tiles on 16-byte
aligned addresses (fixed per layer, ``fits_kernel``), and under ``auto`` only when
the batch has the rule's count of pages and none of the layer's merged runs (pages
adjacent on both sides, as ``Descriptors.coalesced`` merges them) exceeds the rule's
size: such a layer is what ``plan_layers`` would send whole to the kernel. Any other
layer keeps the descriptor path, which splits it between the kernel's address table
and DMA as before.

Loads are enqueued as launches over runs of the load order's layers (``segments``):
the first covers about ``first_piece_descriptors`` pages, each next one twice as many
up to ``piece_descriptors``. Planning no longer needs hiding (it is done before the
first launch, O(pairs)); the cut is kept for the forward: a layer's event is recorded
after the launch that moves it, so ``wait_for_layer_load`` of the first layers waits
for a small launch, not the whole batch. A launch costs the host tens of
microseconds, so the few a batch takes are cheap. Stores need no per-layer events:
one launch per run of the group's kernel layers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from vllm_draft_offload.config import CopyPath
from vllm_draft_offload.copy_paths import CopyEngine
from vllm_draft_offload.metric_defs import Direction
from vllm_draft_offload.page_kernel import ALIGN_BYTES
from vllm_draft_offload.pair_kernel import PairKernel, layer_table, pair_table
from vllm_draft_offload.transfers import Descriptors, LayerRegion, PairBatch, UnitCopies

logger = logging.getLogger(__name__)


def fits_kernel(region: LayerRegion, pool_base: int, unit_bytes: int, tile: int | None) -> bool:
    """Whether every page of the layer, at any slot and block, is whole tiles starting
    16-byte aligned on both sides (``kernel_can_move`` for all its copies at once)."""
    if tile is None:
        return False
    ends = pool_base | unit_bytes | region.slot.offset | region.slot.page_bytes
    ends |= region.device_base | region.device_block_stride
    return ends % ALIGN_BYTES == 0 and region.slot.page_bytes % tile == 0


def longest_runs(pages: np.ndarray, blocks: np.ndarray, pages_per_unit: int) -> tuple[int, int]:
    """Longest runs of pairs whose host pages and GPU blocks both follow the previous
    pair's: (within a unit, across units too). A layer whose GPU blocks are adjacent
    (stride == page) merges the first kind; the second only when it fills its unit."""
    if len(pages) == 0:
        return 0, 0
    follows = (pages[1:] == pages[:-1] + 1) & (blocks[1:] == blocks[:-1] + 1)
    same_unit = follows & (pages[1:] % pages_per_unit != 0)
    return _longest(same_unit), _longest(follows)


def _longest(follows: np.ndarray) -> int:
    if not follows.any():
        return 1
    breaks = np.flatnonzero(np.concatenate(([True], ~follows, [True])))
    return int(np.diff(breaks).max())


def route_layers(
    copier: PairCopier, batch: PairBatch, direction: Direction, path: CopyPath | None = None
) -> list[bool]:
    """Per region: True when the pair kernel moves the whole layer (module docstring).
    ``path``: this batch's path instead of the engine's (``decode_stores_dma``)."""
    engine = copier.engine
    regions = copier.copies.regions
    path = engine.path_for(path)
    if path == "memcpy" or copier.kernel is None:
        return [False] * len(regions)
    picks = list(copier.fits)
    if path == "kernel":
        return picks
    rule = engine.rules[direction]
    count = sum(
        len(batch.host_pages[r.group_index]) for r, p in zip(regions, picks, strict=True) if p
    )
    if count < rule.min_count:
        return [False] * len(regions)
    runs = [
        longest_runs(pages, blocks, per_unit)
        for pages, blocks, per_unit in zip(
            batch.host_pages, batch.gpu_blocks, copier.copies.group_pages_per_unit, strict=True
        )
    ]
    for i, region in enumerate(regions):
        page = region.slot.page_bytes
        within, across = runs[region.group_index]
        merged = 1
        if region.device_block_stride == page:
            merged = across if region.slot.nbytes == copier.copies.pool.unit_bytes else within
        picks[i] = picks[i] and merged * page <= rule.max_bytes
    return picks


class PairCopier:
    """A worker's CPU-tier copies from pairs: ``run_layers`` for loads (an event per
    layer), ``run`` for stores; the layers the pair kernel does not take go through
    ``engine`` as descriptors."""

    def __init__(self, copies: UnitCopies, engine: CopyEngine) -> None:
        self.copies = copies
        self.engine = engine
        pool = copies.pool
        self.fits = [
            fits_kernel(r, pool.base, pool.unit_bytes, engine.tile) for r in copies.regions
        ]
        # Table rows: each group's layers together, in region order within the group.
        self._row: dict[int, int] = {}
        rows: list[int] = []
        for layer_ids in copies.group_rows:
            for i in layer_ids:
                self._row[i] = len(rows)
                rows.append(i)
        self._layer_of_row = rows
        self.kernel: PairKernel | None = None
        if engine.kernel is not None and any(self.fits):
            assert engine.tile is not None
            tables = [
                layer_table(
                    [
                        (r.device_base, r.device_block_stride, r.slot.offset, r.slot.page_bytes)
                        if self.fits[i]
                        else (0, 0, 0, engine.tile)  # never launched: any whole tile
                        for i, r in ((i, copies.regions[i]) for i in ids)
                    ],
                    engine.tile,
                )
                for ids in copies.group_rows
            ]
            self.kernel = PairKernel(
                np.concatenate(tables),
                engine.tile,
                engine.on_device,
                engine.kernel.programs,
                engine.kernel.rows * engine.kernel.tile,
                engine.kernel.warps,
            )
            if engine.on_device:
                try:  # compile now, not on the first hit; a broken build must not stop serving
                    self.kernel.warm_up()
                except Exception as exc:
                    logger.warning(
                        "DraftOffloadConnector: the pair kernel failed to build (%r): "
                        "copies use the descriptor path",
                        exc,
                    )
                    self.kernel = None

    @property
    def moves_every_layer(self) -> bool:
        """Whether the pair kernel is here and can move every layer (none left to the
        descriptor path whatever the route)."""
        return self.kernel is not None and all(self.fits)

    def batch_bytes(self, batch: PairBatch) -> tuple[int, int]:
        """(all bytes, draft layers' bytes) of a batch."""
        total = draft = 0
        for region in self.copies.regions:
            size = region.slot.page_bytes * len(batch.host_pages[region.group_index])
            total += size
            draft += size if region.slot.is_draft else 0
        return total, draft

    def run(
        self,
        batch: PairBatch,
        direction: Direction,
        stream: torch.cuda.Stream | None,
        path: CopyPath | None = None,
        host_base: int | None = None,
    ) -> list[torch.Tensor]:
        """Copy every layer of a batch (a store): enqueued on ``stream``, or done now
        (None: CPU), by ``path`` if given, else the engine's. ``host_base``: where slot 0
        of the batch's host pages is, instead of the CPU tier's (the staged path's GPU
        buffer, staged_stores.py; its pages must all go to the kernel). Returns the
        tensors to keep alive until the stream passes."""
        order = self._layer_of_row  # table order: one launch per group
        keepalive, picks, pairs = self._start(batch, direction, stream, path, host_base)
        if host_base is not None and not all(picks):
            raise ValueError("a batch into another buffer must go to the pair kernel whole")
        legacy = [i for i in range(len(order)) if not picks[i]]
        if legacy:
            descs = self._descriptors(batch, legacy, direction)
            keepalive += self.engine.run(Descriptors.concat(descs), direction, stream, path)
        for segment in self._segments(batch, order, picks, piece=None):
            self._launch(pairs, batch, segment, direction, stream)
        return keepalive

    def run_layers(
        self,
        batch: PairBatch,
        order: Sequence[int],
        direction: Direction,
        stream: torch.cuda.Stream | None,
    ) -> tuple[list[torch.Tensor], list[torch.cuda.Event | None]]:
        """Copy the layers ``order`` names (region indices), in that order; returns the
        tensors to keep alive and, per entry of ``order``, an event recorded after its
        bytes are in place (None on CPU: already done)."""
        keepalive, picks, pairs = self._start(batch, direction, stream)
        events: list[torch.cuda.Event | None] = [None] * len(order)
        position = {layer: k for k, layer in enumerate(order)}
        legacy = [i for i in order if not picks[i]]
        if legacy:
            # The descriptor path first: its planning then overlaps the launches' copies.
            descs = self._descriptors(batch, legacy, direction)
            held, legacy_events = self.engine.run_layers(descs, direction, stream)
            keepalive += held
            for layer, event in zip(legacy, legacy_events, strict=True):
                events[position[layer]] = event
        piece = self.engine.first_piece_descriptors
        for segment in self._segments(batch, order, picks, piece):
            self._launch(pairs, batch, segment, direction, stream)
            if stream is not None:
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
                _, first, count = segment
                for row in range(first, first + count):
                    events[position[self._layer_of_row[row]]] = event
        return keepalive, events

    def _segments(
        self, batch: PairBatch, order: Sequence[int], picks: list[bool], piece: int | None
    ) -> list[tuple[int, int, int]]:
        """Launches as (group, first table row, rows): runs of ``order``'s kernel layers
        on adjacent rows of one group, cut (when ``piece``) after about ``piece`` pages,
        then twice as many each time up to ``piece_descriptors``."""
        segments: list[tuple[int, int, int]] = []
        held, target, cut = 0, piece or 0, True
        for layer in order:
            if not picks[layer]:
                continue
            group, row = self.copies.regions[layer].group_index, self._row[layer]
            if not cut and segments[-1][0] == group and sum(segments[-1][1:]) == row:
                segments[-1] = (group, segments[-1][1], segments[-1][2] + 1)
            else:
                segments.append((group, row, 1))
            cut = False
            if piece is not None:
                held += len(batch.host_pages[group])
                if held >= target:
                    held, cut = 0, True
                    target = min(2 * target, self.engine.piece_descriptors)
        return segments

    def _launch(
        self,
        pairs: list[torch.Tensor],
        batch: PairBatch,
        segment: tuple[int, int, int],
        direction: Direction,
        stream: torch.cuda.Stream | None,
    ) -> None:
        assert self.kernel is not None
        group, first, count = segment
        n_pairs = len(batch.host_pages[group])
        self.kernel.copy(pairs[group], 0, n_pairs, first, count, direction == "store", stream)

    def _descriptors(
        self, batch: PairBatch, layers: list[int], direction: Direction
    ) -> list[Descriptors]:
        """The descriptor path's batches of ``layers`` (region indices), in that order."""
        every = self.copies.layers(batch.host_pages, batch.gpu_blocks, direction == "store")
        return [every[i] for i in layers]

    def _start(
        self,
        batch: PairBatch,
        direction: Direction,
        stream: torch.cuda.Stream | None,
        path: CopyPath | None = None,
        host_base: int | None = None,
    ) -> tuple[list[torch.Tensor], list[bool], list[torch.Tensor]]:
        """Route the layers; upload every group's pairs (one table each) if any go to
        the pair kernel, their host side from ``host_base`` (None: the CPU tier's)."""
        picks = route_layers(self, batch, direction, path)
        if not any(picks):
            return [], picks, []
        assert self.kernel is not None
        keepalive: list[torch.Tensor] = []
        pairs: list[torch.Tensor] = []
        pool = self.copies.pool
        base = pool.base if host_base is None else host_base
        for pages, blocks, per_unit in zip(
            batch.host_pages, batch.gpu_blocks, self.copies.group_pages_per_unit, strict=True
        ):
            slots, page_in_unit = np.divmod(pages, per_unit)
            held = self.kernel.upload(
                pair_table(base + slots * pool.unit_bytes, page_in_unit, blocks), stream
            )
            if stream is not None:  # on CPU the copies are done on return
                keepalive += held
            pairs.append(held[-1])
        return keepalive, picks, pairs
