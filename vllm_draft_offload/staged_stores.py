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
``units`` slots; a larger batch goes in waves on the same stream, so a wave's gather
starts after the previous wave's DMA has drained its slots. Session 32 (H200, 8B shape,
64 requests, 12 pairs beside the other paths in one run): decode 1.026 x without
storing, the prefill phase 1.002 x, a storing batch's longest decode step 75-79 ms
against 73-75 ms without storing (81-216 ms on every other path) and no stall beyond
the one every batch had.

It applies to a batch only where the pair kernel can move every layer and every unit of
the batch is stored whole (each group's every page of it), since the DMA writes the
whole host slot; any other batch takes its usual route. The buffer is GPU memory beyond
what vLLM sized its KV cache from (``units`` x a unit's bytes), so the default
(``staging_units``) stays small: at most ``DEFAULT_STAGING_UNITS`` units and
``DEFAULT_STAGING_BYTES``, and no more than a ``1/STAGING_FREE_SHARE`` of the GPU memory
free when the connector registers the KV cache.
"""

from __future__ import annotations

import contextlib
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
        """Store ``batch`` (whose ``slots`` says it can go staged): per wave of up to
        ``units`` slots, the kernel gathers them into the buffer, then one copy a slot
        moves it to the host. Enqueued on ``stream`` (done now on CPU); returns what to
        keep alive until the stream passes."""
        keepalive: list[torch.Tensor] = []
        pool = self.copier.copies.pool
        for start in range(0, len(slots), self.units):
            wave = slots[start : start + self.units]
            keepalive += self.copier.run(
                self._into_buffer(batch, wave), "store", stream, "kernel", self.base
            )
            context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with context:
                for index, slot in enumerate(wave):
                    staged = self.buffer[index * self.unit_bytes : (index + 1) * self.unit_bytes]
                    pool.unit_view(int(slot)).copy_(staged, non_blocking=stream is not None)
        return keepalive

    def _into_buffer(self, batch: PairBatch, wave: np.ndarray) -> PairBatch:
        """The wave's pairs with each host page renumbered into the buffer's slots (the
        wave's i-th slot becomes buffer slot i)."""
        host_pages, gpu_blocks = [], []
        for pages, blocks, per_unit in zip(
            batch.host_pages, batch.gpu_blocks, self._per_unit, strict=True
        ):
            slot, page_in_unit = np.divmod(pages, per_unit)
            index = np.searchsorted(wave, slot)
            mine = (index < len(wave)) & (wave[np.minimum(index, len(wave) - 1)] == slot)
            host_pages.append(index[mine] * per_unit + page_in_unit[mine])
            gpu_blocks.append(blocks[mine])
        return PairBatch(host_pages, gpu_blocks)
