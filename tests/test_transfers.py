"""Copy descriptors and the paths that run them: every byte lands exactly where it belongs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_draft_offload.config import ConfigError, parse_config
from vllm_draft_offload.copy_paths import (
    CopyEngine,
    kernel_unavailable,
    pipeline_groups,
    plan_copies,
    plan_layers,
)
from vllm_draft_offload.copy_rules import (
    RULES_FILE,
    AutoRule,
    auto_rules,
    rule_source,
    rules_from_rows,
    write_rules,
)
from vllm_draft_offload.geometry import LayerSlot
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    UnitCopies,
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
# Pages move by batched DMA or by the gather/scatter kernel (copy_paths.py,
# page_kernel.py); ``auto`` splits a batch by the measured table (copy_rules.py).
# The kernel's bytes are checked in test_page_kernel.py.

H100 = "NVIDIA H100 80GB HBM3"
H100_RUN = Path(__file__).parents[1] / "results/gpu/session5_h100/copy_speed.json"
RULES = {"load": AutoRule(256 * 1024, 16), "store": AutoRule(256 * 1024, 16)}
TILE = 2048


def _scattered(sizes: list[int], gap: int = 64) -> Descriptors:
    """Descriptors that never merge: a gap after every source and destination."""
    strides = [-(-(s + gap) // gap) * gap for s in sizes[:-1]]  # every start 64-aligned
    offsets = np.cumsum([0] + strides).astype(np.int64)
    return Descriptors(
        (1 << 20) + offsets, (1 << 40) + offsets[::-1].copy(), np.array(sizes, dtype=np.int64)
    )


def _h100_rows() -> list[dict]:
    return json.loads(H100_RUN.read_text())["rows"]


def test_shipped_table_is_what_the_h100_run_measured() -> None:
    """The table's H100 entry (also the default) is derived from the session-5 run of
    this package's kernel: it beat DMA at every page size up to 256 KiB both ways."""
    measured = rules_from_rows(_h100_rows())
    assert measured == RULES
    assert auto_rules(H100) == measured
    assert auto_rules(None) == measured and auto_rules("NVIDIA B200") == measured
    assert "session5_h100" in rule_source(H100) and "(default)" in rule_source("NVIDIA B200")
    table = json.loads(RULES_FILE.read_text())
    assert table["default"] == H100


@pytest.mark.parametrize("direction", ["load", "store"])
def test_auto_picks_the_path_the_measurements_say(direction: str) -> None:
    """For every page size of the H100 run: pages that never merge go to the kernel
    exactly when the kernel was at least as fast as DMA there and at every smaller
    size, else to DMA."""
    rows = [r for r in _h100_rows() if r["direction"] == direction]
    gbps = {(r["setting"], r["page_bytes"]): r["GBps"] for r in rows}
    rules = rules_from_rows(_h100_rows())
    kernel_so_far = True
    for page in sorted({r["page_bytes"] for r in rows}):
        kernel_so_far = kernel_so_far and gbps[("kernel", page)] >= gbps[("memcpy", page)]
        plan = plan_copies(_scattered([page] * 32), direction, "auto", TILE, rules)  # type: ignore[arg-type]
        assert (len(plan.kernel.sizes), len(plan.memcpy.sizes)) == (
            (32, 0) if kernel_so_far else (0, 32)
        ), page


def test_rules_from_rows_stop_at_the_first_size_dma_wins() -> None:
    def rows(wins: dict[int, tuple[float, float]]) -> list[dict]:
        out = []
        for page, (kernel, memcpy) in wins.items():
            for direction in ("load", "store"):
                out += [
                    {
                        "direction": direction,
                        "setting": "kernel",
                        "page_bytes": page,
                        "GBps": kernel,
                    },
                    {
                        "direction": direction,
                        "setting": "memcpy",
                        "page_bytes": page,
                        "GBps": memcpy,
                    },
                    {"direction": direction, "setting": "auto", "page_bytes": page, "GBps": 0.0},
                ]
        return out

    # A win after a loss does not count: a size in between was not measured.
    got = rules_from_rows(rows({4096: (9, 1), 8192: (9, 1), 65536: (1, 9), 1 << 20: (9, 1)}))
    assert got["load"] == AutoRule(8192, 16) and got["store"] == AutoRule(8192, 16)
    # DMA faster from the smallest size: the kernel is never chosen.
    assert rules_from_rows(rows({4096: (1, 9)}), min_count=4)["load"] == AutoRule(0, 4)
    # Repeated rows (several runs): the best of each.
    repeated = rows({4096: (1, 9)}) + rows({4096: (10, 2)})
    assert rules_from_rows(repeated)["store"].max_bytes == 4096
    with pytest.raises(ValueError, match="no kernel and memcpy rows"):
        rules_from_rows([r for r in rows({4096: (9, 1)}) if r["setting"] != "memcpy"])


