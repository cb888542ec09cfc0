"""Copy descriptors and the paths that run them: every byte lands exactly where it belongs."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_draft_offload.config import ConfigError, parse_config
from vllm_draft_offload.copy_paths import (
    AutoRule,
    CopyEngine,
    CopyPlan,
    auto_rules,
    kernel_chunk_bytes,
    kernel_table,
    kernel_unavailable,
    plan_copies,
)
from vllm_draft_offload.geometry import LayerSlot
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    layer_descriptors,
    run_descriptors_on_host,
)

PAGE = 64


def _page_copies(src_base: int, dst_base: int, src_pages: list[int], dst_pages: list[int]):
    src = np.array([src_base + p * PAGE for p in src_pages], dtype=np.int64)
    dst = np.array([dst_base + p * PAGE for p in dst_pages], dtype=np.int64)
    return Descriptors(src, dst, np.full(len(src), PAGE, dtype=np.int64))


def test_adjacent_runs_merge_and_gaps_split() -> None:
    # host pages 0..5 ascending; device blocks: run 10,11,12, then 7 (jump), then 8, 20
    desc = _page_copies(0, 0, [0, 1, 2, 3, 4, 5], [10, 11, 12, 7, 8, 20]).coalesced()
    assert desc.src.tolist() == [0, 3 * PAGE, 5 * PAGE]
    assert desc.dst.tolist() == [10 * PAGE, 7 * PAGE, 20 * PAGE]
    assert desc.sizes.tolist() == [3 * PAGE, 2 * PAGE, PAGE]
    assert desc.num_bytes == 6 * PAGE


def test_descending_blocks_stay_separate() -> None:
    desc = _page_copies(0, 0, [0, 1, 2], [9, 8, 7])
    assert desc.coalesced().sizes.tolist() == [PAGE] * 3


def test_coalesced_copy_is_bit_exact() -> None:
    rng = np.random.default_rng(0)
    host = rng.integers(0, 255, size=16 * PAGE, dtype=np.uint8)
    device = np.zeros(32 * PAGE, dtype=np.uint8)
    host_pages = list(range(16))
    device_blocks = [3, 4, 5, 6, 30, 29, 12, 13, 14, 0, 1, 2, 20, 21, 27, 28]
    desc = _page_copies(host.ctypes.data, device.ctypes.data, host_pages, device_blocks)
    assert len(desc.coalesced().sizes) < len(desc.sizes)
    run_descriptors_on_host(desc)
    for page, block in zip(host_pages, device_blocks, strict=True):
        got = device[block * PAGE : (block + 1) * PAGE]
        assert np.array_equal(got, host[page * PAGE : (page + 1) * PAGE])
    untouched = set(range(32)) - set(device_blocks)
    assert all(not device[b * PAGE : (b + 1) * PAGE].any() for b in untouched)


# ---------------------------------------------------------------- copy paths
#
# Pages move by batched DMA or by vLLM's Triton gather/scatter kernel
# (copy_paths.py). Here the DMA side runs as memmove (the CPU fallback) and the
# kernel side runs vLLM's own kernel body in Triton's CPU interpreter, on the same
# host pointers: what the kernel would do on the GPU, byte for byte.


def _rules() -> AutoRule:
    rules = auto_rules()
    assert rules["load"] == rules["store"]  # one table for both directions (module doc)
    return rules["load"]


def _scattered(sizes: list[int], gap: int = 64) -> Descriptors:
    """Descriptors that never merge: a gap after every source and destination."""
    strides = [-(-(s + gap) // gap) * gap for s in sizes[:-1]]  # every start 64-aligned
    offsets = np.cumsum([0] + strides).astype(np.int64)
    return Descriptors(
        (1 << 20) + offsets, (1 << 40) + offsets[::-1].copy(), np.array(sizes, dtype=np.int64)
    )


@pytest.mark.parametrize("direction", ["load", "store"])
def test_auto_sends_small_runs_to_the_kernel_when_there_are_enough(direction: str) -> None:
    rule = _rules()
    small, large = rule.max_bytes - 8, rule.max_bytes
    assert rule.max_bytes == 28 * 1024 and rule.min_count == 16  # vLLM 0.33's table
    # Enough runs under the threshold: all to the kernel.
    plan = plan_copies(_scattered([small] * rule.min_count), direction, "auto")
    assert len(plan.kernel.sizes) == rule.min_count and not len(plan.memcpy.sizes)
    # One short of the count: the launch is not worth it, all DMA.
    plan = plan_copies(_scattered([small] * (rule.min_count - 1)), direction, "auto")
    assert not len(plan.kernel.sizes) and len(plan.memcpy.sizes) == rule.min_count - 1
    # At the threshold: DMA.
    plan = plan_copies(_scattered([large] * 64), direction, "auto")
    assert not len(plan.kernel.sizes)
    # Mixed: each run goes where it is faster; 8 KiB pages to the kernel, 1 MiB to DMA.
    sizes = [8192] * 20 + [1 << 20] * 3 + [4096] * 5
    plan = plan_copies(_scattered(sizes), direction, "auto")
    assert sorted(plan.kernel.sizes.tolist()) == sorted([8192] * 20 + [4096] * 5)
    assert plan.memcpy.sizes.tolist() == [1 << 20] * 3
    # A size the kernel's 8-byte words cannot move exactly: DMA.
    plan = plan_copies(_scattered([8192] * 20 + [4100] * 2), direction, "auto")
    assert plan.memcpy.sizes.tolist() == [4100, 4100] and len(plan.kernel.sizes) == 20


@pytest.mark.parametrize("direction", ["load", "store"])
def test_auto_decides_after_adjacent_pages_merge(direction: str) -> None:
    rule = _rules()
    # 4 KiB pages, adjacent on both sides in runs of 8: 32 KiB runs, over the threshold.
    page, runs = 4096, 32
    src = np.array([r * (1 << 20) + i * page for r in range(runs) for i in range(8)])
    dst = np.array([(1 << 40) + r * (1 << 21) + i * page for r in range(runs) for i in range(8)])
    desc = Descriptors(src, dst, np.full(len(src), page, dtype=np.int64))
    assert 8 * page >= rule.max_bytes
    plan = plan_copies(desc, direction, "auto")
    assert not len(plan.kernel.sizes) and plan.memcpy.sizes.tolist() == [8 * page] * runs
    # The same pages scattered on the device side: 256 separate 4 KiB copies, kernel.
    rng = np.random.default_rng(1)
    scattered = Descriptors(src, (1 << 40) + rng.permutation(len(src)) * 2 * page, desc.sizes)
    plan = plan_copies(scattered, direction, "auto")
    assert len(plan.kernel.sizes) > len(src) // 2 and plan.kernel.num_bytes > 0


def test_forced_paths() -> None:
    sizes = [2048] * 3 + [1 << 20] * 2 + [4100]
    kernel = plan_copies(_scattered(sizes), "store", "kernel")
    assert kernel.memcpy.sizes.tolist() == [4100]  # only what words cannot move
    assert sorted(kernel.kernel.sizes.tolist()) == sorted([2048] * 3 + [1 << 20] * 2)
    # An address off the 8-byte grid, on either side: DMA (a GPU faults on a misaligned
    # word; the CPU interpreter would not notice, so the rule is checked here).
    for side in ("src", "dst"):
        desc = _scattered([2048] * 20)
        getattr(desc, side)[5] += 4
        plan = plan_copies(desc, "load", "kernel")
        assert getattr(plan.memcpy, side).tolist() == [getattr(desc, side)[5]]
        assert len(plan.kernel.sizes) == 19
    memcpy = plan_copies(_scattered(sizes), "load", "memcpy")
    assert not len(memcpy.kernel.sizes) and memcpy.memcpy.num_bytes == sum(sizes)
    with pytest.raises(ValueError, match="unknown copy path"):
        plan_copies(_scattered(sizes), "load", "dma")  # type: ignore[arg-type]


def test_kernel_chunk_follows_the_largest_page_up_to_8_kib() -> None:
    assert kernel_chunk_bytes([2048]) == 2048
    assert kernel_chunk_bytes([2048, 3000]) == 4096
    assert kernel_chunk_bytes([8192]) == 8192
    assert kernel_chunk_bytes([20 * 1024, 1 << 20]) == 8192


def test_copy_path_setting_is_validated() -> None:
    base = {"cpu_bytes_to_use": 1 << 20}
    assert parse_config(base).copy_path == "auto"
    assert parse_config({**base, "copy_path": "kernel"}).copy_path == "kernel"
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.copy_path: .*'memcpy'"):
        parse_config({**base, "copy_path": "dma"})


def test_kernel_falls_back_to_memcpy_without_pinned_memory_or_cuda() -> None:
    pool = HostPool(2, 4096, pin=False)
    assert "not page-locked" in (kernel_unavailable(pinned=False) or "")
    # This machine's vLLM platform is the CPU one: the kernel is never chosen.
    assert "not CUDA" in (kernel_unavailable(pinned=True) or "")
    for setting in ("auto", "kernel", "memcpy"):
        assert CopyEngine(setting, pool, [2048], on_device=True).path == "memcpy"
        assert CopyEngine(setting, pool, [2048], on_device=False).path == "memcpy"


@pytest.fixture(scope="module")
def interpreted_kernel() -> Callable[[Descriptors, int], None]:
    """vLLM's gather/scatter kernel body, run by Triton's CPU interpreter, launched as
    vLLM's ``swap_blocks_batch`` launches it (min(NUM_SMS, n) programs)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from vllm.v1.kv_offload.cpu import swap_blocks_triton

    fn = swap_blocks_triton._swap_blocks_kernel
    fn = getattr(fn, "fn", fn)  # a JITFunction where vLLM found Triton, else the function
    # The function as written, with the real triton.language in its globals (vLLM's
    # CPU build hands it a placeholder module).
    body = types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl, "triton": triton})
    body.__qualname__, body.__module__ = fn.__qualname__, fn.__module__
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # read when the function is decorated
        kernel = triton.jit(body)

    def launch(desc: Descriptors, chunk_bytes: int) -> None:
        n = len(desc.sizes)
        if not n:
            return
        table = kernel_table(desc)
        grid = (min(swap_blocks_triton.NUM_SMS, n),)
        kernel[grid](table[0], table[1], table[2], n, BYTES_PER_CHUNK=chunk_bytes)

    return launch


