"""`vllm-draft-offload restore-speed`: its bookkeeping and speed table on CPU (the engines
need a GPU)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from vllm_draft_offload.bench.speed import hook_cost, l3_dir, restore_engine, restore_report, shapes
from vllm_draft_offload.bench.speed import restore as restore_speed
from vllm_draft_offload.l3_calibration import object_name


def args(**over: object) -> argparse.Namespace:
    base = {
        "config": "ours_l3_fill", "cpu_gib": 1, "chunk_size": 256, "l3_dir": "/tmp/x",
        "l3_io_threads": None, "l3_backlog_gib": None, "l3_staging_mb": None,
    }  # fmt: skip
    return argparse.Namespace(**{**base, **over})


def test_l3_runs_with_default_connector_settings_unless_a_flag_says_so() -> None:
    extra = restore_engine.connector_config(args())["kv_connector_extra_config"]
    # Decision logging changes no behaviour: the rest are the connector's defaults.
    assert extra["l3"] == {"enabled": True, "log_decisions": True}
    assert extra["lmcache.extra_config"] == {"save_chunk_meta": True}
    extra = restore_engine.connector_config(
        args(l3_io_threads=8, l3_backlog_gib=16, l3_staging_mb=2048)
    )["kv_connector_extra_config"]
    assert extra["l3"] == {
        "enabled": True,
        "log_decisions": True,
        "io_threads": 8,
        "max_pending_write_bytes": 16 << 30,
    }
    assert extra["lmcache.extra_config"]["draft_offload.l3_staging_mb"] == 2048
    spread = restore_engine.connector_config(args(l3_spread_reads=True))
    assert spread["kv_connector_extra_config"]["l3"] == {
        "enabled": True,
        "log_decisions": True,
        "spread_reads": True,
    }


def test_l3_variants_are_warm_restarts_with_their_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--l3-variants: more warm restarts, each with its settings and fresh prompts of its
    own (a prompt another restart prefilled would hit storage)."""
    assert restore_speed.variant_engine("spread+strict") == "ours_l3_spread_strict"
    variant = args(config="ours_l3_spread_strict", l3_variant="spread+strict")
    assert restore_engine.is_restart(variant.config)
    assert not restore_engine.is_restart(args().config)  # the fill engine
    assert restore_engine.connector_config(variant)["kv_connector_extra_config"]["l3"] == {
        "enabled": True,
        "log_decisions": True,
        "spread_reads": True,
        "wait_past_allowance": False,
    }
    overlap = args(config="ours_l3_overlap", l3_variant="overlap")
    l3 = restore_engine.connector_config(overlap)["kv_connector_extra_config"]["l3"]
    assert l3["overlap_restore"] is True
    for bad in (
        ["--l3-variants", "fast"],
        ["--l3-variants", "spread+spread"],
        ["--l3-variants", "strict"],
    ):
        with pytest.raises(SystemExit):
            restore_speed.main(["--out", "/tmp/never.json", "--configs", "ours", *bad])
        assert "--l3-variants" in capsys.readouterr().err


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
    files = l3_dir.unit_files(tmp_path)
    assert [f.name for f in files] == ["u0.data", "u1.data", "u2.data", "u3.data"]
    got = l3_dir.write_throughput(files)
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
            "read_warm_into_memory_GBps": {"1": 2.048, "8": 4.096},
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
                "fresh_s": [0.5, 0.4, 0.6], "hit_s": [0.2, 0.2], "hit_cached": [1023, 1023],
                "fresh_busy_s": [0.55, 0.6, 0.65],
                "busy_hit_s": [0.3, 0.6], "busy_hit_cached": [1023, 0],
                "phases": {
                    "hit_s": [
                        {"ttft_s": 0.2, "waiting_s": 0.1, "scheduled_to_first_token_s": 0.08,
                         "l3_thread_seconds": {"read_wall": 1.0, "read_cpu": 0.5,
                                               "write_wall": 0.0, "write_cpu": 0.0}},
                        {"ttft_s": 0.2, "waiting_s": None, "scheduled_to_first_token_s": 0.09,
                         "l3_thread_seconds": {"read_wall": 3.0, "read_cpu": 1.0,
                                               "write_wall": 0.0, "write_cpu": 0.0}},
                    ],
                },
                "l3_decisions": [
                    "(EngineCore pid=1) INFO [l3_decisions.py:80] L3 decision req=3 policy=cost: x",
                    "(EngineCore pid=1) INFO [l3_decisions.py:80] L3 decision req=4 policy=cost: "
                    "cpu chunks 0, storage range [0, 4) found 4 -> fetched; fetch 4, landed 4; "
                    "est load 0.1 s (unit 0.01 s) vs recompute 0.5 s (fit); probe none; "
                    "resident 4/4; waited 0.2 s of 0.5 s (lookup 0.01 s, fetch 0.0001 s)",
                    # A fetch given up with part landed is not a whole fetch: not timed.
                    "(EngineCore pid=1) INFO [l3_decisions.py:80] L3 decision req=5 policy=cost: "
                    "cpu chunks 0, storage range [0, 4) found 4 -> fetched; fetch 4, landed 2; "
                    "est load 0.1 s (unit 0.01 s) vs recompute 0.5 s (fit); probe none; "
                    "resident 4/4; waited 0.2 s of 0.5 s (lookup 0.01 s, fetch 0.0001 s)",
                    "(EngineCore pid=1) INFO [l3_calibration.py:90] prefill calibration loaded",
                ],
            },
        },
    }  # fmt: skip
    restore_report.summarize(report)
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
    # Hits and recompute behind storage writes, against the quiet recompute.
    assert restart["busy_hit_tokens_per_prompt"] == [1023, 0]
    assert restart["busy_ttft_vs_recompute_per_prompt"] == [0.3 / 0.5, 0.6 / 0.5]
    assert abs(restart["fresh_busy_vs_fresh"] - 0.6 / 0.5) < 1e-12
    hit_phases = restart["phases"]["hit_s"]
    assert hit_phases["waiting_s"] == 0.1  # the request without stats is left out
    assert hit_phases["scheduled_to_first_token_s"] == 0.09
    assert hit_phases["l3_read_thread_s"] == 2.0
    assert hit_phases["l3_read_cpu_of_wall"] == 1.5 / 4.0
    assert "l3_write_thread_s" not in hit_phases  # nothing written during the hits
    assert restart["storage_decisions"][0] == "L3 decision req=3 policy=cost: x"
    # 4 units of 256 tokens x 100 bytes in 0.1 ms, against the raw read into memory.
    assert restart["fetch_GBps"] == [4 * 25600 / 0.0001 / 1e9]
    ratios = restart["fetch_vs_read_warm_into_memory"]
    assert abs(ratios["1"] - 0.5) < 1e-9 and abs(ratios["8"] - 0.25) < 1e-9
    assert summary["raw_disk"]["read_warm_into_memory_GBps"] == {"1": 2.048, "8": 4.096}
    assert summary["raw_disk"]["read_cold_GBps"] == {"1": 1.2}
    assert "ours_l3_restart_strict" not in summary
    # Against a fresh prompt behind the same writes too (median 0.6).
    assert restart["busy_ttft_vs_busy_recompute_per_prompt"] == [0.3 / 0.6, 0.6 / 0.6]
    report["configs"]["ours_l3_strict"] = {
        "fresh_s": [0.5], "hit_s": [0.25, 0.3], "hit_cached": [1023, 512],
    }  # fmt: skip
    restore_report.summarize(report)
    strict = report["summary"]["ours_l3_restart_strict"]
    assert strict["ttft_vs_recompute_per_prompt"] == [0.5, 0.6]
    assert strict["hit_tokens_per_prompt"] == [1023, 512]


