"""Render the Grafana dashboard's panels to a PNG from recorded ``/metrics`` scrapes.

No Grafana or Prometheus needed: every panel's PromQL is evaluated over the series of
a scrape file (``serve-bench`` writes ``OUT/RUN/metrics.prom``) at each scrape time,
with Grafana's ``$__rate_interval`` (4 scrape intervals unless told) and every
dashboard variable set to all values. The panels keep the dashboard's layout, titles,
units and legends. Only the PromQL the dashboard uses is implemented (rate, irate,
sum by, histogram_quantile, arithmetic): anything else stops the render with the
panel and the expression named.

Also writes ``PNG.json`` beside the picture: every plotted series, and its last value.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.serve.promql import Evaluator, UnsupportedPromQL, parse
from vllm_draft_offload.bench.serve.scrape import Labels, Scrapes, read_scrapes

EXAMPLES = """examples:
  vllm-draft-offload dashboard-render --metrics $OUT/serve/ours_cpu/metrics.prom \\
      --out docs/dashboard.png
  vllm-draft-offload dashboard-render --metrics metrics.prom --out /tmp/d.png \\
      --dashboard configs/grafana/draft-offload.json --rate-interval 10
"""
REPO_DASHBOARD = Path(__file__).resolve().parents[3] / "configs" / "grafana" / "draft-offload.json"
GRID_COLUMNS = 24  # Grafana's gridPos width
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
# Grafana unit -> (factor, axis label)
UNITS: dict[str, tuple[float, str]] = {
    "percentunit": (100.0, "%"),
    "GBs": (1.0, "GB/s"),
    "s": (1.0, "s"),
    "ops": (1.0, "per s"),
    "short": (1.0, ""),
}


@dataclass
class PanelData:
    title: str
    unit: str
    grid: dict[str, int]
    # legend -> (seconds since the first scrape, values); NaN where the query had no value
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with ``$name`` / ``${name}`` replaced; UnsupportedPromQL naming an
    unknown one."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise UnsupportedPromQL(f"dashboard variable ${name} has no value")
        return variables[name]

    return VARIABLE.sub(one, expr)


def legend(fmt: str | None, labels: Labels) -> str:
    """Grafana's legend: ``{{label}}`` replaced by the series' value ('' if absent)."""
    have = dict(labels)
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in labels) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: have.get(m.group(1), ""), fmt).strip()


def default_variables(dashboard: dict[str, Any], rate_interval_s: float) -> dict[str, str]:
    """Every templating variable as "All" (``.*``), and Grafana's built-in intervals."""
    seconds = f"{max(1, round(rate_interval_s))}s"
    out = {v["name"]: ".*" for v in dashboard.get("templating", {}).get("list", [])}
    out.update(__rate_interval=seconds, __interval=seconds, __range=seconds)
    return out


def rate_interval(scrapes: Scrapes) -> float:
    """Grafana's floor for ``$__rate_interval``: four scrape intervals."""
    steps = [b - a for a, b in zip(scrapes.times, scrapes.times[1:], strict=False)]
    return 4 * statistics.median(steps) if steps else 4.0


def evaluate_dashboard(
    dashboard: dict[str, Any], scrapes: Scrapes, variables: dict[str, str]
) -> list[PanelData]:
    """Every panel's targets at every scrape time."""
    if not scrapes.times:
        raise ValueError("the scrape file holds no scrape")
    evaluator, start = Evaluator(scrapes), scrapes.times[0]
    panels = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            continue
        data = PanelData(
            title=panel["title"],
            unit=panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short"),
            grid=panel["gridPos"],
        )
        if data.unit not in UNITS:
            raise UnsupportedPromQL(f"panel {data.title!r}: unit {data.unit!r} is not supported")
        for target in panel["targets"]:
            expr = substitute(target["expr"], variables)
            try:
                tree = parse(expr)
                points = {t: evaluator.evaluate(tree, t) for t in scrapes.times}
            except (UnsupportedPromQL, ValueError) as e:
                raise UnsupportedPromQL(f"panel {data.title!r}: {e} (in {expr})") from e
            names = {
                labels for value in points.values() if isinstance(value, dict) for labels in value
            }
            for labels in sorted(names):
                values = [
                    float(v.get(labels, math.nan)) if isinstance(v, dict) else v
                    for v in points.values()
                ]
                times = [t - start for t in points]
                data.series[legend(target.get("legendFormat"), labels)] = (times, values)
            if not names and all(isinstance(v, float) for v in points.values()):
                data.series[target.get("legendFormat") or expr] = (
                    [t - start for t in points],
                    [float(v) for v in points.values()],  # type: ignore[arg-type]
                )
        panels.append(data)
    return panels


