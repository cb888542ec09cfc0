"""`restore-speed`'s report: each configuration's connector log lines, the summary of
one shape (ratios to recompute, native and the pinned-copy limit) and the speed table."""

from __future__ import annotations

import json
import re
from typing import Any

from vllm_draft_offload.bench.speed.restore_engine import is_restart
from vllm_draft_offload.metric_defs import AUDIT_RESULTS, L3_THREAD_OPS

# Lines of a child's output worth keeping in the report: the connector's storage
# decisions and calibration, and anything it warned about.
LOG_MARKERS = ("L3 decision", "prefill calibration", "DraftOffloadConnector")

LOG_TAIL_CHARS = 4000

# A decision line's whole fetch: units asked for and landed, and the fetch's seconds.
_WHOLE_FETCH = re.compile(r"-> fetched; fetch (\d+), landed (\d+);.*, fetch ([0-9.]+) s\)")


def connector_log(stdout: str, stderr: str = "") -> dict[str, Any]:
    """The connector's lines from a child's output (vLLM logs to stdout by default),
    and the tail of each stream."""
    lines = (stdout + "\n" + stderr).splitlines()
    return {
        "l3_decisions": [line for line in lines if any(m in line for m in LOG_MARKERS)][-400:],
        "log_tail": {"stdout": stdout[-LOG_TAIL_CHARS:], "stderr": stderr[-LOG_TAIL_CHARS:]},
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _store_gbps(result: dict[str, Any]) -> float | None:
    """An engine's median store GB/s: GPU time of the connector's own device->host
    copies of the fresh prompts (None if none was timed)."""
    stores = result.get("store_GBps_metric") or []
    return _median(stores) if stores else None


def summarize(report: dict[str, Any]) -> None:
    configs = report["configs"]
    recompute = configs.get("recompute", {})
    base = _median(recompute["fresh_s"]) if recompute.get("fresh_s") else None
    summary: dict[str, Any] = {"recompute_ttft_s": base}
    if base and recompute.get("first_request_s"):
        # The no-connector control of a restart's first request: an engine's first
        # long prefill against its later ones, nothing cached.
        summary["recompute_first_request_ratio"] = recompute["first_request_s"] / base
    hits = {
        "native": configs.get("native", {}),
        "ours": configs.get("ours", {}),
        "ours_l3_restart": configs.get("ours_l3", {}),
        "ours_l3_restart_cold": configs.get("ours_l3_cold", {}),
    }
    # restore-speed --l3-variants: more warm restarts, other settings.
    for config, result in configs.items():
        if is_restart(config) and config not in ("ours_l3", "ours_l3_cold"):
            hits[f"ours_l3_restart_{config.removeprefix('ours_l3_')}"] = result
    for name, result in hits.items():
        hit = result.get("hit_s")
        if not hit:
            continue
        # After a restart every hit is a first hit of its prompt: no warm-up to drop.
        restart = name.startswith("ours_l3_restart")
        steady = _median(hit if restart else hit[1:] or hit)
        cached = result["hit_cached"][-1]
        metric = result.get("restore_GBps_metric") or []
        summary[name] = {
            "hit_ttft_s_steady": steady,
            "hit_ttft_s_first": hit[0],
            "cached_tokens": cached,
            "ratio_to_recompute": steady / base if base else None,
            "ratio_to_recompute_first": hit[0] / base if base else None,
            # A lower bound on restore bandwidth: the whole hit TTFT counted as copy time.
            "restore_GBps_lower_bound": cached * report["kv_bytes_per_token"] / steady / 1e9,
            # GPU time of the connector's own host->device copies (CUDA events).
            "restore_GBps_connector": _median(metric) if metric else None,
        }
        if result.get("cpu_hit_s"):
            summary[name]["cpu_hit_after_l3_ttft_s"] = _median(result["cpu_hit_s"])
        if restart:
            # Every prompt: tokens hit after the restart, and TTFT against this engine's
            # own recompute of prompts it has never seen (and the recompute config's).
            own = _median(result["fresh_s"]) if result.get("fresh_s") else None
            summary[name]["hit_tokens_per_prompt"] = result["hit_cached"]
            summary[name]["prompt_tokens"] = report["tokens"]
            summary[name]["hit_ttft_s_per_prompt"] = hit
            summary[name]["recompute_ttft_s_same_engine"] = own
            summary[name]["warmup_tokens"] = result.get("warmup_tokens", 0)
            summary[name]["warmup_ttft_s"] = result.get("warmup_s")
            summary[name]["ttft_vs_recompute_per_prompt"] = (
                [h / (base or own) for h in hit] if (base or own) else None
            )
            summary[name].update(restart_extras(result, base or own))
            summary[name]["storage_decisions"] = [
                line[line.index("L3 decision") :]
                for line in result.get("l3_decisions", [])
                if "L3 decision req=" in line
            ]
            unit_bytes = report["kv_bytes_per_token"] * report.get("chunk_size", 256)
            summary[name].update(
                fetch_speed(summary[name]["storage_decisions"], unit_bytes, report, name)
            )
    pinned = report.get("pinned_h2d_GBps")
    if "ours" in summary and pinned and summary["ours"]["restore_GBps_connector"]:
        summary["ours"]["restore_vs_pinned_memcpy"] = (
            summary["ours"]["restore_GBps_connector"] / pinned
        )
    if "ours" in summary:
        store = _store_gbps(configs["ours"])
        pinned_d2h = report.get("pinned_d2h_GBps")
        summary["ours"]["store_GBps_connector"] = store
        summary["ours"]["store_vs_pinned_memcpy"] = (
            store / pinned_d2h if store and pinned_d2h else None
        )
    if "native" in summary and "ours" in summary:
        summary["ours_vs_native_ttft"] = (
            summary["ours"]["hit_ttft_s_steady"] / summary["native"]["hit_ttft_s_steady"]
        )
        summary["ours_vs_native_ttft_first"] = (
            summary["ours"]["hit_ttft_s_first"] / summary["native"]["hit_ttft_s_first"]
        )
    audit = configs.get("ours_audit", {}).get("audit_recompute_units")
    if audit is not None:
        # What the store path wrote, compared with a recompute (on the host, within the
        # audit's tolerance): any mismatch is wrong KV in the CPU tier.
        summary["ours_audit"] = {
            **audit,
            "store_GBps_connector": _store_gbps(configs["ours_audit"]),
            "all_ok": audit.get("ok", 0) > 0
            and not audit.get("mismatch")
            and not audit.get("error"),
        }
    fill = configs.get("ours_l3_fill", {})
    if "units_expected" in fill:
        raw = report.get("raw_disk", {})
        written = fill.get("l3_write", {})
        summary["ours_l3_writes"] = {
            "units_in_storage": fill["l3_files"],
            "units_expected": fill["units_expected"],
            "written_fraction": fill["l3_files"] / fill["units_expected"],
            **fill.get("l3_counters", {}),
            "sustained_write_GBps": written.get("GBps"),
            "raw_write_GBps": raw.get("write_GBps"),
            "write_vs_raw": written["GBps"] / raw["write_GBps"]
            if written.get("GBps") and raw.get("write_GBps")
            else None,
        }
    if "raw_disk" in report:
        raw = report["raw_disk"]
        summary["raw_disk"] = {
            k: raw[k]
            for k in (
                "write_GBps",
                "read_direct_GBps",
                "read_cold_GBps",
                "read_warm_GBps",
                "read_warm_into_memory_GBps",
            )
            if k in raw
        }
    report["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)


def fetch_speed(
    decisions: list[str], unit_bytes: int, report: dict[str, Any], name: str
) -> dict[str, Any]:
    """GB/s of every whole storage fetch in a restart's decision lines (units landed x
    unit bytes / the fetch's seconds), and their median against the raw read of each
    thread count: a warm restart's against the page-cache read into memory (a fetch
    lands its bytes in host slots; ``read_warm_GBps`` reads into a buffer the CPU cache
    holds), a cold one's against the cold read."""
    speeds = []
    for line in decisions:
        match = _WHOLE_FETCH.search(line)
        if match and int(match[1]) == int(match[2]) > 0 and float(match[3]) > 0:
            speeds.append(int(match[2]) * unit_bytes / float(match[3]) / 1e9)
    if not speeds:
        return {}
    raw = report.get("raw_disk", {})
    key = "read_cold_GBps" if name == "ours_l3_restart_cold" else "read_warm_into_memory_GBps"
    fetch = _median(speeds)
    return {
        "fetch_GBps": speeds,
        f"fetch_vs_{key.removesuffix('_GBps')}": {
            threads: fetch / gbps for threads, gbps in raw.get(key, {}).items() if gbps
        },
    }


# Each timed kind of request, and the fresh prompts it is compared with: those that ran
# in the same condition (quiet, or behind another prompt's storage writes).
_SAME_CONDITION = {
    "hit_s": "fresh_s",
    "cpu_hit_s": "fresh_s",
    "short_hit_s": "fresh_s",
    "odd_fresh_s": "fresh_s",
    "busy_hit_s": "fresh_busy_s",
}


def prefill_extra_s(phases: dict[str, list[dict[str, Any]]]) -> dict[str, list[float | None]]:
    """Per request of each kind, its time from scheduling to first token minus the median
    of the fresh prompts' in the same condition: what its prefill and loads took beyond a
    fresh prefill, its wait on storage left out (negative by what a hit saved). Session
    30's partial admissions came out 14-37 ms over the declines beside them, read by hand
    from these phases."""
    out: dict[str, list[float | None]] = {}
    for label, reference in _SAME_CONDITION.items():
        records, fresh = phases.get(label), phases.get(reference)
        base = [
            r["scheduled_to_first_token_s"]
            for r in fresh or []
            if r.get("scheduled_to_first_token_s") is not None
        ]
        if not records or not base:
            continue
        median = _median(base)
        out[label] = [
            None
            if r.get("scheduled_to_first_token_s") is None
            else r["scheduled_to_first_token_s"] - median
            for r in records
        ]
    return out


def restart_extras(result: dict[str, Any], recompute_s: float | None) -> dict[str, Any]:
    """A restarted engine's hits behind storage writes, its recompute behind them, and
    where each kind of request's time went (medians of vLLM's request stats and of the
    storage threads' clocks)."""
    out: dict[str, Any] = {}
    busy = result.get("busy_hit_s")
    if busy:
        out["busy_hit_tokens_per_prompt"] = result.get("busy_hit_cached")
        out["busy_hit_ttft_s_per_prompt"] = busy
        out["busy_ttft_vs_recompute_per_prompt"] = (
            [h / recompute_s for h in busy] if recompute_s else None
        )
    fresh, fresh_busy = result.get("fresh_s"), result.get("fresh_busy_s")
    if fresh and fresh_busy:
        # Recompute right behind another prompt's storage writes, against with none.
        out["fresh_busy_vs_fresh"] = _median(fresh_busy) / _median(fresh)
        if busy:
            # Against the recompute it competes with: a fresh prompt behind the same writes.
            out["busy_ttft_vs_busy_recompute_per_prompt"] = [h / _median(fresh_busy) for h in busy]
    short = result.get("short_hit_s")
    if short:
        out["short_hit_tokens_per_prompt"] = result.get("short_hit_cached")
        out["short_hit_ttft_s_per_prompt"] = short
    extra = prefill_extra_s(result.get("phases") or {})
    if extra:
        out["scheduled_to_first_token_extra_s"] = extra
    phases: dict[str, Any] = {}
    for label, records in (result.get("phases") or {}).items():
        row: dict[str, Any] = {}
        for key in ("ttft_s", "waiting_s", "scheduled_to_first_token_s"):
            values = [r[key] for r in records if r.get(key) is not None]
            row[key] = _median(values) if values else None
        for op in L3_THREAD_OPS:
            walls = [r.get("l3_thread_seconds", {}).get(f"{op}_wall", 0.0) for r in records]
            cpus = [r.get("l3_thread_seconds", {}).get(f"{op}_cpu", 0.0) for r in records]
            if sum(walls) > 0:
                row[f"l3_{op}_thread_s"] = sum(walls) / len(walls)
                row[f"l3_{op}_cpu_of_wall"] = sum(cpus) / sum(walls)
        phases[label] = row
    if phases:
        out["phases"] = phases
    if "settle_timeouts" in result:
        out["settle_timeouts"] = result["settle_timeouts"]
    return out


def combine(reports: dict[str, dict[str, Any]], common: dict[str, Any]) -> dict[str, Any]:
    """The run's report: one shape keeps the single-shape layout, several go under
    ``shapes``; both get the ``table`` of every shape."""
    table = [table_row(name, report) for name, report in reports.items()]
    if len(reports) == 1:
        return {**next(iter(reports.values())), "table": table}
    return {**common, "shapes": reports, "table": table}


def table_row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """One shape's line of the speed table, from its summary (None where a
    configuration did not run or failed)."""
    summary = report.get("summary", {})
    ours, native = summary.get("ours", {}), summary.get("native", {})
    return {
        "shape": name,
        "page_bytes": report.get("page_bytes", {}).get("target"),
        "copy_path": report.get("copy_path"),
        "restore_GBps": ours.get("restore_GBps_connector"),
        "restore_vs_pinned_memcpy": ours.get("restore_vs_pinned_memcpy"),
        "store_GBps": ours.get("store_GBps_connector"),
        "store_vs_pinned_memcpy": ours.get("store_vs_pinned_memcpy"),
        # ours_audit: the stored units compared with a recompute (ok, mismatch, error).
        "stores_audited": {
            k: v for k, v in summary.get("ours_audit", {}).items() if k in AUDIT_RESULTS
        }
        or None,
        "recompute_ttft_s": summary.get("recompute_ttft_s"),
        "hit_ttft_s_first": ours.get("hit_ttft_s_first"),
        "hit_ttft_s_steady": ours.get("hit_ttft_s_steady"),
        "first_vs_recompute": ours.get("ratio_to_recompute_first"),
        "steady_vs_recompute": ours.get("ratio_to_recompute"),
        "native_first_vs_recompute": native.get("ratio_to_recompute_first"),
        "native_steady_vs_recompute": native.get("ratio_to_recompute"),
        "first_vs_native": summary.get("ours_vs_native_ttft_first"),
        "steady_vs_native": summary.get("ours_vs_native_ttft"),
        # Issue 13's item 4: the engine's first hit as fast as its steady ones (~1).
        "first_over_steady": _over(ours.get("hit_ttft_s_first"), ours.get("hit_ttft_s_steady")),
        "native_first_over_steady": _over(
            native.get("hit_ttft_s_first"), native.get("hit_ttft_s_steady")
        ),
    }


def _over(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None
