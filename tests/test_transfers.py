"""Copy descriptors: coalescing adjacent pages must move exactly the same bytes."""

from __future__ import annotations

import numpy as np

from vllm_draft_offload.transfers import Descriptors, run_descriptors_on_host

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