def _run_plan(
    desc: Descriptors,
    direction: str,
    path: str,
    chunk_bytes: int,
    kernel: Callable[[Descriptors, int], None],
) -> CopyPlan:
    plan = plan_copies(desc, direction, path)  # type: ignore[arg-type]
    assert plan.kernel.num_bytes + plan.memcpy.num_bytes == desc.num_bytes
    kernel(plan.kernel, chunk_bytes)
    run_descriptors_on_host(plan.memcpy)
    return plan


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

    def descriptors(self, slots: list[int], blocks: list[list[int]], to_host: bool) -> Descriptors:
        """Every layer's pages of ``slots`` paired with the group's ``blocks``."""
        parts = []
        for region in self.regions:
            per_chunk = region.blocks_per_chunk
            host = [s * per_chunk + p for s in slots for p in range(per_chunk)]
            parts.append(
                layer_descriptors(region, self.pool, host, blocks[region.group_index], to_host)
            )
        return Descriptors.concat(parts)


def _non_contiguous_blocks(rng: np.random.Generator, count: int, num_blocks: int) -> list[int]:
    """Distinct block ids: an ascending run of three (which merges), then the others
    in random order (jumps and descents, which do not)."""
    start = int(rng.integers(0, num_blocks - 2))
    run = [start, start + 1, start + 2]
    rest = [int(b) for b in rng.permutation(num_blocks) if b not in run]
    return (run + rest)[:count]