def test_each_request_is_set_against_fresh_prompts_of_its_own_condition() -> None:
    """scheduled_to_first_token_extra_s: a request's time from scheduling to first token
    minus the median of the fresh prompts' that ran in its condition (quiet ones for hits
    and short hits, those behind writes for hits behind writes); a request vLLM gave no
    stats for stays None, and a kind with no fresh prompt beside it is left out."""

    def phase(sched: float | None) -> dict[str, float | None]:
        return {"ttft_s": 1.0, "waiting_s": 0.0, "scheduled_to_first_token_s": sched}

    phases = {
        "fresh_s": [phase(0.40), phase(0.50), phase(0.45)],
        "fresh_busy_s": [phase(0.52), phase(None), phase(0.48)],
        "hit_s": [phase(0.06), phase(0.47)],
        "short_hit_s": [phase(0.47), phase(None)],
        "odd_fresh_s": [phase(0.44)],
        "busy_hit_s": [phase(0.53)],
    }
    extra = restore_report.prefill_extra_s(phases)
    assert extra == {
        "hit_s": [pytest.approx(0.06 - 0.45), pytest.approx(0.02)],
        "short_hit_s": [pytest.approx(0.02), None],
        "odd_fresh_s": [pytest.approx(-0.01)],
        "busy_hit_s": [pytest.approx(0.01)],  # the upper median of two, as in the whole report
    }
    assert "cpu_hit_s" not in extra
    assert restore_report.prefill_extra_s({"hit_s": [phase(0.4)]}) == {}
    result = {
        "fresh_s": [0.5], "hit_s": [0.2], "hit_cached": [1023],
        "short_hit_s": [0.49, 0.5], "short_hit_cached": [256, 256], "phases": phases,
    }  # fmt: skip
    extras = restore_report.restart_extras(result, 0.5)
    assert extras["short_hit_tokens_per_prompt"] == [256, 256]
    assert extras["short_hit_ttft_s_per_prompt"] == [0.49, 0.5]
    assert extras["scheduled_to_first_token_extra_s"] == extra


