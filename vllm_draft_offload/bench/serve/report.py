"""``serve-bench`` results: one run's summary from what it recorded (``vllm bench
serve``'s result JSON, the ``/metrics`` scrapes, the server log), and the comparison
of the runs as JSON and as a markdown table.

Counters are the increase from the first scrape (server up, before the first request)
to the last (after the last request), so the bench client's own requests are all that
they count.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.markdown import table as markdown_table
from vllm_draft_offload.bench.serve.scrape import Scrapes
from vllm_draft_offload.metric_defs import (
    FALLBACKS,
    HIT_CHUNKS,
    LOADED_BYTES,
    LOADED_CHUNKS,
    MISS_CHUNKS,
    REFUSALS,
    SPEC_ACCEPTED,
    SPEC_DRAFTS,
    STORED_BYTES,
    STORED_CHUNKS,
)

# What the summary keeps of `vllm bench serve`'s result (the rest is per request).
BENCH_FIELDS: tuple[str, ...] = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
    "median_e2el_ms", "p99_e2el_ms",
    "spec_decode_acceptance_length", "spec_decode_acceptance_rate",
)  # fmt: skip
KV_CACHE_SIZE = re.compile(r"(?:GPU|CPU|XPU|TPU)[^:]*KV cache size: ([\d,]+) tokens")


def _total(metric_name: str) -> str:
    """The sample name of a counter (prometheus_client appends ``_total``)."""
    return metric_name + "_total"


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _acceptance(drafts: float, accepted: float) -> float | None:
    """Mean acceptance length, 1 + accepted draft tokens per drafting step."""
    return 1.0 + accepted / drafts if drafts else None


def counters(scrapes: Scrapes) -> dict[str, Any]:
    """The run's prefix-cache, spec-decode and connector counters over the scrape window."""
    d = scrapes.delta
    gpu_q, gpu_h = d("vllm:prefix_cache_queries_total"), d("vllm:prefix_cache_hits_total")
    ext_q = d("vllm:external_prefix_cache_queries_total")
    ext_h = d("vllm:external_prefix_cache_hits_total")
    drafts = d("vllm:spec_decode_num_drafts_total")
    accepted = d("vllm:spec_decode_num_accepted_tokens_total")
    ours_drafts = scrapes.delta_by(_total(SPEC_DRAFTS.name), "restored")
    ours_accepted = scrapes.delta_by(_total(SPEC_ACCEPTED.name), "restored")

    def nonzero(name: str) -> dict[str, float]:
        return {k: v for k, v in scrapes.delta_by(_total(name), "cause").items() if v}

    return {
        "prompt_tokens": d("vllm:prompt_tokens_total"),
        "gpu_prefix_cache": {"queries": gpu_q, "hits": gpu_h, "hit_rate": _ratio(gpu_h, gpu_q)},
        "external_prefix_cache": {
            "queries": ext_q,
            "hits": ext_h,
            "hit_rate": _ratio(ext_h, ext_q),
        },
        "spec_decode": {
            "drafts": drafts,
            "draft_tokens": d("vllm:spec_decode_num_draft_tokens_total"),
            "accepted_tokens": accepted,
            "acceptance_length": _acceptance(drafts, accepted),
        },
        "draft_offload": {
            "lookup_hit_chunks": scrapes.delta_by(_total(HIT_CHUNKS.name), "tier"),
            "lookup_miss_chunks": scrapes.delta_by(_total(MISS_CHUNKS.name), "tier"),
            "stored_chunks": scrapes.delta_by(_total(STORED_CHUNKS.name), "tier"),
            "loaded_chunks": scrapes.delta_by(_total(LOADED_CHUNKS.name), "tier"),
            "stored_bytes": scrapes.delta_by(_total(STORED_BYTES.name), "part"),
            "loaded_bytes": scrapes.delta_by(_total(LOADED_BYTES.name), "part"),
            "acceptance_restored": _acceptance(
                ours_drafts.get("true", 0.0), ours_accepted.get("true", 0.0)
            ),
            "acceptance_fresh": _acceptance(
                ours_drafts.get("false", 0.0), ours_accepted.get("false", 0.0)
            ),
            "fallbacks": nonzero(FALLBACKS.name),
            "refusals": nonzero(REFUSALS.name),
        },
    }


def kv_cache_tokens(server_log: str) -> int | None:
    """The KV cache capacity vLLM logged at start (``GPU KV cache size: N tokens``)."""
    found = KV_CACHE_SIZE.findall(server_log)
    return int(found[-1].replace(",", "")) if found else None


def summarize_run(bench: dict[str, Any], scrapes: Scrapes, server_log: str) -> dict[str, Any]:
    """One run: the bench client's latencies and throughput, the server's counters."""
    return {
        "bench": {k: bench.get(k) for k in BENCH_FIELDS},
        "request_errors": request_errors(bench),
        "counters": counters(scrapes),
        "kv_cache_tokens": kv_cache_tokens(server_log),
        "scrapes": len(scrapes.times),
        "scrape_window_s": scrapes.times[-1] - scrapes.times[0] if scrapes.times else 0.0,
    }


def request_errors(bench: dict[str, Any]) -> dict[str, int]:
    """The failed requests' errors, each with how many requests it failed."""
    return dict(Counter(error for error in bench.get("errors") or [] if error))


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int] | None:
    """How many requests generated the same text in both runs (both ran greedy on the
    same shuffled prompts, from ``--save-detailed`` results), among those that succeeded
    in both: a request that failed in both has two empty texts, which prove nothing."""
    ta, tb = a.get("generated_texts"), b.get("generated_texts")
    if not ta or not tb or len(ta) != len(tb):
        return None
    ea = a.get("errors") or [""] * len(ta)
    eb = b.get("errors") or [""] * len(tb)
    both = [i for i in range(len(ta)) if not ea[i] and not eb[i]]
    return {"equal": sum(ta[i] == tb[i] for i in both), "of": len(both), "requests": len(ta)}