def test_written_rules_are_what_auto_reads(tmp_path: Path) -> None:
    path = tmp_path / "rules.json"
    new = {"load": AutoRule(128 * 1024, 16), "store": AutoRule(32 * 1024, 8)}
    write_rules("NVIDIA H200", new, "run A", path)  # a new table: its GPU is the default
    assert auto_rules("NVIDIA H200", path) == new == auto_rules("other", path)
    write_rules(H100, RULES, "run B", path)
    assert auto_rules(H100, path) == RULES and auto_rules("other", path) == new
    assert rule_source(H100, path) == f"{H100}: run B"
    write_rules("NVIDIA H200", RULES, "run C", path)  # replaced, read afresh
    assert auto_rules("NVIDIA H200", path) == RULES
    with pytest.raises(ValueError, match="min_count"):
        write_rules("bad", {"load": AutoRule(1, 0), "store": AutoRule(1, 1)}, "x", path)


@pytest.mark.parametrize("direction", ["load", "store"])
def test_auto_sends_small_runs_to_the_kernel_when_there_are_enough(direction: str) -> None:
    rule = RULES[direction]  # type: ignore[index]
    small, large = rule.max_bytes, rule.max_bytes + TILE
    # Enough runs up to the threshold: all to the kernel.
    plan = plan_copies(_scattered([small] * rule.min_count), direction, "auto", TILE, RULES)  # type: ignore[arg-type]
    assert len(plan.kernel.sizes) == rule.min_count and not len(plan.memcpy.sizes)
    # One short of the count: the launch is not worth it, all DMA.
    plan = plan_copies(_scattered([small] * (rule.min_count - 1)), direction, "auto", TILE, RULES)  # type: ignore[arg-type]
    assert not len(plan.kernel.sizes) and len(plan.memcpy.sizes) == rule.min_count - 1
    # Over the threshold: DMA.
    plan = plan_copies(_scattered([large] * 64), direction, "auto", TILE, RULES)  # type: ignore[arg-type]
    assert not len(plan.kernel.sizes)
    # Mixed: each run goes where it is faster; 8 KiB pages to the kernel, 1 MiB to DMA.
    sizes = [8192] * 20 + [1 << 20] * 3 + [4096] * 5
    plan = plan_copies(_scattered(sizes), direction, "auto", TILE, RULES)  # type: ignore[arg-type]
    assert sorted(plan.kernel.sizes.tolist()) == sorted([8192] * 20 + [4096] * 5)
    assert plan.memcpy.sizes.tolist() == [1 << 20] * 3
    # A size that is not whole tiles: DMA.
    plan = plan_copies(_scattered([8192] * 20 + [4112] * 2), direction, "auto", TILE, RULES)  # type: ignore[arg-type]
    assert plan.memcpy.sizes.tolist() == [4112, 4112] and len(plan.kernel.sizes) == 20


@pytest.mark.parametrize("direction", ["load", "store"])
def test_auto_decides_after_adjacent_pages_merge(direction: str) -> None:
    # 8 KiB pages, adjacent on both sides in runs of 64: 512 KiB runs, over both
    # thresholds (256 KiB): DMA, as one copy per run.
    page, run, runs = 8192, 64, 32
    src = np.array([r * (1 << 22) + i * page for r in range(runs) for i in range(run)])
    dst = np.array([(1 << 40) + r * (1 << 23) + i * page for r in range(runs) for i in range(run)])
    desc = Descriptors(src, dst, np.full(len(src), page, dtype=np.int64))
    plan = plan_copies(desc, direction, "auto", TILE, RULES)  # type: ignore[arg-type]
    assert plan.memcpy.sizes.tolist() == [run * page] * runs
    assert plan.memcpy.num_bytes == desc.num_bytes and not len(plan.kernel.sizes)
    # The same pages scattered on the device side: 2048 separate 8 KiB copies, kernel.
    rng = np.random.default_rng(1)
    scattered = Descriptors(src, (1 << 40) + rng.permutation(len(src)) * 2 * page, desc.sizes)
    plan = plan_copies(scattered, direction, "auto", TILE, RULES)  # type: ignore[arg-type]
    assert len(plan.kernel.sizes) > len(src) // 2 and plan.kernel.num_bytes > 0


