"""Outputs of the spec-decode offload benchmark: summary.json, summary.md, PNG plots.

Works on the recorded JSON only (no vllm, no torch), so ``--report-only`` can rebuild
everything from a run made elsewhere. Numbers: summary.py; goals:
goals.py; definitions in docs/benchmark.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.workloads.goals import evaluate_goals
from vllm_draft_offload.bench.workloads.summary import summarize

# ----------------------------------------------------------------------------- outputs


def _f(v: float | None, fmt: str = ".3g") -> str:
    return "–" if v is None else format(v, fmt)


def markdown(data: dict[str, Any], summary: dict[str, Any], goals: list[dict[str, Any]]) -> str:
    dev = data.get("device") or {}
    mem = (dev.get("memcpy") or {}).get("gbps")
    v = data.get("versions", {})
    lines = [
        "# Spec-decode offload benchmark",
        "",
        f"Device: {dev.get('name', '?')}; pinned H2D memcpy: {_f(mem)} GB/s; "
        f"vllm {v.get('vllm')}, torch {v.get('torch')}, lmcache {v.get('lmcache')}"
        + ("; **CPU dry run: numbers are not performance data**" if data.get("dry_run") else ""),
        "",
        "## Goals",
        "",
        "| goal | target | value | result | detail |",
        "|---|---|---|---|---|",
    ]
    for g in goals:
        lines.append(
            f"| {g['description']}{' — ' + g['drafter'] if g.get('drafter') else ''} "
            f"| {g['op']} {g['threshold']:g} | {_f(g['value'], '.4g')} | {g['message']} "
            f"| {g['detail']} |"
        )
    lines += [
        "",
        "## Per configuration x drafter x workload",
        "",
        "| config | drafter | workload | AL fresh | AL restored | ratio | AL cont. "
        "| TTFT p50/p90 fill ms | TTFT p50/p90 restore ms | tok/s restore | hits "
        "| recomputed/hit mean (max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        f, r = row["phases"].get("fill") or {}, row["phases"].get("restore") or {}
        lines.append(
            f"| {row['config']} | {row['drafter']} | {row['workload']} | {_f(row['al_fresh'])} "
            f"| {_f(row['al_restored'])} | {_f(row['al_ratio'], '.4f')} | {_f(row['al_continue'])} "
            f"| {_f(f.get('ttft_p50_ms'))}/{_f(f.get('ttft_p90_ms'))} "
            f"| {_f(r.get('ttft_p50_ms'))}/{_f(r.get('ttft_p90_ms'))} "
            f"| {_f(r.get('output_tok_s'))} "
            f"| {r.get('hit_requests', '–')}/{r.get('n', '–')} "
            f"| {_f(r.get('recomputed_per_hit_mean'))} ({_f(r.get('recomputed_per_hit_max'))}) |"
        )
    lines += [
        "",
        "## TTFT vs prefix length (single request, max_tokens=1)",
        "",
        "| config | drafter | prefix | fresh p50 ms | first hit ms | hit p50 ms | hit/fresh "
        "| cached | GB/s est. | GB/s metric |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in summary["runs"]:
        for L, t in run["ttft"].items():
            lines.append(
                f"| {run['config']} | {run['drafter']} | {L} | {_f(t['fresh_p50_ms'])} "
                f"| {_f(t['first_hit_ms'])} | {_f(t['hit_p50_ms'])} | {_f(t['hit_over_fresh'])} "
                f"| {_f(t['hit_cached'], '.0f')} | {_f(t['restore_gbps_est'])} "
                f"| {_f(t['restore_gbps_metric'])} |"
            )
    lines += [
        "",
        "## Runs",
        "",
        "| config | drafter | status | startup s | error |",
        "|---|---|---|---|---|",
    ]
    for run in summary["runs"]:
        err = (run.get("error") or "") + (" — " + run["log_errors"][0] if run["log_errors"] else "")
        err = err.replace("|", "/").replace("\n", " ")[:240]
        lines.append(
            f"| {run['config']} | {run['drafter']} | {run['status']} "
            f"| {_f(run['startup_s'])} | {err} |"
        )
    if summary["checks"]:
        lines += ["", "## Warnings", ""] + [f"- {c}" for c in summary["checks"]]
    return "\n".join(lines) + "\n"


def _length_axis(ax: Any, summary: dict[str, Any]) -> None:
    """log2 x axis labelled with the measured prefix lengths themselves."""
    lengths = sorted({int(L) for run in summary["runs"] for L in run["ttft"]})
    ax.set_xscale("log", base=2)
    if lengths:
        ax.set_xticks(lengths, [str(L) for L in lengths], fontsize=7)
        ax.minorticks_off()
    ax.set_xlabel("prefix length (tokens)")


def plots(summary: dict[str, Any], data: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    written: list[str] = []
    rows = [r for r in summary["rows"] if r["workload"] != "nohit"]
    wls = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(wls)), figsize=(5 * max(1, len(wls)), 4), squeeze=False)
    for ax, wl in zip(axes[0], wls or [""], strict=False):
        sel = [r for r in rows if r["workload"] == wl]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r["al_fresh"] or 0 for r in sel], 0.4, label="fresh")
        ax.bar([x + 0.2 for x in xs], [r["al_restored"] or 0 for r in sel], 0.4, label="restored")
        for x, r in zip(xs, sel, strict=True):  # the ratio is what the goal is about
            if r["al_ratio"] is not None:
                top = max(r["al_fresh"] or 0, r["al_restored"] or 0)
                ax.text(x, top, f"{r['al_ratio']:.3f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(
            list(xs),
            [f"{r['config']} · {r['drafter']}" for r in sel],
            rotation=45,
            ha="right",
            fontsize=7,
        )
        ax.set_title(f"acceptance length: {wl}")
        ax.set_ylabel("1 + accepted/drafts")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
    written.append("acceptance.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in summary["runs"]:
        t = run["ttft"]
        if not t:
            continue
        Ls = sorted(t, key=int)
        label = f"{run['config']} {run['drafter']}"
        a1.plot([int(L) for L in Ls], [t[L]["fresh_p50_ms"] for L in Ls], marker="o", label=label)
        line = a2.plot(
            [int(L) for L in Ls], [t[L]["hit_p50_ms"] for L in Ls], marker="o", label=label
        )
        a2.scatter(
            [int(L) for L in Ls],
            [t[L]["first_hit_ms"] for L in Ls],
            marker="x",
            color=line[0].get_color(),
        )
    for ax, title in (
        (a1, "fresh prefill (recompute)"),
        (a2, "after GPU reset: steady hit (x = first hit)"),
    ):
        _length_axis(ax, summary)
        ax.set_yscale("log")  # 1k..16k prefixes and 10x-apart configs on one axis
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_prefix.png", dpi=110)
    plt.close(fig)
    written.append("ttft_vs_prefix.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in summary["runs"]:
        t = run["ttft"]
        pts = [(int(L), v["restore_gbps_est"]) for L, v in t.items() if v["restore_gbps_est"]]
        if pts:
            pts.sort()
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=f"{run['config']} {run['drafter']} (est.)",
            )
        mp = [(int(L), v["restore_gbps_metric"]) for L, v in t.items() if v["restore_gbps_metric"]]
        if mp:
            mp.sort()
            ax.plot(
                *zip(*mp, strict=True),
                marker="s",
                linestyle="--",
                label=f"{run['config']} {run['drafter']} (metric)",
            )
    mem = ((data.get("device") or {}).get("memcpy") or {}).get("gbps")
    if mem:
        ax.axhline(mem, color="k", label=f"pinned H2D memcpy {mem:.1f} GB/s")
        ax.axhline(0.8 * mem, color="k", linestyle=":", label="0.8 x memcpy (goal)")
    else:
        ax.text(
            0.5,
            0.95,
            "pinned memcpy not measured (CPU run)",
            transform=ax.transAxes,
            ha="center",
            va="top",
            fontsize=8,
        )
    _length_axis(ax, summary)
    ax.set_ylabel("restore GB/s")
    ax.set_title("restore throughput vs pinned memcpy", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "restore_gbps.png", dpi=110)
    plt.close(fig)
    written.append("restore_gbps.png")
    return written


def write_report(data: dict[str, Any], out: Path) -> dict[str, Any]:
    """summary.json + summary.md + PNGs under ``out``; returns the summary object."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(data)
    goals = evaluate_goals(summary, data)
    summary["goals"] = goals
    summary["plots"] = plots(summary, data, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.md").write_text(markdown(data, summary, goals))
    return summary