# ------------------------------------------------------------------------ markdown


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _rows(run: dict[str, Any]) -> dict[str, tuple[Any, int]]:
    """Table rows of one run: label -> (value, decimals)."""
    b, c = run["bench"], run["counters"]
    ours = c["draft_offload"]
    hits, misses = sum(ours["lookup_hit_chunks"].values()), sum(ours["lookup_miss_chunks"].values())
    return {
        "TTFT p50 (ms)": (b["median_ttft_ms"], 1),
        "TTFT p99 (ms)": (b["p99_ttft_ms"], 1),
        "TPOT p50 (ms)": (b["median_tpot_ms"], 2),
        "output throughput (tok/s)": (b["output_throughput"], 0),
        "requests/s": (b["request_throughput"], 2),
        "completed / failed": (f"{b['completed']} / {b['failed']}", 0),
        "GPU prefix-cache hit rate": (c["gpu_prefix_cache"]["hit_rate"], 3),
        "external prefix-cache hit tokens": (int(c["external_prefix_cache"]["hits"]), 0),
        "external prefix-cache hit rate": (c["external_prefix_cache"]["hit_rate"], 3),
        "connector hit chunks / looked up (cpu)": (
            f"{int(ours['lookup_hit_chunks'].get('cpu', 0))} / {int(hits + misses)}",
            0,
        ),
        "connector GB loaded (target+draft)": (sum(ours["loaded_bytes"].values()) / 1e9, 3),
        "connector GB stored (target+draft)": (sum(ours["stored_bytes"].values()) / 1e9, 3),
        "acceptance length (vLLM, all requests)": (c["spec_decode"]["acceptance_length"], 3),
        "acceptance length restored / fresh (connector)": (
            f"{_fmt(ours['acceptance_restored'], 3)} / {_fmt(ours['acceptance_fresh'], 3)}",
            0,
        ),
        "fallbacks / refusals": (
            f"{int(sum(ours['fallbacks'].values()))} / {int(sum(ours['refusals'].values()))}",
            0,
        ),
    }


RATIO_ROWS = ("TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "output throughput (tok/s)")


def markdown(result: dict[str, Any]) -> str:
    """The comparison table of ``serve_bench.json`` (``docs/benchmark.md`` style)."""
    runs: dict[str, dict[str, Any]] = {k: v for k, v in result["runs"].items() if "bench" in v}
    env, setup = result["env"], result["setup"]
    w = setup["workload"]
    lines = [
        f"`vllm bench serve --dataset-name prefix_repetition` on {env['gpu']} "
        f"(vLLM {env['versions'].get('vllm')}, torch {env['versions'].get('torch')}, "
        f"vllm-draft-offload {env['versions'].get('vllm-draft-offload')}): "
        f"{w['num_prompts']} requests over {w['num_prefixes']} prefixes of "
        f"{w['prefix_len']} tokens + {w['suffix_len']}-token suffixes, {w['output_len']} "
        f"output tokens, concurrency {w['max_concurrency']}; drafter "
        f"{setup['draft'] or 'none'} ({setup['spec_method'] or 'no spec decode'}, "
        f"k={setup['num_spec']}); GPU KV cache {setup['gpu_kv_tokens']:,} tokens for "
        f"{w['working_set_tokens']:,} tokens of prefixes.",
        "",
    ]
    failed = {k: v.get("error") for k, v in result["runs"].items() if "bench" not in v}
    for name, error in failed.items():
        lines.append(f"**{name} failed:** {error}")
    for name, run in runs.items():
        if run["bench"].get("failed"):
            errors = "; ".join(f"{n} × {e}" for e, n in run.get("request_errors", {}).items())
            lines.append(
                f"**{name}: {run['bench']['failed']} of "
                f"{run['bench']['failed'] + (run['bench'].get('completed') or 0)} requests "
                f"failed** ({errors or 'no error text'}): its figures cover the rest only."
            )
    if not runs:
        return "\n".join(lines) + "\n"
    names = list(runs)
    rows = {name: _rows(run) for name, run in runs.items()}
    with_ratio = "none" in runs and "ours_cpu" in runs
    header = ["", *names] + (["ours_cpu / none"] if with_ratio else [])
    cells_by_label = []
    for label in rows[names[0]]:
        cells = [label, *(_fmt(rows[n][label][0], rows[n][label][1]) for n in names)]
        if with_ratio:
            ratio = None
            if label in RATIO_ROWS:
                ratio = _ratio(rows["ours_cpu"][label][0] or 0.0, rows["none"][label][0] or 0.0)
            cells.append(_fmt(ratio, 2))
        cells_by_label.append(cells)
    lines += markdown_table(header, cells_by_label)
    same = result.get("same_outputs")
    if same and same["of"]:
        scope = (
            ""
            if same["of"] == same["requests"]
            else f" requests that succeeded in both (of {same['requests']})"
        )
        lines += [
            "",
            f"Identical generated text in both runs: {same['equal']} of {same['of']}{scope}.",
        ]
    elif same:
        lines += ["", "No request succeeded in both runs: their texts were not compared."]
    return "\n".join(lines) + "\n"


def load_bench_result(path: Path) -> dict[str, Any]:
    """``vllm bench serve --save-result``'s file (one JSON object)."""
    return json.loads(path.read_text())