def test_short_hits_reach_each_engine_and_bad_counts_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--short-hit-chunks is handed to every engine; a count that leaves no chunk to
    compute, or more reps than the restarts' prompt seeds allow, is refused by name."""
    refused = [
        (["--short-hit-chunks", "4", "--tokens", "1024"], "must leave a chunk"),
        (["--short-hit-chunks", "1", "--reps", "11"], "at most 10 --reps"),
    ]
    for bad, why in refused:
        with pytest.raises(SystemExit):
            restore_speed.main(["--out", str(tmp_path / "x.json"), *bad])
        err = capsys.readouterr().err
        assert "--short-hit-chunks" in err and why in err, err
    commands: list[list[str]] = []

    def engine(cmd: list[str], env: dict[str, str], timeout_s: float | None):  # noqa: ANN202
        commands.append(cmd)
        raise SystemExit(0)

    monkeypatch.setattr(restore_speed, "run_child", engine)
    with pytest.raises(SystemExit):
        restore_speed.main(
            ["--out", str(tmp_path / "y.json"), "--shape", "small", "--configs", "recompute",
             "--short-hit-chunks", "2", "--l3-dir", str(tmp_path / "l3")]
        )  # fmt: skip
    cmd = commands[0]
    assert cmd[cmd.index("--short-hit-chunks") + 1] == "2"


def test_a_staging_setting_of_0_reaches_the_engines_and_none_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--store-staging-units 0 (stores unstaged) is handed on, not dropped as falsy;
    without the flag the engines keep the connector's default."""
    commands: list[list[str]] = []

    def engine(cmd: list[str], env: dict[str, str], timeout_s: float | None):  # noqa: ANN202
        commands.append(cmd)
        raise SystemExit(0)

    monkeypatch.setattr(restore_speed, "run_child", engine)
    for staging in (["--store-staging-units", "0"], []):
        with pytest.raises(SystemExit):
            restore_speed.main(
                ["--out", str(tmp_path / "y.json"), "--shape", "small", "--configs", "ours",
                 "--l3-dir", str(tmp_path / "l3"), *staging]
            )  # fmt: skip
    given, default = commands
    assert given[given.index("--store-staging-units") + 1] == "0"
    assert "--store-staging-units" not in default


def test_connector_log_keeps_decisions_and_the_tail() -> None:
    output = "\n".join(
        ["vLLM noise"] * 50
        + ["INFO L3 decision req=0 policy=cost: cpu chunks 0 ... -> fetched", "more noise"]
    )
    got = restore_report.connector_log(output, "LMCache noise")
    assert got["l3_decisions"] == [
        "INFO L3 decision req=0 policy=cost: cpu chunks 0 ... -> fetched"
    ]
    assert got["log_tail"]["stdout"].endswith("more noise")
    assert got["log_tail"]["stderr"] == "LMCache noise"


def test_small_shape_is_a_1b_geometry_with_a_two_layer_drafter() -> None:
    target, draft = shapes.SHAPES["small"]
    assert (target["num_hidden_layers"], target["num_key_value_heads"], target["head_dim"]) == (
        16, 8, 64,
    )  # fmt: skip
    assert draft["num_hidden_layers"] == 2 and draft["head_dim"] == 64
    # K and V of 16 tokens, bf16: 32 KiB a layer (the Llama-8B shape's is 64 KiB).
    assert shapes.page_bytes(target) == 32 * 1024
    assert shapes.page_bytes(shapes.LLAMA8B) == 64 * 1024
    assert shapes.kv_bytes_per_token(target) == 16 * 2 * 8 * 64 * 2


