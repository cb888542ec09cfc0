"""The page kernel without an address table: addresses computed on the device.

``page_kernel.py`` reads each tile's two addresses from a table the host builds per
batch: 16 bytes per tile, written by numpy at about 60 ns per descriptor (coalesce,
split, concatenate, cut into tiles, page-locked upload), against about 76 ns of copy
per 4 KiB page on an H100. That host work held 4 KiB loads at 0.71 x pinned memcpy
while the copy alone ran at 0.87-0.90 x. But every layer of a KV-cache group moves
the same (host page, GPU block) pairs, so the host need only send the pairs:

* **Pairs, per batch.** Three int64 per pair (host slot base, page within the unit,
  GPU block id), shared by every layer of the group: host work O(pairs), not
  O(layers x pairs), and the upload 24 bytes a pair instead of 16 a layer-tile.
* **Layers, once.** A table per worker (``LAYER_COLUMNS`` per layer, the rows of each
  KV-cache group together): GPU base, GPU block stride, offset in a unit, page bytes,
  tiles per page and the running count of tiles per page over the group's rows. The
  layers never change, so it is uploaded once and kept on the device.
* **Tile -> (layer, pair, tile in page) by arithmetic.** A launch covers rows
  ``first_row .. first_row + n_rows`` of one group: tiles run layer by layer, each
  layer's ``n_pairs x tiles_per_page`` tiles pair by pair. A program finds its tiles'
  layer by comparing with the rows' first tiles (a handful of scalar loads per 16 KiB
  moved), then the pair and the tile within the page by one division.

The copy itself is ``page_kernel``'s: a persistent grid of ``programs`` programs,
``ROWS`` tiles of ``TILE_WORDS`` 8-byte words per iteration, 16-byte aligned vector
accesses. The same preconditions hold, checked per layer once (``copy_routes.py``):
every page start 16-byte aligned, page bytes a multiple of the tile.

On CPU tensors the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, the
tests), else a host fallback memmoves the tiles of ``pair_tile_table``, the same
formula in numpy (which the tests also compare with ``page_kernel.tile_table``).
"""

from __future__ import annotations

import contextlib
import functools
import os

import numpy as np
import torch

from vllm_draft_offload.page_kernel import (
    BLOCK_BYTES,
    DEFAULT_PROGRAMS,
    NUM_WARPS,
    WORD_BYTES,
    PageKernel,
    interpreting,
    memmove_tiles,
)

try:  # Triton is optional: without it the kernel is unavailable and DMA does it all.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported install has Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# Columns of the layer table, one row per layer.
TILES_BEFORE, TILES_PER_PAGE, GPU_BASE, GPU_STRIDE, HOST_OFFSET, PAGE_BYTES = range(6)
LAYER_COLUMNS = 6
# Rows of the pair table: host slot base (pool base + slot x unit bytes), page within
# the unit, GPU block id.
PAIR_ROWS = 3


