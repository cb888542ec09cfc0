"""Stores through a GPU staging buffer (``store_staging_units``; on by default on CUDA).

Before it, each store path cost something at a real shape (8B shape, 64 requests a
batch; H100 and H200). The pair kernel writes the host pages from the SMs, so its programs
likely hold SMs for the whole PCIe transfer, beside the decode steps (decode 0.947 x,
53 pairs). DMA leaves the SMs alone (decode 1.033 x) but lengthened the prefill phase
(1.10-1.13 x), and a decode-built chunk's pages do not merge
(requests decoding in lockstep take their new blocks in turn), so a step storing 64
units hands the driver one copy a page, 36,864 of them at the 8B shape. With decode
steps' stores on DMA, a storing batch's longest ``wait_for_save`` call was 22.6-42.5 ms
(session 31; which steps held it is not recorded).

Staged, the pair kernel gathers each unit's pages into a unit-shaped slot of a GPU
buffer, device memory to device memory, and one DMA a unit then moves that slot,
contiguous, to the unit's host slot: a few launches and one copy call a unit, neither
holding SMs through the transfer nor handing the driver a copy a page. The buffer holds
``units`` slots in two halves, and a batch goes in waves of a half, alternating: on CUDA
the DMA runs on a stream of its own, so a wave's gather (on the store stream) runs while
the previous wave's DMA drains the other half. In session 33 (H200), with one wave at a
time on the store stream, the gather and the DMA ran one after the other and stores
moved 0.80-0.81 x pinned memcpy at the small and 8B shapes (0.94-0.97 x unstaged on an
H100 in session 25): by those figures the gather (HBM to HBM) took about a fifth of the
DMA's time (a quarter if the unit DMA alone runs at pinned memcpy speed). Overlapped
(another machine), in the same session, 0.94-0.95 x. Session 32 (H200, 8B shape, 64
requests, 12 pairs beside the other paths in one run): decode 1.026 x without storing,
the prefill phase 1.002 x, a storing batch's longest decode step 75-79 ms against 73-75
ms without storing (81-216 ms on every other path) and no stall beyond the one every
batch had.

It applies to a batch only where the pair kernel can move every layer and every unit of
the batch is stored whole (each group's every page of it), since the DMA writes the
whole host slot; any other batch takes its usual route. The buffer is GPU memory beyond
what vLLM sized its KV cache from (``units`` x a unit's bytes), so the default
(``staging_units``) stays small: at most ``DEFAULT_STAGING_UNITS`` units and
``DEFAULT_STAGING_BYTES``, and no more than a ``1/STAGING_FREE_SHARE`` of the GPU memory
free when the connector registers the KV cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from vllm_draft_offload.copy_routes import PairCopier
from vllm_draft_offload.transfers import PairBatch

logger = logging.getLogger(__name__)

# The default buffer (store_staging_units unset): the 8 units measured at the 8B shape
# (302 MB; session 32), fewer where a unit is larger, none where not even one fits.
DEFAULT_STAGING_UNITS = 8
DEFAULT_STAGING_BYTES = 512 << 20
# The default takes at most this share of the GPU memory free at registration: CUDA
# graphs are captured after the KV cache, from what vLLM left free.
STAGING_FREE_SHARE = 4


def staging_units(
    setting: int | None,
    copy_path: str,
    on_device: bool,
    kernel_moves_every_layer: bool,
    unit_bytes: int,
    free_bytes: Callable[[], int] | None,
) -> int:
    """The staging buffer's units: ``setting`` when given (0: off), else (the default)
    on CUDA under ``copy_path`` auto where the pair kernel can move every layer, as many
    units as ``DEFAULT_STAGING_UNITS``, ``DEFAULT_STAGING_BYTES`` and a share of the
    GPU memory ``free_bytes()`` reports allow (asked only then; None: no such bound),
    logged when that is none. Off CUDA a buffer is only another host copy, and a forced
    ``copy_path`` is what the user asked for every copy, so the default leaves both
    alone."""
    if setting is not None:
        return setting
    if copy_path != "auto" or not on_device or not kernel_moves_every_layer:
        return 0
    budget = DEFAULT_STAGING_BYTES
    if free_bytes is not None:
        budget = min(budget, free_bytes() // STAGING_FREE_SHARE)
    units = min(DEFAULT_STAGING_UNITS, budget // unit_bytes)
    if not units:
        logger.info(
            "DraftOffloadConnector: stores not staged: a unit of %d B exceeds the default "
            "buffer's %d B (at most %d B and 1/%d of the free GPU memory)",
            unit_bytes,
            budget,
            DEFAULT_STAGING_BYTES,
            STAGING_FREE_SHARE,
        )
    return units


def buffer_regions(units: int) -> list[tuple[int, int]]:
    """The buffer's regions as (first slot, slots): two halves (the first the larger),
    so one wave's gather can fill one while the other drains; one region of one slot."""
    if units < 2:
        return [(0, units)]
    first = (units + 1) // 2
    return [(0, first), (first, units - first)]


