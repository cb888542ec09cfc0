"""The soak's phases: the connector engine idle, then working, next to the baseline.

``soak --idle-seconds S``: every request the connector engine gets in its first S
seconds carries `IDLE_PARAMS` (request_options.py: neither stored nor restored; the
connector is loaded and its hooks run every step, but it moves nothing), later ones are
plain. ``--idle-off load`` turns only restores off (`idle_options`): the idle phase
then stores, and the active phase's extra cost in the same engine is the restores'.
One run then gives both "idle connector vs no connector" and "working connector vs no
connector"; ``--baseline-first`` runs the no-connector engine first, so that the
engines' order can be told apart from the connector.

Windows, in seconds since an engine's load started; a request belongs to the window its
end falls in (``a < end_t <= b``):

* ``baseline``: [m, baseline_seconds] of the no-connector engine;
* ``idle``: [m, S] of ours (only with ``--idle-seconds``); every request ending in it
  was sent idle (``idle_requests`` counts them, ``requests`` must equal it);
* ``active``: [S + m, seconds] of ours (without ``--idle-seconds``: [m, seconds]).

m (`margin`) is ``--phase-margin`` (20 s), at most a quarter of the shortest window: it
skips an engine's warm-up and, after the switch, the idle requests still in flight and
the CPU tier's first fill. Requests ending after the deadline (the drain, fewer streams)
are in no window. Faults fall in the active phase only (`active_schedule`).

Per window, from the requests: output tokens a second, mean ms per output token and
per spec step (vLLM's first/last token timestamps: decode only, no queue or prefill),
acceptance, TTFT; from the counters sampled every second (between the first sample at
or after the window's start and the last at or before its end): engine steps (steps
that produced output: the count of ``vllm:iteration_tokens_total``), ms per engine
step, drafts per engine step (the requests decoding per step), preemptions, the
connector's stored and loaded chunks, and vLLM's mean queue/prefill/decode seconds of
the requests that finished there.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from vllm_draft_offload.bench.stress.faults import schedule

IDLE_PARAMS: dict[str, Any] = {"draft_offload": {"store": False, "load": False}}
TRANSFERS = ("store", "load")  # what an idle phase can turn off (``soak --idle-off``)
DEFAULT_MARGIN_S = 20.0

STEPS = "vllm:iteration_tokens_total_count"
PREEMPTIONS = "vllm:num_preemptions_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
STORED = "vllm:draft_offload_stored_chunks_total{{tier={}}}"
LOADED = "vllm:draft_offload_loaded_chunks_total{{tier={}}}"
TIMES = ("queue", "prefill", "decode")  # vllm:request_{x}_time_seconds


def idle_options(off: tuple[str, ...] = TRANSFERS) -> dict[str, Any]:
    """The ``kv_transfer_params`` of an idle request: ``off`` (of ``TRANSFERS``) false.
    With only ``load`` off, the idle phase stores and never restores: the stores' cost
    alone, against the active phase in the same engine."""
    return {"draft_offload": dict.fromkeys(off, False)}


def idle_params(
    idle_s: float, off: tuple[str, ...] = TRANSFERS
) -> Callable[[float], dict[str, Any] | None]:
    """``params_for`` of `engine.StreamDriver`: idle before ``idle_s``, plain after."""

    def params_for(t: float) -> dict[str, Any] | None:
        # a fresh dict per request: vLLM keeps it on the request
        return idle_options(off) if t < idle_s else None

    return params_for


def is_idle(request: dict[str, Any]) -> bool:
    """Whether a request was sent idle (any of the transfers turned off)."""
    options = (request.get("kv_transfer_params") or {}).get("draft_offload")
    return bool(options) and set(options) <= set(TRANSFERS) and not any(options.values())


def active_schedule(
    seconds: float, idle_s: float, faults: tuple[str, ...], period: float | None
) -> list[tuple[float, str, float]]:
    """`faults.schedule` over the active phase only: [idle_s, seconds]."""
    return [(idle_s + t, f, hold) for t, f, hold in schedule(seconds - idle_s, faults, period)]


def margin(requested: float, lengths: list[float]) -> float:
    """The skipped seconds at a window's start: at most a quarter of the shortest one."""
    return max(0.0, min([requested, *(x / 4 for x in lengths if x > 0)]))


