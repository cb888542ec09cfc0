"""`vllm-draft-offload copy-speed` end to end on CPU tensors (no timing asserted): every
page size, direction and copy path is run and checked bit for bit."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.speed import copy_rig
from vllm_draft_offload.copy_paths import CopyEngine
from vllm_draft_offload.copy_routes import PairCopier
from vllm_draft_offload.metric_defs import Direction
from vllm_draft_offload.transfers import Descriptors, UnitCopies


def test_dry_run_reports_every_page_size_direction_and_path(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    rc = cli.main(
        ["copy-speed", "--dry-run-cpu", "--total-mib", "1", "--pages-kib", "2,8,64",
         "--reps", "2", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["on_device"] is False
    assert report["layers"] == 1
    rows = report["rows"]
    assert {(r["page_bytes"], r["direction"], r["setting"]) for r in rows} == {
        (kib * 1024, d, s)
        for kib in (2, 8, 64)
        for d in ("load", "store")
        for s in ("memcpy", "kernel", "auto")
    }
    assert all(r["bit_exact"] and r["GBps"] > 0 and r["layers"] == 1 for r in rows)
    # The worker's build from the job's lists, alone and with the batch.
    assert all(r["host_build_ms"] > 0 and r["GBps_from_pairs"] > 0 for r in rows)
    # The median rep from the lists is never above the best one.
    assert all(
        0 < r["vs_pinned_memcpy_from_pairs_median"] <= r["vs_pinned_memcpy_from_pairs"]
        for r in rows
    )
    # On CPU the copy alone is the wall time of the same call (no stream to hold).
    assert all(r["device_GBps"] > 0 and r["host_enqueue_ms"] > 0 for r in rows)
    # Every page is its own copy (none of them merge), by the path its setting says.
    for r in rows:
        count = (1 << 20) // r["page_bytes"]
        assert r["kernel_copies"] + r["memcpy_copies"] == count
        if r["setting"] != "auto":
            assert r["path"] == f"{r['setting']} (cpu)"
            assert r["kernel_copies"] == (count if r["setting"] == "kernel" else 0)
            # What the connector runs: the pair kernel for kernel, DMA for memcpy.
            assert r["pair_kernel"] == (r["setting"] == "kernel")
    # auto runs last, with the table derived from this run's kernel and memcpy rows.
    assert [r["setting"] for r in rows][-6:] == ["auto"] * 6
    assert report["auto_rules_source"] == "derived from this run"
    for r in rows:
        if r["setting"] == "auto":
            rule = report["auto_rules"][r["direction"]]
            to_kernel = r["page_bytes"] <= rule["max_bytes"]
            assert r["kernel_copies"] == ((1 << 20) // r["page_bytes"] if to_kernel else 0)
            assert r["pair_kernel"] == to_kernel
    summary = report["summary"]
    assert summary["all_bit_exact"] is True
    for direction in ("load", "store"):
        assert summary[direction]["goal_0.8_met"] is None  # says nothing off a GPU
        device_worst = summary[direction]["kernel_device_min_vs_pinned_from_4KiB"]
        assert device_worst == min(
            r["device_vs_pinned_memcpy"]
            for r in rows
            if r["direction"] == direction and r["setting"] == "kernel"
            and r["page_bytes"] >= 4096
        )  # fmt: skip
        assert set(summary[direction]["vs_pinned_by_page"]) == {"2048", "8192", "65536"}


def test_auto_uses_the_shipped_table_without_both_forced_paths(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    argv = ["copy-speed", "--dry-run-cpu", "--total-mib", "0.25", "--pages-kib", "4",
            "--reps", "1", "--paths", "kernel,auto", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["auto_rules_source"].startswith("table: NVIDIA H100")
    assert report["auto_rules"]["load"]["max_bytes"] == 256 * 1024


def test_kernel_knobs_are_recorded_and_bad_ones_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "copy.json"
    argv = ["copy-speed", "--dry-run-cpu", "--total-mib", "0.25", "--pages-kib", "4",
            "--reps", "1", "--paths", "kernel", "--kernel-block-kib", "64",
            "--kernel-warps", "8", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["kernel_block_bytes"], report["kernel_warps"]) == (64 * 1024, 8)
    assert all(r["bit_exact"] for r in report["rows"])
    for flag, value in (("--kernel-block-kib", "24"), ("--kernel-warps", "3")):
        with pytest.raises(SystemExit):
            cli.main(["copy-speed", "--dry-run-cpu", flag, value, "--out", str(out)])
        assert flag in capsys.readouterr().err


def test_rules_are_written_only_from_a_gpu_run_of_both_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra in (["--dry-run-cpu"], ["--paths", "kernel,auto"]):
        with pytest.raises(SystemExit):
            cli.main(["copy-speed", "--write-rules", str(tmp_path / "r.json"),
                      "--out", str(tmp_path / "c.json"), *extra])  # fmt: skip
        assert "--write-rules" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_scattered_pages_never_merge_and_a_wrong_copy_is_caught() -> None:
    rig = copy_rig.Rig(64 * 1024, on_device=False)
    try:
        page, count = 4096, 16
        blocks, load, store = copy_rig.scattered_pages(
            rig.pool.base, rig.device.data_ptr(), page, count, seed=3
        )
        assert len(set(blocks.tolist())) == count and blocks.max() < 2 * count
        assert blocks.min() > 0  # never vLLM's null block
        assert len(load.coalesced().sizes) == count  # no two pages merge
        engine = CopyEngine("auto", rig.pool, [page], on_device=False)

        def exact(desc: Descriptors, direction: Direction) -> bool:
            enqueue = functools.partial(engine.run, desc, direction)
            return rig.bit_exact(enqueue, direction, blocks, page)

        assert exact(load, "load")
        assert exact(store, "store")
        assert not exact(load.select(np.arange(count) != 5), "load")  # one page left behind
        # Off by a block (the one before: blocks are odd, the last is the tensor's last).
        assert not exact(Descriptors(load.src, load.dst - page, load.sizes), "load")
    finally:
        rig.close()


def test_one_layer_is_the_batch_copy_speed_always_ran() -> None:
    """--layers 1 (the default): one layer's pairs are the scattered pages' (same host
    pages, blocks and order), in the one region copy-speed always gave PairCopier."""
    page, count = 4096, 32
    rig = copy_rig.Rig(count * page, on_device=False)
    try:
        engine = CopyEngine("kernel", rig.pool, [page], on_device=False)
        batch = copy_rig.LayerBatch(rig, engine, page, layers=1)
        blocks, load, store = copy_rig.scattered_pages(
            rig.pool.base, rig.device.data_ptr(), page, count, seed=page
        )
        assert np.array_equal(batch.blocks, blocks)
        for direction in ("load", "store"):
            pairs = batch.inputs[direction]
            assert np.array_equal(pairs.host_pages[0], np.arange(count))
            assert np.array_equal(pairs.gpu_blocks[0], blocks)
        (region,) = batch.copier.copies.regions
        assert (region.slot.offset, region.slot.nbytes, region.pages_per_unit) == (
            0,
            count * page,
            count,
        )
        assert (region.device_base, region.device_block_stride, region.num_blocks) == (
            rig.device.data_ptr(),
            page,
            2 * count,
        )
        for to_host, old in ((False, load), (True, store)):
            (built,) = batch.copier.copies.layers(batch.host_pages, batch.gpu_blocks, to_host)
            for field in ("src", "dst", "sizes"):
                assert np.array_equal(getattr(built, field), getattr(old, field))
    finally:
        rig.close()


@pytest.mark.parametrize("setting", ["memcpy", "kernel"])
def test_every_layer_of_a_multi_layer_batch_is_copied_and_checked(setting: str) -> None:
    """Four layers at the same blocks, each its own host and device region: the
    worker's loads (run_layers) and stores (run) are bit exact, by the pair kernel
    (kernel) or the descriptor path (memcpy), and a copy that misses or mixes up one
    layer is caught."""
    page, layers, per_layer = 4096, 4, 8
    rig = copy_rig.Rig(layers * per_layer * page, on_device=False)
    try:
        engine = CopyEngine(setting, rig.pool, [page], on_device=False)  # type: ignore[arg-type]
        batch = copy_rig.LayerBatch(rig, engine, page, layers)
        regions = batch.copier.copies.regions
        assert len({r.device_base for r in regions}) == layers
        assert [r.slot.offset for r in regions] == [k * per_layer * page for k in range(layers)]
        for direction in copy_rig.DIRECTIONS:
            assert batch.pair_kernel_layers(direction) == [setting == "kernel"] * layers
            # One set of pairs for every layer.
            assert [len(pages) for pages in batch.inputs[direction].host_pages] == [per_layer]

        def exact(direction: Direction, enqueue: copy_rig.Enqueue | None = None) -> bool:
            enqueue = enqueue or batch.enqueue(direction)
            return rig.bit_exact(enqueue, direction, batch.blocks, page, layers)

        for direction in copy_rig.DIRECTIONS:
            assert exact(direction)
            assert exact(direction, batch.enqueue(direction, from_pairs=True))
        # Layer 2 never loaded.
        pairs = batch.inputs["load"]

        def skip_layer_2(stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
            return batch.copier.run_layers(pairs, [0, 1, 3], "load", stream)[0]

        assert not exact("load", skip_layer_2)
        # Layer 2 at layer 1's host pages (its offset in the unit), or at layer 1's blocks.
        at_host_of_1 = dataclasses.replace(regions[2].slot, offset=regions[1].slot.offset)
        for wrong_2 in (
            dataclasses.replace(regions[2], slot=at_host_of_1),
            dataclasses.replace(regions[2], device_base=regions[1].device_base),
        ):
            wrong = [regions[0], regions[1], wrong_2, regions[3]]
            batch.copier = PairCopier(UnitCopies(wrong, rig.pool), engine)
            assert not exact("load")
            assert not exact("store")
    finally:
        rig.close()


def test_dry_run_of_several_layers(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    argv = ["copy-speed", "--dry-run-cpu", "--total-mib", "1", "--pages-kib", "4,16",
            "--reps", "1", "--layers", "4", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["layers"] == 4 and report["total_bytes"] == 1 << 20
    rows = report["rows"]
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        assert r["layers"] == 4 and r["bit_exact"]
        # The same pages in all, split between the layers: none merge.
        assert r["kernel_copies"] + r["memcpy_copies"] == (1 << 20) // r["page_bytes"]
        if r["setting"] != "auto":
            assert r["pair_kernel"] == (r["setting"] == "kernel")
    assert report["summary"]["all_bit_exact"] is True


@pytest.mark.parametrize(
    ("layers", "pages_kib"), [("3", "4"), ("0", "4"), ("-2", "4"), ("16", "4,24")]
)
def test_layers_must_split_every_page_size_evenly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layers: str, pages_kib: str
) -> None:
    """1 MiB is 256 pages of 4 KiB (not a multiple of 3) and 42 of 24 KiB."""
    with pytest.raises(SystemExit):
        cli.main(["copy-speed", "--dry-run-cpu", "--total-mib", "1", "--layers", layers,
                  "--pages-kib", pages_kib, "--out", str(tmp_path / "c.json")])  # fmt: skip
    assert "--layers" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
