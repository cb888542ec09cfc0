"""The markdown of the pressure run's and the soak's reports, from their summaries."""

from __future__ import annotations

from typing import Any

from vllm_draft_offload.bench.stress.flips import NEAR_TIE_NATS
from vllm_draft_offload.bench.stress.phases import phase_markdown


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