def windows(data: dict[str, Any]) -> tuple[float, dict[str, tuple[float, float]]]:
    """(margin, {window: (start, end)}) of a recorded soak (older runs: no idle phase)."""
    seconds = float(data["seconds"])
    idle = float(data.get("idle_seconds") or 0.0)
    base = data["runs"].get("baseline")
    base_s = float(base.get("seconds") or 0.0) if base else 0.0
    m = margin(float(data.get("phase_margin_s", DEFAULT_MARGIN_S)), [base_s, idle, seconds - idle])
    out: dict[str, tuple[float, float]] = {}
    if base_s > 0:
        out["baseline"] = (m, base_s)
    if idle > 0:
        out["idle"] = (m, idle)
    out["active"] = (idle + m, seconds)
    return m, out


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def decode_seconds_per_token(done: list[dict[str, Any]]) -> float | None:
    """The mean over requests of the engine's own first-to-last-token time per token
    after the first (decode only: queueing, loads and prefill come before the first)."""
    return _mean(
        [
            (q["last_ts"] - q["first_ts"]) / (q["out_len"] - 1)
            for q in done
            if "last_ts" in q and "first_ts" in q and int(q.get("out_len") or 0) > 1
        ]
    )


def request_figures(reqs: list[dict[str, Any]], a: float, b: float) -> dict[str, Any]:
    """What finished in (a, b]: see the module's docstring."""
    done = [q for q in reqs if a < q.get("end_t", float("inf")) <= b]
    span = b - a
    timed = [q for q in done if "last_ts" in q and "first_ts" in q]
    per_step = [
        (q["last_ts"] - q["first_ts"]) / q["spec"]["steps"]
        for q in timed
        if (q.get("spec") or {}).get("steps")
    ]
    steps = sum(q["spec"]["steps"] for q in done if q.get("spec"))
    accepted = sum(q["spec"]["accepted"] for q in done if q.get("spec"))
    prompt = sum(int(q.get("prompt_len") or 0) for q in done)
    cached = sum(int(q.get("cached") or 0) for q in done)
    ttft = [q["ttft_s"] for q in done if "ttft_s" in q]
    return {
        "requests": len(done),
        "idle_requests": sum(is_idle(q) for q in done),
        "output_tokens_per_s": sum(int(q.get("out_len") or 0) for q in done) / span
        if span > 0
        else None,
        "computed_prompt_tokens_per_s": (prompt - cached) / span if span > 0 else None,
        "cached_share": cached / prompt if prompt else None,
        "ms_per_output_token_mean": _ms(decode_seconds_per_token(done)),
        "ms_per_spec_step_mean": _ms(_mean(per_step)),
        "spec_steps_per_request": steps / len(done) if done else None,
        "acceptance_length": 1 + accepted / steps if steps else None,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_mean_s": _mean(ttft),
    }


def _steps_recorded(samples: list[dict[str, Any]]) -> bool:
    """Whether the run sampled the step and preemption counters (since session 20).

    Samples keep nonzero counters only, and an engine that served made steps: a run
    whose last sample has no step count did not record them (None, not 0)."""
    return any(STEPS in s.get("counters", {}) for s in samples[-1:])