def test_layers_share_one_launch_and_its_minimum_count() -> None:
    """Loads plan every layer together: ten small copies in each of two layers make
    one launch worth it, while either layer alone would stay on DMA."""
    layers = [_scattered([4096] * 10), _scattered([4096] * 10 + [1 << 20])]
    alone = [plan_copies(d, "load", "auto", TILE, RULES) for d in layers]
    assert all(not len(p.kernel.sizes) for p in alone)
    together = plan_layers(layers, "load", "auto", TILE, RULES)
    assert [len(p.kernel.sizes) for p in together] == [10, 10]
    assert [p.memcpy.sizes.tolist() for p in together] == [[], [1 << 20]]


def test_forced_paths() -> None:
    sizes = [2048] * 3 + [1 << 20] * 2 + [4112]
    kernel = plan_copies(_scattered(sizes), "store", "kernel", TILE, RULES)
    assert kernel.memcpy.sizes.tolist() == [4112]  # only what whole tiles cannot move
    assert sorted(kernel.kernel.sizes.tolist()) == sorted([2048] * 3 + [1 << 20] * 2)
    # An address off the 16-byte grid, on either side: DMA (the kernel's vector
    # accesses would fault on the GPU; the CPU would not notice, so it is checked here).
    for side in ("src", "dst"):
        desc = _scattered([2048] * 20)
        getattr(desc, side)[5] += 8
        plan = plan_copies(desc, "load", "kernel", TILE, RULES)
        assert getattr(plan.memcpy, side).tolist() == [getattr(desc, side)[5]]
        assert len(plan.kernel.sizes) == 19
    memcpy = plan_copies(_scattered(sizes), "load", "memcpy", TILE, RULES)
    assert not len(memcpy.kernel.sizes) and memcpy.memcpy.num_bytes == sum(sizes)
    # No tile (pages of odd sizes): everything by DMA, whatever the setting.
    none = plan_copies(_scattered(sizes), "load", "kernel", None, RULES)
    assert not len(none.kernel.sizes)
    with pytest.raises(ValueError, match="unknown copy path"):
        plan_copies(_scattered(sizes), "load", "dma", TILE, RULES)  # type: ignore[arg-type]


def test_copy_path_setting_is_validated() -> None:
    base = {"cpu_bytes_to_use": 1 << 20}
    assert parse_config(base).copy_path == "auto"
    assert parse_config({**base, "copy_path": "kernel"}).copy_path == "kernel"
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.copy_path: .*'memcpy'"):
        parse_config({**base, "copy_path": "dma"})


def test_kernel_falls_back_to_memcpy_where_it_cannot_run() -> None:
    pool = HostPool(2, 4096, pin=False)
    assert "not page-locked" in (kernel_unavailable(pinned=False) or "")
    # This machine's vLLM platform is the CPU one: no kernel on a "device".
    assert "not CUDA" in (kernel_unavailable(pinned=True) or "")
    for setting in ("auto", "kernel", "memcpy"):
        assert CopyEngine(setting, pool, [2048], on_device=True).path == "memcpy"
        # CPU tensors: the kernel's share runs through its CPU interface.
        engine = CopyEngine(setting, pool, [2048, 4096], on_device=False)
        assert engine.path == setting and engine.tile == 2048
        # Pages sharing no 16-byte power of two: DMA only.
        assert CopyEngine(setting, pool, [2056], on_device=False).path == "memcpy"


