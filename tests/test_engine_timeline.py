"""decode-overhead's engine timeline (--time-hooks): decode steps' wall times, stalls and
GC pauses per timed batch, on the real vLLM Scheduler (tests/kv_sim.py) and in the
report."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_draft_offload.bench.speed import decode_report as rep
from vllm_draft_offload.bench.speed import engine_timeline as tl


def test_summary_counts_decode_steps_their_tail_stalls_and_gc_pauses() -> None:
    steps = [(0.010, True)] * 19 + [(0.050, True), (1.2, False)]
    pauses = [(0, 0.001), (2, 0.030)]
    summary = tl.summarize(steps, pauses)
    assert summary["engine_steps"] == 21 and summary["decode_steps"] == 20
    assert summary["decode_step_median_ms"] == pytest.approx(10.0)
    assert summary["decode_step_max_ms"] == pytest.approx(50.0)  # the prefill step is not one
    assert 10.0 < summary["decode_step_p99_ms"] <= 50.0
    assert summary["stall_steps"] == 1 and summary["stall_ms"] == pytest.approx(40.0)
    # Where it fell: after 19 decode steps (no prompt step before it in this batch).
    assert summary["decode_step_max_at"] == 19
    assert summary["stalls_at"] == [[19, pytest.approx(50.0)]]
    assert summary["gc_collections"] == 2 and summary["gc_gen2"] == 1
    assert summary["gc_pause_ms"] == pytest.approx(31.0)
    assert summary["gc_longest_ms"] == pytest.approx(30.0)
    # Counted from the last step with prompt tokens: a stall right behind a prompt step
    # (its stores just issued) reads 0.
    behind = [(0.010, True)] * 5 + [(0.2, False), (0.060, True)] + [(0.010, True)] * 5
    summary = tl.summarize(behind, [])
    assert summary["decode_step_max_at"] == 0
    assert summary["stalls_at"] == [[0, pytest.approx(60.0)]]
    # A batch that only prefilled has no decode-step figures.
    assert "decode_step_median_ms" not in tl.summarize([(1.0, False)], [])


def test_timeline_times_the_engines_decode_steps_only_while_on(
    model_dirs: tuple[Path, Path],
) -> None:
    from kv_sim import SimEngine, SimSetup, prompt

    eng = SimEngine(*model_dirs, SimSetup())
    schedule = eng.scheduler.schedule
    timeline = tl.EngineTimeline(eng, max_decode_tokens=1, step_attr="step")
    eng.add_request("off", prompt(1, 40), max_tokens=3)
    eng.run_until_done()
    assert timeline.take()["engine_steps"] == 0
    timeline.on = True
    eng.add_request("on", prompt(2, 70), max_tokens=5)
    eng.run_until_done()
    gc.collect()
    timeline.on = False
    taken = timeline.take()
    # One prompt step (its 70 tokens), then one token a step: 4 decode steps after the
    # first token, each timed from the output before it (the store's report may add
    # steps that schedule nothing).
    assert taken["decode_steps"] == 4, taken
    assert taken["engine_steps"] >= 4
    assert 0 < taken["decode_step_median_ms"] <= taken["decode_step_max_ms"]
    assert taken["gc_collections"] >= 1 and taken["gc_gen2"] >= 1
    assert timeline.take()["engine_steps"] == 0
    timeline.close()
    assert eng.scheduler.schedule == schedule and "step" not in vars(eng)
    assert timeline._on_gc not in gc.callbacks


class _QueueOfTwo:
    """vLLM's EngineCore.step_with_batch_queue with a queue of two (async scheduling),
    reduced to its protocol (the real one needs a model executor): a call schedules a
    batch and returns (None, True) while the queue has room, else it also waits for the
    oldest batch (here: sleeps its ``seconds``) and returns that batch's outputs."""

    def __init__(self, batches: list[tuple[dict[str, int], float]]) -> None:
        self.todo = list(batches)
        self.queue: list[tuple[dict[str, int], float]] = []
        self.scheduler = self

    def schedule(self) -> SimpleNamespace:
        self.queue.append(self.todo.pop(0))
        return SimpleNamespace(num_scheduled_tokens=self.queue[-1][0])

    def step_fn(self) -> tuple[dict[str, int] | None, bool]:
        if self.todo:
            self.scheduler.schedule()
            if len(self.queue) < 2 and self.todo:
                return None, True
        tokens, seconds = self.queue.pop(0)
        time.sleep(seconds)
        return tokens, True


def test_a_batch_queue_times_each_finished_batch_by_its_own_kind() -> None:
    """With async scheduling a call either only schedules or returns the oldest batch's
    outputs: each interval between outputs is classed by the batch it finished, not by
    the one scheduled last (a prompt batch here takes 30 ms, a decode batch 2 ms)."""
    prompt_batch, decode_batch = ({"a": 64, "b": 64}, 0.030), ({"a": 4, "b": 4}, 0.002)
    core = _QueueOfTwo([prompt_batch, decode_batch, decode_batch, prompt_batch, decode_batch])
    timeline = tl.EngineTimeline(core, max_decode_tokens=4)
    timeline.on = True
    while core.todo or core.queue:
        core.step_fn()
    taken = timeline.take()
    # Five outputs, four intervals, ended by decode, decode, prompt, decode batches.
    assert taken["engine_steps"] == 4 and taken["decode_steps"] == 3, taken
    assert taken["decode_step_max_ms"] < 25, taken  # no prompt batch's 30 ms among them
    timeline.close()


def _batch(rate: float, arm: str, median_ms: float, p99_ms: float, stall_ms: float) -> dict:
    engine = {
        "decode_steps": 100,
        "decode_step_median_ms": median_ms,
        "decode_step_p99_ms": p99_ms,
        "decode_step_max_ms": p99_ms + 5,
        "decode_step_max_at": int(p99_ms),
        "stall_steps": 1 if stall_ms else 0,
        "stall_ms": stall_ms,
        "gc_pause_ms": 2.0,
    }
    machine = {"steal_share": 0.0, "busy_share": 0.05, "gpu_util_pct": 90}
    return {"arm": arm, "decode_tok_s": rate, "machine": machine, "engine": engine}


def test_report_gives_each_arms_step_tail_and_links_stalls_to_slow_batches() -> None:
    runs = [
        {
            "reps": [
                _batch(5000.0, "on", 15.0, 40.0, 0.0),
                _batch(3000.0, "off", 15.5, 20.0, 600.0),
                _batch(4000.0, "off", 15.0, 21.0, 200.0),
                _batch(4500.0, "on", 15.2, 44.0, 50.0),
            ]
        }
    ]
    tails = rep.step_tails(runs)
    assert tails is not None
    assert tails["on"]["decode_step_p99_ms"] == pytest.approx(42.0)
    assert tails["off"]["decode_step_p99_ms"] == pytest.approx(20.5)
    assert tails["on"]["decode_step_max_ms"] == pytest.approx(49.0)
    assert tails["on"]["decode_step_max_at"] == [40, 44]  # each batch's, sorted
    assert tails["off"]["stall_ms"] == pytest.approx(800.0) and tails["off"]["stall_steps"] == 2
    assert rep.step_tails([{"reps": [{"arm": "on", "decode_tok_s": 1.0}]}]) is None
    link = rep.machine_link(runs)
    assert link is not None
    assert link["stall_ms"]["rank_corr_with_tok_s"] == pytest.approx(-1.0)
    assert link["stall_ms"]["range"] == [0.0, 600.0]
