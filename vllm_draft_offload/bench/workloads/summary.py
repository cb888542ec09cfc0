"""Summary of a recorded benchmark run: per config x drafter x workload numbers.

Works on the recorded JSON only (no vllm, no torch), so ``--report-only`` can rebuild
everything from a run made elsewhere.

Definitions (also in docs/benchmark.md):

* acceptance length (AL) = 1 + accepted draft tokens / drafting steps, from the
  ``vllm:spec_decode_num_accepted_tokens`` / ``vllm:spec_decode_num_drafts`` counters
  diffed around a phase. fill = fresh prefill; restore = the same prompts after the
  GPU prefix cache was reset; ratio = restore / fill.
* TTFT = ``RequestOutput.metrics.first_token_latency`` (arrival -> first token).
* recomputed per hit = prompt tokens - ``num_cached_tokens`` of restore-phase
  requests with a hit; "excess" subtracts what whole-chunk reuse must recompute
  anyway; the connector's own ``recomputed_tokens_per_hit`` histogram is preferred.
* restore GB/s: "metric" = connector ``loaded_bytes`` / ``transfer_seconds`` (ours
  only); "estimate" = KV bytes/token x hit tokens / (TTFT of hit - TTFT of a fresh
  prompt as long as the uncached tail), the same formula for every config.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
LOADED_BYTES = "vllm:draft_offload_loaded_bytes_total"
TRANSFER_S = "vllm:draft_offload_transfer_seconds_total"
RECOMP = "vllm:draft_offload_recomputed_tokens_per_hit"
GOAL_TTFT_LEN = 16384

OURS = ("ours_cpu", "ours_disk")


# ----------------------------------------------------------------------------- helpers


def sum_prefix(counters: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in counters.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def acceptance_length(counters: dict[str, float]) -> float | None:
    drafts = sum_prefix(counters, DRAFTS)
    if drafts <= 0:
        return None
    return 1.0 + sum_prefix(counters, ACCEPTED) / drafts


def pct(values: Iterable[float | None], q: float) -> float | None:
    """Percentile with linear interpolation (q in [0, 100]); None when empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median(values: Iterable[float | None]) -> float | None:
    return pct(values, 50)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def decode_tok_s(requests: list[dict[str, Any]]) -> float | None:
    """Tokens after the first / span from the first first-token to the last token."""
    timed = [r for r in requests if r.get("first_ts") and r.get("last_ts")]
    if not timed:
        return None
    span = max(r["last_ts"] for r in timed) - min(r["first_ts"] for r in timed)
    tokens = sum(max(0, r["out_len"] - 1) for r in timed)
    return tokens / span if span > 0 else None


def histogram_stats(counters: dict[str, float], name: str) -> dict[str, Any] | None:
    """count/mean/fraction <= 1 of a recorded histogram; None when it saw nothing."""
    count = sum_prefix(counters, name + "_count")
    if count <= 0:
        return None
    total = sum_prefix(counters, name + "_sum")
    buckets: dict[float, float] = {}
    for key, value in counters.items():
        base, _, rest = key.partition("{")
        if base != name + "_bucket":
            continue
        for kv in rest.rstrip("}").split(","):
            if kv.startswith("le="):
                le = float(kv[3:])
                buckets[le] = buckets.get(le, 0.0) + value
    le1 = max((v for le, v in buckets.items() if le <= 1.0), default=None)
    upper = min((le for le, v in buckets.items() if v >= count), default=None)
    return {
        "count": count,
        "mean": total / count,
        "frac_le_1": (le1 / count) if le1 is not None else None,
        "max_upper_bound": upper,  # smallest bucket bound holding every sample
    }


def run_key(run: dict[str, Any]) -> tuple[str, str]:
    d = run["drafter"]
    return run["config"], d.get("label") or f"{d['method']}:{Path(d['path']).name}"


# ----------------------------------------------------------------------------- summary


