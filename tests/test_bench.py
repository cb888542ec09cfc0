"""`vllm-draft-offload bench` (vllm_draft_offload.bench.workloads): reporting on recorded
data, goal evaluation on crafted numbers, workload/engine construction, crash handling,
and one tiny CPU dry run."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.workloads import goals as gl
from vllm_draft_offload.bench.workloads import run as bench
from vllm_draft_offload.bench.workloads import specs as wlm
from vllm_draft_offload.bench.workloads import summary as sm

EXAMPLE = Path(__file__).parent / "data" / "bench_example.json"

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- report-only


def test_report_only_rebuilds_summary_and_plots(tmp_path: Path) -> None:
    assert cli.main(["bench", "--report-only", str(EXAMPLE), "--out", str(tmp_path)]) == 0
    for name in ("acceptance.png", "ttft_vs_prefix.png", "restore_gbps.png"):
        blob = (tmp_path / name).read_bytes()
        assert blob[:8] == PNG_MAGIC and len(blob) > 5000, name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [g["goal"] for g in summary["goals"] if g["goal"] != "acceptance"] == [
        "recompute",
        "restore_vs_memcpy",
        "restore_vs_native",
        "ttft_16k",
        "nohit_decode",
    ]
    data = json.loads(EXAMPLE.read_text())
    # every drafter of the run gets its own acceptance verdict
    assert {g["drafter"] for g in summary["goals"] if g["goal"] == "acceptance"} == {
        d["label"] for d in data["drafters"]
    }
    # the CPU example has no memcpy figure: that goal must say so, not pass
    mem = next(g for g in summary["goals"] if g["goal"] == "restore_vs_memcpy")
    assert mem["status"] == "n/a" and "memcpy" in mem["message"]
    # the acceptance ratio of a row is recomputed from the raw counters of its phases
    run = next(r for r in data["runs"] if r["config"] == "ours_cpu" and r["status"] == "ok")
    phases = run["workloads"]["divergent"]["phases"]
    fill = next(p for p in phases if p["phase"] == "fill")["counters"]
    restore = next(p for p in phases if p["phase"] == "restore")["counters"]

    def al(c: dict[str, float]) -> float:
        return 1 + c.get(sm.ACCEPTED, 0.0) / c[sm.DRAFTS]

    row = next(
        r
        for r in summary["rows"]
        if r["config"] == "ours_cpu"
        and r["workload"] == "divergent"
        and r["drafter"] == run["drafter"]["label"]
    )
    assert row["al_ratio"] == pytest.approx(al(restore) / al(fill))
    md = (tmp_path / "summary.md").read_text()
    assert "## Goals" in md and "CPU dry run" in md
    # crashed configurations are rows of the report, not a failed report
    for r in data["runs"]:
        if r["status"] != "ok":
            assert f"| {r['config']} | {r['drafter']['label']} | {r['status']} |" in md


# ----------------------------------------------------------------------------- goals

D = {"method": "eagle3", "path": "/m/eagle3", "label": "eagle3:eagle3"}
KV_BPT = 1000  # bytes per token in the crafted engine


def _phase(
    name: str, drafts: float, accepted: float, requests: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "phase": name,
        "round": 0,
        "n": len(requests),
        "reset": {"ok": True},
        "counters": {sm.DRAFTS: drafts, sm.ACCEPTED: accepted},
        "requests": requests,
        "wall_s": 1.0,
        "output_tokens": 10,
        "digest": "x",
        "outputs_digest": "y",
    }


def _run(
    config: str,
    *,
    accepted_restored: float = 150.0,
    hist: dict[str, float] | None = None,
    hit_ms: float = 4.0,
    fresh_ms: float = 20.0,
    tail_ms: float = 1.0,
    gbps_metric: float | None = None,
    decode_tok_s: float = 100.0,
) -> dict[str, Any]:
    req_fill = [
        {"prompt_len": 300, "cached": 0, "out_len": 8, "expected_hit": None, "ttft_s": 0.02}
    ]
    req_rest = [
        {"prompt_len": 300, "cached": 256, "out_len": 8, "expected_hit": 256, "ttft_s": 0.005}
    ]
    # nohit: 2 requests of 101 tokens each over a 2 s decode span -> 100 tok/s x scale
    span = 200.0 / decode_tok_s
    nohit = [
        {"prompt_len": 32, "cached": 0, "out_len": 101, "first_ts": 10.0, "last_ts": 10.0 + span},
        {"prompt_len": 32, "cached": 0, "out_len": 101, "first_ts": 10.0, "last_ts": 10.0 + span},
    ]
    hits_counters: dict[str, float] = {}
    if gbps_metric is not None:
        hits_counters = {
            sm.LOADED_BYTES + "{part=target,tier=cpu}": gbps_metric * 1e9 * 0.8,
            sm.LOADED_BYTES + "{part=draft,tier=cpu}": gbps_metric * 1e9 * 0.2,
            sm.TRANSFER_S + "{direction=load,tier=cpu}": 1.0,
            sm.TRANSFER_S + "{direction=store,tier=cpu}": 5.0,  # must not count for loads
        }
    return {
        "config": config,
        "drafter": D,
        "status": "ok",
        "engine": {"kv_bytes_per_token": KV_BPT},
        "totals": hist or {},
        "ttft_curve": {
            "16384": {
                "prompt_len": 16385,
                "fresh": [{"ttft_s": fresh_ms / 1e3}] * 3,
                "first_hit": {"ttft_s": 3 * hit_ms / 1e3, "cached": 16384},
                "hits": [{"ttft_s": hit_ms / 1e3, "cached": 16384}] * 3,
                "tail": [{"ttft_s": tail_ms / 1e3}] * 3,
                "hits_counters": hits_counters,
            }
        },
        "workloads": {
            "divergent": {
                "phases": [
                    _phase("fill", 100, 150, req_fill),
                    _phase("restore", 100, accepted_restored, req_rest),
                ]
            },
            "nohit": {"phases": [_phase("fill", 10, 5, nohit)]},
        },
    }


def _hist(samples: list[int]) -> dict[str, float]:
    name = sm.RECOMP
    out = {f"{name}_count": float(len(samples)), f"{name}_sum": float(sum(samples))}
    for le in (0, 1, 8, 32):
        out[f"{name}_bucket{{le={float(le)}}}"] = float(sum(s <= le for s in samples))
    out[f"{name}_bucket{{le=+Inf}}"] = float(len(samples))
    return out


def _data(runs: list[dict[str, Any]], memcpy: float | None = 25.0) -> dict[str, Any]:
    return {"device": {"name": "H100", "memcpy": {"gbps": memcpy}}, "drafters": [D], "runs": runs}


def _goals(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["goal"]: g for g in gl.evaluate_goals(sm.summarize(data), data)}


def test_goals_all_pass_on_crafted_numbers() -> None:
    data = _data(
        [
            _run(
                "ours_cpu",
                accepted_restored=149,
                hist=_hist([1, 1, 0, 1]),
                hit_ms=4.0,
                fresh_ms=20.0,
                gbps_metric=21.0,
                decode_tok_s=98.0,
            ),
            _run("native", hit_ms=7.0),
            _run("gpu_prefix", decode_tok_s=100.0),
        ]
    )
    g = _goals(data)
    assert {k: v["status"] for k, v in g.items()} == dict.fromkeys(g, "pass")
    assert g["acceptance"]["value"] == pytest.approx(2.49 / 2.5)
    assert g["recompute"]["value"] == 1.0  # all samples in the le=1 bucket
    assert g["restore_vs_memcpy"]["value"] == pytest.approx(21.0 / 25.0)  # loads only
    # both sides by the same TTFT estimate: 16384 tokens x 1000 B / (hit - tail)
    assert g["restore_vs_native"]["value"] == pytest.approx((7.0 - 1.0) / (4.0 - 1.0))
    assert g["ttft_16k"]["value"] == pytest.approx(4.0 / 20.0)
    assert g["nohit_decode"]["value"] == pytest.approx(0.98)
    assert g["ttft_16k"]["message"].startswith("pass")


def test_goals_miss_report_by_how_much() -> None:
    data = _data(
        [
            _run(
                "ours_cpu",
                accepted_restored=100,
                hist=_hist([1, 2, 1]),
                hit_ms=10.0,
                fresh_ms=20.0,
                gbps_metric=15.0,
                decode_tok_s=90.0,
            ),
            _run("native", hit_ms=2.5),
            _run("gpu_prefix", decode_tok_s=100.0),
        ]
    )
    g = _goals(data)
    assert {k: v["status"] for k, v in g.items()} == dict.fromkeys(g, "miss")
    # AL 2.0 vs 2.5: ratio 0.8, 0.19/0.99 = 19.19% short of the goal
    assert g["acceptance"]["margin_pct"] == pytest.approx(-(0.99 - 0.8) / 0.99 * 100)
    assert g["acceptance"]["message"].startswith("missed by 19.2%")
    # a sample of 2 lands in the le=8 bucket: the histogram bounds the max by 8
    assert g["recompute"]["value"] == 8.0 and "missed by 700.0%" in g["recompute"]["message"]
    assert g["restore_vs_memcpy"]["message"].startswith("missed by 25.0%")  # 0.6 vs 0.8
    # ours (10-1 ms) vs native (2.5-1 ms) for the same bytes: 1.5/9 of native's GB/s
    assert g["restore_vs_native"]["value"] == pytest.approx(1.5 / 9.0)
    assert g["ttft_16k"]["message"].startswith("missed by 100.0%")  # 0.5 vs <= 0.25
    assert g["nohit_decode"]["value"] == pytest.approx(0.9)
    assert g["nohit_decode"]["message"].startswith(f"missed by {(0.97 - 0.9) / 0.97 * 100:.1f}%")


def test_goals_not_measured_are_not_passes() -> None:
    # no memcpy (CPU), no native, no gpu_prefix, restore phase without hits
    run = _run("ours_cpu", gbps_metric=21.0)
    for p in run["workloads"]["divergent"]["phases"]:
        for r in p["requests"]:
            r["cached"] = 0
    g = _goals(_data([run], memcpy=None))
    assert g["acceptance"]["status"] == "n/a"  # a restore without hits proves nothing
    assert g["restore_vs_memcpy"]["status"] == "n/a"
    assert g["restore_vs_native"]["status"] == "n/a"
    assert g["nohit_decode"]["status"] == "n/a"
    # without the connector histogram the request-level excess over whole chunks counts
    assert g["recompute"]["status"] == "n/a"  # ... and there were no hits at all
    run2 = _run("ours_cpu")
    run2["workloads"]["divergent"]["phases"][1]["requests"][0]["cached"] = 254  # 256 expected
    g2 = _goals(_data([run2]))
    assert g2["recompute"]["value"] == 2.0 and g2["recompute"]["status"] == "miss"


def test_goal_result_boundaries() -> None:
    assert gl.goal_result("acceptance", 0.99)["status"] == "pass"
    assert gl.goal_result("ttft_16k", 0.25)["status"] == "pass"
    assert gl.goal_result("ttft_16k", 0.2501)["status"] == "miss"
    assert (
        gl.goal_result("acceptance", None, reason="crashed")["message"] == "not measured: crashed"
    )


def test_helpers() -> None:
    assert sm.pct([3.0, 1.0, 2.0, None], 50) == 2.0
    assert sm.pct([0.0, 10.0], 90) == pytest.approx(9.0)
    assert sm.pct([], 50) is None
    c = {sm.DRAFTS: 10.0, sm.ACCEPTED: 5.0}
    assert sm.acceptance_length(c) == 1.5
    assert sm.acceptance_length({}) is None


# ----------------------------------------------------------------------------- workloads


def test_gpu_defaults_put_docs_under_cache_pressure() -> None:
    s = wlm.Sizes()
    s.validate()
    capacity = (s.num_gpu_blocks() - 1) * s.block_size
    assert s.max_model_len() <= capacity < sum(s.doc_lengths)  # longest fits, docs together don't
    assert s.max_model_len() <= 32768  # the gpu fixture's max_position
    d = wlm.dry_run_sizes()
    d.validate()
    assert d.max_model_len() <= (d.num_gpu_blocks() - 1) * d.block_size < sum(d.doc_lengths)


def test_workloads_are_deterministic_and_shaped() -> None:
    s = wlm.dry_run_sizes()
    for name in wlm.WORKLOADS:
        a, b = wlm.build_workload(name, s, 256), wlm.build_workload(name, s, 256)
        assert a.fill == b.fill and a.cont == b.cont
        assert all(wlm.FIRST_TOKEN_ID <= t < 256 for p in a.fill for t in p)
    div = wlm.build_workload("divergent", s, 256)
    prefix = div.fill[0][: s.div_prefix]
    assert s.div_prefix % s.chunk_size == 0
    assert div.cont is not None
    for p in div.fill + div.cont[0]:
        assert p[: s.div_prefix] == prefix
    # successors of the chunk-aligned prefix differ between fill and continuation
    assert len({p[s.div_prefix] for p in div.fill + div.cont[0]}) > 1
    doc = wlm.build_workload("docqa", s, 256)
    assert [len(p) - s.doc_question_len for p in doc.fill] == list(s.doc_lengths)
    chat = wlm.build_workload("chat", s, 256)
    nxt = wlm.chat_next_turn(s, 256, chat.fill, [[5] * 3] * len(chat.fill), 2)
    assert all(n[: len(p) + 3] == p + [5] * 3 for n, p in zip(nxt, chat.fill, strict=True))
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        wlm.with_overrides(s, div_prefix=s.chunk_size + 1).validate()


def test_engine_kwargs_per_config() -> None:
    s = wlm.Sizes()
    d = wlm.Drafter("eagle3", "/m/eagle3")
    kw = {c: wlm.engine_kwargs(c, "/m/t", d, s, "fs:///tmp/bench-l3/x") for c in wlm.CONFIGS}
    assert kw["none"]["enable_prefix_caching"] is False and "kv_transfer_config" not in kw["none"]
    assert kw["gpu_prefix"]["enable_prefix_caching"] is True
    assert kw["native"]["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"
    assert kw["lmcache"]["kv_transfer_config"] == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
    }
    assert wlm.engine_env("lmcache", s)["LMCACHE_CHUNK_SIZE"] == "256"
    ours = kw["ours_cpu"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert ours == {"cpu_bytes_to_use": s.cpu_bytes, "chunk_size": 256}
    disk = kw["ours_disk"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert disk["l3"] == {"enabled": True} and disk["lmcache.remote_url"] == "fs:///tmp/bench-l3/x"
    assert disk["lmcache.extra_config"]["save_chunk_meta"] is True
    # the connector is the only difference between the engines
    strip = [
        {k: v for k, v in k_.items() if k not in ("kv_transfer_config", "enable_prefix_caching")}
        for k_ in kw.values()
    ]
    assert all(x == strip[0] for x in strip)
    small = wlm.engine_kwargs(
        "ours_disk", "/m/t", d, wlm.with_overrides(s, disk_mode="small-cpu"), "fs:///x"
    )
    assert (
        small["kv_transfer_config"]["kv_connector_extra_config"]["cpu_bytes_to_use"]
        == s.disk_cpu_bytes
    )


def test_parse_drafters() -> None:
    ds = wlm.parse_drafters("eagle3,small-draft,mtp:/x/y", "/fx")
    assert [(d.method, d.path) for d in ds] == [
        ("eagle3", "/fx/eagle3"),
        ("draft_model", "/fx/small-draft"),
        ("mtp", "/x/y"),
    ]
    assert [d.eagle_family for d in ds] == [True, False, True]
    with pytest.raises(ValueError):
        wlm.parse_drafters("eagle3", None)


# ----------------------------------------------------------------------------- crash handling


def test_crashing_engine_is_a_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = tmp_path / "worker.py"
    # dies like a native crash: no result JSON, non-zero exit, something in the log
    worker.write_text("import os, sys\nprint('boom in connector', flush=True)\nos._exit(134)\n")
    monkeypatch.setattr(bench, "WORKER", [str(worker)])
    (tmp_path / "jobs").mkdir()
    (tmp_path / "logs").mkdir()
    job = {"config": "lmcache", "drafter": D, "stage": "all"}
    rec = bench.run_engine_job(job, "lmcache--x", tmp_path, dict(__import__("os").environ), 60)
    assert rec["status"] == "crashed" and rec["rc"] == 134
    assert "boom in connector" in rec["log_tail"]


def test_merge_stages_adds_totals() -> None:
    fill = {"status": "ok", "totals": {"a": 1.0}, "workloads": {"w": 1}, "wall_s": 2}
    restore = {"status": "ok", "totals": {"a": 2.0, "b": 1.0}, "workloads": {"w": 2}, "wall_s": 3}
    m = bench.merge_stages(fill, restore)
    assert m["totals"] == {"a": 3.0, "b": 1.0} and m["workloads"] == {"w": 2} and m["wall_s"] == 5
    bad = bench.merge_stages({**fill, "status": "crashed", "error": "x"}, copy.deepcopy(restore))
    assert bad["status"] == "crashed"


# ----------------------------------------------------------------------------- CPU e2e


@pytest.mark.e2e
def test_dry_run_cpu_ours_cpu_end_to_end(tmp_path: Path) -> None:
    fx = tmp_path / "fx"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_draft_offload.bench",
            "fixtures",
            "--out",
            str(fx),
            "--preset",
            "tiny",
            "--max-steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if made.returncode != 0 or not (fx / "self-draft" / "config.json").exists():
        pytest.skip(f"vllm-draft-offload fixtures --preset tiny failed: {made.stderr[-500:]}")
    out = tmp_path / "bench"
    rc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_draft_offload.bench",
            "bench",
            "--fixtures",
            str(fx),
            "--dry-run-cpu",
            "--out",
            str(out),
            "--configs",
            "ours_cpu",
            "--drafters",
            # a byte copy of the target: its proposals are accepted whenever its KV
            # matches the target's, so the acceptance ratio below can really drop
            "self-draft",
            "--workloads",
            "divergent",
            "--prompt-lengths",
            "64",
            "--ttft-reps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    ).returncode
    data = json.loads((out / "bench.json").read_text())
    run = data["runs"][0]
    assert rc == 0, run.get("log_tail") or run.get("error")
    assert run["status"] == "ok", run.get("log_tail")
    phases = {p["phase"]: p for p in run["workloads"]["divergent"]["phases"]}
    assert set(phases) == {"fill", "restore", "continue"}
    assert phases["fill"]["requests"][0]["cached"] == 0  # later ones may hit the GPU cache
    # after the GPU reset, the replayed prompts are served by the connector
    assert phases["restore"]["reset"]["ok"]
    assert all(r["cached"] >= data["sizes"]["div_prefix"] for r in phases["restore"]["requests"])
    assert run["totals"].get("vllm:draft_offload_loaded_bytes_total{part=draft,tier=cpu}", 0) > 0
    # the same prompts under greedy decoding give the same answers fresh and restored
    assert phases["restore"]["outputs_digest"] == phases["fill"]["outputs_digest"]
    summary = json.loads((out / "summary.json").read_text())
    row = next(r for r in summary["rows"] if r["workload"] == "divergent")
    assert row["al_fresh"] > 2.0  # 3 speculative tokens, self-drafting
    assert row["al_ratio"] >= 0.99
    goal = next(g for g in summary["goals"] if g["goal"] == "acceptance")
    assert goal["status"] == "pass"
    # continuation prompts reuse the chunk-aligned prefix: whole chunks, 0 tokens short
    assert all(r["cached"] == r["expected_hit"] for r in phases["continue"]["requests"])
    curve = run["ttft_curve"]["64"]
    # a 65-token prompt: the connector leaves two tokens to compute under spec decode
    assert curve["hits"][0]["cached"] == 63 and curve["fresh"][0]["cached"] == 0
    for name in (
        "summary.json",
        "summary.md",
        "acceptance.png",
        "ttft_vs_prefix.png",
        "restore_gbps.png",
    ):
        assert (out / name).exists(), name