def counter_figures(samples: list[dict[str, Any]], a: float, b: float) -> dict[str, Any] | None:
    """The sampled counters' change over (a, b]; None with fewer than two samples there."""
    inside = [s for s in samples if a <= s["t"] <= b and "counters" in s]
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    first, last = inside[0], inside[-1]
    span = last["t"] - first["t"]

    def d(key: str) -> float:
        return last["counters"].get(key, 0.0) - first["counters"].get(key, 0.0)

    steps = d(STEPS)
    known = _steps_recorded(samples)
    out: dict[str, Any] = {
        "span_s": [first["t"], last["t"]],
        "engine_steps": int(steps) if known else None,
        "ms_per_engine_step": 1e3 * span / steps if steps else None,
        "drafts_per_engine_step": d(DRAFTS) / steps if steps else None,
        "preemptions": int(d(PREEMPTIONS)) if known else None,
        "stored_chunks": {t: int(d(STORED.format(t))) for t in ("cpu", "l3")},
        "loaded_chunks": {t: int(d(LOADED.format(t))) for t in ("cpu", "l3")},
    }
    for x in TIMES:
        n = d(f"vllm:request_{x}_time_seconds_count")
        out[f"{x}_s_mean"] = d(f"vllm:request_{x}_time_seconds_sum") / n if n else None
    return out


def engine_figures(run: dict[str, Any], order: int | None) -> dict[str, Any]:
    """One engine over its whole load: steps, preemptions, and how vLLM scheduled."""
    engine = run.get("engine") or {}
    samples = [s for s in run.get("samples") or [] if "counters" in s]
    out: dict[str, Any] = {
        "order": order,
        "status": run.get("status"),
        "async_scheduling": engine.get("async_scheduling"),  # None: not recorded
        "max_num_batched_tokens": engine.get("max_num_batched_tokens"),
        "load_s": run.get("wall_s"),
        "engine_steps": None,
        "preemptions": None,
        "ms_per_engine_step": None,
    }
    whole = counter_figures(samples, samples[0]["t"], samples[-1]["t"]) if samples else None
    if whole is not None:
        for key in ("engine_steps", "preemptions", "ms_per_engine_step"):
            out[key] = whole[key]
    return out


RATIOS = (
    "output_tokens_per_s",
    "ms_per_output_token_mean",
    "ms_per_spec_step_mean",
    "ms_per_engine_step",
)


def phase_summary(data: dict[str, Any]) -> dict[str, Any]:
    """``summary["phases"]`` and ``summary["engines"]`` of a recorded soak."""
    m, wins = windows(data)
    runs = data["runs"]
    order = data.get("engine_order") or ["ours", "baseline"]
    figures: dict[str, Any] = {}
    for name, (a, b) in wins.items():
        run = runs.get("baseline" if name == "baseline" else "ours") or {}
        if run.get("status") not in ("ok", "crashed"):
            continue
        fig = {"window_s": [a, b], **request_figures(run.get("requests") or [], a, b)}
        fig["counters"] = counter_figures(run.get("samples") or [], a, b)
        for key in ("ms_per_engine_step", "drafts_per_engine_step", "preemptions"):
            fig[key] = (fig["counters"] or {}).get(key)
        figures[name] = fig
    base = figures.get("baseline")
    vs = {
        name: _ratios(figures[name], base)
        for name in ("idle", "active")
        if base and name in figures
    }
    engines = {
        name: engine_figures(runs[name], order.index(name) if name in order else None)
        for name in ("ours", "baseline")
        if name in runs
    }
    return {
        "margin_s": m,
        "idle_seconds": float(data.get("idle_seconds") or 0.0),
        "idle_off": list(data.get("idle_off") or TRANSFERS),
        "engine_order": order,
        "ours_connector": data.get("ours_connector") or "draft_offload",
        "figures": figures,
        "vs_baseline": vs,
        # one engine's two phases: what the connector's work costs with the engine's
        # own speed divided out (engines of one config differ by more than the gap)
        "active_vs_idle": _ratios(figures["active"], figures["idle"])
        if "active" in figures and "idle" in figures
        else None,
        "engines": engines,
    }


