"""The gather/scatter kernel (page_kernel.py) moves every byte where it belongs.

The kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1) on host pointers:
the same program the GPU compiles, byte for byte; the host fallback (memmove per
tile) runs the same tile tables. Both go through the connector's ``CopyEngine`` the
way the worker calls it: ``run_layers`` for a step's loads, ``run`` for a store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_draft_offload import page_kernel
from vllm_draft_offload.copy_paths import CopyEngine, plan_copies
from vllm_draft_offload.copy_rules import AutoRule
from vllm_draft_offload.geometry import LayerSlot
from vllm_draft_offload.page_kernel import PageKernel, kernel_can_move, tile_bytes, tile_table
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    layer_descriptors,
    run_descriptors_on_host,
)

pytest.importorskip("triton")
RULES = {"load": AutoRule(48 * 1024, 16), "store": AutoRule(64 * 1024, 16)}


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU copies run the Triton kernel in the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert page_kernel.interpreting()


def test_tile_is_the_largest_power_of_two_every_page_shares() -> None:
    assert tile_bytes([2048]) == 2048
    assert tile_bytes([32 * 1024, 16 * 1024]) == 16 * 1024
    assert tile_bytes([1 << 20]) == page_kernel.MAX_TILE_BYTES
    assert tile_bytes([16 * 576 * 2]) == 2048  # an MLA page (576 = 9 x 64)
    assert tile_bytes([64 * 1024, 24 * 1024, 8192]) == 8192
    assert tile_bytes([2056]) is None and tile_bytes([]) is None  # under 16 bytes


def test_tile_table_cuts_every_copy_into_tiles_in_order() -> None:
    desc = Descriptors(
        np.array([1 << 20, 1 << 24], dtype=np.int64),
        np.array([1 << 30, (1 << 30) + 48], dtype=np.int64),
        np.array([48, 16], dtype=np.int64),
    )
    assert tile_table(desc, 16).tolist() == [
        [1 << 20, (1 << 20) + 16, (1 << 20) + 32, 1 << 24],
        [1 << 30, (1 << 30) + 16, (1 << 30) + 32, (1 << 30) + 48],
    ]
    assert kernel_can_move(desc, 32).tolist() == [False, False]
    with pytest.raises(ValueError, match="16-byte"):
        tile_table(desc, 32)
    assert tile_table(desc.select(np.zeros(2, dtype=bool)), 16).shape == (2, 0)
    # Written in place (the GPU path writes into page-locked memory), one-tile pages too.
    out = np.zeros((2, 4), dtype=np.int64)
    assert tile_table(desc, 16, out=out) is out and out[1, 3] == (1 << 30) + 48
    pages = Descriptors(desc.src, desc.dst, np.array([16, 16], dtype=np.int64))
    assert tile_table(pages, 16, out=out[:, :2]).tolist() == [desc.src.tolist(), desc.dst.tolist()]
    with pytest.raises(ValueError, match="shape"):
        tile_table(desc, 16, out=np.zeros((2, 3), dtype=np.int64))


def test_bad_kernel_settings_are_refused() -> None:
    for tile in (8, 3000, 32 * 1024):
        with pytest.raises(ValueError, match="power of two"):
            PageKernel(tile)
    with pytest.raises(ValueError, match="programs"):
        PageKernel(2048, programs=0)
    with pytest.raises(ValueError, match="block_bytes"):
        PageKernel(2048, block_bytes=1024)
    with pytest.raises(ValueError, match="block_bytes"):
        PageKernel(2048, block_bytes=3 * 2048)
    with pytest.raises(ValueError, match="warps"):
        PageKernel(2048, warps=3)


@pytest.mark.parametrize(
    ("programs", "block_kib", "warps"), [(1, 16, 4), (3, 16, 4), (64, 16, 4), (3, 64, 8)]
)
@pytest.mark.parametrize("tile", [16, 2048, 16 * 1024])
def test_every_stride_and_the_ragged_last_block_are_copied(
    interpret: None, tile: int, programs: int, block_kib: int, warps: int
) -> None:
    """Fewer programs than blocks (each loops over several), a tile count that is no
    multiple of the block's rows, copies of several tiles, any block and warp count
    copy-speed can try: all land, nothing else."""
    rng = np.random.default_rng(tile + programs)
    kernel = PageKernel(tile, programs, block_kib * 1024, warps)
    sizes = rng.integers(1, 4, 23) * tile
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    src_buf = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    got = np.zeros(int(sizes.sum()) + len(sizes) * tile, dtype=np.uint8)  # a gap after each
    want = got.copy()
    order = rng.permutation(len(sizes))
    dst_off = np.concatenate(([0], np.cumsum(sizes[order] + tile)[:-1]))[np.argsort(order)]
    desc = Descriptors(src_buf.ctypes.data + offsets, got.ctypes.data + dst_off, sizes)
    assert kernel.grid(tile_table(desc, tile).shape[1]) <= programs
    kernel.copy(desc, None)
    run_descriptors_on_host(Descriptors(desc.src, want.ctypes.data + dst_off, sizes))
    assert np.array_equal(got, want) and got.any()


@dataclass
class Rig:
    """Layers of two KV-cache groups (a drafter with its own page size and block size)
    over CPU 'device' tensors with padded block strides, and a host pool."""

    regions: list[LayerRegion]
    device: list[torch.Tensor]
    pool: HostPool

    @classmethod
    def build(cls, pages: tuple[int, int], num_blocks: int, num_slots: int) -> Rig:
        groups = ((4, pages[0], 2), (2, pages[1], 1))  # blocks/chunk, page, layers
        regions, device, offset = [], [], 0
        for g, (per_chunk, page, layers) in enumerate(groups):
            for i in range(layers):
                stride = page + 64  # padding between blocks, as kernel-block views have
                tensor = torch.zeros(num_blocks * stride, dtype=torch.uint8)
                name = f"g{g}.l{i}"
                slot = LayerSlot(name, g, page, offset, per_chunk * page, is_draft=g == 1)
                offset += per_chunk * page
                regions.append(
                    LayerRegion(slot, g, per_chunk, tensor.data_ptr(), stride, num_blocks)
                )
                device.append(tensor)
        return cls(regions, device, HostPool(num_slots, offset, pin=False))

    def block(self, layer: int, block: int) -> torch.Tensor:
        region = self.regions[layer]
        start = block * region.device_block_stride
        return self.device[layer][start : start + region.slot.page_bytes]

    def layer_descriptors(
        self, slots: list[int], blocks: list[list[int]], to_host: bool
    ) -> list[Descriptors]:
        """Per layer: its pages of ``slots`` paired with the group's ``blocks``."""
        parts = []
        for region in self.regions:
            per_chunk = region.pages_per_unit
            host = [s * per_chunk + p for s in slots for p in range(per_chunk)]
            parts.append(
                layer_descriptors(region, self.pool, host, blocks[region.group_index], to_host)
            )
        return parts


