"""The L3 fetch benchmark runs end to end on a tiny configuration (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.speed import l3_fetch as l3_fetch_speed


def test_fetch_speed_reports_cold_and_warm_by_threads_next_to_the_raw_disk(
    tmp_path: Path,
) -> None:
    out = tmp_path / "speed.json"
    rc = cli.main(
        ["l3-speed", "--url", f"fs://{tmp_path / 'l3'}", "--unit-mb", "0.5", "--units", "3",
         "--threads", "1,2", "--reps", "1", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    for mode in ("cold", "warm"):
        # the worker's default path (one unit per thread) beside l3.spread_reads' and
        # l3.threads_per_unit's (4 by default: with 1 or 2 threads, one unit at a time)
        for path in ("", "_spread", "_split"):
            assert set(report[f"fetch_GBps{path}"][mode]) == {"1", "2"}
            assert all(v > 0 for v in report[f"fetch_GBps{path}"][mode].values())
            assert all(v > 0 for v in report[f"first_unit_s{path}"][mode].values())
    # Warm fetches are also set against a raw read that lands in memory, as a fetch must.
    assert set(report["fetch_vs_raw"]) == {"cold", "warm", "warm_into_memory"}
    assert all(set(ratios) == {"1", "2"} for ratios in report["fetch_vs_raw"].values())
    assert report["cold_method"] == "fadvise_dontneed"
    assert report["fetch_reader"].split()[0] in ("native", "python")
    raw = report["raw"]
    assert raw["directory"] == str(tmp_path / "l3")
    assert raw["write_GBps"] > 0 and raw["bytes"] > 0
    assert set(raw["read_cold_GBps"]) == set(raw["read_warm_GBps"]) == {"1", "2"}
    assert set(raw["read_warm_into_memory_GBps"]) == {"1", "2"}
    # The baseline file is gone; only the units remain.
    assert {p.suffix for p in (tmp_path / "l3").iterdir()} == {".data"}
    assert report["units"] == 3
    assert report["threads_per_unit"] == 4


def test_fetch_speed_warm_only_on_redis_has_no_raw_baseline(tmp_path: Path) -> None:
    from redis_fixture import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        import pytest

        pytest.skip("redis-server not installed")
    with RedisServer(tmp_path / "redis") as server:
        report = l3_fetch_speed.main(
            ["--url", server.url, "--unit-mb", "0.25", "--units", "2", "--threads", "1",
             "--reps", "1", "--modes", "warm"]
        )  # fmt: skip
    assert set(report["fetch_GBps"]) == {"warm"} and "raw" not in report
    # Redis objects arrive whole: not spread, not split
    assert "fetch_GBps_spread" not in report and "fetch_GBps_split" not in report


def test_stages_report_fetch_next_to_a_plain_read_with_the_split(tmp_path: Path) -> None:
    from vllm_draft_offload import fast_io

    readers = ["native", "python"] if fast_io.AVAILABLE else ["python"]
    out = tmp_path / "stages.json"
    rc = cli.main(
        ["l3-stages", "--dir", str(tmp_path / "l3"), "--unit-mb", "0.6", "--units", "3",
         "--threads", "2", "--reps", "1", "--engine-loop-ms", "0,0.5", "--writes", "0,2",
         "--reader", ",".join(readers), "--piece-kib", "64", "--native-piece-kib", "32",
         "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    # Where it ran: the GPU (here none) and the versions behind the figures.
    assert report["gpu"] == "cpu"
    assert report["versions"]["lmcache"] and report["versions"]["xxhash"]
    assert report["native_available"] == fast_io.AVAILABLE
    assert report["fetch_reader"] == fast_io.reader()
    assert fast_io.NATIVE == fast_io.AVAILABLE  # the run switched readers and back
    rows = report["scenarios"]
    # Every reader x engine loop x writes (not held, and held to one at a time).
    assert [
        (r["reader"], r["piece_kib"], r["engine_loop_ms"], r["writes"], r["writes_held"])
        for r in rows
    ] == [
        (reader, {"native": 32, "python": 64}[reader], loop, writes, held)
        for reader in readers
        for loop in (0, 0.5)
        for writes, held in ((0, False), (2, False), (2, True))
    ]
    unit = report["unit_bytes"]
    assert unit == 36 * 16 * (int(0.6 * 2**20) // 36 // 16)
    for row in rows:
        assert row["fetch_GBps"] > 0 and row["raw_GBps"] > 0
        assert row["fetch_vs_raw"] == row["fetch_GBps"] / row["raw_GBps"]
        stages = row["stages_ms_per_unit"]
        assert stages["read_and_checksum"] > 0
        assert stages["total"] >= stages["read_and_checksum"]
        # The payload in one call (the header came with LMCache's metadata) ...
        assert row["hashed_reads_per_unit"] == 1
        if row["reader"] == "native":  # ... whose pieces never leave C
            assert stages["read"] is None and stages["checksum"] is None
            assert row["pieces_per_unit"] is None
        else:  # ... in pieces, each read and hashed in Python
            assert stages["read"] > 0 and stages["checksum"] > 0
            assert row["pieces_per_unit"] == -(-unit // (row["piece_kib"] << 10))
    assert len(list((tmp_path / "l3").glob("*.data"))) == 3
