"""The pair kernel (pair_kernel.py) and its routes (copy_routes.py): addresses computed
on the device from (host page, GPU block) pairs land every byte where the address-table
path (page_kernel.py) lands it.

The kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1) on host pointers; the
host fallback memmoves the tiles of ``pair_tile_table``. Both go through
``PairCopier`` the way the worker calls it: ``run`` for a store, ``run_layers`` for a
step's loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_page_kernel import assert_16_byte_accesses_on_sm90, assert_loaded, fill_random

from vllm_draft_offload import pair_kernel
from vllm_draft_offload.copy_paths import CopyEngine
from vllm_draft_offload.copy_routes import PairCopier, longest_runs, route_layers
from vllm_draft_offload.copy_rules import AutoRule
from vllm_draft_offload.geometry import LayerSlot
from vllm_draft_offload.page_kernel import PageKernel, tile_table
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    PairBatch,
    UnitCopies,
)

pytest.importorskip("triton")
RULES = {"load": AutoRule(48 * 1024, 16), "store": AutoRule(64 * 1024, 16)}


@dataclass
class Rig:
    """Target layers of one KV-cache group and draft layers of another (their own page
    and block sizes) over CPU 'device' tensors with padded block strides, and a pool."""

    regions: list[LayerRegion]
    device: list[torch.Tensor]
    pool: HostPool

    @classmethod
    def build(cls, pages: tuple[int, int], num_blocks: int, num_slots: int, pad: int = 64) -> Rig:
        groups = ((4, pages[0], 3), (2, pages[1], 2))  # blocks/chunk, page, layers
        specs = [(g, per_chunk, page) for g, (per_chunk, page, n) in enumerate(groups)]
        order = [specs[0], specs[1], specs[0], specs[0], specs[1]]  # groups interleaved
        regions, device, offset = [], [], 0
        for i, (g, per_chunk, page) in enumerate(order):
            stride = page + pad
            tensor = torch.zeros(num_blocks * stride, dtype=torch.uint8)
            slot = LayerSlot(f"l{i}.g{g}", g, page, offset, per_chunk * page, is_draft=g == 1)
            offset += per_chunk * page
            regions.append(LayerRegion(slot, g, per_chunk, tensor.data_ptr(), stride, num_blocks))
            device.append(tensor)
        return cls(regions, device, HostPool(num_slots, offset, pin=False))

    def block(self, layer: int, block: int) -> torch.Tensor:
        region = self.regions[layer]
        start = block * region.device_block_stride
        return self.device[layer][start : start + region.slot.page_bytes]

    def pages(self, slots: list[int]) -> list[list[int]]:
        return [[s * per + p for s in slots for p in range(per)] for per in (4, 2)]

    def copier(self, setting: str) -> PairCopier:
        page_bytes = [r.slot.page_bytes for r in self.regions]
        engine = CopyEngine(setting, self.pool, page_bytes, on_device=False, rules=RULES)  # type: ignore[arg-type]
        return PairCopier(UnitCopies(self.regions, self.pool), engine)


def _scattered(rng: np.random.Generator, count: int, num_blocks: int) -> list[int]:
    """Distinct block ids, never 0 (vLLM's null block): descending, then shuffled, so
    neither side's order follows the other's."""
    ids = [int(b) for b in rng.permutation(np.arange(1, num_blocks))][:count]
    half = len(ids) // 2
    return sorted(ids[:half], reverse=True) + ids[half:]


PAGE_PAIRS = [
    (2048, 4096),
    (4096, 2048),
    (8192, 32 * 1024),
    (16 * 1024, 16 * 576 * 2),  # a drafter with MLA-sized pages: 2 KiB tiles
    (64 * 1024, 8192),
    (1 << 20, 4096),
]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(pairs, first row, rows) of every pair-kernel launch."""
    seen: list[tuple[int, int, int]] = []
    real = pair_kernel.PairKernel.copy

    def copy(self, pairs, first_pair, n_pairs, first_row, n_rows, to_host, stream):  # type: ignore[no-untyped-def]
        seen.append((n_pairs, first_row, n_rows))
        return real(self, pairs, first_pair, n_pairs, first_row, n_rows, to_host, stream)

    monkeypatch.setattr(pair_kernel.PairKernel, "copy", copy)
    return seen


@pytest.mark.parametrize("pages", PAGE_PAIRS, ids=lambda p: f"{p[0] // 1024}k+{p[1] / 1024:g}k")
@pytest.mark.parametrize("mode", ["interpret", "fallback", "auto", "pieces"])
def test_pair_round_trip_is_bit_exact(
    pages: tuple[int, int],
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    launches: list[tuple[int, int, int]],
) -> None:
    """Store scattered GPU blocks of every target and draft layer into non-adjacent host
    slots, load them back into other scattered blocks: every byte lands, nothing else
    is touched (padding included). ``pieces``: loads cut into launches of a few pages."""
    monkeypatch.setenv("TRITON_INTERPRET", "0" if mode == "fallback" else "1")
    setting = "auto" if mode in ("auto", "pieces") else "kernel"
    rng = np.random.default_rng(sum(pages))
    num_blocks = 24 if pages[0] < (1 << 20) else 12
    rig = Rig.build(pages, num_blocks, num_slots=5)
    slots = [3, 0, 4] if pages[0] < (1 << 20) else [3]
    host_pages = rig.pages(slots)
    src_blocks = [_scattered(rng, len(p), num_blocks) for p in host_pages]
    expected = fill_random(rig, rng, src_blocks)
    copier = rig.copier(setting)
    if mode == "pieces":
        copier.engine.first_piece_descriptors, copier.engine.piece_descriptors = 2, 5
    store = PairBatch.concat([copier.copies.pairs(host_pages, src_blocks)], 2)
    assert copier.run(store, "store", None) == []
    store_launches = len(launches)
    for tensor in rig.device:
        tensor.zero_()
    dst_blocks = [_scattered(rng, len(b), num_blocks) for b in src_blocks]
    load = copier.copies.pairs(host_pages, dst_blocks)
    order = sorted(range(len(rig.regions)), key=lambda i: rig.regions[i].slot.is_draft)
    keepalive, events = copier.run_layers(load, order, "load", None)
    assert events == [None] * len(order)
    assert_loaded(rig, src_blocks, dst_blocks, expected, num_blocks)
    # The pair kernel moved what the setting sends to it: every layer (kernel), the
    # layers of pages up to the direction's rule (auto; scattered blocks never merge).
    stored, loaded = launches[:store_launches], launches[store_launches:]
    want = {"store": len(rig.regions), "load": len(rig.regions)}
    if setting == "auto":
        want = {
            d: sum(r.slot.page_bytes <= RULES[d].max_bytes for r in rig.regions)  # type: ignore[index]
            for d in want
        }
    assert sum(rows for _, _, rows in stored) == want["store"]
    assert sum(rows for _, _, rows in loaded) == want["load"]
    assert len(stored) <= 2  # one launch per group
    if mode == "pieces":  # every layer holds more pages than a piece: a launch each
        assert all(rows == 1 for _, _, rows in loaded)
    elif setting == "kernel":
        assert len(loaded) == 2  # targets first, then the draft layers


@pytest.mark.parametrize("to_host", [False, True])
@pytest.mark.parametrize("pages", [(2048, 4096), (16 * 1024, 16 * 576 * 2), (64 * 1024, 8192)])
def test_pair_table_is_the_address_tables_tiles(pages: tuple[int, int], to_host: bool) -> None:
    """The kernel's formula (``pair_tile_table``) gives, tile for tile, the addresses
    ``tile_table`` cuts from the descriptor path's batches of the group's layers: a
    wrong index formula fails here, not only in a round trip."""
    rng = np.random.default_rng(pages[0] + to_host)
    rig = Rig.build(pages, 24, num_slots=5)
    copier = rig.copier("kernel")
    assert copier.kernel is not None and all(copier.fits)
    host_pages = rig.pages([4, 1, 2])
    blocks = [_scattered(rng, len(p), 24) for p in host_pages]
    per_layer = copier.copies.layers(host_pages, blocks, to_host)
    pool = rig.pool
    for g, layer_ids in enumerate(copier.copies.group_rows):
        pages_g = np.asarray(host_pages[g])
        slots, within = np.divmod(pages_g, rig.regions[layer_ids[0]].pages_per_unit)
        pairs = pair_kernel.pair_table(
            pool.base + slots * pool.unit_bytes, within, np.asarray(blocks[g])
        )
        first = copier._row[layer_ids[0]]
        got = pair_kernel.pair_tile_table(
            copier.kernel.layers, pairs, first, len(layer_ids), copier.kernel.tile, to_host
        )
        want = tile_table(Descriptors.concat([per_layer[i] for i in layer_ids]), copier.kernel.tile)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("store", [False, True])
def test_pair_kernel_writes_what_the_table_kernel_writes(
    store: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both kernels in Triton's interpreter, same pairs, separate destinations: the same
    bytes, with repeated-order (descending, then shuffled) block ids."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(7 + store)
    pages = (4096, 2048)
    rig = Rig.build(pages, 20, num_slots=4)
    copier = rig.copier("kernel")
    host_pages = rig.pages([2, 0])
    blocks = [_scattered(rng, len(p), 20) for p in host_pages]
    for tensor in rig.device:
        tensor.copy_(torch.from_numpy(rng.integers(0, 256, tensor.numel(), dtype=np.uint8)))
    rig.pool.buffer.copy_(torch.from_numpy(rng.integers(0, 256, rig.pool.buffer.numel())))
    before = [t.clone() for t in [*rig.device, rig.pool.buffer]]
    batch = copier.copies.pairs(host_pages, blocks)
    if store:
        copier.run(batch, "store", None)
    else:
        copier.run_layers(batch, list(range(len(rig.regions))), "load", None)
    by_pairs = [t.clone() for t in [*rig.device, rig.pool.buffer]]
    for tensor, saved in zip([*rig.device, rig.pool.buffer], before, strict=True):
        tensor.copy_(saved)
    desc = Descriptors.concat(copier.copies.layers(host_pages, blocks, store))
    PageKernel(copier.kernel.tile).copy(desc, None)  # type: ignore[union-attr]
    by_table = [t.clone() for t in [*rig.device, rig.pool.buffer]]
    assert all(torch.equal(a, b) for a, b in zip(by_pairs, by_table, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(by_pairs, before, strict=True))


def test_longest_runs_within_and_across_units() -> None:
    pages = np.array([0, 1, 2, 3, 4, 9, 10])  # 4 pages a unit: 3 -> 4 crosses units
    blocks = np.array([5, 6, 7, 8, 9, 1, 2])
    assert longest_runs(pages, blocks, 4) == (4, 5)
    assert longest_runs(np.array([3, 1]), np.array([1, 2]), 4) == (1, 1)
    assert longest_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 4) == (0, 0)


ROUTES = [
    # (setting, pages (target, draft), blocks, pad, misaligned layer, expected per layer)
    ("memcpy", (4096, 2048), "scattered", 64, None, [False] * 5),
    ("kernel", (4096, 2048), "scattered", 64, None, [True] * 5),
    ("kernel", (4096, 2048), "scattered", 64, 1, [True, False, True, True, True]),
    ("auto", (4096, 2048), "scattered", 64, None, [True] * 5),
    # Pages over the rule's size: the descriptor path (it sends them to DMA).
    ("auto", (64 * 1024, 2048), "scattered", 64, None, [False, True, False, False, True]),
    # Adjacent blocks, unpadded: runs merge past the rule's size: descriptors (DMA).
    ("auto", (16 * 1024, 2048), "ascending", 0, None, [False, True, False, False, True]),
    # Padded blocks never merge, however adjacent their ids.
    ("auto", (16 * 1024, 2048), "ascending", 64, None, [True] * 5),
    # Too few pages to pay for a launch.
    ("auto", (4096, 2048), "few", 64, None, [False] * 5),
]


@pytest.mark.parametrize(("setting", "pages", "blocks", "pad", "bad", "want"), ROUTES)
def test_route_layers_picks_the_pair_kernel_where_it_should(
    setting: str, pages: tuple[int, int], blocks: str, pad: int, bad: int | None, want: list[bool]
) -> None:
    rig = Rig.build(pages, 40, num_slots=6, pad=pad)
    if bad is not None:  # a layer whose blocks start 8 bytes off 16-byte alignment
        region = rig.regions[bad]
        rig.regions[bad] = LayerRegion(
            region.slot,
            region.group_index,
            region.pages_per_unit,
            region.device_base + 8,
            region.device_block_stride,
            region.num_blocks - 1,
        )
    copier = rig.copier(setting)
    slots = [0] if blocks == "few" else [1, 2, 4]
    host_pages = rig.pages(slots)
    if blocks == "ascending":
        gpu_blocks = [list(range(1, 1 + len(p))) for p in host_pages]
    else:
        gpu_blocks = [_scattered(np.random.default_rng(3), len(p), 40) for p in host_pages]
    if blocks == "few":
        host_pages = [p[:2] for p in host_pages]
        gpu_blocks = [b[:2] for b in gpu_blocks]
    batch = copier.copies.pairs(host_pages, gpu_blocks)
    assert route_layers(copier, batch, "load") == want


@pytest.mark.parametrize("setting", ["kernel", "auto"])
def test_a_store_routed_to_dma_takes_no_kernel_launch_and_lands_bit_exact(
    setting: str, monkeypatch: pytest.MonkeyPatch, launches: list[tuple[int, int, int]]
) -> None:
    """A batch given path "memcpy" (a decode step's stores under decode_stores_dma) goes
    whole to the descriptor path, whatever the engine's setting would pick, and its
    bytes land as the kernel's would; the next batch without it takes the kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(11)
    rig = Rig.build((4096, 2048), 24, num_slots=5)
    host_pages = rig.pages([3, 0, 4])
    src_blocks = [_scattered(rng, len(p), 24) for p in host_pages]
    expected = fill_random(rig, rng, src_blocks)
    copier = rig.copier(setting)
    store = PairBatch.concat([copier.copies.pairs(host_pages, src_blocks)], 2)
    assert route_layers(copier, store, "store", "memcpy") == [False] * len(rig.regions)
    assert route_layers(copier, store, "store") == [True] * len(rig.regions)
    copier.run(store, "store", None, "memcpy")
    assert launches == []
    for tensor in rig.device:
        tensor.zero_()
    dst_blocks = [_scattered(rng, len(b), 24) for b in src_blocks]
    load = copier.copies.pairs(host_pages, dst_blocks)
    copier.run_layers(load, list(range(len(rig.regions))), "load", None)
    assert_loaded(rig, src_blocks, dst_blocks, expected, 24)
    assert sum(rows for _, _, rows in launches) == len(rig.regions)  # the load: kernel


@pytest.mark.parametrize("to_host", [False, True])
@pytest.mark.parametrize("tile", [16, 2048, 16 * 1024])
def test_the_compiled_pair_kernel_moves_16_bytes_per_access(tile: int, to_host: bool) -> None:
    """The addresses computed on the device keep page_kernel's 16-byte vector loads and
    stores, all of a thread's share of a block in flight before the first store."""
    assert_16_byte_accesses_on_sm90(
        pair_kernel._jitted(False),
        signature={
            "pairs": "*i64",
            "pair_stride": "i64",
            "n_pairs": "i64",
            "layers": "*i64",
            "first_row": "i32",
            "n_rows": "i32",
            "n_tiles": "i32",
            "TO_HOST": "constexpr",
            "TILE_WORDS": "constexpr",
            "ROWS": "constexpr",
        },
        constexprs={"TO_HOST": to_host, "TILE_WORDS": tile // 8, "ROWS": PageKernel(tile).rows},
    )