def test_copy_path_reaches_our_connector_only_when_given() -> None:
    extra = restore_engine.connector_config(args(config="ours"))["kv_connector_extra_config"]
    assert "copy_path" not in extra  # the connector's own default
    extra = restore_engine.connector_config(args(config="ours", copy_path="memcpy"))[
        "kv_connector_extra_config"
    ]
    assert extra["copy_path"] == "memcpy"
    native = restore_engine.connector_config(args(config="native", copy_path="memcpy"))
    assert "copy_path" not in native["kv_connector_extra_config"]


def test_staging_and_the_audit_reach_our_connector_only_when_asked() -> None:
    def extra(**over: object) -> dict:
        return restore_engine.connector_config(args(**over))["kv_connector_extra_config"]

    assert "store_staging_units" not in extra(config="ours")  # the connector's default
    assert extra(config="ours", store_staging_units=0)["store_staging_units"] == 0
    assert "audit_recompute_fraction" not in extra(config="ours")
    assert extra(config="ours_audit")["audit_recompute_fraction"] == 1.0
    native = restore_engine.connector_config(args(config="native", store_staging_units=0))
    assert "store_staging_units" not in native["kv_connector_extra_config"]


def test_the_audited_stores_reach_the_summary_and_the_table() -> None:
    report = _shape_report("small", [0.3, 0.1, 0.1], [1.3, 0.2, 0.2])
    audited = {"fresh_s": [1.0], "store_GBps_metric": [40.0, 41.0, 42.0]}
    report["configs"]["ours_audit"] = {
        **audited, "audit_recompute_units": {"ok": 12.0, "mismatch": 0.0, "error": 0.0}
    }  # fmt: skip
    restore_report.summarize(report)
    assert report["summary"]["ours_audit"] == {
        "ok": 12.0, "mismatch": 0.0, "error": 0.0, "store_GBps_connector": 41.0, "all_ok": True
    }  # fmt: skip
    row = restore_report.table_row("small", report)
    assert row["stores_audited"] == {"ok": 12.0, "mismatch": 0.0, "error": 0.0}
    report["configs"]["ours_audit"]["audit_recompute_units"]["mismatch"] = 1.0
    restore_report.summarize(report)
    assert report["summary"]["ours_audit"]["all_ok"] is False


def _shape_report(name: str, ours_hits: list[float], native_hits: list[float]) -> dict:
    return {
        "shape_name": name,
        "page_bytes": {"target": 32768, "draft": 32768},
        "copy_path": "auto (connector default)",
        "tokens": 1024,
        "kv_bytes_per_token": 100,
        "pinned_h2d_GBps": 50.0,
        "pinned_d2h_GBps": 40.0,
        "configs": {
            "recompute": {"fresh_s": [1.0, 1.0, 1.0]},
            "native": {"fresh_s": [1.0], "hit_s": native_hits, "hit_cached": [1023] * 3},
            "ours": {
                "fresh_s": [1.0], "hit_s": ours_hits, "hit_cached": [1023] * 3,
                "restore_GBps_metric": [44.0, 45.0, 46.0], "store_GBps_metric": [30.0, 36.0, 38.0],
            },
        },
    }  # fmt: skip


def test_summary_and_table_give_copy_ratios_and_first_and_steady_hits() -> None:
    report = _shape_report("small", ours_hits=[0.3, 0.1, 0.1], native_hits=[1.3, 0.2, 0.2])
    restore_report.summarize(report)
    ours = report["summary"]["ours"]
    assert ours["restore_vs_pinned_memcpy"] == 45.0 / 50.0
    assert ours["store_GBps_connector"] == 36.0 and ours["store_vs_pinned_memcpy"] == 36.0 / 40.0
    assert ours["ratio_to_recompute_first"] == 0.3 and ours["ratio_to_recompute"] == 0.1
    assert report["summary"]["ours_vs_native_ttft"] == 0.5
    assert abs(report["summary"]["ours_vs_native_ttft_first"] - 0.3 / 1.3) < 1e-12
    row = restore_report.table_row("small", report)
    assert row == {
        "shape": "small", "page_bytes": 32768, "copy_path": "auto (connector default)",
        "restore_GBps": 45.0, "restore_vs_pinned_memcpy": 0.9,
        "store_GBps": 36.0, "store_vs_pinned_memcpy": 0.9, "stores_audited": None,
        "recompute_ttft_s": 1.0, "hit_ttft_s_first": 0.3, "hit_ttft_s_steady": 0.1,
        "first_vs_recompute": 0.3, "steady_vs_recompute": 0.1,
        "native_first_vs_recompute": 1.3, "native_steady_vs_recompute": 0.2,
        "first_vs_native": 0.3 / 1.3, "steady_vs_native": 0.5,
        "first_over_steady": 0.3 / 0.1, "native_first_over_steady": 1.3 / 0.2,
    }  # fmt: skip


