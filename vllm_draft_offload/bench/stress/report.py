"""Summaries, markdown and the figure of the pressure run and the soak, from their JSON.

Pure functions of the recorded data (no engine), so ``--report-only`` and the tests
rebuild every number from a recorded run. Counter keys are prometheus sample names
as `workloads.worker.snapshot_metrics` writes them, e.g.
``vllm:draft_offload_loaded_chunks_total{tier=cpu}``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.stress.phases import (
    decode_seconds_per_token,
    phase_markdown,
    phase_summary,
)

LOADED = "vllm:draft_offload_loaded_chunks_total{{tier={}}}"
HIT = "vllm:draft_offload_lookup_hit_chunks_total{{tier={}}}"
MISS = "vllm:draft_offload_lookup_miss_chunks_total{{tier={}}}"
SPEC_DRAFTS = "vllm:draft_offload_spec_drafts_total{{restored={}}}"
SPEC_ACC = "vllm:draft_offload_spec_accepted_tokens_total{{restored={}}}"
EXT_HITS, EXT_QUERIES = (
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
)
GPU_HITS, GPU_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
# vLLM's hit tokens by the tier that supplied them, counted at admission (the connector
# files storage hits under disk for fs://, external_unspecified for remote stores).
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total{{source={}}}"
SOURCES = {"cpu": ("host",), "l3": ("disk", "external_unspecified")}
_CAUSE = re.compile(r"^vllm:draft_offload_(fallbacks|refusals)_total\{cause=([^}]*)\}$")
TIERS = ("cpu", "l3")
MIN_ACCEPT_RATIO = 0.99
MIN_EXT_HIT_FRACTION = 0.05  # "well above zero": >= 5 % of prompt tokens from the tiers
# A greedy output that first differs from the reference where the reference's pick led
# the runner-up by less than this (nats) is a numerics near-tie, not wrong KV. On an H100
# (bf16), the GPU prefix cache alone, with no connector, flipped such picks.
NEAR_TIE_NATS = 0.1


def add_near_tie_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--near-tie-nats",
        type=float,
        default=None,
        help="an answer that first differs from the reference where the reference's pick "
        f"led by less than this is a numerics near-tie (default {NEAR_TIE_NATS})",
    )


def _al(accepted: float, steps: float) -> float | None:
    return 1.0 + accepted / steps if steps else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def connector_acceptance(counters: dict[str, float]) -> dict[str, float | None]:
    """Acceptance length restored / fresh from the connector's own spec counters."""
    restored = _al(
        counters.get(SPEC_ACC.format("true"), 0), counters.get(SPEC_DRAFTS.format("true"), 0)
    )
    fresh = _al(
        counters.get(SPEC_ACC.format("false"), 0), counters.get(SPEC_DRAFTS.format("false"), 0)
    )
    return {"al_restored": restored, "al_fresh": fresh, "ratio": _ratio(restored, fresh)}


_THREAD_SECONDS = re.compile(
    r"vllm:draft_offload_l3_thread_seconds_total\{clock=(?P<clock>\w+),op=(?P<op>\w+)\}"
)


