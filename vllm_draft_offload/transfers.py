"""Byte-level copies between GPU KV blocks and the host pool.

A copy is a batch of (src pointer, dst pointer, size) descriptors. On CUDA one
batch goes to the driver in a single call (vLLM's `swap_blocks_batch`, i.e.
cuMemcpyBatchAsync) on a side stream; on CPU tensors the same descriptors are
executed with memmove, so CI runs the exact pointer arithmetic that runs on
the GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from vllm_draft_offload.geometry import LayerSlot, UnitLayout
from vllm_draft_offload.windows import NULL_BLOCK


@dataclass(frozen=True)
class LayerRegion:
    """Where one layer's blocks live on the device, beside its slot in a unit."""

    slot: LayerSlot
    group_index: int  # position in UnitLayout.groups
    pages_per_unit: int  # the group's pages in a unit (GroupLayout.pages_per_unit)
    device_base: int
    device_block_stride: int
    num_blocks: int


class HostPool:
    """The CPU tier's bytes: `num_slots` units, page-locked when a GPU is used."""

    def __init__(self, num_slots: int, unit_bytes: int, pin: bool) -> None:
        self.num_slots = num_slots
        self.unit_bytes = unit_bytes
        # A pageable allocation registered with the driver: torch's pinned
        # allocator rounds sizes up to a power of two, which would overshoot the
        # configured budget by up to 2x.
        self.buffer = torch.empty(num_slots * unit_bytes, dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        self.pinned = False
        if pin:
            from vllm.v1.kv_offload.cpu.host_register import host_register

            self.pinned = bool(host_register(self.base, self.buffer.numel()))

    def unit_view(self, slot: int) -> torch.Tensor:
        return self.buffer[slot * self.unit_bytes : (slot + 1) * self.unit_bytes]

    def close(self) -> None:
        if self.pinned:
            from vllm.v1.kv_offload.cpu.host_register import host_unregister

            host_unregister(self.base)
            self.pinned = False


@dataclass
class Descriptors:
    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())

    def coalesced(self) -> Descriptors:
        """Merge runs of pages that are adjacent on both sides into one copy each.

        A DMA descriptor has a fixed cost of a few microseconds, so thousands of
        page-sized copies (8-64 KiB each) run far below copy-engine bandwidth.
        Host pages of a chunk are always adjacent; GPU blocks often are too (the
        free-block queue hands out ascending runs), and then a chunk's layer
        moves as one copy.
        """
        if len(self.sizes) < 2:
            return self
        follows = (self.src[:-1] + self.sizes[:-1] == self.src[1:]) & (
            self.dst[:-1] + self.sizes[:-1] == self.dst[1:]
        )
        if not follows.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~follows)))
        return Descriptors(self.src[starts], self.dst[starts], np.add.reduceat(self.sizes, starts))

    def slice(self, start: int, stop: int) -> Descriptors:
        """Descriptors ``start:stop``, in order (views, not copies)."""
        return Descriptors(self.src[start:stop], self.dst[start:stop], self.sizes[start:stop])

    def select(self, mask: np.ndarray) -> Descriptors:
        """The descriptors where ``mask`` is true, in order."""
        return Descriptors(self.src[mask], self.dst[mask], self.sizes[mask])

    @staticmethod
    def concat(parts: list[Descriptors]) -> Descriptors:
        if not parts:
            empty = np.empty(0, dtype=np.int64)
            return Descriptors(empty, empty.copy(), empty.copy())
        return Descriptors(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.sizes for p in parts]),
        )


@dataclass(frozen=True)
class PairBatch:
    """A batch's checked (host page, GPU block) pairs, per KV-cache group."""

    host_pages: list[np.ndarray]
    gpu_blocks: list[np.ndarray]

    @staticmethod
    def concat(parts: list[PairBatch], num_groups: int) -> PairBatch:
        def join(arrays: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)

        return PairBatch(
            [join([p.host_pages[g] for p in parts]) for g in range(num_groups)],
            [join([p.gpu_blocks[g] for p in parts]) for g in range(num_groups)],
        )