class DeviceLayers(Protocol):
    """What the page and pair kernel tests' rigs share."""

    regions: list[LayerRegion]
    device: list[torch.Tensor]

    def block(self, layer: int, block: int) -> torch.Tensor: ...


def fill_random(
    rig: DeviceLayers, rng: np.random.Generator, src_blocks: list[list[int]]
) -> dict[tuple[int, int], torch.Tensor]:
    """Random bytes in every layer of ``rig`` (either test's rig); what each layer's
    ``src_blocks`` of its group hold, by (layer, block)."""
    for layer, tensor in enumerate(rig.device):
        tensor.copy_(torch.from_numpy(rng.integers(0, 256, tensor.numel(), dtype=np.uint8)))
        assert rig.block(layer, 0).any()
    return {
        (layer, b): rig.block(layer, b).clone()
        for layer, region in enumerate(rig.regions)
        for b in src_blocks[region.group_index]
    }


def assert_loaded(
    rig: DeviceLayers,
    src_blocks: list[list[int]],
    dst_blocks: list[list[int]],
    expected: dict[tuple[int, int], torch.Tensor],
    num_blocks: int,
) -> None:
    """After a load into zeroed layers: each layer's ``dst_blocks`` hold, bit for bit,
    what its ``src_blocks`` held (``fill_random``), every other block and the padding
    between blocks are untouched."""
    for layer, region in enumerate(rig.regions):
        g = region.group_index
        moved = dict(zip(dst_blocks[g], src_blocks[g], strict=True))
        for block in range(num_blocks):
            got = rig.block(layer, block)
            if block in moved:
                assert torch.equal(got, expected[(layer, moved[block])]), (layer, block)
            else:
                assert not got.any(), (layer, block)
        # Padding between blocks is never written.
        stride, page = region.device_block_stride, region.slot.page_bytes
        pad = rig.device[layer].view(num_blocks, stride)[:, page:]
        assert not pad.any()