def test_a_failed_or_missing_configuration_leaves_its_cells_empty() -> None:
    report = _shape_report("llama8b", [0.3, 0.1, 0.1], [1.3, 0.2, 0.2])
    report["configs"]["native"] = {"error": "engine died"}
    del report["configs"]["ours"]["store_GBps_metric"]
    restore_report.summarize(report)
    row = restore_report.table_row("llama8b", report)
    assert row["store_GBps"] is None and row["store_vs_pinned_memcpy"] is None
    assert row["first_vs_native"] is None and row["native_steady_vs_recompute"] is None
    assert row["native_first_over_steady"] is None
    assert row["first_over_steady"] == pytest.approx(3.0)
    assert row["restore_vs_pinned_memcpy"] == 0.9  # what did run is still there


def test_one_shape_keeps_its_layout_and_several_go_under_shapes() -> None:
    common = {"gpu": "H100", "pinned_h2d_GBps": 50.0, "pinned_d2h_GBps": 40.0}
    small = _shape_report("small", [0.3, 0.1, 0.1], [1.3, 0.2, 0.2])
    big = _shape_report("llama8b", [0.5, 0.2, 0.2], [1.5, 0.4, 0.4])
    for report in (small, big):
        restore_report.summarize(report)
    one = restore_report.combine({"small": small}, common)
    assert one["summary"] is small["summary"] and one["configs"] is small["configs"]
    assert [row["shape"] for row in one["table"]] == ["small"]
    both = restore_report.combine({"small": small, "llama8b": big}, common)
    assert set(both["shapes"]) == {"small", "llama8b"} and both["gpu"] == "H100"
    assert [row["shape"] for row in both["table"]] == ["small", "llama8b"]
    assert both["table"][1]["steady_vs_native"] == 0.5


def test_unknown_or_repeated_shapes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for shape in ("small,huge", "small,small"):
        with pytest.raises(SystemExit):
            restore_speed.main(["--out", "/tmp/never.json", "--shape", shape])
        assert "--shape" in capsys.readouterr().err


def test_gptoss_shape_alternates_windows_as_vllm_reads_them(tmp_path: Path) -> None:
    """gpt-oss-20b's attention layout: config.json carries what vLLM 0.33's Llama reads
    per layer (`layer_types`, `sliding_window`), and the bytes that grow with a prefix
    are the 12 full-attention layers' only."""
    target, draft = shapes.SHAPES["gptoss20b"]
    config = json.loads(
        (Path(shapes.write_config(tmp_path / "t", target, 16448)) / "config.json").read_text()
    )
    assert config["sliding_window"] == 128 and len(config["layer_types"]) == 24
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert shapes.kv_bytes_per_token(target) == 2 * 2 * 12 * 8 * 64
    assert shapes.page_bytes(target) == 32 * 1024  # 8 KV heads x 64, 16 tokens, K and V
    assert not shapes.has_windows(draft)
    # The hook-cost model simulates full attention only: it refuses the shape.
    with pytest.raises(SystemExit):
        hook_cost.build_parser().parse_args(["--out", "x", "--shape", "gptoss20b"])


