"""`vllm-draft-offload restore-speed`: L3 bookkeeping on CPU (the engines need a GPU)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from vllm_draft_offload.bench.speed import restore as restore_speed
from vllm_draft_offload.l3_calibration import object_name


def args(**over: object) -> argparse.Namespace:
    base = {
        "config": "ours_l3_fill", "cpu_gib": 1, "chunk_size": 256, "l3_dir": "/tmp/x",
        "l3_io_threads": None, "l3_backlog_gib": None, "l3_staging_mb": None,
    }  # fmt: skip
    return argparse.Namespace(**{**base, **over})


def test_l3_runs_with_default_connector_settings_unless_a_flag_says_so() -> None:
    extra = restore_speed.connector_config(args())["kv_connector_extra_config"]
    # Decision logging changes no behaviour: the rest are the connector's defaults.
    assert extra["l3"] == {"enabled": True, "log_decisions": True}
    assert extra["lmcache.extra_config"] == {"save_chunk_meta": True}
    extra = restore_speed.connector_config(
        args(l3_io_threads=8, l3_backlog_gib=16, l3_staging_mb=2048)
    )["kv_connector_extra_config"]
    assert extra["l3"] == {
        "enabled": True,
        "log_decisions": True,
        "io_threads": 8,
        "max_pending_write_bytes": 16 << 30,
    }
    assert extra["lmcache.extra_config"]["draft_offload.l3_staging_mb"] == 2048


def test_write_throughput_counts_whole_units_between_first_and_last_write(tmp_path: Path) -> None:
    now = time.time_ns()
    for i in range(4):
        path = tmp_path / f"u{i}.data"
        path.write_bytes(b"x" * 1000)
        os.utime(path, ns=(now, now + i * 500_000_000))  # one every 0.5 s
    (tmp_path / "u9.123-4-5.tmp").write_bytes(b"x" * 50)  # a write in flight: not a unit
    # The engines' prefill calibration is not a unit either.
    calibration = object_name(b"salt", "NVIDIA H200")
    (tmp_path / f"vllm-draft-offload@1@0@1{calibration}@uint8.data").write_bytes(b"{}")
    files = restore_speed.unit_files(tmp_path)
    assert [f.name for f in files] == ["u0.data", "u1.data", "u2.data", "u3.data"]
    got = restore_speed.write_throughput(files)
    assert got["files"] == 4 and got["bytes"] == 4000
    assert abs(got["first_to_last_s"] - 1.5) < 1e-6
    assert abs(got["GBps"] - 3000 / 1.5 / 1e9) < 1e-15


def test_summary_reports_writes_restarts_and_raw_disk() -> None:
    report = {
        "tokens": 1024,
        "kv_bytes_per_token": 100,
        "raw_disk": {
            "write_GBps": 2.0, "read_direct_GBps": {"1": 1.5},
            "read_cold_GBps": {"1": 1.2}, "read_warm_GBps": {"1": 6.0},
        },
        "configs": {
            "recompute": {"fresh_s": [0.5, 0.5, 0.5]},
            "ours_l3_fill": {
                "fresh_s": [0.5], "l3_files": 11, "units_expected": 12, "first_request_s": 0.8,
                "l3_counters": {"stored_chunks_l3": 11.0, "l3_write_dropped": 1.0},
                "l3_write": {"GBps": 1.8},
            },
            "ours_l3_cold": {
                "fresh_s": [0.5], "hit_s": [0.4, 0.6], "hit_cached": [1023, 768],
                "cpu_hit_s": [0.05],
            },
            "ours_l3": {
                "fresh_s": [0.5], "hit_s": [0.2, 0.2], "hit_cached": [1023, 1023],
                "l3_decisions": [
                    "(EngineCore pid=1) INFO [l3_decisions.py:80] L3 decision req=3 policy=cost: x",
                    "(EngineCore pid=1) INFO [l3_calibration.py:90] prefill calibration loaded",
                ],
            },
        },
    }  # fmt: skip
    restore_speed.summarize(report)
    summary = report["summary"]
    writes = summary["ours_l3_writes"]
    assert writes["written_fraction"] == 11 / 12
    assert writes["l3_write_dropped"] == 1.0
    assert abs(writes["write_vs_raw"] - 0.9) < 1e-9
    cold = summary["ours_l3_restart_cold"]
    assert cold["hit_tokens_per_prompt"] == [1023, 768]
    assert cold["ttft_vs_recompute_per_prompt"] == [0.4 / 0.5, 0.6 / 0.5]
    restart = summary["ours_l3_restart"]
    assert restart["ttft_vs_recompute_per_prompt"] == [0.4, 0.4]
    # The first prompt against a fresh engine's first request.
    assert restart["first_prompt_vs_first_request_recompute"] == 0.2 / 0.8
    assert restart["storage_decisions"] == ["L3 decision req=3 policy=cost: x"]
    assert summary["raw_disk"]["read_cold_GBps"] == {"1": 1.2}


def test_connector_log_keeps_decisions_and_the_tail() -> None:
    output = "\n".join(
        ["vLLM noise"] * 50
        + ["INFO L3 decision req=0 policy=cost: cpu chunks 0 ... -> fetched", "more noise"]
    )
    got = restore_speed.connector_log(output, "LMCache noise")
    assert got["l3_decisions"] == [
        "INFO L3 decision req=0 policy=cost: cpu chunks 0 ... -> fetched"
    ]
    assert got["log_tail"]["stdout"].endswith("more noise")
    assert got["log_tail"]["stderr"] == "LMCache noise"