def _non_contiguous_blocks(rng: np.random.Generator, count: int, num_blocks: int) -> list[int]:
    """Distinct block ids: an ascending run of three (which merges), then the others
    in random order (jumps and descents, which do not). Never block 0, vLLM's null block."""
    start = int(rng.integers(1, num_blocks - 2))
    run = [start, start + 1, start + 2]
    rest = [int(b) for b in rng.permutation(num_blocks) if b not in run and b]
    return (run + rest)[:count]


PAGE_PAIRS = [
    (2048, 4096),
    (4096, 2048),
    (8192, 32 * 1024),
    (16 * 1024, 16 * 576 * 2),  # a drafter with MLA-sized pages: 2 KiB tiles
    (64 * 1024, 8192),
    (1 << 20, 4096),
]


@pytest.mark.parametrize("pages", PAGE_PAIRS, ids=lambda p: f"{p[0] // 1024}k+{p[1] / 1024:g}k")
@pytest.mark.parametrize("mode", ["interpret", "fallback", "auto", "memcpy", "pieces"])
def test_round_trip_is_bit_exact(
    pages: tuple[int, int], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Store scattered GPU blocks of every layer into non-adjacent host slots, load them
    back into other scattered blocks: every byte lands where it belongs, nothing else
    is touched. ``interpret``: every copy the kernel can take runs in Triton's
    interpreter; ``fallback``: the same tile tables by memmove; ``auto``: the
    measured split (kernel share in the interpreter); ``memcpy``: DMA only;
    ``pieces``: ``auto`` planned and enqueued in groups of 2, 4, then 5 descriptors, so
    layers are cut across groups."""
    piece = 5 if mode == "pieces" else None
    mode = "auto" if mode == "pieces" else mode
    setting = {"interpret": "kernel", "fallback": "kernel"}.get(mode, mode)
    monkeypatch.setenv("TRITON_INTERPRET", "0" if mode == "fallback" else "1")
    rng = np.random.default_rng(sum(pages))
    num_blocks = 24 if pages[0] < (1 << 20) else 12
    rig = Rig.build(pages, num_blocks, num_slots=5)
    slots = [3, 0, 4] if pages[0] < (1 << 20) else [3]
    per_chunk = {r.group_index: r.pages_per_unit for r in rig.regions}
    src_blocks = [
        _non_contiguous_blocks(rng, len(slots) * per_chunk[g], num_blocks)
        for g in sorted(per_chunk)
    ]
    expected = fill_random(rig, rng, src_blocks)
    page_bytes = [r.slot.page_bytes for r in rig.regions]
    engine = CopyEngine(setting, rig.pool, page_bytes, on_device=False, rules=RULES)  # type: ignore[arg-type]
    assert engine.path == setting
    if piece is not None:
        engine.piece_descriptors, engine.first_piece_descriptors = piece, 2

    store = Descriptors.concat(rig.layer_descriptors(slots, src_blocks, to_host=True))
    assert engine.run(store, "store", None) == []
    for tensor in rig.device:
        tensor.zero_()
    dst_blocks = [_non_contiguous_blocks(rng, len(blocks), num_blocks) for blocks in src_blocks]
    loads = rig.layer_descriptors(slots, dst_blocks, to_host=False)
    keepalive, events = engine.run_layers(loads, "load", None)
    assert keepalive == [] and events == [None] * len(rig.regions)
    assert_loaded(rig, src_blocks, dst_blocks, expected, num_blocks)
    # The kernel really moved pages where the setting says it should.
    kernel_bytes = sum(
        plan_copies(d, "load", setting, engine.tile, RULES).kernel.num_bytes  # type: ignore[arg-type]
        for d in [store, *loads]
    )
    if setting == "kernel" or (setting == "auto" and max(pages) <= RULES["load"].max_bytes):
        assert kernel_bytes > 0
    if setting == "memcpy":
        assert kernel_bytes == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    units=st.lists(st.integers(1, 256), min_size=1, max_size=40),
    odd=st.booleans(),
    shift=st.sampled_from([0, 0, 0, 8]),
    path=st.sampled_from(["auto", "kernel", "memcpy"]),
    direction=st.sampled_from(["load", "store"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_split_moves_what_memmove_moves(
    units: list[int], odd: bool, shift: int, path: str, direction: str, seed: int
) -> None:
    """Any batch (sizes in 16-byte units, or with 1-15 bytes more; sources aligned or
    8 bytes off; destinations in any order, some adjacent), split by any path and run
    by kernel (interpreted) + DMA, writes exactly what a plain memmove of each
    descriptor writes."""
    rng = np.random.default_rng(seed)
    sizes = np.array(units, dtype=np.int64) * 16 + (rng.integers(1, 16, len(units)) if odd else 0)
    slot = int(sizes.max() + 15) // 16 * 16  # keeps every descriptor's start aligned
    src_buf = rng.integers(0, 256, slot * len(sizes) + shift + 16, dtype=np.uint8)
    base = -src_buf.ctypes.data % 16  # the buffer's first 16-byte boundary
    order = rng.permutation(len(sizes))
    src = src_buf.ctypes.data + base + shift + np.arange(len(sizes), dtype=np.int64) * slot
    got, want = (np.zeros(slot * len(sizes) + 16, dtype=np.uint8) for _ in range(2))
    got_base, want_base = (-a.ctypes.data % 16 for a in (got, want))
    desc = Descriptors(src, got.ctypes.data + got_base + order * slot, sizes)
    pool = HostPool(1, 16, pin=False)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        engine = CopyEngine(path, pool, [16], on_device=False, rules=RULES)  # type: ignore[arg-type]
        engine.run(desc, direction, None)  # type: ignore[arg-type]
    run_descriptors_on_host(Descriptors(src, want.ctypes.data + want_base + order * slot, sizes))
    assert np.array_equal(got[got_base:], want[want_base:])


def assert_16_byte_accesses_on_sm90(
    kernel: object,
    signature: dict[str, str],
    constexprs: dict[str, object],
    attrs: dict[tuple[int, ...], list[list[object]]] | None = None,
) -> None:
    """Compile ``kernel`` for an H100 (sm_90) without a GPU, by Triton's own compiler and
    ptxas: every data access is a 16-byte vector load or store, and each thread has its
    whole share of a 16 KiB block in flight (all its loads before the first store)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler import compile as triton_compile
    except ImportError as exc:  # pragma: no cover - a Triton without these entry points
        pytest.skip(f"Triton's compiler API is not there: {exc}")
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        compiled = triton_compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": page_kernel.NUM_WARPS}
        )
    except RuntimeError as exc:  # pragma: no cover - e.g. no ptxas in this Triton build
        pytest.skip(f"no CUDA toolchain in this Triton: {exc}")
    ptx = compiled.asm["ptx"]
    per_thread = page_kernel.BLOCK_BYTES // (page_kernel.NUM_WARPS * 32 * 16)
    assert ptx.count("ld.global.v2.b64") == per_thread == ptx.count("st.global.v2.b64")
    assert ptx.index("st.global.v2.b64") > ptx.rindex("ld.global.v2.b64")


@pytest.mark.parametrize("tile", [16, 2048, 16 * 1024])
def test_the_compiled_kernel_moves_16_bytes_per_access(tile: int) -> None:
    """Every data access a 16-byte vector load or store, each thread's share of a 16 KiB
    block in flight (8 loads before the first store)."""
    assert_16_byte_accesses_on_sm90(
        page_kernel._jitted(False),
        signature={
            "table": "*i64",
            "n_tiles": "i32",
            "TILE_WORDS": "constexpr",
            "ROWS": "constexpr",
        },
        constexprs={"TILE_WORDS": tile // 8, "ROWS": PageKernel(tile).rows},
        attrs={(0,): [["tt.divisibility", 16]]},  # torch's allocations: the table is aligned
    )
