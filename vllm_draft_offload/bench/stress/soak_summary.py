"""The soak's summary, from its JSON: crashes, replayed outputs against the reference,
acceptance, hits, memory, TTFT and throughput next to the no-connector engine, phases,
and a verdict.

Pure functions of the recorded data (no engine), so ``--report-only`` and the tests
rebuild every number from a recorded run.
"""

from __future__ import annotations

from typing import Any

from vllm_draft_offload.bench.stress.acceptance import connector_acceptance
from vllm_draft_offload.bench.stress.counters import (
    causes,
    hit_rate_series,
    thread_seconds,
    tier_tokens,
)
from vllm_draft_offload.bench.stress.flips import NEAR_TIE_NATS, flips
from vllm_draft_offload.bench.stress.phases import decode_seconds_per_token, phase_summary
from vllm_draft_offload.bench.stress.state_growth import state_growth


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def _ttft(reqs: list[dict[str, Any]], until: float | None = None) -> dict[str, Any]:
    t = [q["ttft_s"] for q in reqs if "ttft_s" in q and (until is None or q["submit_t"] <= until)]
    return {"n": len(t), "p50_s": percentile(t, 50), "p99_s": percentile(t, 99)}


def throughput(reqs: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """What an engine finished in its first ``window_s``: requests, output tokens a
    second, and the prompt tokens it computed (not served by a cache). Under a saturating
    load TTFT is mostly queueing, so this tells a slower engine from slower restores."""
    done = [q for q in reqs if q.get("end_t", float("inf")) <= window_s]
    out = sum(int(q.get("out_len") or 0) for q in done)
    computed = sum(int(q.get("prompt_len") or 0) - int(q.get("cached") or 0) for q in done)
    return {
        "requests": len(done),
        "output_tokens_per_s": out / window_s if window_s else None,
        "computed_prompt_tokens": computed,
        "decode_s_per_token_mean": decode_seconds_per_token(done),
    }


def _first_last(samples: list[dict[str, Any]], key: str) -> tuple[Any, Any]:
    values = [s[key] for s in samples if key in s]
    return (values[0], values[-1]) if values else (None, None)


def soak_summary(data: dict[str, Any]) -> dict[str, Any]:
    ours = data["runs"].get("ours", {})
    base = data["runs"].get("baseline")
    rep = data["runs"].get("replay")
    samples = ours.get("samples") or []
    first = samples[0]["counters"] if samples else {}
    last = samples[-1]["counters"] if samples else {}
    delta = {k: v - first.get(k, 0.0) for k, v in last.items()}
    failed: list[str] = []
    crashes = int(ours.get("crashes") or 0) + (ours.get("status") not in ("ok", "crashed"))
    if crashes:
        failed.append(f"{crashes} crash(es): {ours.get('error')}")
    kinds: dict[str, int] = {}
    for q in ours.get("requests") or []:
        kinds[q["kind"]] = kinds.get(q["kind"], 0) + 1
    replay: dict[str, Any] = {"n": 0, "mismatches": None, "control_mismatches": None}
    if rep and rep.get("status") == "ok":
        replay = replay_summary(
            ours.get("replay_sample") or [], rep, float(data.get("near_tie_nats", NEAR_TIE_NATS))
        )
        if replay["margins_known"]:
            # judged like the pressure run's flips: wrong KV changes confident picks,
            # numerics (a batch's shapes, cached vs computed KV) flips near-ties only
            if replay["confident_flips"]:
                failed.append(
                    f"{replay['confident_flips']}/{replay['n']} replayed outputs differ at a "
                    f"pick the reference made by >= {replay['near_tie_nats']} nats"
                )
        elif replay["mismatches"]:
            failed.append(f"{replay['mismatches']}/{replay['n']} replayed outputs differ")
    else:
        failed.append("replay did not run" if not rep else f"replay {rep.get('status')}")
    mem = [s for s in samples if "pinned_bytes" in s]
    pinned = [s["pinned_bytes"] for s in mem]
    pool = [s["pool_bytes"] for s in mem]
    rss = [s["rss_bytes"] for s in mem]
    memory = {
        "samples": len(mem),
        # samples whose connector probe failed (collective_rpc): RSS only
        "probe_errors": sum("probe_error" in s for s in samples),
        "pinned_min": min(pinned, default=None),
        "pinned_max": max(pinned, default=None),
        "pool_min": min(pool, default=None),
        "pool_max": max(pool, default=None),
        "cpu_bytes_budget": data.get("cpu_bytes"),
        "rss_start": rss[0] if rss else None,
        "rss_max": max(rss, default=None),
        "rss_end": rss[-1] if rss else None,
        "l3_pending_write_max": max((s["l3_pending_write_bytes"] for s in mem), default=None),
        "l3_staging_max": max((s["l3_staging_in_use_bytes"] for s in mem), default=None),
        # This process (vLLM's frontend, the run's records) and the engine's processes
        # (EngineCore and workers: the connector), and the no-connector engine's.
        "rss_driver": _first_last(mem, "rss_driver_bytes"),
        "rss_engine": _first_last(mem, "rss_engine_bytes"),
        "baseline_rss_engine": _first_last((base or {}).get("samples") or [], "rss_engine_bytes"),
        "state_growth": state_growth(samples),
    }
    budget = data.get("cpu_bytes")
    # The pool is the CPU tier (pinned on a GPU host, pageable on CPU): one allocation
    # of the configured budget, so it must neither move nor exceed it.
    if not pool:
        failed.append("no connector memory samples")
    elif min(pool) != max(pool) or (budget and max(pool) > budget) or max(pinned) > max(pool):
        failed.append("CPU-tier pool not flat / over budget")
    faults: dict[str, int] = {}
    for ev in data.get("faults") or []:
        if ev.get("ok"):
            faults[ev["fault"]] = faults.get(ev["fault"], 0) + 1
    win = base.get("seconds") if base else None
    ttft = {
        "ours": _ttft(ours.get("requests") or []),
        # over the baseline's window: requests finished, output tokens a second, prompt
        # tokens computed (a TTFT gap from a slower engine, or from restores)
        "throughput_first_window": {
            "ours": throughput(ours.get("requests") or [], win),
            "baseline": throughput(base.get("requests") or [], win),
        }
        if win and base and base.get("status") == "ok"
        else None,
        "ours_first_window": _ttft(ours.get("requests") or [], win) if win else None,
        "baseline": _ttft(base.get("requests") or [])
        if base and base.get("status") == "ok"
        else None,
        "baseline_seconds": win,
    }
    return {
        "crashes": crashes,
        "requests": {"total": sum(kinds.values()), "by_kind": kinds},
        "replay": replay,
        "acceptance": connector_acceptance(delta),
        "hits": tier_tokens(delta, int(data["chunk_size"])),
        "causes": causes(delta),
        # seconds the storage threads spent per op, by wall clock and their own CPU clock
        "l3_thread_seconds": thread_seconds(delta),
        "faults_injected": faults,
        "memory": memory,
        "ttft": ttft,
        "hit_rate": hit_rate_series(samples),
        # idle / active / baseline windows side by side, and each engine's steps
        "phases": phase_summary(data),
        "failed": failed,
        "verdict": "fail" if failed else "pass",
    }


def replay_summary(
    sample: list[dict[str, Any]], rep: dict[str, Any], near_tie: float
) -> dict[str, Any]:
    """Ours' replayed sample against the no-connector reference (and the reference's
    reversed-order control): mismatches, and each flip with the reference's margin where
    the replay recorded margins (runs before that: ``margins_known`` False)."""
    margins = rep.get("reference_margins")
    reference = [
        {"output": out, "margins": margins[i] if margins else None}
        for i, out in enumerate(rep["reference"])
    ]
    control = [
        {"seq": x.get("seq"), "output": out} for x, out in zip(sample, rep["control"], strict=True)
    ]
    ours_flips = flips(sample, reference, near_tie)
    control_flips = flips(control, reference, near_tie)
    return {
        "n": len(sample),
        # a flip is an answer that differs from the reference's, wherever it first does
        "mismatches": len(ours_flips),
        "control_mismatches": len(control_flips),
        "margins_known": bool(margins),
        "near_tie_nats": near_tie,
        "flips": ours_flips,
        "control_flips": control_flips,
        "confident_flips": sum(not f["near_tie"] for f in ours_flips),
    }
