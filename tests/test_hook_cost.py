"""`vllm-draft-offload hook-cost`: the real Scheduler and connector through a decode
batch on the CPU, each config's steps and stores, and the report's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_draft_offload.bench.speed import hook_cost as hc
from vllm_draft_offload.bench.speed import hook_report


def test_a_tiny_batch_decodes_with_spec_tokens_and_only_store_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "hook_cost.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(hc.tempfile, "tempdir", str(scratch))
    # 2 requests of 64 + 70 tokens, chunks of 32: two prompt chunks each, stored in the
    # prefill step, then the decode chunks ending at 96 and 128.
    hc.main(
        ["--out", str(out), "--shape", "tiny", "--batch", "2", "--prompt-tokens", "64",
         "--decode-tokens", "70", "--chunk-size", "32", "--cpu-gib", "0.01", "--reps", "1"]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert list(scratch.glob("hook-cost-*")) == []  # the engines' work directory is gone
    none, idle, store = (report["configs"][c][0] for c in ("none", "idle", "store"))
    # 69 tokens after the first, 4 a step (3 drafts, all accepted, and the bonus token).
    assert none["decode_steps"] == idle["decode_steps"] == store["decode_steps"] == 18
    # Every whole chunk of 134 tokens: 2 per request stored in the prefill step, then
    # chunk 3 and chunk 4 of both requests in one step each.
    assert none["stored_chunks"] == idle["stored_chunks"] == 0
    assert store["stored_chunks"] == 2 * 4
    assert store["steps_with_stores"] >= 2
    with_stores = store["us_per_step_with_stores"]
    # The memmove is timed apart and inside wait_for_save; the scheduler's hooks run.
    assert 0 < with_stores["copy_exec"] <= with_stores["worker.wait_for_save"]
    assert store["us_per_step_without_stores"]["sched.build_connector_meta"] > 0
    assert "copy_exec" not in idle["us_per_step_with_stores"]
    summary = report["summary"]
    assert set(summary["added_ms_over_decode"]) == {"idle", "store"}


def test_engine_time_of_a_step_leaves_out_the_memmove() -> None:
    step = {
        "schedule": 100e-6,
        "update_from_output": 50e-6,
        "sched.build_connector_meta": 30e-6,  # inside schedule: not counted twice
        "worker.wait_for_save": 400e-6,
        "worker.get_transfer_results": 10e-6,
        "copy_exec": 300e-6,
    }
    assert hook_report.engine_us(step) == pytest.approx(100 + 50 + 400 + 10 - 300)
    assert hook_report.hooks_us(step) == pytest.approx(30 + 400 + 10 - 300)

    def run(decode: float, hooks: float, every: float) -> dict[str, float]:
        return {
            "engine_ms_over_decode": decode, "hooks_ms_over_decode": hooks,
            "engine_ms_all_steps": every, "hooks_ms_all_steps": 2 * hooks, "decode_steps": 10,
        }  # fmt: skip

    configs = {
        "none": [run(5.0, 0, 8.0)],
        "idle": [run(6.0, 0.3, 9.0), run(5.5, 0.4, 9.5)],
        "store": [run(9.0, 2.0, 20.0)],
    }
    summary = hook_report.compare(configs)
    assert summary["hooks_ms_over_decode"] == {"idle": 0.3, "store": 2.0}
    assert summary["added_ms_over_decode"] == {"idle": 0.5, "store": 4.0}  # fastest batch
    assert summary["added_us_per_decode_step"] == {"idle": 50.0, "store": 400.0}
    assert summary["hooks_ms_all_steps"] == {"idle": 0.6, "store": 4.0}
    assert summary["added_ms_all_steps"] == {"idle": 1.0, "store": 12.0}


def test_shared_prefixes_in_a_small_cache_restore_from_the_cpu_tier(tmp_path: Path) -> None:
    """--shared-prefixes with --gpu-blocks: about one request at a time fits and two
    prefixes alternate, so later requests find their prefix (partly) evicted from the
    KV cache and load it from the CPU tier; every step counts in *_all_steps."""
    out = tmp_path / "hook_cost.json"
    # 4 requests of 128 tokens (64 shared: 2 chunks of 32; the last 64 their own) and
    # 16 decode tokens, in a cache of 14 blocks of 16
    hc.main(
        ["--out", str(out), "--shape", "tiny", "--batch", "4", "--prompt-tokens", "128",
         "--decode-tokens", "16", "--chunk-size", "32", "--cpu-gib", "0.01", "--reps", "1",
         "--shared-prefixes", "2", "--gpu-blocks", "14"]
    )  # fmt: skip
    report = json.loads(out.read_text())
    none, idle, store = (report["configs"][c][0] for c in ("none", "idle", "store"))
    assert none["loaded_chunks"] == idle["loaded_chunks"] == 0
    # requests 3 and 4 could load both chunks of their prefix at most
    assert 0 < store["loaded_chunks"] <= 2 * 2
    assert store["steps"] > store["decode_steps"]  # the prefill steps count too
    assert store["hooks_ms_all_steps"] > store["hooks_ms_over_decode"] > 0
    assert set(report["summary"]["added_ms_all_steps"]) == {"idle", "store"}


def test_too_few_gpu_blocks_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        hc.main(["--out", str(tmp_path / "x.json"), "--shape", "tiny", "--prompt-tokens", "128",
                 "--decode-tokens", "16", "--gpu-blocks", "3"])  # fmt: skip