def layer_descriptors(
    region: LayerRegion,
    pool: HostPool,
    host_pages: list[int],
    device_blocks: list[int],
    to_host: bool,
) -> Descriptors:
    """One descriptor per page of one layer.

    A plan naming vLLM's null block is refused: that block stands for every freed
    sliding-window position of every request and must stay zero, and what it holds
    is no request's KV, so neither a load nor a store may touch it.
    """
    pages = np.asarray(host_pages, dtype=np.int64)
    blocks = np.asarray(device_blocks, dtype=np.int64)
    _check_pairs(region, pool, pages, blocks)
    slots, page_in_chunk = np.divmod(pages, region.pages_per_unit)
    host = (
        pool.base
        + slots * pool.unit_bytes
        + region.slot.offset
        + page_in_chunk * region.slot.page_bytes
    )
    device = region.device_base + blocks * region.device_block_stride
    sizes = np.full(len(pages), region.slot.page_bytes, dtype=np.int64)
    return Descriptors(device, host, sizes) if to_host else Descriptors(host, device, sizes)


class UnitCopies:
    """Copy descriptors of every layer of a job at once.

    ``layer_descriptors`` per layer costs a dozen small numpy calls, about 25 us:
    with 18 layers, half a millisecond per store job on the engine's critical path.
    Every layer of a group moves the same (host page, GPU block) pairs, so the pairs
    are checked once per group and each layer's addresses come from one broadcast
    (rows: the group's layers, columns: the pairs).
    """

    def __init__(self, regions: list[LayerRegion], pool: HostPool) -> None:
        self.regions = regions
        self.pool = pool
        num_groups = 1 + max((r.group_index for r in regions), default=-1)
        self._rows: list[list[int]] = [
            [i for i, r in enumerate(regions) if r.group_index == g] for g in range(num_groups)
        ]
        self.group_rows = self._rows  # each group's region indices, in region order
        # Each group's pages in a unit: host page p is page p % n of slot p // n.
        self.group_pages_per_unit = [regions[rows[0]].pages_per_unit for rows in self._rows]

        def column(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64).reshape(-1, 1)

        self._device_base = [column([regions[i].device_base for i in rows]) for rows in self._rows]
        self._stride = [
            column([regions[i].device_block_stride for i in rows]) for rows in self._rows
        ]
        self._offset = [column([regions[i].slot.offset for i in rows]) for rows in self._rows]
        self._page = [column([regions[i].slot.page_bytes for i in rows]) for rows in self._rows]
        self._draft_page_bytes = [
            sum(regions[i].slot.page_bytes for i in rows if regions[i].slot.is_draft)
            for rows in self._rows
        ]
        # Where each region's row sits in its group's arrays.
        self._where = {i: (g, k) for g, rows in enumerate(self._rows) for k, i in enumerate(rows)}

    def _group(
        self, g: int, host_pages: list[int], device_blocks: list[int], to_host: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, sizes), each (layers of group g) x (pairs), after the checks of
        ``layer_descriptors`` (a failure names the group's first layer)."""
        first = self.regions[self._rows[g][0]]
        pages = np.asarray(host_pages, dtype=np.int64)
        blocks = np.asarray(device_blocks, dtype=np.int64)
        _check_pairs(first, self.pool, pages, blocks)
        slots, page_in_chunk = np.divmod(pages, first.pages_per_unit)
        host = (self.pool.base + slots * self.pool.unit_bytes) + (
            self._offset[g] + page_in_chunk * self._page[g]
        )
        device = self._device_base[g] + blocks * self._stride[g]
        sizes = np.broadcast_to(self._page[g], host.shape)
        return (device, host, sizes) if to_host else (host, device, sizes)

    def layers(
        self, host_pages: list[list[int]], gpu_blocks: list[list[int]], to_host: bool
    ) -> list[Descriptors]:
        """One batch per region, in region order (equal to ``layer_descriptors`` of each)."""
        groups = [
            self._group(g, host_pages[g], gpu_blocks[g], to_host) for g in range(len(self._rows))
        ]
        out = []
        for i in range(len(self.regions)):
            g, k = self._where[i]
            src, dst, sizes = groups[g]
            out.append(Descriptors(src[k], dst[k], np.ascontiguousarray(sizes[k])))
        return out

    def pairs(self, host_pages: list[list[int]], gpu_blocks: list[list[int]]) -> PairBatch:
        """A job's pairs per group, after the checks of ``layer_descriptors``: what the
        pair kernel needs (``copy_routes.py``), without any layer's addresses."""
        pages = [np.asarray(p, dtype=np.int64) for p in host_pages]
        blocks = [np.asarray(b, dtype=np.int64) for b in gpu_blocks]
        for g, rows in enumerate(self._rows):
            _check_pairs(self.regions[rows[0]], self.pool, pages[g], blocks[g])
        return PairBatch(pages, blocks)

    def unit(
        self, host_pages: list[list[int]], gpu_blocks: list[list[int]], to_host: bool
    ) -> tuple[Descriptors, int]:
        """Every layer's copies as one batch (group by group, each layer's pages in
        order), and the bytes of draft layers among them."""
        src, dst, sizes = [], [], []
        draft = 0
        for g in range(len(self._rows)):
            s, d, n = self._group(g, host_pages[g], gpu_blocks[g], to_host)
            src.append(s.ravel())
            dst.append(d.ravel())
            sizes.append(n.ravel())
            draft += self._draft_page_bytes[g] * len(host_pages[g])
        return Descriptors(np.concatenate(src), np.concatenate(dst), np.concatenate(sizes)), draft


def _check_pairs(
    region: LayerRegion, pool: HostPool, pages: np.ndarray, blocks: np.ndarray
) -> None:
    """Refuse a plan that would touch anything but a request's blocks and pool slots."""
    if len(pages) != len(blocks):
        raise ValueError("host pages and device blocks differ in length")
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= region.num_blocks):
        raise ValueError(f"block id out of range for layer {region.slot.name}")
    if len(blocks) and (blocks == NULL_BLOCK).any():
        raise ValueError(f"copy plan names vLLM's null block for layer {region.slot.name}")
    if len(pages) and (pages.min() < 0 or pages.max() // region.pages_per_unit >= pool.num_slots):
        raise ValueError("host slot out of range")


def run_descriptors_on_host(desc: Descriptors) -> None:
    """Synchronous memmove of every descriptor: the CPU-tensor path."""
    desc = desc.coalesced()
    for src, dst, size in zip(
        desc.src.tolist(), desc.dst.tolist(), desc.sizes.tolist(), strict=True
    ):
        ctypes.memmove(dst, src, size)


def run_descriptors_on_stream(desc: Descriptors, stream: torch.cuda.Stream) -> list[torch.Tensor]:
    """Submit a batch to the driver on `stream`; returns tensors to keep alive."""
    from vllm import _custom_ops as ops

    desc = desc.coalesced()
    src = torch.from_numpy(desc.src)
    dst = torch.from_numpy(desc.dst)
    sizes = torch.from_numpy(desc.sizes)
    with torch.cuda.stream(stream):
        ops.swap_blocks_batch(src, dst, sizes)
    return [src, dst, sizes]


def build_layer_regions(
    layout: UnitLayout, kv_caches: dict[str, torch.Tensor], num_blocks: int
) -> list[LayerRegion]:
    """Map every unit layer to its device tensor, checking shapes agree."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    group_index = {group.group_id: i for i, group in enumerate(layout.groups)}
    regions = []
    for slot in layout.layers:
        if slot.name not in kv_caches:
            raise ValueError(f"vLLM registered no KV tensor for layer {slot.name!r}")
        view = group_kernel_blocks(kv_caches[slot.name], num_blocks)
        block_stride = view.stride(0) * view.element_size()
        if view.shape[0] != num_blocks or block_stride < slot.page_bytes:
            raise ValueError(
                f"KV tensor of {slot.name!r} (shape {tuple(view.shape)}, block stride "
                f"{block_stride} B) does not hold {num_blocks} pages of {slot.page_bytes} B"
            )
        index = group_index[slot.group_id]
        regions.append(
            LayerRegion(
                slot=slot,
                group_index=index,
                pages_per_unit=layout.groups[index].pages_per_unit,
                device_base=view.data_ptr(),
                device_block_stride=block_stride,
                num_blocks=num_blocks,
            )
        )
    return regions
