"""The soak's figure: memory, hit rates, fallbacks and TTFT over the run, with the
injected faults and the connector's idle phase marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.stress.counters import causes


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
