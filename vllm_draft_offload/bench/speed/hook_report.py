"""``hook-cost``'s report: mean microseconds per step of each timed name, and what the
connector adds to the engine's CPU time over ``none``'s."""

from __future__ import annotations

import statistics
from typing import Any

# What a step was (Engine.step), beside the seconds timed in it.
TAGS = ("tokens", "store_jobs", "stored_chunks", "loaded_chunks", "decode")


def engine_us(step: dict[str, float]) -> float:
    """Microseconds the engine spent on a step outside the forward: the scheduler, and
    the worker's connector calls without the CPU-only memmove (``copy_exec``)."""
    worker = sum(v for k, v in step.items() if k.startswith("worker."))
    return 1e6 * (step.get("schedule", 0.0) + step.get("update_from_output", 0.0) + worker
                  - step.get("copy_exec", 0.0))  # fmt: skip


def hooks_us(step: dict[str, float]) -> float:
    """Microseconds of the connector's own hooks in a step, both halves (the memmove
    left out): the part of ``engine_us`` that is ours alone."""
    hooks = sum(v for k, v in step.items() if k.startswith(("sched.", "worker.")))
    return 1e6 * (hooks - step.get("copy_exec", 0.0))


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Mean microseconds per decode step of each timed name (steps with store jobs and
    without apart), and the engine's total per decode step and over the batch's decode."""
    decode = [s for s in steps if s.get("decode") and s.get("tokens")]
    names = sorted({k for s in decode for k in s} - set(TAGS))

    def mean_us(group: list[dict[str, float]]) -> dict[str, float]:
        if not group:
            return {}
        return {n: round(1e6 * statistics.fmean(s.get(n, 0.0) for s in group), 1) for n in names}

    with_stores = [s for s in decode if s.get("store_jobs")]
    return {
        "decode_steps": len(decode),
        "steps_with_stores": len(with_stores),
        "store_jobs": int(sum(s.get("store_jobs", 0) for s in steps)),
        "stored_chunks": int(sum(s.get("stored_chunks", 0) for s in steps)),
        "us_per_step_with_stores": mean_us(with_stores),
        "us_per_step_without_stores": mean_us([s for s in decode if not s.get("store_jobs")]),
        "engine_us_per_decode_step": round(statistics.fmean(map(engine_us, decode)), 1),
        "engine_ms_over_decode": round(sum(map(engine_us, decode)) / 1e3, 2),
        "hooks_us_per_decode_step": round(statistics.fmean(map(hooks_us, decode)), 1),
        "hooks_ms_over_decode": round(sum(map(hooks_us, decode)) / 1e3, 2),
        # every step, prefills and restores too (the load of --shared-prefixes)
        "steps": len(steps),
        "loaded_chunks": int(sum(s.get("loaded_chunks", 0) for s in steps)),
        "engine_ms_all_steps": round(sum(map(engine_us, steps)) / 1e3, 2),
        "hooks_ms_all_steps": round(sum(map(hooks_us, steps)) / 1e3, 2),
    }


def compare(configs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the connector adds to the engine's CPU time over the batch's decode, idle
    and storing: its hooks alone, and the engine's total over ``none``'s (which also
    counts vLLM's own connector plumbing, and more noise). The fastest batch of each
    config: the least disturbed by other work on the machine."""
    steps = configs["none"][0]["decode_steps"]
    out: dict[str, Any] = {}
    for span in ("over_decode", "all_steps"):
        best = {c: min(r[f"engine_ms_{span}"] for r in runs) for c, runs in configs.items()}
        hooks = {c: min(r[f"hooks_ms_{span}"] for r in runs) for c, runs in configs.items()}
        out[f"hooks_ms_{span}"] = {c: ms for c, ms in hooks.items() if c != "none"}
        out[f"engine_ms_{span}"] = best
        out[f"added_ms_{span}"] = {c: round(ms - best["none"], 2) for c, ms in best.items()
                                   if c != "none"}  # fmt: skip
    out["added_us_per_decode_step"] = {
        c: round(1e3 * ms / steps, 1) if steps else None
        for c, ms in out["added_ms_over_decode"].items()
    }
    return out