def summarize_phase(ph: dict[str, Any]) -> dict[str, Any]:
    reqs = ph.get("requests", [])
    hit = [r for r in reqs if r.get("cached", 0) > 0]
    raw = [r["prompt_len"] - r["cached"] for r in hit]
    excess = [r["expected_hit"] - r["cached"] for r in hit if r.get("expected_hit") is not None]
    spec_hit = [r["spec"] for r in hit if r.get("spec")]
    steps = sum(s["steps"] for s in spec_hit)
    wall = ph.get("wall_s") or 0.0
    return {
        "phase": ph["phase"],
        "round": ph.get("round", 0),
        "n": len(reqs),
        "reset_ok": (ph.get("reset") or {}).get("ok"),
        "al": acceptance_length(ph.get("counters", {})),
        "al_hit_requests": (1 + sum(s["accepted"] for s in spec_hit) / steps) if steps else None,
        "ttft_p50_ms": _ms(pct((r.get("ttft_s") for r in reqs), 50)),
        "ttft_p90_ms": _ms(pct((r.get("ttft_s") for r in reqs), 90)),
        "output_tok_s": (ph.get("output_tokens", 0) / wall) if wall > 0 else None,
        "decode_tok_s": decode_tok_s(reqs),
        "hit_requests": len(hit),
        "prompt_tokens": sum(r["prompt_len"] for r in reqs),
        "cached_tokens": sum(r["cached"] for r in reqs),
        "recomputed_per_hit_mean": statistics.fmean(raw) if raw else None,
        "recomputed_per_hit_max": max(raw) if raw else None,
        "excess_per_hit_max": max(excess) if excess else None,
        "digest": ph.get("digest"),
        "outputs_digest": ph.get("outputs_digest"),
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def _merge_phases(phs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several rounds of one phase (chat turns) pooled: counters added, requests joined."""
    if not phs:
        return None
    if len(phs) == 1:
        return phs[0]
    counters: dict[str, float] = {}
    for p in phs:
        for k, v in p.get("counters", {}).items():
            counters[k] = counters.get(k, 0.0) + v
    resets = [p.get("reset", {}).get("ok") for p in phs if p.get("reset")]
    return {
        "phase": phs[0]["phase"],
        "round": -1,
        "counters": counters,
        "requests": [r for p in phs for r in p.get("requests", [])],
        "wall_s": sum(p.get("wall_s", 0.0) for p in phs),
        "output_tokens": sum(p.get("output_tokens", 0) for p in phs),
        "reset": {"ok": all(resets)} if resets else {},
        "digest": ",".join(p.get("digest", "") for p in phs),
        "outputs_digest": ",".join(p.get("outputs_digest", "") for p in phs),
    }


def summarize_ttft(run: dict[str, Any]) -> dict[str, Any]:
    kv_bpt = (run.get("engine") or {}).get("kv_bytes_per_token")
    out: dict[str, Any] = {}
    for key, cur in sorted(run.get("ttft_curve", {}).items(), key=lambda kv: int(kv[0])):
        hits = cur.get("hits", [])
        fresh = cur.get("fresh", [])
        tail = cur.get("tail", [])
        cached = _median(h.get("cached") for h in hits)
        hit_p50 = _median(h.get("ttft_s") for h in hits)
        tail_p50 = _median(t.get("ttft_s") for t in tail)
        est = None
        if kv_bpt and cached and hit_p50 is not None and tail_p50 is not None:
            dt = hit_p50 - tail_p50
            est = kv_bpt * cached / dt / 1e9 if dt > 0 else None
        hc = cur.get("hits_counters", {})
        lb = sum_prefix(hc, LOADED_BYTES)
        ls = sum_prefix(hc, TRANSFER_S, direction="load")
        first = cur.get("first_hit") or {}
        out[key] = {
            "prompt_len": cur.get("prompt_len"),
            "fresh_p50_ms": _ms(_median(f.get("ttft_s") for f in fresh)),
            "first_hit_ms": _ms(first.get("ttft_s")),
            "first_hit_cached": first.get("cached"),
            "hit_p50_ms": _ms(hit_p50),
            "hit_cached": cached,
            "tail_p50_ms": _ms(tail_p50),
            "restore_gbps_est": est,
            "restore_gbps_metric": (lb / ls / 1e9) if lb > 0 and ls > 0 else None,
            "hit_over_fresh": ratio(hit_p50, _median(f.get("ttft_s") for f in fresh)),
        }
    return out


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for run in data.get("runs", []):
        config, drafter = run_key(run)
        base = {"config": config, "drafter": drafter, "method": run["drafter"]["method"]}
        totals = run.get("totals", {})
        lb = sum_prefix(totals, LOADED_BYTES)
        ls = sum_prefix(totals, TRANSFER_S, direction="load")
        runs.append(
            {
                **base,
                "status": run.get("status"),
                "error": run.get("error"),
                "log_errors": run.get("log_errors") or [],
                "startup_s": (run.get("engine") or {}).get("startup_s"),
                "kv_bytes_per_token": (run.get("engine") or {}).get("kv_bytes_per_token"),
                "recomputed_hist": histogram_stats(totals, RECOMP),
                "restore_gbps_metric_total": (lb / ls / 1e9) if lb > 0 and ls > 0 else None,
                "loaded_bytes": {
                    t: sum_prefix(totals, LOADED_BYTES, tier=t) for t in ("cpu", "l3")
                },
                "ttft": summarize_ttft(run),
            }
        )
        for wname, wl in run.get("workloads", {}).items():
            phases = wl.get("phases", [])
            by = {
                name: _merge_phases([p for p in phases if p["phase"] == name])
                for name in ("fill", "restore", "continue")
            }
            s = {k: summarize_phase(v) if v else None for k, v in by.items()}
            al_f = s["fill"]["al"] if s["fill"] else None
            al_r = s["restore"]["al"] if s["restore"] else None
            rows.append(
                {
                    **base,
                    "workload": wname,
                    "phases": s,
                    "al_fresh": al_f,
                    "al_restored": al_r,
                    "al_ratio": ratio(al_r, al_f),
                    "al_continue": s["continue"]["al"] if s["continue"] else None,
                }
            )
    return {"rows": rows, "runs": runs, "checks": sanity_checks(rows, runs)}


def sanity_checks(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[str]:
    """Things that make a number meaningless; listed in the summary, not goals."""
    notes: list[str] = []
    for r in runs:
        errs = "; ".join(r["log_errors"][:2])
        if r["status"] != "ok":
            who = f"{r['config']} / {r['drafter']}"
            notes.append(f"{who}: {r['status']}: {r.get('error') or ''} {errs}".strip())
        elif errs:
            notes.append(f"{r['config']} / {r['drafter']}: ran, but its log has errors: {errs}")
    digests: dict[tuple[str, str, str], set[str]] = {}
    for row in rows:
        for name, ph in row["phases"].items():
            if not ph:
                continue
            if ph["reset_ok"] is False:
                notes.append(
                    f"{row['config']} / {row['drafter']} / {row['workload']}: GPU prefix-cache "
                    f"reset failed before {name}; its hits may be GPU hits"
                )
            if name != "continue" or row["workload"] != "chat":  # chat turns depend on answers
                digests.setdefault((row["drafter"], row["workload"], name), set()).add(ph["digest"])
        rs = row["phases"].get("restore")
        if row["config"] in OURS + ("native", "lmcache") and rs and rs["hit_requests"] == 0:
            notes.append(
                f"{row['config']} / {row['drafter']} / {row['workload']}: no restore-phase hits"
            )
    for (drafter, wl, name), ds in digests.items():
        if len(ds) > 1:
            notes.append(f"{drafter} / {wl} / {name}: configs saw different prompts")
    return notes