@pytest.mark.parametrize("content", [None, "{not json", '{"default": "x", "gpus": {}}'])
def test_an_unreadable_table_leaves_auto_on_dma_and_serving_on(
    content: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing or broken copy_rules.json must not stop the engine: auto then uses DMA
    for everything, the other settings are untouched."""
    from vllm_draft_offload import copy_rules

    broken = tmp_path / "copy_rules.json"
    if content is not None:
        broken.write_text(content)
    monkeypatch.setattr(copy_rules, "RULES_FILE", broken)
    pool = HostPool(2, 1 << 16, pin=False)
    engine = CopyEngine("auto", pool, [4096], on_device=False)
    assert all(rule.max_bytes == 0 for rule in engine.rules.values())
    plan = plan_copies(_scattered([4096] * 64), "load", engine.path, engine.tile, engine.rules)
    assert not len(plan.kernel.sizes) and len(plan.memcpy.sizes) == 64
    kernel = CopyEngine("kernel", pool, [4096], on_device=False)
    forced = plan_copies(_scattered([4096] * 64), "load", kernel.path, kernel.tile, kernel.rules)
    assert len(forced.kernel.sizes) == 64


# ---------------------------------------------------------------- every layer at once


def _interleaved_regions(num_blocks: int) -> list[LayerRegion]:
    """Layers of two groups in interleaved order (as a layout may list them), with their
    own page sizes, padded block strides and unit offsets."""
    specs = [(0, 4096, 4), (1, 1024, 2), (0, 4096, 4), (1, 1024, 2), (0, 4096, 4)]
    regions, offset = [], 0
    for i, (group, page, per_chunk) in enumerate(specs):
        slot = LayerSlot(f"l{i}", group, page, offset, per_chunk * page, is_draft=group == 1)
        offset += per_chunk * page
        base = (1 << 32) * (i + 1)
        regions.append(LayerRegion(slot, group, per_chunk, base, page + 256, num_blocks))
    return regions


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_layer_at_once_equals_each_layer_alone(data: st.DataObject) -> None:
    num_blocks, num_slots = 40, 6
    regions = _interleaved_regions(num_blocks)
    pool = HostPool(num_slots, sum(r.slot.nbytes for r in regions[:2]) * 3, pin=False)
    copies = UnitCopies(regions, pool)
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), max_size=3, unique=True))
    host_pages, gpu_blocks = [], []
    for per_chunk in (4, 2):
        host_pages.append([s * per_chunk + p for s in slots for p in range(per_chunk)])
        blocks = st.lists(
            st.integers(1, num_blocks - 1),
            min_size=len(host_pages[-1]),
            max_size=len(host_pages[-1]),
        )
        gpu_blocks.append(data.draw(blocks))
    to_host = data.draw(st.booleans())
    alone = [
        layer_descriptors(r, pool, host_pages[r.group_index], gpu_blocks[r.group_index], to_host)
        for r in regions
    ]
    at_once = copies.layers(host_pages, gpu_blocks, to_host)
    for a, b in zip(alone, at_once, strict=True):
        assert a.src.tolist() == b.src.tolist() and a.dst.tolist() == b.dst.tolist()
        assert a.sizes.tolist() == b.sizes.tolist()
    whole, draft = copies.unit(host_pages, gpu_blocks, to_host)
    concat = Descriptors.concat(alone)

    def copies_of(desc: Descriptors) -> list[tuple[int, int, int]]:
        return sorted(zip(desc.src.tolist(), desc.dst.tolist(), desc.sizes.tolist(), strict=True))

    assert copies_of(whole) == copies_of(concat)  # the same copies, grouped by KV-cache group
    assert draft == sum(d.num_bytes for d, r in zip(alone, regions, strict=True) if r.slot.is_draft)


@pytest.mark.parametrize(
    ("group0_blocks", "message"),
    [([1, 2, 3], "differ in length"), ([1, 2, 3, 40], "out of range for layer l0"),
     ([1, 0, 3, 4], "null block for layer l0")],
)  # fmt: skip
def test_every_layer_at_once_refuses_what_each_layer_refuses(
    group0_blocks: list[int], message: str
) -> None:
    regions = _interleaved_regions(40)
    pool = HostPool(2, sum(r.slot.nbytes for r in regions), pin=False)
    with pytest.raises(ValueError, match=message):
        UnitCopies(regions, pool).unit([[0, 1, 2, 3], [0, 1]], [group0_blocks, [5, 6]], True)
    with pytest.raises(ValueError, match="host slot out of range"):
        UnitCopies(regions, pool).unit([[8, 9, 10, 11], [0, 1]], [[1, 2, 3, 4], [5, 6]], True)


def _numbered(start: int, count: int) -> Descriptors:
    ids = np.arange(start, start + count, dtype=np.int64)
    return Descriptors(ids, ids + 1000, np.full(count, 16, dtype=np.int64))


@pytest.mark.parametrize("first", [1, 2, 512])
@pytest.mark.parametrize("piece", [1, 3, 4, 8, 100])
def test_pipeline_groups_cover_every_descriptor_once_in_order(piece: int, first: int) -> None:
    """Layers of 0, 5, 1, 9 and 2 descriptors: every one lands in exactly one group,
    in order; the first group holds at most ``first``, each next at most twice the one
    before and never more than ``piece``, and every group but the last is full; each
    layer's last piece is marked, an empty layer too (its event still comes)."""
    sizes = [0, 5, 1, 9, 2]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    layers = [_numbered(int(start), n) for start, n in zip(starts, sizes, strict=True)]
    groups = pipeline_groups(layers, piece, first)
    flat = [item for group in groups for item in group]
    assert np.concatenate([d.src for _, d, _ in flat]).tolist() == list(range(sum(sizes)))
    held = [sum(len(d.sizes) for _, d, _ in group) for group in groups]
    limit = min(first, piece)
    for count in held[:-1]:
        assert count == limit  # full: a group closes only when it holds its target
        limit = min(2 * limit, piece)
    assert held[-1] <= limit
    assert [layer for layer, _, last in flat if last] == list(range(len(sizes)))
    assert [layer for layer, _, _ in flat] == sorted(layer for layer, _, _ in flat)
    assert pipeline_groups([], piece, first) == []