PAGE_PAIRS = [(2048, 4096), (4096, 2048), (8192, 32 * 1024), (64 * 1024, 8192), (1 << 20, 4096)]


@pytest.mark.parametrize("pages", PAGE_PAIRS, ids=lambda p: f"{p[0] // 1024}k+{p[1] // 1024}k")
@pytest.mark.parametrize("mode", ["memmove", "auto", "kernel"])
def test_round_trip_is_bit_exact(
    pages: tuple[int, int], mode: str, interpreted_kernel: Callable[[Descriptors, int], None]
) -> None:
    """Store scattered GPU blocks of every layer into non-adjacent host slots, load them
    back into other scattered blocks: every byte lands where it belongs, nothing else
    is touched. ``memmove`` is the CPU path the connector runs in CI (CopyEngine with
    no stream); ``auto``/``kernel`` split the batch and run the kernel's share in the
    interpreter."""
    rng = np.random.default_rng(sum(pages))
    num_blocks = 24 if pages[0] < (1 << 20) else 12
    rig = Rig.build(pages, num_blocks, num_slots=5)
    slots = [3, 0, 4] if pages[0] < (1 << 20) else [3]
    per_chunk = {r.group_index: r.blocks_per_chunk for r in rig.regions}
    src_blocks = [
        _non_contiguous_blocks(rng, len(slots) * per_chunk[g], num_blocks)
        for g in sorted(per_chunk)
    ]
    for layer, tensor in enumerate(rig.device):
        tensor.copy_(torch.from_numpy(rng.integers(0, 256, tensor.numel(), dtype=np.uint8)))
        assert rig.block(layer, 0).any()
    expected = {
        (layer, b): rig.block(layer, b).clone()
        for layer, region in enumerate(rig.regions)
        for b in src_blocks[region.group_index]
    }
    chunk = kernel_chunk_bytes(r.slot.page_bytes for r in rig.regions)
    engine = CopyEngine("auto", rig.pool, [r.slot.page_bytes for r in rig.regions], False)

    kernel_bytes = 0

    def run(desc: Descriptors, direction: str) -> None:
        nonlocal kernel_bytes
        if mode == "memmove":
            engine.run(desc, direction, None)  # type: ignore[arg-type]
        else:
            plan = _run_plan(desc, direction, mode, chunk, interpreted_kernel)
            kernel_bytes += plan.kernel.num_bytes

    run(rig.descriptors(slots, src_blocks, to_host=True), "store")
    for tensor in rig.device:
        tensor.zero_()
    dst_blocks = [_non_contiguous_blocks(rng, len(blocks), num_blocks) for blocks in src_blocks]
    run(rig.descriptors(slots, dst_blocks, to_host=False), "load")
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
    if mode == "kernel" or (mode == "auto" and max(pages) < _rules().max_bytes):
        assert kernel_bytes > 0  # the kernel really moved pages here


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=st.lists(st.integers(1, 2048), min_size=1, max_size=40),
    odd=st.booleans(),
    shift=st.sampled_from([0, 0, 0, 4]),
    path=st.sampled_from(["auto", "kernel", "memcpy"]),
    direction=st.sampled_from(["load", "store"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_split_moves_what_memmove_moves(
    interpreted_kernel: Callable[[Descriptors, int], None],
    words: list[int],
    odd: bool,
    shift: int,
    path: str,
    direction: str,
    seed: int,
) -> None:
    """Any batch (sizes in words, or with 1-7 bytes more; sources word-aligned or not;
    destinations in any order, some adjacent), split by any path and run by kernel +
    DMA, writes exactly what a plain memmove of each descriptor writes."""
    rng = np.random.default_rng(seed)
    sizes = np.array(words, dtype=np.int64) * 8 + (rng.integers(1, 8, len(words)) if odd else 0)
    slot = int(sizes.max() + 7) // 8 * 8  # keeps every descriptor's start aligned
    src_buf = rng.integers(0, 256, slot * len(sizes) + shift, dtype=np.uint8)
    order = rng.permutation(len(sizes))
    src = src_buf.ctypes.data + shift + np.arange(len(sizes), dtype=np.int64) * slot
    got, want = (np.zeros(slot * len(sizes), dtype=np.uint8) for _ in range(2))
    desc = Descriptors(src, got.ctypes.data + order * slot, sizes)
    _run_plan(desc, direction, path, kernel_chunk_bytes([slot]), interpreted_kernel)
    run_descriptors_on_host(Descriptors(src, want.ctypes.data + order * slot, sizes))
    assert np.array_equal(got, want)