def _ratios(figures: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """``figures`` over ``base`` for each of ``RATIOS`` (None where either is missing)."""
    return {k: figures[k] / base[k] if figures[k] is not None and base[k] else None for k in RATIOS}


def _c(x: Any, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def idle_note(p: dict[str, Any]) -> str:
    """What the idle phase's requests turned off, and for how long."""
    if not p["idle_seconds"]:
        return "No idle phase."
    off = ", ".join(f"{key}: false" for key in p.get("idle_off") or TRANSFERS)
    return f"Ours idle (requests sent `{off}`) for its first {p['idle_seconds']:.0f} s."


def null_note(p: dict[str, Any]) -> str:
    """soak --ours-connector null: the connector engine's figures are vLLM's plumbing's."""
    if p.get("ours_connector") != "null":
        return ""
    return (
        " The connector engine ran `NullConnector` (every hook returns at once): its rows"
        " are what vLLM's connector plumbing costs, not ours."
    )


def phase_markdown(p: dict[str, Any]) -> list[str]:
    """soak.md's phase table: each window's figures, ratios to the baseline's."""
    if not p["figures"]:
        return []
    lines = [
        "",
        "## Phases",
        "",
        f"Engine order: {' → '.join(p['engine_order'])}. Windows by request end, seconds "
        f"since the engine's load started, {p['margin_s']:.0f} s skipped after each start "
        "and after the switch; (×) = ratio to the baseline's. " + idle_note(p) + null_note(p),
        "",
        "| phase | window (s) | requests (idle) | output tok/s (×) | ms / output token (×) "
        "| ms / spec step (×) | AL | engine steps | ms / engine step (×) | drafts / step "
        "| preemptions | stored chunks cpu / l3 | loaded chunks | queue / prefill s | TTFT p50 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in p["figures"].items():
        r = p["vs_baseline"].get(name, {})
        c = f["counters"] or {}
        stored, loaded = c.get("stored_chunks") or {}, c.get("loaded_chunks") or {}

        def cell(key: str, fmt: str, f: dict[str, Any] = f, r: dict[str, Any] = r) -> str:
            ratio = f" ({_c(r[key], '{:.3f}')})" if key in r else ""
            return _c(f[key], fmt) + ratio

        cells = [
            name,
            f"{f['window_s'][0]:.0f}–{f['window_s'][1]:.0f}",
            f"{f['requests']} ({f['idle_requests']})",
            cell("output_tokens_per_s", "{:.0f}"),
            cell("ms_per_output_token_mean", "{:.2f}"),
            cell("ms_per_spec_step_mean", "{:.2f}"),
            _c(f["acceptance_length"]),
            _c(c.get("engine_steps"), "{}"),
            cell("ms_per_engine_step", "{:.2f}"),
            _c(f["drafts_per_engine_step"]),
            _c(f["preemptions"], "{}"),
            f"{_c(stored.get('cpu'), '{}')} / {_c(stored.get('l3'), '{}')}",
            _c(loaded.get("cpu"), "{}"),
            f"{_c(c.get('queue_s_mean'), '{:.3f}')} / {_c(c.get('prefill_s_mean'), '{:.3f}')}",
            _c(f["ttft_p50_s"], "{:.3f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if p.get("active_vs_idle"):
        r = p["active_vs_idle"]
        lines += [
            "",
            "Active over idle, one engine: output tok/s "
            f"{_c(r['output_tokens_per_s'], '{:.3f}')}, ms / output token "
            f"{_c(r['ms_per_output_token_mean'], '{:.3f}')}, ms / engine step "
            f"{_c(r['ms_per_engine_step'], '{:.3f}')}.",
        ]
    lines += ["", "Engines over their whole load:", ""]
    for name, e in p["engines"].items():
        sched = {True: "on", False: "off", None: "not recorded"}[e["async_scheduling"]]
        lines.append(
            f"* {name}: async scheduling {sched}, {_c(e['engine_steps'], '{}')} engine steps "
            f"({_c(e['ms_per_engine_step'])} ms each), {_c(e['preemptions'], '{}')} "
            f"preemptions, {_c(e['load_s'], '{:.0f}')} s of load"
        )
    return lines
