"""decode-overhead's figures: decode rate of a batch, acceptance length, and a shape's
summary and table row from its engines' reports (vllm-draft-offload decode-overhead)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_draft_offload.bench.speed.decode_configs import STORING

GOAL = 0.97
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


def whole_chunks(prompt_tokens: int, decode_tokens: int, chunk: int) -> int:
    """Chunks of one request whose KV can all exist: with speculative decoding the last
    step is cut short at ``max_tokens``, and a request's last token is then a verified
    draft token whose KV was computed (every batch of the 8B runs stored 6 chunks of
    1,024 + 512 tokens). Without it, or when the last token is a bonus token, the last
    token has no KV, and a request whose length is a multiple of ``chunk`` has one whole
    chunk fewer: so this is the most, and ``stored_fraction`` is at most 1."""
    return (prompt_tokens + decode_tokens) // chunk


def decode_rate(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Decode tokens/s of one batch from the engine's per-request timestamps: output
    tokens after each request's first, from the last first token to the last token."""
    tokens_after_first = sum(max(0, r["out_len"] - 1) for r in requests)
    if not requests or any("first_ts" not in r for r in requests):
        return {"decode_tokens": tokens_after_first, "decode_s": None, "decode_tok_s": None}
    start = max(r["first_ts"] for r in requests)
    end = max(r["last_ts"] for r in requests)
    return {
        "decode_tokens": tokens_after_first,
        "decode_s": end - start,
        "decode_tok_s": tokens_after_first / (end - start) if end > start else None,
    }


def acceptance_length(counters: dict[str, float]) -> float | None:
    drafts = counters.get(DRAFTS, 0.0)
    return 1.0 + counters.get(ACCEPTED, 0.0) / drafts if drafts > 0 else None


def arm_reps(runs: list[dict[str, Any]], arm: str) -> list[dict[str, Any]]:
    """Every batch of ``arm`` in a config's engines (a rep without an arm, from a run
    before pairs, is an ``on`` batch)."""
    return [rep for run in runs for rep in run.get("reps", []) if rep.get("arm", "on") == arm]


def arm_rates(runs: list[dict[str, Any]], arm: str) -> list[float]:
    """Decode tokens/s of every batch of ``arm`` that has a rate."""
    return [rep["decode_tok_s"] for rep in arm_reps(runs, arm) if rep.get("decode_tok_s")]


def prefill_s(rep: dict[str, Any]) -> float | None:
    """A batch's seconds before it decodes (its wall time less the decode span): where
    its prompts are prefilled, and stored."""
    wall, decode = rep.get("wall_s"), rep.get("decode_s")
    return wall - decode if wall and decode and wall > decode else None


def paired(
    runs: list[dict[str, Any]],
    value: Callable[[dict[str, Any]], float | None] = lambda rep: rep.get("decode_tok_s"),
) -> dict[str, Any] | None:
    """The on/off ratio of ``value`` (decode tokens/s unless said) of every pair in a
    config's engines, their median and range."""
    ratios = []
    for run in runs:
        arms: dict[int, dict[str, float]] = {}
        for rep in run.get("reps", []):
            if (measured := value(rep)) and "rep" in rep:
                arms.setdefault(rep["rep"], {})[rep["arm"]] = measured
        ratios += [pair["on"] / pair["off"] for pair in arms.values() if len(pair) == 2]
    if not ratios:
        return None
    return {
        "on_vs_off": statistics.median(ratios),
        "ci95": median_ci(ratios),
        "range": [min(ratios), max(ratios)],
        "pairs": len(ratios),
        "ratios": ratios,
    }


def median_ci(values: list[float], resamples: int = 4000, seed: int = 0) -> list[float]:
    """A bootstrap 95 % interval of the median (percentile method, a fixed seed so a
    report reads the same every time it is made)."""
    rng = np.random.default_rng(seed)
    draws = rng.choice(np.asarray(values), size=(resamples, len(values)), replace=True)
    low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return [float(low), float(high)]


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties ranked by order), None below 3 points or for
    a constant series."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    ranks_x = np.argsort(np.argsort(xs)).astype(float)
    ranks_y = np.argsort(np.argsort(ys)).astype(float)
    return float(np.corrcoef(ranks_x, ranks_y)[0, 1])


# What the machine did during a batch (machine_state.MachineSampler) and, with
# --time-hooks, the engine (engine_timeline.py), as the report reads it: a field's name,
# and how to take it out of a batch's record.
MACHINE_FIELDS = {
    "steal_share": lambda rep: rep["machine"].get("steal_share"),
    "busy_share": lambda rep: rep["machine"].get("busy_share"),
    "sm_clock_mhz": lambda rep: (rep["machine"].get("sm_clock_mhz") or {}).get("median"),
    # the GPU's busy share: where decode is GPU-bound it stays near 100 %, and a batch
    # whose host fell behind shows it idle (H100, session 20: rank correlation 0.9)
    "gpu_util_pct": lambda rep: rep["machine"].get("gpu_util_pct"),
    # a batch slower in every decode step, or in a few stalls
    "decode_step_median_ms": lambda rep: (rep.get("engine") or {}).get("decode_step_median_ms"),
    "stall_ms": lambda rep: (rep.get("engine") or {}).get("stall_ms"),
    "gc_pause_ms": lambda rep: (rep.get("engine") or {}).get("gc_pause_ms"),
}


