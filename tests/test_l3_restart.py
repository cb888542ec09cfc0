"""A restarted engine hits what its predecessor wrote, with DEFAULT L3 settings.

Two processes, as in scripts/restore_speed.py: a fill engine (a spawned interpreter)
serves prompts whose lengths are exact multiples of the chunk with max_tokens=1,
lands its writes in a real fs:// directory and exits; then a fresh engine in this
process sends the same prompts. The default `l3.hit_policy` (cost) weighs storage
reads against recompute, so the simulated forward takes time per token as a device
would (kv_sim `compute_s_per_token`): storage here is far faster than recompute, and
every prompt, the first one after the start included, must come from storage.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
from kv_sim import SimEngine, SimSetup, prompt
from l3_throttle import throttle
from test_l3_tier import CHUNK, L3_EXTRA, finish_l3_writes

PROMPT_CHUNKS = 8
PROMPTS = 3
# 4 ms per token: a 256-token prompt recomputes in about 1 s (so a request may wait
# about 50 ms on storage it has not measured yet), while reading its 8 units (32 KiB
# each) from a local fs:// directory takes milliseconds.
COMPUTE_S_PER_TOKEN = 4e-3


def prompts() -> list[list[int]]:
    return [prompt(700 + i, PROMPT_CHUNKS * CHUNK) for i in range(PROMPTS)]


def default_engine(model_dirs: tuple[Path, Path], url: str) -> SimEngine:
    """Storage turned on and nothing else: the connector's defaults decide."""
    extra = {"l3": {"enabled": True}, "lmcache.remote_url": url, "lmcache.extra_config": L3_EXTRA}
    return SimEngine(
        *model_dirs,
        SimSetup(extra_config=extra, compute_s_per_token=COMPUTE_S_PER_TOKEN),
    )


def fill_engine(model_dirs: tuple[Path, Path], url: str, done: Any) -> None:
    """Process 1: prefill every prompt, land its writes, stop."""
    try:
        eng = default_engine(model_dirs, url)
        for i, tokens in enumerate(prompts()):
            eng.add_request(f"fill{i}", tokens, max_tokens=1)
            eng.run_until_done()
        finish_l3_writes(eng)
        eng.shutdown()
        done.put(("ok", None))
    except BaseException as exc:  # the parent must hear of it, not time out
        done.put(("error", repr(exc)))
        raise


@pytest.fixture(scope="module")
def filled(model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> str:
    """An fs:// directory written by a fill engine that has exited."""
    url = f"fs://{tmp_path_factory.mktemp('restart') / 'l3'}"
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(target=fill_engine, args=(model_dirs, url, done))
    proc.start()
    try:
        kind, value = done.get(timeout=180)
        assert kind == "ok", value
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    units = list(Path(url.removeprefix("fs://")).glob("*.data"))
    assert len(units) >= PROMPTS * PROMPT_CHUNKS
    return url


def test_restarted_engine_hits_every_prompt_from_storage_with_defaults(
    model_dirs: tuple[Path, Path], filled: str
) -> None:
    eng = default_engine(model_dirs, filled)
    l3 = eng.scheduler.connector.scheduler.l3
    assert l3 is not None
    for i, tokens in enumerate(prompts()):
        req = f"restart{i}"
        eng.add_request(req, tokens, max_tokens=2)
        eng.run_prefill(req)
        why = decision_lines(eng)
        assert eng.external_hits[req] >= 0.95 * len(tokens), why
        # vLLM files the hit under the disk it came from, not the CPU tier.
        assert eng.hit_sources[req] == {"disk": eng.external_hits[req]}, why
        assert eng.mismatched_positions(req) == []
        eng.run_until_done()
    # Once in the CPU tier, the same prompt hits from host memory.
    eng.evict_gpu_kv()
    eng.add_request("again", prompts()[0], max_tokens=2)
    eng.run_prefill("again")
    assert eng.hit_sources["again"] == {"host": eng.external_hits["again"]}
    assert eng.external_hits["again"] >= 0.95 * len(prompts()[0])
    assert eng.mismatched_positions("again") == []
    eng.run_until_done()
    published = eng.take_published()
    assert published["chunks"]["load/l3"] == PROMPTS * PROMPT_CHUNKS
    assert not published["l3_declined"]
    # The fill engine's prefill speed, read from storage, priced the first request.
    first = l3.log.recent[0]
    assert first.estimate_source == "calibration", first.line()
    # Its probe: two units, both landed in time.
    assert first.probe.startswith("2/2 landed"), first.line()
    eng.shutdown()


def test_restart_on_slow_storage_waits_only_its_allowance(
    model_dirs: tuple[Path, Path], filled: str
) -> None:
    """Right after a restart the storage is unmeasured; here it answers reads in 3 s,
    far slower than recomputing. The first request waits on its probe only for its
    allowance, 5 % of the estimated recompute, then recomputes: the bound holds
    whatever the storage speed. Units found in storage are not written again."""
    eng = default_engine(model_dirs, filled)
    throttle(eng.worker.worker.l3.store, get=3.0)
    tokens = prompts()[0]
    eng.add_request("slow", tokens, max_tokens=2)
    started = time.monotonic()
    eng.run_prefill("slow")
    elapsed = time.monotonic() - started
    assert eng.external_hits["slow"] == 0
    assert eng.mismatched_positions("slow") == []
    decision = eng.scheduler.connector.scheduler.l3.log.recent[-1]
    assert decision.outcome == "declined:fetch_too_slow", decision.line()
    assert decision.estimate_source == "calibration"
    assert decision.recompute_s is not None and decision.allowance_s is not None
    assert decision.allowance_s == pytest.approx(0.05 * decision.recompute_s)
    # It stopped waiting when the allowance ran out, give or take an engine step.
    assert decision.waited_s < decision.allowance_s + 0.25, decision.line()
    assert elapsed < 3.0  # prefilled before the probe could land
    eng.run_until_done()  # the probe lands in the background, timing the storage
    published = eng.take_published()
    assert published["l3_declined"] == {"fetch_too_slow": PROMPT_CHUNKS}
    assert published["chunks"]["store/cpu"] == PROMPT_CHUNKS
    eng.worker.worker.l3.flush(10)
    eng.step()
    assert "store/l3" not in eng.take_published()["chunks"]
    eng.shutdown()


def decision_lines(eng: SimEngine) -> str:
    log = getattr(eng.scheduler.connector.scheduler.l3, "log", None)
    return "\n".join(d.line() for d in log.recent) if log is not None else ""


def test_restore_speed_reads_the_calibration_an_engine_left(filled: str) -> None:
    """The benchmark's diagnosis of restart decisions reads the real calibration file
    LMCache's fs:// backend wrote, not a unit."""
    from vllm_draft_offload.bench.speed.l3_dir import calibration_samples

    samples = calibration_samples(Path(filled.removeprefix("fs://")))
    assert samples and all(len(s) == 3 for s in samples)
    assert max(s[0] for s in samples) >= PROMPT_CHUNKS * CHUNK - 1  # a prefill was timed
