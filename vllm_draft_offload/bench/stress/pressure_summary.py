"""The pressure run's summary, from its JSON: per drafter, outputs against the
reference and the GPU-prefix-cache control, hits per tier, acceptance, and a verdict.

Pure functions of the recorded data (no engine), so ``--report-only`` and the tests
rebuild every number from a recorded run.
"""

from __future__ import annotations

from typing import Any

from vllm_draft_offload.bench.stress.acceptance import connector_acceptance, request_acceptance
from vllm_draft_offload.bench.stress.counters import tier_tokens
from vllm_draft_offload.bench.stress.flips import NEAR_TIE_NATS, flips

MIN_ACCEPT_RATIO = 0.99
MIN_EXT_HIT_FRACTION = 0.05  # "well above zero": >= 5 % of prompt tokens from the tiers


def _mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def pressure_summary(data: dict[str, Any]) -> dict[str, Any]:
    rows = []
    labels = list(dict.fromkeys(r["drafter"]["label"] for r in data["runs"]))
    for label in labels:
        runs = {r["role"]: r for r in data["runs"] if r["drafter"]["label"] == label}
        rows.append(_pressure_row(label, runs, data))
    return {"rows": rows, "pass": bool(rows) and all(r["verdict"] == "pass" for r in rows)}


def _pressure_row(
    label: str, runs: dict[str, dict[str, Any]], data: dict[str, Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "drafter": label,
        "status": {role: r.get("status") for role, r in runs.items()},
        "crashes": sum(int(r.get("crashes") or 0) for r in runs.values()),
        "device": next((r["engine"].get("device") for r in runs.values() if r.get("engine")), None),
    }
    failed: list[str] = [f"{k} {v}" for k, v in row["status"].items() if v != "ok"]
    ours, ref, ctl = runs.get("ours"), runs.get("reference"), runs.get("control")
    if not failed and ours and ref and ctl:
        out = {k: [q["output"] for q in r["requests"]] for k, r in runs.items()}
        total = len(out["reference"])
        if not len(out["ours"]) == len(out["control"]) == total:
            failed.append("request counts differ")
        else:
            prompt_tokens = sum(q["prompt_len"] for q in ours["requests"])
            row["requests"] = total
            row["prompt_tokens"] = prompt_tokens
            row["hits"] = tier_tokens(ours["counters"], int(data["chunk_size"]))
            row["control_hits"] = tier_tokens(ctl["counters"], int(data["chunk_size"]))
            row["ours_mismatch"] = _mismatches(out["ours"], out["reference"])
            row["control_mismatch"] = _mismatches(out["control"], out["reference"])
            near_tie = float(data.get("near_tie_nats", NEAR_TIE_NATS))
            row["ours_flips"] = flips(ours["requests"], ref["requests"], near_tie)
            row["control_flips"] = flips(ctl["requests"], ref["requests"], near_tie)
            row["ours_confident_flips"] = sum(not f["near_tie"] for f in row["ours_flips"])
            margins_known = any(q.get("margins") for q in ref["requests"])
            row["outputs_equal"] = f"{total - row['ours_mismatch']}/{total}"
            row["acceptance"] = request_acceptance(ours["requests"], ref["requests"])
            row["connector_acceptance"] = connector_acceptance(ours["counters"])
            ext = row["hits"]["external_hit_tokens"]
            row["external_hit_fraction"] = ext / prompt_tokens if prompt_tokens else 0.0
            cpu_hits = row["hits"]["hit_tokens"]["cpu"]
            if cpu_hits is None:
                failed.append("CPU-tier hits unknown (recorded without hits by source)")
            elif cpu_hits <= 0:
                failed.append("no CPU-tier hits")
            if row["external_hit_fraction"] < MIN_EXT_HIT_FRACTION:
                failed.append(f"external hits {row['external_hit_fraction']:.1%} of prompt tokens")
            if margins_known:
                # Each flip is judged where it happens: wrong KV changes confident picks;
                # numerics (cached vs computed KV, batch shapes) flips near-ties only.
                if row["ours_confident_flips"]:
                    failed.append(
                        f"{row['ours_confident_flips']} outputs differ at a pick the reference "
                        f"made by >= {near_tie} nats"
                    )
            else:
                # No margins recorded (older runs): the control's mismatches are the
                # noise floor. Batch-invariant mode does not make a GPU prefix-cache hit
                # match a full prefill (an H100 control differed on 1 and 4 of 1494).
                limit = row["control_mismatch"]
                if row["ours_mismatch"] > limit:
                    failed.append(f"{row['ours_mismatch']} outputs differ (control {limit})")
            ratio = row["acceptance"]["ratio"]
            if ratio is None or ratio < MIN_ACCEPT_RATIO:
                failed.append(f"acceptance ratio {ratio}")
    elif not failed:
        failed.append("missing runs")
    row["failed"] = failed
    row["verdict"] = "fail" if failed else "pass"
    return row
