"""The raw disk passes of the L3 benchmarks, on a tiny file (no timing asserted)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_draft_offload.bench.speed import disk_baseline as disk


def test_measure_reports_every_pass_by_threads_and_removes_its_file(tmp_path: Path) -> None:
    report = disk.measure(
        tmp_path, disk.BLOCK // 2, threads=(1, 3), drop_caches=False, reps=2, into_memory=True
    )
    assert report["bytes"] == disk.BLOCK  # at least one whole block
    assert report["write_GBps"] > 0
    for kind in ("read_cold_GBps", "read_warm_GBps", "read_warm_into_memory_GBps"):
        assert set(report[kind]) == {"1", "3"} and all(v > 0 for v in report[kind].values())
    if report["write_direct"]:
        assert set(report["read_direct_GBps"]) == {"1", "3"}
    assert report["cold_method"] == "fadvise_dontneed"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_read_pass_reads_every_byte_of_an_uneven_file(tmp_path: Path, threads: int) -> None:
    path = tmp_path / "f.bin"
    block = 64 << 10
    path.write_bytes(os.urandom(3 * block + 4096))  # ranges do not split evenly
    assert disk.read_pass(path, threads, block=block) > 0
    assert disk.read_pass(path, threads, direct=True, block=block) > 0
    assert disk.read_pass(path, threads, block=block, into_memory=True) > 0


def test_write_pass_writes_whole_blocks_and_syncs(tmp_path: Path) -> None:
    block = 64 << 10
    result = disk.write_pass(tmp_path, 5 * block + 100, block=block)
    assert result["bytes"] == 5 * block
    assert Path(result["path"]).stat().st_size == 5 * block


def test_cache_reads_every_byte_of_every_file(tmp_path: Path) -> None:
    sizes = [disk.BLOCK + 4096, 100, 3 * disk.BLOCK]  # past a block, inside one, several
    paths = []
    for i, size in enumerate(sizes):
        paths.append(tmp_path / f"{i}.data")
        paths[-1].write_bytes(os.urandom(size))
    disk.evict(paths)
    report = disk.cache(paths, threads=2)
    assert report["files"] == 3 and report["bytes"] == sum(sizes)
