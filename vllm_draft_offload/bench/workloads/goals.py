"""Project goals evaluated on a benchmark summary: pass / miss (by how much) / n/a.

A goal whose inputs were not measured (CPU run, crashed config, no hits) is "n/a"
with the reason, never a pass.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.workloads.specs import EAGLE_METHODS
from vllm_draft_offload.bench.workloads.summary import GOAL_TTFT_LEN, OURS, ratio

# Project goals: (id, description, comparison, threshold)
GOALS: tuple[tuple[str, str, str, float], ...] = (
    ("acceptance", "restored/fresh acceptance length, every drafter (ours)", ">=", 0.99),
    ("recompute", "tokens recomputed per EAGLE hit (ours_cpu)", "<=", 1.0),
    ("restore_vs_memcpy", "restore GB/s / pinned H2D memcpy GB/s (ours_cpu)", ">=", 0.8),
    ("restore_vs_native", "restore GB/s ours_cpu / native (same estimate)", ">=", 1.0),
    ("ttft_16k", "16k-token hit TTFT / recompute TTFT (ours_cpu)", "<=", 0.25),
    ("nohit_decode", "no-hit decode tok/s ours_cpu / gpu_prefix", ">=", 0.97),
)


# ----------------------------------------------------------------------------- goals


def goal_result(
    goal_id: str, value: float | None, detail: str = "", reason: str = ""
) -> dict[str, Any]:
    """pass/miss (and by how much) of one goal; n/a with a reason when unmeasured."""
    _, desc, op, thr = next(g for g in GOALS if g[0] == goal_id)
    res: dict[str, Any] = {
        "goal": goal_id,
        "description": desc,
        "op": op,
        "threshold": thr,
        "value": value,
        "detail": detail,
    }
    if value is None or (isinstance(value, float) and math.isnan(value)):
        res.update(status="n/a", margin_pct=None, message=f"not measured: {reason or 'no data'}")
        return res
    ok = value >= thr if op == ">=" else value <= thr
    # margin > 0: headroom; < 0: missed by that fraction of the threshold
    margin = (value - thr) / thr * 100 if op == ">=" else (thr - value) / thr * 100
    res["status"] = "pass" if ok else "miss"
    res["margin_pct"] = margin
    if ok:
        res["message"] = f"pass: {value:.4g} {op} {thr:g} ({margin:+.1f}% headroom)"
    else:
        res["message"] = f"missed by {-margin:.1f}%: {value:.4g}, needs {op} {thr:g}"
    return res


def evaluate_goals(summary: dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    rows, runs = summary["rows"], summary["runs"]
    run_by = {(r["config"], r["drafter"]): r for r in runs}
    drafters = [
        d.get("label") or f"{d['method']}:{Path(d['path']).name}" for d in data.get("drafters", [])
    ]
    if not drafters:
        drafters = sorted({r["drafter"] for r in runs})
    methods = {r["drafter"]: r["method"] for r in runs}
    goals: list[dict[str, Any]] = []

    # 1. acceptance ratio, one row per drafter: the worst (config, workload) of ours
    for d in drafters:
        cands = [
            (row["al_ratio"], f"{row['config']}/{row['workload']}")
            for row in rows
            if row["drafter"] == d
            and row["config"] in OURS
            and row["al_ratio"] is not None
            and (row["phases"].get("restore") or {}).get("hit_requests", 0) > 0
        ]
        if cands:
            v, where = min(cands)
            res = goal_result("acceptance", v, f"{d}: worst {where} of {len(cands)}")
        else:
            res = goal_result("acceptance", None, d, "no ours run with restore-phase hits")
        res["drafter"] = d
        goals.append(res)

    # 2. recomputed tokens per EAGLE hit: connector histogram (all hits of the run),
    #    else the request-level excess over whole-chunk reuse.
    vals: list[tuple[float, str]] = []
    eagle = [d for d in drafters if methods.get(d, "") in EAGLE_METHODS]
    for d in eagle:
        r = run_by.get(("ours_cpu", d))
        h = (r or {}).get("recomputed_hist")
        if h and h["max_upper_bound"] is not None:
            vals.append(
                (
                    h["max_upper_bound"],
                    f"{d}: connector histogram, {h['count']:.0f} hits, "
                    f"mean {h['mean']:.2f}, {100 * (h['frac_le_1'] or 0):.0f}% <= 1",
                )
            )
            continue
        ex = [
            row["phases"]["restore"]["excess_per_hit_max"]
            for row in rows
            if row["config"] == "ours_cpu"
            and row["drafter"] == d
            and row["phases"].get("restore")
            and row["phases"]["restore"]["excess_per_hit_max"] is not None
        ]
        if ex:
            vals.append((float(max(ex)), f"{d}: request-level excess over whole chunks (max)"))
    if vals:
        v, det = max(vals)
        goals.append(goal_result("recompute", v, det))
    else:
        goals.append(
            goal_result("recompute", None, "", "no ours_cpu run with an EAGLE drafter and hits")
        )

    # 3./4. restore throughput (largest curve length), worst drafter
    memcpy = ((data.get("device") or {}).get("memcpy") or {}).get("gbps")
    vs_mem: list[tuple[float, str]] = []
    vs_nat: list[tuple[float, str]] = []
    for d in drafters:
        ours, nat = run_by.get(("ours_cpu", d)), run_by.get(("native", d))
        if not ours or not ours["ttft"]:
            continue
        L = max(ours["ttft"], key=int)
        o = ours["ttft"][L]
        metric = o["restore_gbps_metric"] or ours["restore_gbps_metric_total"]
        gbps = metric if metric is not None else o["restore_gbps_est"]
        src = "connector metric" if metric is not None else "TTFT estimate"
        if memcpy and gbps is not None:
            vs_mem.append(
                (gbps / memcpy, f"{d}: {gbps:.2f} GB/s ({src}, {L} tokens) vs memcpy {memcpy:.2f}")
            )
        n_est = ((nat or {}).get("ttft") or {}).get(L, {}).get("restore_gbps_est")
        if n_est and o["restore_gbps_est"] is not None:
            vs_nat.append(
                (
                    o["restore_gbps_est"] / n_est,
                    f"{d}: {o['restore_gbps_est']:.2f} vs native {n_est:.2f} GB/s "
                    f"(estimates, {L} tokens)",
                )
            )
    goals.append(
        goal_result("restore_vs_memcpy", *min(vs_mem))
        if vs_mem
        else goal_result(
            "restore_vs_memcpy",
            None,
            "",
            "pinned memcpy not measured (CPU run)"
            if not memcpy
            else "no ours_cpu restore throughput",
        )
    )
    goals.append(
        goal_result("restore_vs_native", *min(vs_nat))
        if vs_nat
        else goal_result("restore_vs_native", None, "", "no native or ours_cpu restore estimate")
    )

    # 5. 16k hit TTFT vs recompute
    tt: list[tuple[float, str]] = []
    for d in drafters:
        ours = run_by.get(("ours_cpu", d))
        if not ours or not ours["ttft"]:
            continue
        L = str(GOAL_TTFT_LEN) if str(GOAL_TTFT_LEN) in ours["ttft"] else max(ours["ttft"], key=int)
        o = ours["ttft"][L]
        if o["hit_over_fresh"] is not None and (o["hit_cached"] or 0) > 0:
            note = "" if str(GOAL_TTFT_LEN) == L else f" (at {L}, no {GOAL_TTFT_LEN} point)"
            tt.append(
                (
                    o["hit_over_fresh"],
                    f"{d}: hit {o['hit_p50_ms']:.2f} ms vs fresh {o['fresh_p50_ms']:.2f} ms{note}",
                )
            )
    goals.append(
        goal_result("ttft_16k", *max(tt))
        if tt
        else goal_result("ttft_16k", None, "", "no ours_cpu TTFT curve with hits")
    )

    # 6. no-hit decode throughput vs no connector
    nh: list[tuple[float, str]] = []
    for d in drafters:
        get = {
            row["config"]: row["phases"]["fill"]
            for row in rows
            if row["drafter"] == d and row["workload"] == "nohit" and row["phases"].get("fill")
        }
        o, b = get.get("ours_cpu"), get.get("gpu_prefix")
        if o and b:
            key = "decode_tok_s" if o["decode_tok_s"] and b["decode_tok_s"] else "output_tok_s"
            r = ratio(o[key], b[key])
            if r is not None:
                nh.append((r, f"{d}: {o[key]:.1f} vs {b[key]:.1f} tok/s ({key})"))
    goals.append(
        goal_result("nohit_decode", *min(nh))
        if nh
        else goal_result("nohit_decode", None, "", "needs nohit on ours_cpu and gpu_prefix")
    )
    return goals