def causes(counters: dict[str, float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"fallbacks": {}, "refusals": {}}
    for key, value in counters.items():
        m = _CAUSE.match(key)
        if m and value:
            out[m.group(1)][m.group(2)] = value
    return out


def tier_tokens(counters: dict[str, float], chunk: int) -> dict[str, Any]:
    """Hit tokens by the tier that held them.

    From vLLM's ``prompt_tokens_cached_by_source`` (``by_source``): what each request
    was admitted with. Runs recorded without it (before session 9) fall back to the
    connector's loads (``loaded_chunks``): ``loaded_chunks{tier=l3}`` counts units
    fetched from storage into a CPU slot, and every restore to the GPU counts under
    ``cpu``, so the CPU tier's own hits are ``cpu - l3``. That holds only while every
    fetched unit is restored once: fetched units that a small CPU tier evicts before
    use (or that finish in the background after their request stopped waiting) make
    it wrong. Where it visibly is (fewer CPU-tier loads than fetches, or more fetched
    tokens than external hits), both are None (unknown).
    """
    loaded = {t: int(counters.get(LOADED.format(t), 0)) for t in TIERS}
    by_source = {
        tier: sum(int(counters.get(BY_SOURCE.format(s), 0)) for s in sources)
        for tier, sources in SOURCES.items()
    }
    hit_tokens: dict[str, int | None]
    if any(by_source.values()):
        method, hit_tokens = "by_source", dict(by_source)
    else:
        own, fetched = loaded["cpu"] - loaded["l3"], loaded["l3"] * chunk
        method = "loaded_chunks"
        if own < 0 or fetched > int(counters.get(EXT_HITS, 0)):
            hit_tokens = {"cpu": None, "l3": None}
        else:
            hit_tokens = {"cpu": own * chunk, "l3": fetched}
    return {
        "hit_tokens": hit_tokens,
        "hit_tokens_method": method,
        "loaded_chunk_tokens": {t: int(counters.get(LOADED.format(t), 0) * chunk) for t in TIERS},
        "lookup_hit_chunks": {t: int(counters.get(HIT.format(t), 0)) for t in TIERS},
        "external_hit_tokens": int(counters.get(EXT_HITS, 0)),
        "gpu_prefix_hit_tokens": int(counters.get(GPU_HITS, 0)),
    }


def _mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First output position where two answers differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def flips(
    run: list[dict[str, Any]], reference: list[dict[str, Any]], near_tie: float
) -> list[dict[str, Any]]:
    """Every answer of ``run`` that differs from the reference's: where it first differs,
    the reference's margin there (its pick's lead over the runner-up, when recorded), and
    whether that makes it a near-tie."""
    out = []
    for got, ref in zip(run, reference, strict=True):
        first = first_difference(got["output"], ref["output"])
        if first is None:
            continue
        margins = ref.get("margins") or []
        margin = margins[first] if first < len(margins) else None
        out.append(
            {
                "seq": got.get("seq"),
                "first_diff": first,
                "cached": got.get("cached"),
                "reference_margin": margin,
                "near_tie": margin is not None and margin < near_tie,
            }
        )
    return out


# ----------------------------------------------------------------------------- pressure


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
            row["acceptance"] = _request_acceptance(ours["requests"], ref["requests"])
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


def _request_acceptance(ours: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """AL of ours on its requests that had a cache hit vs the same requests computed fresh."""
    hit = [i for i, q in enumerate(ours) if q.get("cached", 0) > 0 and q.get("spec")]

    def al(reqs: list[dict[str, Any]]) -> float | None:
        acc = sum(reqs[i]["spec"]["accepted"] for i in hit if reqs[i].get("spec"))
        steps = sum(reqs[i]["spec"]["steps"] for i in hit if reqs[i].get("spec"))
        return _al(acc, steps)

    restored, fresh = al(ours), al(ref)
    return {
        "hit_requests": len(hit),
        "al_restored": restored,
        "al_fresh": fresh,
        "ratio": _ratio(restored, fresh),
    }


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _al_cell(a: dict[str, Any]) -> str:
    """``ratio (AL restored / AL fresh)``."""
    return f"{_f(a['ratio'])} ({_f(a['al_restored'], '{:.2f}')} / {_f(a['al_fresh'], '{:.2f}')})"


def pressure_markdown(data: dict[str, Any]) -> str:
    s = data["summary"]
    ver = ", ".join(f"{k} {v}" for k, v in data["versions"].items() if v)
    dev = next((r["device"] for r in s["rows"] if r.get("device")), "unknown")
    inv = "on" if data.get("batch_invariant") else "off"
    p = data["plan"]
    lines = [
        "# Pressure run",
        "",
        f"Device: {dev}; {ver}. Batch-invariant mode: {inv}.",
        f"{p['streams']} streams, {p['prefixes']} prefixes x {p['prefix_len']} tokens "
        f"({p['hot']} hot), {p['rounds']} rounds; GPU KV {p['gpu_tokens']} tokens, "
        f"working set {p['prefixes'] * p['prefix_len']} tokens; storage tier: {data['l3']}"
        + (
            f" (hit policy {data['l3_hit_policy']}, CPU tier {data['cpu_fraction']} x the "
            "working set)."
            if "l3_hit_policy" in data  # not in results recorded before session 8
            else "."
        ),
        "",
        "| config | hit tokens cpu | hit tokens l3 | external hit tokens (share) "
        "| GPU prefix hits | outputs equal / total | control mismatch "
        "| acceptance restored/fresh | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        why = f": {'; '.join(r['failed'])}" if r["failed"] else ""
        if "hits" not in r:
            lines.append(f"| {r['drafter']} | | | | | | | | {r['verdict']}{why} |")
            continue
        h, a = r["hits"], r["acceptance"]
        cells = [
            r["drafter"],
            _f(h["hit_tokens"]["cpu"], "{}"),
            _f(h["hit_tokens"]["l3"], "{}"),
            f"{h['external_hit_tokens']} ({r['external_hit_fraction']:.0%})",
            h["gpu_prefix_hit_tokens"],
            r["outputs_equal"],
            f"{r['control_mismatch']}/{r['requests']}",
            f"{_al_cell(a)}, {a['hit_requests']} hit requests",
            f"{r['verdict']}{why}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    methods = {r["hits"]["hit_tokens_method"] for r in s["rows"] if "hits" in r}
    if "loaded_chunks" in methods:
        lines += [
            "",
            "Hit tokens by tier derived from the connector's loads (recorded without "
            "vLLM's hits by source): n/a where storage fetched units that were not served "
            "(the CPU tier dropped them before use); `loaded_chunk_tokens` in the JSON "
            "has what each tier moved.",
        ]
    flipped = [
        (r["drafter"], role, f)
        for r in s["rows"]
        for role in ("ours", "control")
        for f in r.get(f"{role}_flips", [])
    ]
    lines += _flip_lines(flipped, float(data.get("near_tie_nats", NEAR_TIE_NATS)))
    if data.get("dry_run"):
        lines += ["", "CPU dry run: tiny fixtures, numbers show the pipeline only."]
    return "\n".join(lines) + "\n"


def _flip_lines(flipped: list[tuple[str, str, dict[str, Any]]], near_tie: float) -> list[str]:
    """Every answer that differs from the reference, as (config, run, flip)."""
    if not flipped:
        return []
    lines = [
        "",
        "Answers that differ from the reference (the reference's margin: its pick's lead "
        f"over the runner-up at the first differing token; near-tie below {near_tie} nats):",
        "",
        "| config | run | request | first differing token | prompt tokens cached "
        "| reference margin | near-tie |",
        "|---|---|---|---|---|---|---|",
    ]
    for drafter, role, f in flipped:
        margin = f["reference_margin"]
        cells = [drafter, role, f["seq"], f["first_diff"], f["cached"], _f(margin, "{:.4f}")]
        cells.append("yes" if f["near_tie"] else ("unknown" if margin is None else "**no**"))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


# ----------------------------------------------------------------------------- soak


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


def thread_seconds(counters: dict[str, float]) -> dict[str, float]:
    """The storage threads' ``{op}/{clock}`` seconds (``l3_thread_seconds``) in counters."""
    out: dict[str, float] = {}
    for key, value in counters.items():
        m = _THREAD_SECONDS.match(key)
        if m:
            out[f"{m.group('op')}/{m.group('clock')}"] = value
    return out


def hit_rate_series(samples: list[dict[str, Any]], window_s: float = 5.0) -> list[dict[str, Any]]:
    """Per window: chunk hit rate per tier, and token hit rates of vLLM's two caches."""
    out: list[dict[str, Any]] = []
    prev = samples[0] if samples else None
    for s in samples[1:]:
        if s["t"] - prev["t"] < window_s and s is not samples[-1]:
            continue
        a, b = prev["counters"], s["counters"]

        def d(key: str, a: dict[str, float] = a, b: dict[str, float] = b) -> float:
            return b.get(key, 0.0) - a.get(key, 0.0)

        point: dict[str, Any] = {"t": s["t"]}
        for tier in TIERS:
            looked = d(HIT.format(tier)) + d(MISS.format(tier))
            point[tier] = d(HIT.format(tier)) / looked if looked else None
        point["external"] = d(EXT_HITS) / d(EXT_QUERIES) if d(EXT_QUERIES) else None
        point["gpu"] = d(GPU_HITS) / d(GPU_QUERIES) if d(GPU_QUERIES) else None
        out.append(point)
        prev = s
    return out


def _first_last(samples: list[dict[str, Any]], key: str) -> tuple[Any, Any]:
    values = [s[key] for s in samples if key in s]
    return (values[0], values[-1]) if values else (None, None)


# Connector containers listed in the summary: those that grew most after the warm-up.
STATE_GROWTH_TOP = 8


def state_growth(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Containers of the connector (samples' ``state``, stress/state.py) with more entries
    at the end than after the warm-up (the first count at 60 s or a quarter of the run),
    most growth first: under a steady load, a leak. ``flat_since_t``: from when on the
    count held its last value, at its peak (None while it still rose at the end): a
    container that fills to a bound it is built with (a cache of one entry per slot)
    and stays there is no leak, and this tells the two apart over a long enough run."""
    counted = [s for s in samples if "state" in s]
    if len(counted) < 2:
        return []
    start = min(60.0, counted[-1]["t"] / 4)
    base = next(s for s in counted if s["t"] >= start or s is counted[-1])
    later = counted[counted.index(base) :]
    peak: dict[str, int] = {}
    for s in later:
        for path, n in s["state"].items():
            peak[path] = max(n, peak.get(path, 0))
    first, last = base["state"], counted[-1]["state"]
    grew = [
        {
            "path": p,
            "t0": base["t"],
            "first": first.get(p, 0),
            "last": n,
            "max": peak[p],
            "flat_since_t": _flat_since(later, p, n) if n == peak[p] else None,
        }
        for p, n in last.items()
        if n > first.get(p, 0)
    ]
    grew.sort(key=lambda g: g["last"] - g["first"], reverse=True)
    return grew[:STATE_GROWTH_TOP]


def _flat_since(counted: list[dict[str, Any]], path: str, value: int) -> float | None:
    """The time of the first of the trailing samples whose count of ``path`` is
    ``value`` (None when only the last one is: nothing to call flat yet)."""
    since = None
    for sample in reversed(counted):
        if sample["state"].get(path, 0) != value:
            break
        since = sample["t"]
    return since if since is not None and since < counted[-1]["t"] else None


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


def _rss_span(span: Any, m: Any) -> str:
    start, end = span or (None, None)
    if start == end == 0:
        return "in the driver's process"  # the engine ran in-process (CPU dry run)
    return f"{m(start)} → {m(end)}"


def _throughput_cell(tp: dict[str, Any] | None) -> str:
    if not tp:
        return "n/a"
    ours, base = tp["ours"], tp["baseline"]
    return (
        f"{ours['requests']} vs {base['requests']}; "
        f"{_f(ours['output_tokens_per_s'], '{:.0f}')} vs "
        f"{_f(base['output_tokens_per_s'], '{:.0f}')}; "
        f"{ours['computed_prompt_tokens']:,} vs {base['computed_prompt_tokens']:,}; "
        f"{_f(_ms(ours.get('decode_s_per_token_mean')), '{:.2f}')} vs "
        f"{_f(_ms(base.get('decode_s_per_token_mean')), '{:.2f}')} ms"
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def soak_markdown(data: dict[str, Any]) -> str:
    s = data["summary"]

    def m(x: float | None) -> str:
        return "n/a" if x is None else f"{x / (1 << 20):.1f} MiB"

    def p(t: dict[str, Any] | None) -> str:
        t = t or {}
        return f"{_f(t.get('p50_s'))} / {_f(t.get('p99_s'))} s"

    t, mem, rep, hits = s["ttft"], s["memory"], s["replay"], s["hits"]["hit_tokens"]
    ver = ", ".join(f"{k} {v}" for k, v in data["versions"].items() if v)
    why = f": {'; '.join(s['failed'])}" if s["failed"] else ""
    rows = [
        ("verdict", f"{s['verdict']}{why}"),
        ("crashes", s["crashes"]),
        ("requests", f"{s['requests']['total']} {s['requests']['by_kind']}"),
        (
            "replayed outputs differing",
            f"{rep['mismatches']} / {rep['n']} (control {rep['control_mismatches']})"
            + (
                f"; at a confident pick: {rep['confident_flips']}"
                if rep.get("margins_known")
                else ""
            ),
        ),
        ("acceptance restored / fresh", _al_cell(s["acceptance"])),
        ("hit tokens cpu / l3", f"{_f(hits['cpu'], '{}')} / {_f(hits['l3'], '{}')}"),
        ("fallbacks by cause", s["causes"]["fallbacks"] or "none"),
        ("refusals by cause", s["causes"]["refusals"] or "none"),
        ("faults injected", s["faults_injected"] or "none"),
        (
            "CPU-tier pool min / max (budget); pinned min / max",
            f"{m(mem['pool_min'])} / {m(mem['pool_max'])} ({m(mem['cpu_bytes_budget'])}); "
            f"{m(mem['pinned_min'])} / {m(mem['pinned_max'])}",
        ),
        (
            "RSS start / max / end",
            f"{m(mem['rss_start'])} / {m(mem['rss_max'])} / {m(mem['rss_end'])}",
        ),
        (
            "RSS start → end: driver; engine; no-connector engine",
            "; ".join(
                _rss_span(mem.get(key), m)
                for key in ("rss_driver", "rss_engine", "baseline_rss_engine")
            ),
        ),
        (
            "connector containers grown after the warm-up (first → last, max)",
            "; ".join(
                f"{g['path']} {g['first']} → {g['last']} ({g['max']}"
                + (
                    f"; flat since {g['flat_since_t']:.0f} s)"
                    if g.get("flat_since_t") is not None
                    else ")"
                )
                for g in mem.get("state_growth") or []
            )
            or "none",
        ),
        ("TTFT p50 / p99, ours (whole run)", p(t["ours"])),
        (
            "storage threads' seconds (wall / own CPU), read; write",
            "; ".join(
                f"{_f(s['l3_thread_seconds'].get(f'{op}/wall'))} / "
                f"{_f(s['l3_thread_seconds'].get(f'{op}/cpu'))}"
                for op in ("read", "write")
            )
            if s.get("l3_thread_seconds")
            else "not recorded",
        ),
    ]
    if t.get("baseline_seconds"):  # a run without a no-connector engine has nothing to compare
        rows += [
            (
                f"first {t['baseline_seconds']} s, ours vs no connector: requests finished; "
                "output tokens/s; prompt tokens computed; decode per output token (mean)",
                _throughput_cell(t.get("throughput_first_window")),
            ),
            (
                f"TTFT p50 / p99, ours first {t['baseline_seconds']} s vs no connector",
                f"{p(t['ours_first_window'])} vs {p(t['baseline'])}",
            ),
        ]
    head = [
        "# Soak",
        "",
        f"Device: {data.get('device')}; {ver}. Backend {data['backend']}, "
        f"{data['load']['streams']} streams, {data['seconds']:.0f} s.",
        "",
        "| field | value |",
        "|---|---|",
    ]
    flipped = [("soak", "ours", f) for f in rep.get("flips") or []]
    flipped += [("soak", "control", f) for f in rep.get("control_flips") or []]
    tail = _flip_lines(flipped, float(rep.get("near_tie_nats", NEAR_TIE_NATS)))
    tail += phase_markdown(s["phases"])
    return "\n".join(head + [f"| {k} | {v} |" for k, v in rows] + tail) + "\n"


def soak_plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    samples = data["runs"].get("ours", {}).get("samples") or []
    fig, ax = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    mem = [x for x in samples if "pinned_bytes" in x]
    t = [x["t"] for x in mem]
    for key, label in (
        ("rss_bytes", "RSS (all processes)"),
        ("rss_driver_bytes", "RSS (driver)"),
        ("rss_engine_bytes", "RSS (engine processes)"),
        ("pool_bytes", "CPU-tier pool"),
        ("pinned_bytes", "pinned"),
        ("l3_pending_write_bytes", "L3 pending writes"),
        ("l3_staging_in_use_bytes", "L3 staging in use"),
    ):
        ax[0].plot(t, [x.get(key, 0) / (1 << 20) for x in mem], label=label)
    ax[0].set_ylabel("MiB")
    ax[0].legend(fontsize=7)
    hr = s["hit_rate"]
    for key in ("cpu", "l3", "external", "gpu"):
        ax[1].plot([p["t"] for p in hr], [p[key] for p in hr], marker=".", label=key)
    ax[1].set_ylabel("hit rate")
    ax[1].legend(fontsize=7)
    for cause in sorted({c for x in samples for c in causes(x["counters"])["fallbacks"]}):
        ax[2].plot(
            [x["t"] for x in samples],
            [causes(x["counters"])["fallbacks"].get(cause, 0) for x in samples],
            label=cause,
        )
    ax[2].set_ylabel("fallbacks (cumulative)")
    if ax[2].lines:
        ax[2].legend(fontsize=7)
    reqs = data["runs"].get("ours", {}).get("requests") or []
    ax[3].scatter([q["end_t"] for q in reqs], [q.get("ttft_s", 0) for q in reqs], s=3)
    ax[3].set_ylabel("TTFT (s)")
    ax[3].set_xlabel("seconds since load start")
    for ev in data.get("faults") or []:
        for a in ax:
            a.axvline(ev["t"], color="red", alpha=0.3, lw=0.8)
    idle = float(data.get("idle_seconds") or 0.0)
    for a in ax if idle else ():
        a.axvspan(0, idle, color="grey", alpha=0.15)
    shaded = ", grey = connector idle" if idle else ""
    ax[0].set_title(f"soak ({data['backend']}): red lines = injected faults{shaded}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
