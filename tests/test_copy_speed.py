"""`vllm-draft-offload copy-speed` end to end on CPU tensors (no timing asserted): every
page size, direction and copy path is run and checked bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.speed import copy as copy_speed
from vllm_draft_offload.copy_paths import CopyEngine


def test_dry_run_reports_every_page_size_direction_and_path(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    rc = cli.main(
        ["copy-speed", "--dry-run-cpu", "--total-mib", "1", "--pages-kib", "2,8,64",
         "--reps", "2", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["on_device"] is False
    rows = report["rows"]
    assert {(r["page_bytes"], r["direction"], r["setting"]) for r in rows} == {
        (kib * 1024, d, s)
        for kib in (2, 8, 64)
        for d in ("load", "store")
        for s in ("memcpy", "kernel", "auto")
    }
    assert all(r["bit_exact"] and r["GBps"] > 0 for r in rows)
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
    rig = copy_speed.Rig(64 * 1024, on_device=False)
    try:
        page, count = 4096, 16
        blocks, load, store = copy_speed.scattered_pages(
            rig.pool.base, rig.device.data_ptr(), page, count, seed=3
        )
        assert len(set(blocks.tolist())) == count and blocks.max() < 2 * count
        assert blocks.min() > 0  # never vLLM's null block
        assert len(load.coalesced().sizes) == count  # no two pages merge
        engine = CopyEngine("auto", rig.pool, [page], on_device=False)
        assert rig.bit_exact(engine, load, "load", blocks, page)
        assert rig.bit_exact(engine, store, "store", blocks, page)
        short = load.select(np.arange(count) != 5)  # one page left behind
        assert not rig.bit_exact(engine, short, "load", blocks, page)
        # Off by a block (the one before: blocks are odd, the last is the tensor's last).
        stray = copy_speed.Descriptors(load.src, load.dst - page, load.sizes)
        assert not rig.bit_exact(engine, stray, "load", blocks, page)
    finally:
        rig.close()