def machine_link(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How a config's batch speeds went with what the machine did (every arm): per
    field, its range over the batches and its rank correlation with decode tokens/s,
    and every clock-limiting reason NVML gave. None for batches recorded without it."""
    reps = [
        rep
        for run in runs
        for rep in run.get("reps", [])
        if rep.get("decode_tok_s") and rep.get("machine")
    ]
    if not reps:
        return None
    rates = [rep["decode_tok_s"] for rep in reps]
    link: dict[str, Any] = {"batches": len(reps)}
    for field, read in MACHINE_FIELDS.items():
        pairs = [(rate, read(rep)) for rate, rep in zip(rates, reps, strict=True)]
        pairs = [(rate, value) for rate, value in pairs if value is not None]
        values = [value for _, value in pairs]
        link[field] = {
            "range": [min(values), max(values)] if values else None,
            "rank_corr_with_tok_s": rank_correlation([r for r, _ in pairs], values),
        }
    link["clock_reasons"] = sorted(
        {reason for rep in reps for reason in rep["machine"].get("clock_reasons") or []}
    )
    return link


def step_tails(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per arm, over its batches timed with --time-hooks (engine_timeline.py): the median
    of their median and 99th-percentile decode steps, the longest decode step of any,
    where each batch's longest fell (decode steps after its last prompt step, sorted;
    files from before session 32 lack it), and their stalls and GC pauses summed: what
    stores do to inter-token latency, which a batch's mean rate spreads thin. None
    without such batches."""
    tails: dict[str, Any] = {}
    for arm in ("on", "off"):
        timed = [rep["engine"] for rep in arm_reps(runs, arm) if rep.get("engine")]
        timed = [engine for engine in timed if engine.get("decode_steps")]
        if not timed:
            continue
        tails[arm] = {
            "batches": len(timed),
            "decode_step_median_ms": statistics.median(e["decode_step_median_ms"] for e in timed),
            "decode_step_p99_ms": statistics.median(e["decode_step_p99_ms"] for e in timed),
            "decode_step_max_ms": max(e["decode_step_max_ms"] for e in timed),
            "decode_step_max_at": sorted(
                e["decode_step_max_at"] for e in timed if "decode_step_max_at" in e
            ),
            "stall_steps": sum(e["stall_steps"] for e in timed),
            "stall_ms": sum(e["stall_ms"] for e in timed),
            "gc_pause_ms": sum(e["gc_pause_ms"] for e in timed),
        }
    return tails or None


def _ratio(rates: dict[str, float | None], config: str, base: str) -> float | None:
    value, reference = rates.get(config), rates.get(base)
    return value / reference if value and reference else None


def summarize(report: dict[str, Any]) -> None:
    """One shape's figures from its configs' reps (medians over every round), and each
    config's fastest batch and range: a small model's decode is bound by the host (an
    H100, session 14: the GPU busy 29 % of a batch's wall time), whose interference
    only ever slows a batch, so the fastest batch of many is the steadier figure
    when reps spread more than the configs differ."""
    rates: dict[str, float | None] = {}
    best: dict[str, float | None] = {}
    spread: dict[str, list[float] | None] = {}
    for config, runs in report["configs"].items():
        values = arm_rates(runs, "on")
        rates[config] = statistics.median(values) if values else None
        best[config] = max(values) if values else None
        spread[config] = [min(values), max(values)] if values else None
    ratio = _ratio(rates, "store", "none")
    summary: dict[str, Any] = {
        "decode_tok_s": rates,
        "decode_tok_s_best": best,
        "decode_tok_s_range": spread,
        "store_vs_none_best": _ratio(best, "store", "none"),
        "idle_vs_none_best": _ratio(best, "idle", "none"),
        "store_vs_none": ratio,
        "idle_vs_none": _ratio(rates, "idle", "none"),
        # vLLM's connector plumbing alone, then ours over it, then vLLM's own offloading.
        "null_vs_none": _ratio(rates, "null", "none"),
        "idle_vs_null": _ratio(rates, "idle", "null"),
        "native_vs_none": _ratio(rates, "native", "none"),
        # stores forced onto DMA or onto the page kernel (decode_configs.FORCED_COPY_PATH)
        "store_dma_vs_none": _ratio(rates, "store_dma", "none"),
        "store_kernel_vs_none": _ratio(rates, "store_kernel", "none"),
        "goal_0.97_met": ratio >= GOAL if ratio is not None else None,
        "paired": {config: paired(runs) for config, runs in report["configs"].items()},
        # The batches' prefill seconds, storing over opting out: what stores add before
        # decoding starts (H200, 64 requests: DMA stores 1.10 and 1.13 x in sessions 29
        # and 28, the pair kernel 1.00 x).
        "paired_prefill": {
            config: paired(runs, prefill_s) for config, runs in report["configs"].items()
        },
        "machine": {config: machine_link(runs) for config, runs in report["configs"].items()},
        "decode_steps": {config: step_tails(runs) for config, runs in report["configs"].items()},
    }
    off = [
        rate for config in STORING for rate in arm_rates(report["configs"].get(config, []), "off")
    ]
    if off and rates.get("none"):
        summary["store_off_vs_none"] = statistics.median(off) / rates["none"]
    store_reps = arm_reps(report["configs"].get("store", []), "on")
    if store_reps:
        expected = report["batch"] * whole_chunks(
            report["prompt_tokens"], report["decode_tokens"], report["chunk_size"]
        )
        stored = [rep["stored_chunks"] for rep in store_reps]
        summary["stored_chunks_per_batch"] = stored
        summary["expected_chunks_per_batch"] = expected
        summary["stored_fraction"] = min(stored) / expected if expected else None
        summary["store_hit_tokens"] = sum(rep["hit_tokens"] for rep in store_reps)
    turns = next(
        (run["turns"] for run in report["configs"].get("store", []) if "turns" in run), None
    )
    if turns is not None:
        summary["turns"] = summarize_turns(turns, report["chunk_size"])
    report["summary"] = summary


def summarize_turns(turns: dict[str, Any], chunk: int) -> dict[str, Any]:
    fresh, restored = turns["fresh"], turns["restored"]
    # Whole chunks of turn 1's prompt + answer: what the CPU tier holds of each turn 2.
    expected = whole_chunks(turns["prompt_tokens"], turns["answer_tokens"], chunk) * chunk
    fresh_al, restored_al = fresh["acceptance_length"], restored["acceptance_length"]
    return {
        "prompt_tokens": turns["prompt_tokens"],
        "expected_hit_tokens": expected,
        "restored_hit_tokens": restored["hit_tokens"],
        "fresh_hit_tokens": fresh["hit_tokens"],
        "decode_kv_reused": all(hit > turns["prompt_tokens"] for hit in restored["hit_tokens"]),
        "outputs_match": fresh["outputs"] == restored["outputs"],
        "acceptance_fresh": fresh_al,
        "acceptance_restored": restored_al,
        "acceptance_ratio": restored_al / fresh_al if fresh_al and restored_al else None,
    }


def table_row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    summary = report.get("summary", {})
    turns = summary.get("turns", {})
    # Every config's pairs (store_dma, store_kernel, null, idle too), so a run of
    # several storing configs reads from the table without pooling its file.
    prefill = summary.get("paired_prefill", {})
    paired = {
        config: {
            **{key: pairs[key] for key in ("on_vs_off", "ci95", "pairs")},
            **({"prefill_on_vs_off": prefill[config]["on_vs_off"]} if prefill.get(config) else {}),
        }
        for config, pairs in sorted(summary.get("paired", {}).items())
        if pairs
    }
    return {
        "shape": name,
        "decode_tok_s_none": summary.get("decode_tok_s", {}).get("none"),
        "decode_tok_s_store": summary.get("decode_tok_s", {}).get("store"),
        "store_vs_none": summary.get("store_vs_none"),
        "idle_vs_none": summary.get("idle_vs_none"),
        "store_on_vs_off_paired": paired.get("store", {}).get("on_vs_off"),
        "none_on_vs_off_paired": paired.get("none", {}).get("on_vs_off"),
        "paired_by_config": paired,
        "store_off_vs_none": summary.get("store_off_vs_none"),
        "stored_fraction": summary.get("stored_fraction"),
        "turn2_decode_kv_reused": turns.get("decode_kv_reused"),
        "turn2_outputs_match": turns.get("outputs_match"),
        "turn2_acceptance_ratio": turns.get("acceptance_ratio"),
    }


def pool_reports(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Several decode-overhead output files (``{path: contents}``) as one: per shape,
    every file's engines under their config, then the shape's summary and table row
    over all of them. Pairs divide each engine's own speed out, so engines of runs made
    apart pool into one median and interval; ``pooled_from`` names each file's GPU,
    versions and batch settings, so a reader sees what was pooled."""
    shapes: dict[str, dict[str, Any]] = {}
    sources = []
    for path, contents in reports.items():
        sources.append(
            {"file": path, "gpu": contents.get("gpu"), "versions": contents.get("versions")}
        )
        for name, report in contents.get("shapes", {}).items():
            sources[-1].setdefault("shapes", {})[name] = {
                key: report.get(key)
                for key in ("batch", "prompt_tokens", "decode_tokens", "enforce_eager")
            }
            pooled = shapes.setdefault(
                name, {**{k: v for k, v in report.items() if k != "summary"}, "configs": {}}
            )
            for config, runs in report.get("configs", {}).items():
                pooled["configs"].setdefault(config, []).extend(runs)
    for report in shapes.values():
        summarize(report)
    return {
        "pooled_from": sources,
        "shapes": shapes,
        "table": [table_row(name, report) for name, report in shapes.items()],
    }