def waves(slots: np.ndarray, regions: list[tuple[int, int]]) -> list[tuple[int, np.ndarray]]:
    """A batch's slots as (region, slots) waves, in order, the regions taken in turn,
    each wave as many slots as its region holds (the last: what is left)."""
    out: list[tuple[int, np.ndarray]] = []
    start = 0
    while start < len(slots):
        region = len(out) % len(regions)
        size = regions[region][1]
        out.append((region, slots[start : start + size]))
        start += size
    return out


class StagedStores:
    """A worker's staged store path over its pair copier."""

    def __init__(self, copier: PairCopier, units: int, on_device: bool) -> None:
        self.copier = copier
        self.units = units
        pool = copier.copies.pool
        self.unit_bytes = pool.unit_bytes
        # Zeroed: a slot's bytes between layers (alignment) reach the host slot too.
        device = "cuda" if on_device else "cpu"
        try:
            self.buffer = torch.zeros(units * pool.unit_bytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(
                f"store_staging_units={units} needs {units * pool.unit_bytes} bytes of GPU "
                "memory beyond vLLM's KV cache, which is not free: lower "
                "store_staging_units (0: off) or gpu_memory_utilization"
            ) from exc
        self.base = self.buffer.data_ptr()
        self._per_unit = copier.copies.group_pages_per_unit
        self._regions = buffer_regions(units)
        # On CUDA: the unit DMAs' own stream, and per region an event its last DMA
        # recorded, which the next gather into that region waits for.
        self._dma_stream = torch.cuda.Stream() if on_device else None
        self._region_drained = [torch.cuda.Event() for _ in self._regions] if on_device else []

    def slots(self, batch: PairBatch) -> np.ndarray | None:
        """The host slots a batch stores, ascending, when the staged path can move it:
        the pair kernel takes every layer, and each slot's every page of every group is
        in the batch. None otherwise."""
        if not self.copier.moves_every_layer:
            return None
        slots: np.ndarray | None = None
        for pages, per_unit in zip(batch.host_pages, self._per_unit, strict=True):
            found, counts = np.unique(pages // per_unit, return_counts=True)
            if len(np.unique(pages)) != len(pages) or (counts != per_unit).any():
                return None
            if slots is None:
                slots = found
            elif not np.array_equal(slots, found):
                return None
        return slots if slots is not None and len(slots) else None

    def run(
        self, batch: PairBatch, slots: np.ndarray, stream: torch.cuda.Stream | None
    ) -> list[torch.Tensor]:
        """Store ``batch`` (whose ``slots`` says it can go staged) in waves, one a buffer
        region, alternating: the kernel gathers the wave's units into its region, then
        one copy a unit moves each to its host slot. On ``stream`` the gathers, on the
        worker's DMA stream the copies, each gather after the copies that last drained
        its region; ``stream`` then waits for every copy, so what follows it there (the
        batch's completion event) comes after the whole store. Done now on CPU. Returns
        what to keep alive until ``stream`` passes."""
        keepalive: list[torch.Tensor] = []
        for region, wave in waves(slots, self._regions):
            first = self._regions[region][0]
            if stream is not None:
                stream.wait_event(self._region_drained[region])
            keepalive += self.copier.run(
                self._into_buffer(batch, wave, first), "store", stream, "kernel", self.base
            )
            if stream is None:
                self._copy_out(wave, first)
                continue
            assert self._dma_stream is not None
            self._dma_stream.wait_stream(stream)
            with torch.cuda.stream(self._dma_stream):
                self._copy_out(wave, first)
            self._region_drained[region].record(self._dma_stream)
        if stream is not None:
            assert self._dma_stream is not None
            stream.wait_stream(self._dma_stream)
        return keepalive

    def _copy_out(self, wave: np.ndarray, first: int) -> None:
        """One copy a unit from buffer slot ``first + i`` to the wave's i-th host slot, on
        the current stream (asynchronous on CUDA)."""
        pool = self.copier.copies.pool
        for index, slot in enumerate(wave):
            offset = (first + index) * self.unit_bytes
            staged = self.buffer[offset : offset + self.unit_bytes]
            pool.unit_view(int(slot)).copy_(staged, non_blocking=self._dma_stream is not None)

    def _into_buffer(self, batch: PairBatch, wave: np.ndarray, first: int) -> PairBatch:
        """The wave's pairs with each host page renumbered into the buffer's slots (the
        wave's i-th slot becomes buffer slot ``first + i``)."""
        host_pages, gpu_blocks = [], []
        for pages, blocks, per_unit in zip(
            batch.host_pages, batch.gpu_blocks, self._per_unit, strict=True
        ):
            slot, page_in_unit = np.divmod(pages, per_unit)
            index = np.searchsorted(wave, slot)
            mine = (index < len(wave)) & (wave[np.minimum(index, len(wave) - 1)] == slot)
            host_pages.append((first + index[mine]) * per_unit + page_in_unit[mine])
            gpu_blocks.append(blocks[mine])
        return PairBatch(host_pages, gpu_blocks)