ENGINE_SCRIPT = """
import json, sys, time
from pathlib import Path
from vllm_draft_offload.bench.accept.engine import prepare_cpu_platform
prepare_cpu_platform()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm_draft_offload.bench.speed import shapes
work = Path(sys.argv[1])
target, draft = shapes.SHAPES["gptoss20b"]
# The shape's KV geometry (8 KV heads x 64), with a CPU's hidden sizes.
small = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8}
# gpt-oss's alternation at a CPU's size: 6 window + 6 full layers, a 2-layer drafter
# (8 full-attention layers against 6: vLLM keeps the drafter in one group).
t = shapes.write_config(work / "t", {**target, **small, "num_hidden_layers": 12,
    "layer_types": target["layer_types"][:12], "sliding_window": 64}, 1024)
d = shapes.write_config(work / "d", {**draft, **small, "num_hidden_layers": 2}, 1024)
llm = LLM(model=t, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
    max_model_len=1024, enforce_eager=True, enable_prefix_caching=True, block_size=32,
    distributed_executor_backend="uni",
    speculative_config={"method": "draft_model", "model": d, "num_speculative_tokens": 3},
    kv_transfer_config={"kv_connector": "DraftOffloadConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 28, "chunk_size": 64}})
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
prompt = TokensPrompt(prompt_token_ids=[500 + (i * 7919) % 20000 for i in range(520)])
fresh = llm.generate([prompt], params)[0]
for _ in range(200):  # the GPU prefix cache empties once the stores landed
    if llm.reset_prefix_cache():
        break
    llm.generate([TokensPrompt(prompt_token_ids=[600, 601])], SamplingParams(max_tokens=1))
    time.sleep(0.05)
hit = llm.generate([prompt], params)[0]
print("RESULT " + json.dumps({"cached": hit.num_cached_tokens,
    "equal": list(hit.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)}))
"""


def test_gptoss_layout_runs_in_a_cpu_engine_with_the_connector(tmp_path: Path) -> None:
    """The layout the gptoss20b shape runs on the GPU, at a CPU's size, in a real vLLM
    engine: it starts (vLLM accepts the drafter's grouping) and the connector restores
    the prompt's whole chunks after the GPU prefix cache was emptied. Dummy weights: a
    check that the benchmark's configuration runs, not of outputs."""
    import subprocess
    import sys

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["cached"] == 512, result  # 8 chunks of 64; the 8 tokens after recomputed
    assert result["equal"]


def test_restart_units_are_removed_but_the_filled_ones_and_the_calibration(
    tmp_path: Path,
) -> None:
    """A restart's fresh prompts are written to storage and never hit again: restore-speed
    removes their units after each restart, keeping the fill engine's and the
    calibration."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.data").write_bytes(b"u")
    filled = set(l3_dir.unit_files(tmp_path))
    (tmp_path / "c.data").write_bytes(b"u")
    calibration = object_name(b"salt", "NVIDIA H100")
    (tmp_path / f"ns@1@0@1{calibration}@uint8.data").write_bytes(b"{}")
    assert restore_speed.remove_units_but(tmp_path, filled) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.data", "b.data", f"ns@1@0@1{calibration}@uint8.data",
    ]  # fmt: skip


def test_the_output_is_rewritten_after_every_engine_and_a_hung_engine_is_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 17: a warm restart hung, and restore-speed, which wrote its JSON only at
    the end, lost every engine of the run. Now each engine's entry lands in the file
    as it finishes (``complete`` false until the last), and an engine past
    --engine-timeout is killed and recorded. Real child processes stand in for the
    engines: each checks the file the engines before it left, then writes its result
    (the second one hangs instead)."""
    import sys

    from vllm_draft_offload.bench import procs

    out = tmp_path / "restore_speed.json"
    script = tmp_path / "engine.py"
    script.write_text(
        "import json, sys, time\n"
        "out, child, config = sys.argv[1:4]\n"
        "if config != 'recompute':\n"
        "    seen = json.load(open(out))\n"
        "    assert seen['complete'] is False and seen['table'] == [], seen\n"
        "    assert list(seen['configs']) == ['recompute', 'native'][:1], seen\n"
        "    time.sleep(300)\n"
        "json.dump({'config': config, 'hit_s': [0.5]}, open(child, 'w'))\n"
    )

    def engine(cmd: list[str], env: dict[str, str], timeout_s: float | None):  # noqa: ANN202
        config = cmd[cmd.index("--config") + 1]
        child = cmd[cmd.index("--child") + 1]
        return procs.run_child(
            [sys.executable, str(script), str(out), child, config], env, timeout_s
        )

    monkeypatch.setattr(restore_speed, "run_child", engine)
    monkeypatch.setattr(restore_speed, "summarize", lambda report: report.setdefault("summary", {}))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(restore_speed.tempfile, "tempdir", str(scratch))
    restore_speed.main(
        ["--out", str(out), "--shape", "small", "--configs", "recompute,native",
         "--engine-timeout", "5", "--l3-dir", str(tmp_path / "l3")]
    )  # fmt: skip
    final = json.loads(out.read_text())
    assert list(scratch.glob("restore-speed-*")) == []  # the run's work directory is gone
    assert final["complete"] is True
    assert final["configs"]["recompute"]["hit_s"] == [0.5]
    assert final["configs"]["native"]["error"].startswith("timeout after 5")
    assert final["table"][0]["shape"] == "small"