def render(panels: list[PanelData], path: Path, title: str) -> None:
    """The panels at their dashboard positions (Grafana's 24-column grid), on one shared
    time axis, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(p.grid["y"] + p.grid["h"] for p in panels)
    width_in, row_in, head_in = 18.0, 0.4, 0.6
    height_in = rows * row_in + head_in
    fig = plt.figure(figsize=(width_in, height_in))
    # room inside each panel's cell for its title (top), ticks and labels (left, bottom)
    pad_l, pad_r, pad_t, pad_b = 0.7 / width_in, 0.15 / width_in, 0.35, 0.45
    end = max((times[-1] for p in panels for times, _ in p.series.values() if times), default=1)
    for p in panels:
        g = p.grid
        top = height_in - head_in - g["y"] * row_in
        bottom = top - g["h"] * row_in
        ax = fig.add_axes(
            (
                g["x"] / GRID_COLUMNS + pad_l,
                (bottom + pad_b) / height_in,
                g["w"] / GRID_COLUMNS - pad_l - pad_r,
                (top - bottom - pad_t - pad_b) / height_in,
            )
        )
        factor, unit = UNITS[p.unit]
        ax.set_title(p.title, fontsize=9, loc="left")
        plotted = False
        for name, (times, values) in p.series.items():
            ys = [v * factor if math.isfinite(v) else math.nan for v in values]
            if any(math.isfinite(y) for y in ys):
                ax.plot(times, ys, label=name, linewidth=1.2, marker=".", markersize=2.5)
                plotted = True
        if plotted:
            ax.legend(fontsize=6, loc="best", ncol=2, framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlim(0, end)
        ax.set_ylabel(unit, fontsize=7)
        ax.set_xlabel("s since first scrape", fontsize=7, labelpad=1)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11, y=1 - 0.15 / height_in, va="top")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _last(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return finite[-1] if finite else None


def main(argv: list[str] | None = None) -> int:
    ap = command_parser("dashboard-render", __doc__, EXAMPLES)
    ap.add_argument("--metrics", required=True, type=Path, help="a serve-bench metrics.prom")
    ap.add_argument("--out", required=True, type=Path, help="the PNG to write")
    ap.add_argument(
        "--dashboard",
        type=Path,
        default=REPO_DASHBOARD if REPO_DASHBOARD.exists() else None,
        help="Grafana dashboard JSON (default: configs/grafana/draft-offload.json of this "
        "source tree)",
    )
    ap.add_argument("--rate-interval", type=float, help="seconds (default 4 scrape intervals)")
    ap.add_argument("--title", help="figure title (default: the dashboard's and the file's)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.dashboard is None:
        ap.error("--dashboard is needed outside the source tree (configs/grafana/...)")
    dashboard = json.loads(args.dashboard.read_text())
    scrapes = read_scrapes(args.metrics)
    interval = args.rate_interval or rate_interval(scrapes)
    try:
        panels = evaluate_dashboard(dashboard, scrapes, default_variables(dashboard, interval))
    except UnsupportedPromQL as e:
        print(f"dashboard-render: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    title = args.title or (
        f"{dashboard.get('title', 'dashboard')}: {args.metrics} "
        f"({len(scrapes.times)} scrapes, rate interval {interval:g} s)"
    )
    render(panels, args.out, title)
    summary = {
        "dashboard": str(args.dashboard),
        "metrics": str(args.metrics),
        "rate_interval_s": interval,
        "panels": [
            {
                "title": p.title,
                "unit": p.unit,
                "series": {
                    name: {
                        "last": _last(v),
                        "times": t,
                        "values": [x if math.isfinite(x) else None for x in v],
                    }
                    for name, (t, v) in p.series.items()
                },
            }
            for p in panels
        ],
    }
    Path(f"{args.out}.json").write_text(json.dumps(summary) + "\n")
    for p in summary["panels"]:
        lasts = {k: s["last"] for k, s in p["series"].items()}
        print(f"{p['title']}: {lasts or 'no data'}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
