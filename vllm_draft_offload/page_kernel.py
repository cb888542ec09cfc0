"""A gather/scatter kernel for small pages: many pages, every layer, one launch.

Batched DMA pays a fixed cost per descriptor, so pages that do not merge into long
runs (small models, drafters, a shuffled free-block queue) ran far below the link's
bandwidth; vLLM's Triton kernel (12 programs, each copying one page at a time in
8-byte words) reached 0.55 x pinned memcpy for 8 KiB loads on an H100, bound by the
latency of its few outstanding reads. LMCache's multi-layer transfer kernels (CUDA)
show the way out: one launch for every layer, very many small units of work,
pointers into page-locked host memory the GPU addresses directly. This is that, in
Triton:

* **Tiles.** Every descriptor is cut, on the host, into tiles of ``tile`` bytes: the
  largest power of two (at most 16 KiB) that divides every page of the worker, so
  any mix of layers, groups and page sizes is one table and one launch, and every
  program does equal work. The table holds each tile's source and destination
  address (16 bytes a tile: 1/1024 of the data at 16 KiB tiles).
* **Wide accesses.** A program moves ``BLOCK_BYTES`` (16 KiB, ``ROWS`` tiles) per
  iteration as one 2-D load and store of 8-byte words whose addresses are declared
  16-byte aligned, so the compiler emits 16-byte vector accesses, each thread with
  several in flight.
* **Enough in flight.** A persistent grid of ``programs`` programs (default 32)
  strides over the tiles: about 512 KiB of reads outstanding, several times what a
  PCIe Gen5 x16 link needs to stay busy (about 55 GB/s x 2 us), while leaving the
  other SMs to the forward the copy overlaps.
* **Page-locked tables.** The table is written into page-locked memory and uploaded
  on the copy's stream (asynchronous; a pageable upload could wait for the forward).
* **Compiled once.** The tile count is not specialised on, so one compile per worker
  (``warm_up``, at start) serves every batch: the first hit pays no compile.

Preconditions (checked by the caller, ``copy_paths.py``): the host pool is
page-locked and mapped for the device (``cudaHostRegister`` under unified virtual
addressing, as vLLM's own CPU offloading requires); a descriptor goes to the kernel
only if its size is a multiple of ``tile`` and both addresses are 16-byte aligned.

On CPU tensors the same interface runs the kernel in Triton's interpreter when
``TRITON_INTERPRET=1`` (the tests), else a host fallback that performs the same tile
table with memmove.
The address table is also this path's limit: the host builds it at about 60 ns per
descriptor (coalesce, ``kernel_can_move``, select, concatenate, ``tile_table``, a
page-locked upload) against about 76 ns of copy per 4 KiB page on an H100, so 4 KiB
loads reached 0.71 x pinned memcpy with planning included, 0.87-0.90 x for the copy
alone. The connector's CPU-tier copies therefore go to ``pair_kernel.py`` where they
can: the same copy loop, addresses computed on the device from (host page, GPU block)
pairs shared by a group's layers and a layer table kept on the device (host work
O(pairs)); ``copy_routes.py`` decides per layer. This kernel stays for what that one
cannot express: layers with unaligned pages, batches ``auto`` splits between kernel
and DMA, descriptors from elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Iterable

import numpy as np
import torch

from vllm_draft_offload.transfers import Descriptors

try:  # Triton is optional: without it the kernel is unavailable and DMA does it all.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported install has Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# Both ends of a kernel copy must be aligned to this: the vector width of an access.
ALIGN_BYTES = 16
MAX_TILE_BYTES = 16 * 1024
# Bytes one program moves per iteration (ROWS tiles); copy-speed's --kernel-block-kib
# and --kernel-warps try others.
BLOCK_BYTES = 16 * 1024
DEFAULT_PROGRAMS = 32
NUM_WARPS = 4
WORD_BYTES = 8


def triton_missing() -> bool:
    return triton is None


def tile_bytes(page_bytes: Iterable[int]) -> int | None:
    """The tile of a worker: the largest power of two dividing every page size, at
    most ``MAX_TILE_BYTES``; None when that is under 16 bytes (no aligned vector
    access fits, so every copy goes to DMA)."""
    common = 0
    for page in page_bytes:
        common = math.gcd(common, int(page))
    if common <= 0:
        return None
    tile = min(common & -common, MAX_TILE_BYTES)
    return tile if tile >= ALIGN_BYTES else None


def kernel_can_move(desc: Descriptors, tile: int) -> np.ndarray:
    """Per descriptor: whole tiles (a power of two), both ends 16-byte aligned."""
    ends = (desc.src | desc.dst) & (ALIGN_BYTES - 1)
    return (desc.sizes > 0) & ((desc.sizes & (tile - 1)) == 0) & (ends == 0)


def tile_count(desc: Descriptors, tile: int) -> int:
    return int((desc.sizes // tile).sum())


def tile_table(desc: Descriptors, tile: int, out: np.ndarray | None = None) -> np.ndarray:
    """(2, tiles) int64: source addresses, then destination addresses, of every
    ``tile``-byte piece of every descriptor, in descriptor order; written into ``out``
    (e.g. page-locked memory) when given."""
    if len(desc.sizes) and not kernel_can_move(desc, tile).all():
        raise ValueError(f"a descriptor is not whole {tile}-byte tiles on 16-byte addresses")
    counts = desc.sizes // tile
    total = int(counts.sum())
    table = np.empty((2, total), dtype=np.int64) if out is None else out
    if table.shape != (2, total):
        raise ValueError(f"table of shape {table.shape} for {total} tiles")
    if (counts == 1).all():  # pages of one tile each (the common case): no cutting
        table[0], table[1] = desc.src, desc.dst
        return table
    # Offset of each tile within its descriptor: a running count reset at every start.
    within = np.ones(total, dtype=np.int64)
    within[0] = 0
    within[np.cumsum(counts)[:-1]] = 1 - counts[:-1]
    np.cumsum(within, out=within)
    within *= tile
    table[0] = np.repeat(desc.src, counts) + within
    table[1] = np.repeat(desc.dst, counts) + within
    return table


def memmove_tiles(table: np.ndarray, tile: int) -> None:
    """The kernels' host fallback (CPU tensors, no interpreter): move each ``tile``-byte
    tile of a (2, tiles) table of source, then destination addresses."""
    for src, dst in zip(table[0].tolist(), table[1].tolist(), strict=True):
        ctypes.memmove(dst, src, tile)


def _copy_tiles(table, n_tiles, TILE_WORDS: tl.constexpr, ROWS: tl.constexpr):  # noqa: N803
    """Program ``pid`` moves tiles pid*ROWS.. of every stride of programs*ROWS tiles;
    ``table`` holds n_tiles source addresses, then n_tiles destination addresses."""
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * ROWS
    rows = tl.arange(0, ROWS)
    words = tl.arange(0, TILE_WORDS)
    for first in range(pid * ROWS, n_tiles, stride):
        tile = first + rows
        live = tile < n_tiles
        src = tl.load(table + tile, mask=live, other=0).to(tl.pointer_type(tl.int64))
        dst = tl.load(table + n_tiles + tile, mask=live, other=0).to(tl.pointer_type(tl.int64))
        # Every tile starts 16-byte aligned (the caller's rule): 16-byte vector accesses.
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        mask = live[:, None]
        data = tl.load(src[:, None] + words[None, :], mask=mask)
        tl.store(dst[:, None] + words[None, :], data, mask=mask)


@functools.cache
def _jitted(interpret: bool):  # noqa: ANN202 - a Triton kernel object
    """The kernel, compiled for the GPU or run by Triton's CPU interpreter. Triton
    decides between the two when a function is decorated, from TRITON_INTERPRET."""
    assert triton is not None
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return triton.jit(do_not_specialize=["n_tiles"])(_copy_tiles)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def interpreting() -> bool:
    """Whether CPU copies run the kernel in Triton's interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class PageKernel:
    """Launches the kernel for batches of descriptors that ``kernel_can_move``."""

    def __init__(
        self,
        tile: int,
        programs: int = DEFAULT_PROGRAMS,
        block_bytes: int = BLOCK_BYTES,
        warps: int = NUM_WARPS,
    ) -> None:
        if tile < ALIGN_BYTES or tile & (tile - 1) or tile > MAX_TILE_BYTES:
            raise ValueError(f"tile must be a power of two in 16..{MAX_TILE_BYTES}, got {tile}")
        if programs < 1:
            raise ValueError(f"programs must be at least 1, got {programs}")
        if block_bytes < tile or block_bytes & (block_bytes - 1):
            raise ValueError(
                f"block_bytes must be a power of two of at least {tile}, got {block_bytes}"
            )
        if warps < 1 or warps & (warps - 1):
            raise ValueError(f"warps must be a power of two, got {warps}")
        self.tile = tile
        self.rows = block_bytes // tile
        self.programs = programs
        self.warps = warps

    def grid(self, n_tiles: int) -> int:
        return max(1, min(self.programs, -(-n_tiles // self.rows)))

    def copy(self, desc: Descriptors, stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
        """Move every descriptor: enqueued on ``stream`` (GPU), or done now (None:
        CPU tensors). Returns the tensors to keep alive until the stream passes."""
        if not len(desc.sizes):
            return []
        if stream is None:
            table = tile_table(desc, self.tile)
            if interpreting():
                self._launch(torch.from_numpy(table), table.shape[1], interpret=True)
            else:
                memmove_tiles(table, self.tile)
            return []
        n_tiles = tile_count(desc, self.tile)
        host = torch.empty((2, n_tiles), dtype=torch.int64, pin_memory=True)
        tile_table(desc, self.tile, out=host.numpy())
        with torch.cuda.stream(stream):
            device = host.to("cuda", non_blocking=True)
            self._launch(device, n_tiles, interpret=False)
        return [host, device]

    def _launch(self, table: torch.Tensor, n_tiles: int, interpret: bool) -> None:
        kernel = _jitted(interpret)
        kernel[(self.grid(n_tiles),)](
            table,
            n_tiles,
            TILE_WORDS=self.tile // WORD_BYTES,
            ROWS=self.rows,
            num_warps=self.warps,
        )