RESTART_SCRIPT = """
import sys
from vllm_draft_offload.bench.accept.engine import prepare_cpu_platform
prepare_cpu_platform()
from vllm_draft_offload.bench.speed import restore
restore.main(sys.argv[1:])
"""


def test_a_restart_with_short_hits_runs_in_a_cpu_engine(tmp_path: Path) -> None:
    """restore-speed's fill engine and a warm restart with --short-hit-chunks, as the GPU
    runs them (child processes, real vLLM engines, fs:// storage), at a CPU's size: the
    short hit takes its one chunk from the CPU tier, its control is as long as what it
    computed, and every write the restart expects lands (no settle timed out: the short
    hits' units are counted)."""
    import subprocess
    import sys

    target, draft = shapes.SHAPES["small"]
    tiny = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8}
    t = shapes.write_config(tmp_path / "t", {**target, **tiny, "num_hidden_layers": 2}, 1024)
    d = shapes.write_config(tmp_path / "d", {**draft, **tiny, "num_hidden_layers": 1}, 1024)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    results = {}
    for config in ("ours_l3_fill", "ours_l3"):
        out = tmp_path / f"{config}.json"
        proc = subprocess.run(
            [sys.executable, "-c", RESTART_SCRIPT, "--out", str(tmp_path / "unused.json"),
             "--child", str(out), "--target", t, "--draft", d, "--config", config,
             "--tokens", "512", "--chunk-size", "128", "--reps", "1", "--cpu-gib", "1",
             "--l3-dir", str(tmp_path / "l3"), "--enforce-eager", "--short-hit-chunks", "1"],
            capture_output=True, text=True, timeout=900, env=env,
        )  # fmt: skip
        assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
        results[config] = json.loads(out.read_text())
    fill, restart = results["ours_l3_fill"], results["ours_l3"]
    assert fill["l3_files"] == fill["units_expected"] == 3 * 4  # 2 prompts and a warm-up
    assert restart["short_hit_cached"] == [128]  # vLLM's CPU block, the chunk here
    assert len(restart["short_hit_s"]) == len(restart["odd_fresh_s"]) == 1
    assert "settle_timeouts" not in restart, restart
    phases = restart["phases"]
    assert len(phases["short_hit_s"]) == len(phases["odd_fresh_s"]) == 1
    extra = restore_report.restart_extras(restart, None)["scheduled_to_first_token_extra_s"]
    assert set(extra) >= {"short_hit_s", "odd_fresh_s", "hit_s"}


def test_the_store_audit_runs_in_a_cpu_engine(tmp_path: Path) -> None:
    """restore-speed's ours_audit as the GPU runs it (a child process, a real vLLM
    engine), at a CPU's size: every hit recomputes and the stored units it could have
    loaded, every layer, are compared with that recompute; all of them match."""
    import subprocess
    import sys

    target, draft = shapes.SHAPES["small"]
    tiny = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8}
    t = shapes.write_config(tmp_path / "t", {**target, **tiny, "num_hidden_layers": 2}, 1024)
    d = shapes.write_config(tmp_path / "d", {**draft, **tiny, "num_hidden_layers": 1}, 1024)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    out = tmp_path / "ours_audit.json"
    proc = subprocess.run(
        [sys.executable, "-c", RESTART_SCRIPT, "--out", str(tmp_path / "unused.json"),
         "--child", str(out), "--target", t, "--draft", d, "--config", "ours_audit",
         "--tokens", "512", "--chunk-size", "128", "--reps", "2", "--cpu-gib", "1",
         "--enforce-eager"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    audit = json.loads(out.read_text())["audit_recompute_units"]
    # Two hits of a 512-token prompt: its 3 whole chunks before the last token each.
    assert audit == {"ok": 6.0, "mismatch": 0.0, "error": 0.0}, audit
