"""`vllm-draft-offload shared-storage`: engine settings and report on CPU (engines need a GPU)."""

from __future__ import annotations

import argparse

from vllm_draft_offload.bench.accept import shared_storage


def test_each_engine_has_a_fixed_kv_cache_and_the_shared_l3_dir() -> None:
    args = argparse.Namespace(
        fixtures="/fx", enforce_eager=True, kv_cache_gib=8.0, spec_method="eagle3",
        draft="eagle3", num_spec=3, cpu_gib=4.0, l3_dir="/shared/l3",
    )  # fmt: skip
    kw = shared_storage.engine_kwargs(args, 4200)
    assert kw["kv_cache_memory_bytes"] == 8 << 30
    # vLLM 0.33 still checks free memory against gpu_memory_utilization at start (the
    # default 0.92 failed on an H100 once the other engine ran): two must fit.
    assert 2 * kw["gpu_memory_utilization"] <= 0.9
    extra = kw["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["lmcache.remote_url"] == "fs:///shared/l3"
    assert extra["l3"] == {"enabled": True}  # default L3 settings
    assert kw["speculative_config"]["model"] == "/fx/eagle3"


def request(n: int, cached: int, drafts: int, accepted: int, out: list[int]) -> dict:
    return {
        "prompt_len": n, "num_cached_tokens": cached, "num_drafts": drafts,
        "num_accepted": accepted, "acceptance_length": 1 + accepted / drafts,
        "output_token_ids": out,
    }  # fmt: skip


def test_summary_compares_b_restored_with_a_fresh_per_prompt() -> None:
    a = [request(100, 0, 10, 20, [1, 2]), request(100, 0, 10, 10, [3])]
    b = {
        "requests": [request(100, 96, 10, 20, [1, 2]), request(100, 96, 10, 5, [4])],
        "counters": {"lookup_hit_chunks_l3": 6.0},
        "window": [10.0, 20.0],
    }
    report = shared_storage.summarize(a, b, [5.0, 12.0, 19.0, 25.0])
    s = report["summary"]
    assert s["b_hit_tokens_total"] == 192 and s["prompt_tokens_total"] == 200
    assert s["outputs_equal"] == 1
    assert s["acceptance_restored_over_fresh"] == (1 + 25 / 20) / (1 + 30 / 20)
    assert s["a_prompts_written_while_b_ran"] == 2
    assert [p["acceptance_ratio"] for p in report["per_prompt"]] == [1.0, 1.5 / 2.0]