def layer_table(rows: list[tuple[int, int, int, int]], tile: int) -> np.ndarray:
    """(layers, LAYER_COLUMNS) int64 for one group's layers, given per layer (GPU base,
    GPU block stride, offset in a unit, page bytes): the running count of tiles per
    page restarts at each group, so a group's rows are one slice of the table."""
    table = np.zeros((len(rows), LAYER_COLUMNS), dtype=np.int64)
    before = 0
    for i, (gpu_base, gpu_stride, host_offset, page_bytes) in enumerate(rows):
        if page_bytes % tile:
            raise ValueError(f"a page of {page_bytes} B is not whole {tile}-byte tiles")
        table[i] = (before, page_bytes // tile, gpu_base, gpu_stride, host_offset, page_bytes)
        before += page_bytes // tile
    return table


def pair_table(slot_base: np.ndarray, page_in_unit: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """(PAIR_ROWS, pairs) int64: what the kernel reads per pair."""
    return np.stack([slot_base, page_in_unit, blocks]).astype(np.int64, copy=False)


def segment_tiles(layers: np.ndarray, first_row: int, n_rows: int, n_pairs: int) -> int:
    """Tiles of a launch over ``n_rows`` layers from ``first_row`` (one group)."""
    return n_pairs * int(layers[first_row : first_row + n_rows, TILES_PER_PAGE].sum())


def pair_tile_table(
    layers: np.ndarray, pairs: np.ndarray, first_row: int, n_rows: int, tile: int, to_host: bool
) -> np.ndarray:
    """(2, tiles) int64: source, then destination, of every tile of a launch, by the
    kernel's formula (the host fallback, and what the tests check it against)."""
    rows = layers[first_row : first_row + n_rows]
    n_pairs = pairs.shape[1]
    n_tiles = segment_tiles(layers, first_row, n_rows, n_pairs)
    tiles = np.arange(n_tiles, dtype=np.int64)
    starts = (rows[:, TILES_BEFORE] - rows[0, TILES_BEFORE]) * n_pairs
    row = np.searchsorted(starts, tiles, side="right") - 1
    local = tiles - starts[row]
    pair, within = np.divmod(local, rows[row, TILES_PER_PAGE])
    host = (
        pairs[0, pair]
        + rows[row, HOST_OFFSET]
        + pairs[1, pair] * rows[row, PAGE_BYTES]
        + within * tile
    )
    gpu = rows[row, GPU_BASE] + pairs[2, pair] * rows[row, GPU_STRIDE] + within * tile
    return np.stack([gpu, host]) if to_host else np.stack([host, gpu])


def _copy_pair_tiles(
    pairs,
    pair_stride,
    n_pairs,
    layers,
    first_row,
    n_rows,
    n_tiles,
    TO_HOST: tl.constexpr,  # noqa: N803
    TILE_WORDS: tl.constexpr,  # noqa: N803
    ROWS: tl.constexpr,  # noqa: N803
):
    """Program ``pid`` moves tiles pid*ROWS.. of every stride of programs*ROWS tiles of
    the launch's layers; ``pairs`` holds PAIR_ROWS rows of ``pair_stride`` int64."""
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * ROWS
    rows = tl.arange(0, ROWS)
    words = tl.arange(0, TILE_WORDS)
    tile_bytes = TILE_WORDS * 8
    before = tl.load(layers + first_row * 6 + 0).to(tl.int64)
    for first in range(pid * ROWS, n_tiles, stride):
        tile = (first + rows).to(tl.int64)
        live = tile < n_tiles
        # The layer of each tile: the last row whose first tile is at or before it.
        row = (rows * 0 + first_row).to(tl.int64)
        for r in range(first_row + 1, first_row + n_rows):
            start = (tl.load(layers + r * 6 + 0) - before) * n_pairs
            row += (tile >= start).to(tl.int64)
        entry = layers + row * 6
        start = (tl.load(entry + 0, mask=live, other=0) - before) * n_pairs
        per_page = tl.load(entry + 1, mask=live, other=1)
        local = tile - start
        pair = local // per_page
        within = (local - pair * per_page) * tile_bytes
        slot_base = tl.load(pairs + pair, mask=live, other=0)
        page = tl.load(pairs + pair_stride + pair, mask=live, other=0)
        block = tl.load(pairs + 2 * pair_stride + pair, mask=live, other=0)
        gpu_base = tl.load(entry + 2, mask=live, other=0)
        gpu_stride = tl.load(entry + 3, mask=live, other=0)
        host_offset = tl.load(entry + 4, mask=live, other=0)
        page_bytes = tl.load(entry + 5, mask=live, other=0)
        host = slot_base + host_offset + page * page_bytes + within
        gpu = gpu_base + block * gpu_stride + within
        if TO_HOST:
            src = gpu
            dst = host
        else:
            src = host
            dst = gpu
        # Every page starts 16-byte aligned (checked per layer): 16-byte vector accesses.
        src = tl.multiple_of(src.to(tl.pointer_type(tl.int64)), 16)
        dst = tl.multiple_of(dst.to(tl.pointer_type(tl.int64)), 16)
        mask = live[:, None]
        data = tl.load(src[:, None] + words[None, :], mask=mask)
        tl.store(dst[:, None] + words[None, :], data, mask=mask)


@functools.cache
def _jitted(interpret: bool):  # noqa: ANN202 - a Triton kernel object
    """Compiled for the GPU or run by Triton's interpreter (see page_kernel._jitted)."""
    assert triton is not None
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return triton.jit(
            do_not_specialize=["pair_stride", "n_pairs", "first_row", "n_rows", "n_tiles"]
        )(_copy_pair_tiles)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


class PairKernel:
    """Launches the pair kernel over a worker's layer table (kept on the device)."""

    def __init__(
        self,
        layers: np.ndarray,
        tile: int,
        on_device: bool,
        programs: int = DEFAULT_PROGRAMS,
        block_bytes: int = BLOCK_BYTES,
        warps: int = NUM_WARPS,
    ) -> None:
        self.shape = PageKernel(tile, programs, block_bytes, warps)  # checks the settings
        self.tile = tile
        self.layers = layers
        self.on_device = on_device
        table = torch.from_numpy(np.ascontiguousarray(layers))
        self._device_layers = table.to("cuda") if on_device else table

    def upload(self, pairs: np.ndarray, stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
        """The batch's pair table where the kernel reads it: [table] on CPU, else
        [page-locked copy, device copy] (keep both alive until the stream passes)."""
        if not self.on_device:
            return [torch.from_numpy(np.ascontiguousarray(pairs))]
        host = torch.empty(pairs.shape, dtype=torch.int64, pin_memory=True)
        host.numpy()[...] = pairs
        with torch.cuda.stream(stream):
            device = host.to("cuda", non_blocking=True)
        return [host, device]

    def copy(
        self,
        pairs: torch.Tensor,
        first_pair: int,
        n_pairs: int,
        first_row: int,
        n_rows: int,
        to_host: bool,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Move pairs ``first_pair ..+n_pairs`` of ``pairs`` (as ``upload`` returned
        it, last element) for layer rows ``first_row ..+n_rows`` of one group."""
        n_tiles = segment_tiles(self.layers, first_row, n_rows, n_pairs)
        if n_tiles == 0:
            return
        if not self.on_device and not interpreting():
            table = pair_tile_table(
                self.layers,
                pairs[:, first_pair : first_pair + n_pairs].numpy(),
                first_row,
                n_rows,
                self.tile,
                to_host,
            )
            memmove_tiles(table, self.tile)
            return
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._launch(pairs, first_pair, n_pairs, first_row, n_rows, n_tiles, to_host)

    def warm_up(self) -> None:
        """Compile both directions now, not on the first hit (no tiles: nothing moves)."""
        pairs = self.upload(np.zeros((PAIR_ROWS, 1), dtype=np.int64), None)[-1]
        for to_host in (False, True):
            self._launch(pairs, 0, 0, 0, 1, 0, to_host)

    def _launch(
        self,
        pairs: torch.Tensor,
        first_pair: int,
        n_pairs: int,
        first_row: int,
        n_rows: int,
        n_tiles: int,
        to_host: bool,
    ) -> None:
        kernel = _jitted(not self.on_device)
        stride = pairs.shape[1]
        start = pairs.reshape(-1)[first_pair:]  # rows stay `stride` apart
        kernel[(self.shape.grid(n_tiles),)](
            start,
            stride,
            n_pairs,
            self._device_layers,
            first_row,
            n_rows,
            n_tiles,
            TO_HOST=to_host,
            TILE_WORDS=self.tile // WORD_BYTES,
            ROWS=self.shape.rows,
            num_warps=self.shape.warps,
        )
