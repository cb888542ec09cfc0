"""The L3 cost policy: estimators, and the policy on a real engine with real storage
made slow by a throttle (tests/l3_throttle.py)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kv_sim import SimEngine, prompt
from l3_throttle import cold_files, throttle
from test_l3_tier import CHUNK, finish_l3_writes, l3_engine
from test_metrics import clean_registry, vllm_config  # noqa: F401
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from vllm_draft_offload import l3_calibration
from vllm_draft_offload.l3_cost import CostModel, StorageEstimate
from vllm_draft_offload.l3_first_landing import (
    FIRST_LANDING_FACTOR,
    RESIDENT_LANDING_FACTOR,
    RESIDENT_WAIT_FRACTION,
    may_wait_for_first_landing,
    may_wait_for_resident_probe,
)
from vllm_draft_offload.l3_prefill_fit import WINDOW, PrefillEstimate, fit_steps
from vllm_draft_offload.metric_defs import PREFIX
from vllm_draft_offload.metrics import DraftOffloadStats


def test_prefill_fit_recovers_step_cost_despite_outliers() -> None:
    rng = np.random.default_rng(0)
    a, b, c = 0.004, 2e-5, 1e-9
    est = PrefillEstimate()
    for i in range(200):
        tokens = int(rng.integers(1, 4096))
        context = int(rng.integers(0, 32768))
        attention = tokens * (context + tokens / 2)
        seconds = a + b * tokens + c * attention
        if i % 10 == 0:
            seconds += 5.0  # the engine sat idle, or the step waited on I/O
        est.observe(tokens, attention, seconds * (1 + 0.01 * rng.standard_normal()))
    assert est.coef is not None
    assert est.coef[1] == pytest.approx(b, rel=0.1)
    assert est.coef[2] == pytest.approx(c, rel=0.1)
    # The back of a long prefix costs more to recompute than its front.
    assert est.recompute_s(16384, 256) > 1.5 * est.recompute_s(0, 256)  # type: ignore[operator]


def test_steps_only_take_samples_and_a_price_asked_for_fits_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fit runs on the scheduler thread: not once per step (vLLM steps tens of times
    a second), but when a lookup asks for a price, and again only after REFIT_EVERY new
    samples; while no fit can be made, once per new sample asked about."""
    from vllm_draft_offload import l3_prefill_fit

    fits: list[int] = []
    real_fit = l3_prefill_fit.fit_steps
    monkeypatch.setattr(l3_prefill_fit, "fit_steps", lambda s: fits.append(1) or real_fit(s))
    est = PrefillEstimate()
    for _ in range(3):  # too few samples for a fit
        est.observe(512, 512 * 256.0, 0.01)
    assert fits == []
    assert est.recompute_s(0, 256) is not None and est.coef is None  # the rate stands in
    assert len(fits) == 1
    est.recompute_s(0, 256)
    assert len(fits) == 1  # nothing new since: not tried again
    for tokens in (1024, 64, 2048, 128, 4096):
        est.observe(tokens, tokens * tokens / 2, 1e-5 * tokens + 0.002)
    assert len(fits) == 1  # steps alone never fit
    assert est.coef is not None and len(fits) == 2
    for _ in range(l3_prefill_fit.REFIT_EVERY - 1):
        est.observe(300, 300 * 150.0, 0.005)
    first = est.coef
    assert len(fits) == 2 and first is est.coef  # fewer than REFIT_EVERY new: kept
    est.observe(300, 300 * 150.0, 0.005)
    est.recompute_s(0, 256)
    assert len(fits) == 3


def test_a_few_prefills_among_many_short_steps_price_recompute() -> None:
    """What an engine sees between restored hits: many short steps (decodes, tiny
    requests) and few long prefills. The prefills must price recompute."""
    rng = np.random.default_rng(1)
    a, b, c = 0.02, 3e-5, 5e-10
    est = PrefillEstimate()
    for i in range(120):
        tokens, context = (16384, 0) if i % 30 == 7 else (int(rng.integers(1, 4)), 16000)
        seconds = a + b * tokens + c * tokens * (context + tokens / 2)
        est.observe(tokens, tokens * (context + tokens / 2), seconds * (1 + 0.05 * rng.random()))
    truth = b * 16384 + c * 16384 * 8192
    assert est.recompute_s(0, 16384) == pytest.approx(truth, rel=0.15)


def test_one_step_timed_wrong_does_not_price_recompute_at_zero() -> None:
    """Step samples a fill engine on an H100 saved (16k-token prompts at the Llama-8B
    shape, 2-token steps between them), plus one 16k-token step timed at 2 ms as a
    restarted engine's fit had it: the fit alone priced 16k tokens at 1 ms there,
    and every storage hit was declined as slower than that."""
    good = [
        (16384.0, 134217728.0, 0.663902),
        (2.0, 2.0, 0.00104),
        (2.0, 2.0, 0.001098),
        (16384.0, 134217728.0, 0.404831),
        (2.0, 2.0, 0.001),
        (2.0, 2.0, 0.001),
    ]
    wrong = (16384.0, 134217728.0, 0.002)
    for own in (True, False):
        est = PrefillEstimate()
        if own:
            for sample in [*good, wrong]:
                est.observe(int(sample[0]), sample[1], sample[2])
        else:
            assert est.set_prior([*good, wrong])
        assert est.recompute_s(0, 16384) >= 0.5 * 0.404831  # the median good step, halved
    # The fit leaves the mistimed step out: it prices 16k tokens as the good steps do.
    sane, robust = fit_steps(good), fit_steps([*good, wrong])
    assert sane is not None and robust is not None
    assert robust == pytest.approx(sane, rel=1e-6)


def test_prefill_is_unknown_until_a_prefill_step_was_seen() -> None:
    est = PrefillEstimate()
    for _ in range(50):
        est.observe(1, 100.0, 0.01)  # decode steps only
    assert est.recompute_s(0, 256) is None


def test_calibration_round_trip_and_what_it_refuses() -> None:
    samples = [(256.0, 256 * 128.0, 0.8), (2.0, 4094.0, 0.01), (1024.0, 1024 * 512.0, 3.1)]
    blob = l3_calibration.encode(samples, "NVIDIA H200")
    assert l3_calibration.decode(blob, "NVIDIA H200") == samples
    assert l3_calibration.decode(blob, "NVIDIA H100 80GB HBM3") is None  # another device
    for bad in (
        b"not json",
        b'{"version": 2, "device": "NVIDIA H200", "samples": []}',
        b'{"version": 1, "device": "NVIDIA H200", "samples": [[1, 2]]}',
        b'{"version": 1, "device": "NVIDIA H200", "samples": [[1, 2, NaN]]}',
        b'{"version": 1, "device": "NVIDIA H200", "samples": [[1, 2, -3]]}',
    ):
        assert l3_calibration.decode(bad, "NVIDIA H200") is None, bad
    # One name per salt and device; never the name of a unit (32 + 4 hex digits).
    name = l3_calibration.object_name(b"salt", "NVIDIA H200")
    assert len(name) == 40 and int(name, 16) >= 0
    assert name != l3_calibration.object_name(b"salt", "NVIDIA H100 80GB HBM3")
    assert name != l3_calibration.object_name(b"other salt", "NVIDIA H200")
    assert l3_calibration.is_calibration_file(f"ns@1@0@1{name}@uint8.data")
    assert not l3_calibration.is_calibration_file(f"ns@1@0@1{'ab' * 16}0000@uint8.data")


def test_an_earlier_engines_steps_price_recompute_until_the_own_fit() -> None:
    a, b = 0.004, 2e-5
    steps = [(float(n), n * n / 2, a + b * n) for n in (1, 1, 256, 512, 1024, 2048)]
    est = PrefillEstimate()
    assert est.source == "none" and est.recompute_s(0, 256) is None
    assert est.set_prior(steps)
    assert est.source == "calibration"
    assert est.recompute_s(0, 1000) == pytest.approx(b * 1000, rel=0.05)
    for _ in range(3):
        est.observe(512, 512 * 256, 1.0)  # this engine is slower: its own steps win...
    assert est.source == "calibration"
    est.observe(1, 1.0, 0.01)
    assert est.source == "fit"  # ...as soon as they make a fit
    assert est.recompute_s(0, 512) > 10 * b * 512
    # A prior too small for a fit: its fastest per-token prefill rate.
    est = PrefillEstimate()
    assert est.set_prior([(256.0, 0.0, 0.5), (512.0, 0.0, 0.8)])
    assert est.recompute_s(0, 100) == pytest.approx(100 * 0.8 / 512)
    assert not PrefillEstimate().set_prior([(1.0, 1.0, 0.01)])  # decode steps only


@pytest.mark.parametrize(
    ("units", "fastest", "slowest", "pace"),
    [
        (8, 0.020, 0.024, 0.003),  # a round per read thread: its time over its size
        (2, 0.150, 0.300, 0.150),  # the probe, read one after another: a disk
        (2, 0.023, 0.024, None),  # the probe, landed together: says nothing about 8
        (1, 0.010, 0.010, None),  # one read alone
    ],
)
def test_which_rounds_time_the_storage_pace(
    units: int, fastest: float, slowest: float, pace: float | None
) -> None:
    """Seen on an H100 after a warm restart: the two-unit probe landed together in 24 ms;
    priced at 12 ms per unit, the other 62 units came to 0.47 s, above recompute, and
    were declined, where 62 units took 0.17-0.27 s on 8 threads."""
    storage = StorageEstimate(unit_bytes=1, parallel=8)
    got = storage.round_pace(units, fastest, slowest)
    assert got == (pace if pace is None else pytest.approx(pace))


def test_a_fit_of_short_steps_does_not_price_a_long_recompute() -> None:
    """Seen on an H100: a restarted engine served a 255-token request, then decode steps;
    its own fit of those priced a 16k-token recompute at 9.5 s (the calibration: 0.45 s),
    and the wait allowance of a storage hit grew to 9.9 s. Beyond OWN_FIT_REACH times its
    largest step the fit gives way to the calibration; within it, the fit prices."""
    a, b, c = 0.004, 2.5e-5, 1e-9
    prior = [(float(n), n * n / 2, a + b * n + c * n * n / 2) for n in (2, 4096, 8192, 16384)]
    est = PrefillEstimate()
    assert est.set_prior(prior)
    # This engine's own steps: a short prefill whose timing says nothing about 16k tokens.
    for n, seconds in ((255, 0.3), (2, 0.01), (2, 0.012), (2, 0.011)):
        est.observe(n, n * n / 2, seconds)
    assert est.coef is not None  # a fit exists...
    assert est.source_for(256) == "fit" and est.source == "fit"
    assert est.source_for(16384) == "calibration"  # ...but it does not reach 16k tokens
    assert est.recompute_s(0, 16384) == pytest.approx(b * 16384 + c * 16384 * 8192, rel=0.1)
    assert est.recompute_s(0, 255) == pytest.approx(
        float(est.coef[1] * 255 + est.coef[2] * 255 * 127.5)
    )
    # Once it has timed a long prefill, its own fit prices long recomputes again.
    for _ in range(8):
        est.observe(16384, 16384 * 8192, 0.9)
    assert est.source_for(16384) == "fit"
    assert est.recompute_s(0, 16384) > 0.6


def test_a_restarted_engine_shares_its_prior_with_its_own_steps() -> None:
    """The calibration an engine writes keeps the long prefills it was given: a
    restart that timed only short steps must not leave the next one without them."""
    prior = [(16384.0, 134217728.0, 0.45), (2.0, 2.0, 0.001), (8192.0, 33554432.0, 0.2)]
    est = PrefillEstimate()
    assert est.set_prior(prior)
    est.observe(2, 2.0, 0.001)
    assert est.samples_to_share() == [*prior, (2.0, 2.0, 0.001)]
    for _ in range(WINDOW):
        est.observe(2, 2.0, 0.001)
    assert est.samples_to_share() == [(2.0, 2.0, 0.001)] * WINDOW  # the newest WINDOW


def test_steps_that_restore_kv_are_no_prefill_samples() -> None:
    """A hit computing 2 tokens after 16k restored ones takes the copy's time: a
    sample of it would price attention over a long context at the copy's cost."""
    now = [0.0]
    model = CostModel(256, 1 << 20, 2, clock=lambda: now[0])
    model.step_scheduled([(2, 16382)], loads=True)
    now[0] += 0.09
    model.step_output()
    assert model.prefill.observed == 0
    model.step_scheduled([(2048, 0)])
    now[0] += 0.1
    model.step_output()
    assert model.prefill.observed == 1


def test_storage_estimate_replaces_the_prior_and_tracks_changes() -> None:
    storage = StorageEstimate(unit_bytes=40 << 20, parallel=4)
    assert storage.stale()
    assert storage.unit_s > 0.15  # 40 MiB at the 0.25 GB/s prior
    storage.observe_fetch(0.02)
    assert storage.unit_s == pytest.approx(0.02) and not storage.stale()
    assert storage.load_s(8) == pytest.approx(2 * 0.02)  # 4 threads: 2 rounds
    for _ in range(30):
        storage.observe_fetch(1.0)
    assert storage.unit_s > 0.9


def test_bandwidth_bound_storage_is_priced_by_the_pace_fetches_made() -> None:
    """On an H100's disk a lone cold unit read in 35 ms, while 8 read at once took
    190 ms each: the disk, not the thread count, bounds a fetch. A fetch's measured
    pace (seconds per unit landed with many in flight) prices later fetches."""
    storage = StorageEstimate(unit_bytes=40 << 20, parallel=8)
    storage.observe_fetch(0.035)
    assert storage.load_s(64) == pytest.approx(8 * 0.035)
    storage.observe_pace(0.024, 64)  # 64 units landed in 1.5 s
    assert storage.load_s(64) == pytest.approx(64 * 0.024)
    assert storage.load_s(1) == pytest.approx(0.035)  # one unit: its own latency
    # The files got into the page cache: one round of 8 units at a tenth of the pace
    # is believed about as far as 8 unit samples would be (1 - 0.8 ** 8 of the way).
    storage.observe_pace(0.0024, 8)
    assert storage.pace_s == pytest.approx(0.024 + (1 - 0.8**8) * (0.0024 - 0.024))
    assert storage.pace_s < 0.3 * 0.024


def test_a_fetch_slower_than_its_estimate_stops_waiting() -> None:
    """Cold restart on an H100: the estimate (one probe's 35 ms, 8 threads) said 64
    units load in 0.28 s against 0.47 s of recompute, but 3 landed in 0.15 s. The
    request waited on at the estimated pace and took 1.4 x recompute. The pace the
    fetch makes must end the wait."""
    model = _model(unit_s=0.0001)
    model.storage.observe_fetch(0.0001)
    recompute = model.recompute_chunks_s(0, 64)
    assert recompute is not None
    args = dict(first_chunk=0, num_chunks=64, landed=3, coming=61)
    # On the estimate alone it would wait (progress is recent, the estimate is fast)...
    wait, allowance = model.may_wait("fetch", recompute, 0.0, **args)
    assert wait
    # ...but 3 units in as long as the whole recompute is a pace that never pays.
    wait, _ = model.may_wait("fetch", recompute, 0.0, landing_s=recompute, fetched=3, **args)
    assert not wait
    # A fetch on pace keeps waiting.
    wait, _ = model.may_wait("fetch", recompute, 0.0, landing_s=0.001, fetched=3, **args)
    assert wait


def test_without_wait_past_allowance_a_request_stops_at_its_allowance() -> None:
    """Session 9, H100: partial hits waited past their allowance while their first round
    looked on pace, then gave up, at 1.16-1.29 x recompute. With
    l3.wait_past_allowance off, the allowance is the end, in every phase."""
    args = dict(first_chunk=0, num_chunks=64, landed=3, coming=61)
    lenient, strict = _model(unit_s=0.0001), _model(unit_s=0.0001)
    strict.wait_past_allowance = False
    allowance = lenient.wait_allowance_s(0, 64, 3)
    for model in (lenient, strict):  # a lookup past the allowance, within its round trips
        model.storage.round_trip_s = allowance
    for phase in ("lookup", "fetch"):
        # Within the allowance both wait; past it, on pace and just progressed, only the
        # lenient one does.
        assert lenient.may_wait(phase, allowance / 2, 0.0, **args) == (True, allowance)
        assert strict.may_wait(phase, allowance / 2, 0.0, **args) == (True, allowance)
        past = allowance * 1.01
        assert lenient.may_wait(phase, past, 0.0, landing_s=0.001, fetched=3, **args)[0]
        assert not strict.may_wait(phase, past, 0.0, landing_s=0.001, fetched=3, **args)[0]
        # Strict stops at the last poll before its allowance ends: looked at every
        # allowance / 4, at 0.8 of it the next look would come past it.
        poll = allowance / 4
        assert lenient.may_wait(phase, 0.8 * allowance, 0.0, poll_s=poll, **args)[0]
        assert not strict.may_wait(phase, 0.8 * allowance, 0.0, poll_s=poll, **args)[0]
        assert strict.may_wait(phase, 0.7 * allowance, 0.0, poll_s=poll, **args)[0]


def _model(unit_s: float) -> CostModel:
    model = CostModel(chunk_size=256, unit_bytes=1 << 20, parallel=2)
    for tokens in (1, 1, 1, 256, 512, 1024, 2048, 4096):
        context = 1000
        model.prefill.observe(
            tokens,
            tokens * (context + tokens / 2),
            0.002 + 1e-5 * tokens + 1e-10 * tokens * context,
        )
    model.storage.observe_fetch(unit_s)
    return model


def test_no_hit_before_storage_was_timed() -> None:
    model = _model(unit_s=0.0001)
    model.storage = StorageEstimate(unit_bytes=1, parallel=2)
    assert model.chunks_worth_loading(0, 16, round_trip=False) == 0


def test_cost_model_takes_fast_hits_and_declines_slow_ones() -> None:
    assert _model(unit_s=0.0001).chunks_worth_loading(0, 16, round_trip=False) == 16
    assert _model(unit_s=1.0).chunks_worth_loading(0, 16, round_trip=False) == 0
    # Deep in a long context the same chunks cost more to recompute: loading wins there.
    model = _model(unit_s=0.004)
    assert model.chunks_worth_loading(0, 1, round_trip=False) == 0
    assert model.chunks_worth_loading(400, 16, round_trip=False) == 16
    # Unknown engine speed: never risk a hit.
    assert CostModel(256, 1 << 20, 2).chunks_worth_loading(0, 16, round_trip=False) == 0


# ------------------------------------------------------------ on a real engine

PROMPT_CHUNKS = 8
# The simulated forward's time per token, as a device's: a prompt of PROMPT_CHUNKS
# recomputes in about 0.8 s, so reading a few 32 KiB units from a local directory
# (milliseconds) wins, and the 5 % wait allowance is about 40 ms.
COMPUTE_S_PER_TOKEN = 3e-3


def _filled_storage(model_dirs: tuple[Path, Path], url: str) -> list[list[int]]:
    prompts = [prompt(50 + i, PROMPT_CHUNKS * CHUNK + 5) for i in range(2)]
    first = l3_engine(model_dirs, url)
    for i, tokens in enumerate(prompts):
        first.add_request(f"fill{i}", tokens, max_tokens=1)
    first.run_until_done()
    finish_l3_writes(first)
    first.worker.shutdown()
    return prompts


def _engine(model_dirs: tuple[Path, Path], url: str, policy: str, io_threads: int) -> SimEngine:
    l3 = {"enabled": True, "hit_policy": policy, "io_threads": io_threads}
    return l3_engine(
        model_dirs, url, compute_s_per_token=COMPUTE_S_PER_TOKEN, extra_config={"l3": l3}
    )


def _restarted(
    model_dirs: tuple[Path, Path], url: str, policy: str, io_threads: int = 2
) -> SimEngine:
    eng = _engine(model_dirs, url, policy, io_threads)
    # A fresh prompt first: the engine's prefill speed is measured on it.
    eng.add_request("warmup", prompt(59, PROMPT_CHUNKS * CHUNK + 5), max_tokens=8)
    eng.run_until_done()
    return eng


def _serve(eng: SimEngine, req_id: str, tokens: list[int]) -> dict:
    eng.evict_gpu_kv()
    eng.take_published()
    eng.add_request(req_id, tokens, max_tokens=2)
    eng.run_prefill(req_id)
    assert eng.mismatched_positions(req_id) == []
    eng.run_until_done()
    return eng.take_published()


def _decisions(eng: SimEngine) -> str:
    l3 = eng.scheduler.connector.scheduler.l3
    return "\n".join(d.line() for d in l3.log.recent)


def _prefill_while_reads_hang(eng: SimEngine, req_id: str, prompt: list[int]) -> None:
    """Every storage read now takes 3 s: the request must still be prefilled long
    before its reads land, from recompute, with correct KV."""
    throttle(eng.worker.worker.l3.store, get=3.0)
    eng.evict_gpu_kv()
    eng.take_published()
    eng.add_request(req_id, prompt, max_tokens=1)
    started = time.monotonic()
    eng.run_prefill(req_id)
    assert time.monotonic() - started < 2.5
    assert eng.external_hits[req_id] == 0
    assert eng.mismatched_positions(req_id) == []


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_slow_storage_hits_are_declined_and_counted(
    model_dirs: tuple[Path, Path], tmp_path: Path, policy: str
) -> None:
    _slow_storage(model_dirs, f"fs://{tmp_path / 'l3'}", policy)


def test_slow_redis_hits_are_declined_and_counted(
    model_dirs: tuple[Path, Path],
    redis_url: str,  # noqa: F811
) -> None:
    _slow_storage(model_dirs, redis_url, "cost")


def _slow_storage(model_dirs: tuple[Path, Path], url: str, policy: str) -> None:
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, policy, io_threads=8)
    # 1.5 s per unit read: the 8 units load in 1.5 s (one round on 8 threads),
    # far slower than the simulated prefill.
    throttle(eng.worker.worker.l3.store, get=1.5)
    first = _serve(eng, "first", prompts[0])  # measures the storage (a probe, or a hit)
    published = _serve(eng, "second", prompts[1])
    if policy == "always":
        assert eng.external_hits["second"] == PROMPT_CHUNKS * CHUNK
        assert "l3_declined" not in published or not published["l3_declined"]
    else:
        # The probe did not land within the first request's allowance: it recomputed.
        assert eng.external_hits["first"] == 0
        assert first["l3_declined"] == {"fetch_too_slow": PROMPT_CHUNKS}, _decisions(eng)
        assert eng.external_hits["second"] == 0
        # Storage measured slow: the lookup itself is skipped.
        assert published["l3_declined"] == {"not_looked_up": PROMPT_CHUNKS}
        assert published["chunks"].get("load/l3", 0) == 0
    eng.worker.shutdown()


def test_storage_that_one_read_saturates_is_priced_by_a_round(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Seen on an H100 after a restart: one unit alone read in 12 ms, so 64 units on 8
    threads were priced at 8 x 12 ms, but the disk read 8 at once at 175 ms each, as
    fast as one alone. A probe of one unit cannot tell the two apart, and the
    restarted engine waited on fetches slower than recompute. The probe is a round of
    two units: it prices the storage at its real pace (two at once take twice one's
    time), and a hit that would load slower than recompute is not even looked up."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=4)
    disk_s = 0.15  # per read, one at a time: 8 units take 1.2 s, recompute ~0.8 s
    throttle(eng.worker.worker.l3.store, disk=disk_s)
    l3 = eng.scheduler.connector.scheduler.l3
    first = _serve(eng, "first", prompts[0])
    assert eng.external_hits["first"] == 0  # its probe round missed the allowance
    assert first["l3_declined"] == {"fetch_too_slow": PROMPT_CHUNKS}, _decisions(eng)
    assert l3.log.recent[-1].probe == "abandoned with 0/2 landed", _decisions(eng)
    deadline = time.monotonic() + 10
    while l3.fetches.units:  # the probe lands in the background
        assert time.monotonic() < deadline, _decisions(eng)
        eng.step()
        time.sleep(0.005)
    # Priced as the disk really reads: one unit after another.
    assert l3.cost.storage.load_s(PROMPT_CHUNKS) >= 0.8 * PROMPT_CHUNKS * disk_s
    second = _serve(eng, "second", prompts[1])
    assert eng.external_hits["second"] == 0
    assert second["l3_declined"] == {"not_looked_up": PROMPT_CHUNKS}, _decisions(eng)
    assert l3.log.recent[-1].outcome == "declined:not_looked_up", _decisions(eng)
    eng.worker.shutdown()


def test_a_background_probe_is_timed_by_the_workers_not_by_the_next_step(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Seen on an H100 after a warm restart: the probe round (8 units of 37.7 MB from the
    page cache) landed in about 30 ms, just past its 22 ms allowance, so the request
    recomputed. The scheduler heard of the landings only after that 0.7 s prefill step,
    timed the round at 0.7 s, priced 64 units at 5.5 s, and looked up no later hit. A
    round is timed from when the workers queued its reads to when the last one landed:
    the engine's step in between is not the storage's. Here the first request's storage
    is cold, so its probe runs in the background while it recomputes; the next request
    is priced by that probe's reads. (Its first round, 60 ms, is then more than 5 % of
    the recompute: the request waits no longer than that.)"""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=4)
    read_s = 0.06  # 4 parallel reads land in 60 ms: past the ~40 ms allowance
    throttle(eng.worker.worker.l3.store, get=read_s)
    # What the throttle stands for (a resident probe would be waited for past it).
    cold_files(tmp_path / "l3")
    l3 = eng.scheduler.connector.scheduler.l3
    first = _serve(eng, "first", prompts[0])  # recomputes for ~0.8 s in one step
    assert first["l3_declined"] == {"cold_unmeasured": PROMPT_CHUNKS}, _decisions(eng)
    assert l3.log.recent[-1].probe == "4 units in the background", _decisions(eng)
    deadline = time.monotonic() + 10
    while l3.fetches.units:
        assert time.monotonic() < deadline, _decisions(eng)
        eng.step()
        time.sleep(0.005)
    # 4 reads at once in ~60 ms, a pace of 15 ms: 8 units in ~0.12 s, far below the
    # ~0.8 s recompute (timed by the step, 0.8 s for the round: 1.6 s)
    assert l3.cost.storage.load_s(PROMPT_CHUNKS) < 5 * read_s, _decisions(eng)
    cold_files(tmp_path / "l3")  # what the throttle stands for: the lookup sees it
    _serve(eng, "second", prompts[1])
    # So the next hit is looked up and fetched whole (timed by the step: not looked up).
    # Its first round, estimated at 60 ms, is more than 5 % of its recompute and not
    # in the page cache: no bet past the allowance (CostModel.may_wait), it recomputes
    # within that and a poll.
    decision = l3.log.recent[-1]
    assert decision.req_id == "second" and decision.wanted == PROMPT_CHUNKS, _decisions(eng)
    assert decision.first_round_resident is False, decision.line()
    assert decision.load_s is not None and decision.load_s < 5 * read_s, decision.line()
    assert decision.outcome == "declined:fetch_too_slow", decision.line()
    assert decision.waited_s < (decision.allowance_s or 0.0) + 0.03, decision.line()
    eng.worker.shutdown()


def test_fast_storage_hits_are_taken(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """Storage unmeasured, engine speed measured: the first hit probes two units, which
    land within its allowance, then loads the rest; the next hit uses the speed."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=4)
    for req_id, tokens in (("probe", prompts[0]), ("hit", prompts[1])):
        published = _serve(eng, req_id, tokens)
        assert eng.external_hits[req_id] == PROMPT_CHUNKS * CHUNK, _decisions(eng)
        assert published["chunks"]["load/l3"] == PROMPT_CHUNKS
        assert not published.get("l3_declined")
    probe = next(d for d in eng.scheduler.connector.scheduler.l3.log.recent if d.req_id == "probe")
    assert probe.probe.startswith("2/2 landed"), probe.line()
    # The wait, split: the lookup's round trip, then the fetch (after the probe).
    hit = eng.scheduler.connector.scheduler.l3.log.recent[-1]
    assert hit.req_id == "hit" and hit.outcome == "fetched", hit.line()
    assert hit.lookup_s is not None and hit.fetch_s is not None, hit.line()
    assert min(hit.lookup_s, hit.fetch_s) > 0
    assert hit.lookup_s + hit.fetch_s <= hit.waited_s
    # Of the lookup's round trip, the part until its thread had the answer.
    assert hit.lookup_answered_s is not None
    assert 0 < hit.lookup_answered_s <= hit.lookup_s, hit.line()
    assert (
        f"(lookup {hit.lookup_s:.4f} s, answered in {hit.lookup_answered_s:.4f} s, "
        f"fetch {hit.fetch_s:.4f} s)"
    ) in hit.line()
    # When its first unit landed, against the estimate a wait before it bets on.
    assert hit.first_landing_s is not None and hit.first_landing_est_s is not None
    assert 0 < hit.first_landing_s <= hit.fetch_s, hit.line()
    assert f"first landing {hit.first_landing_s:.4f} s (est " in hit.line()
    eng.worker.shutdown()


def test_a_cold_first_hit_recomputes_at_once_and_probes_in_the_background(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """H100, session 23: the first prompt after a restart onto a cold page cache waited on
    its probe, up to its allowance of 5 % of the recompute, and took 1.05-1.07 x of it.
    Storage unmeasured and its first round found not in the page cache: the request
    waits on nothing but the lookup, recomputes with correct KV, and a probe times the
    storage in the background (its units land in the CPU tier). The next request is a
    hit at the measured speed, even from cold files."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=4)
    l3 = eng.scheduler.connector.scheduler.l3
    assert l3.cost.storage.samples == 0
    cold_files(tmp_path / "l3")
    first = _serve(eng, "cold", prompts[0])
    assert eng.external_hits["cold"] == 0
    assert first["l3_declined"] == {"cold_unmeasured": PROMPT_CHUNKS}, _decisions(eng)
    decision = l3.log.recent[-1]
    assert decision.req_id == "cold" and decision.found == PROMPT_CHUNKS, decision.line()
    assert decision.first_round_resident is False, decision.line()
    assert decision.outcome == "declined:cold_unmeasured", decision.line()
    assert decision.probe == "4 units in the background", decision.line()
    assert decision.fetch_s is None and decision.lookup_s is not None, decision.line()
    assert decision.waited_s < decision.lookup_s + 0.03, decision.line()
    deadline = time.monotonic() + 10
    while l3.fetches.units:
        assert time.monotonic() < deadline, _decisions(eng)
        eng.step()
        time.sleep(0.005)
    assert l3.cost.storage.samples == 4, _decisions(eng)
    cold_files(tmp_path / "l3")
    published = _serve(eng, "hit", prompts[1])
    assert eng.external_hits["hit"] == PROMPT_CHUNKS * CHUNK, _decisions(eng)
    assert published["chunks"]["load/l3"] == PROMPT_CHUNKS
    assert not published.get("l3_declined")
    # The probe's units serve the cold prompt's head from the CPU tier.
    eng.evict_gpu_kv()
    eng.take_published()
    eng.add_request("again", prompts[0], max_tokens=1)
    eng.run_prefill("again")
    assert eng.take_published()["chunks"].get("load/cpu", 0) >= 4, _decisions(eng)
    assert eng.mismatched_positions("again") == []
    eng.run_until_done()
    eng.worker.shutdown()


def test_measured_storage_that_stalls_costs_a_bounded_wait(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Storage measured fast, then every read hangs: the request stops waiting once the
    fetch falls behind the measured pace, and recomputes."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=8)
    _serve(eng, "fast", prompts[0])
    assert eng.scheduler.connector.scheduler.l3.cost.storage.samples >= 1
    _prefill_while_reads_hang(eng, "stalled", prompts[1])
    decision = eng.scheduler.connector.scheduler.l3.log.recent[-1]
    assert decision.outcome == "declined:fetch_too_slow", decision.line()
    eng.run_until_done()  # the reads land in the background
    eng.worker.worker.l3.flush(10)
    eng.worker.shutdown()


def test_a_long_recent_step_does_not_stretch_a_stalled_wait(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """As above, right after a long prefill (H100, session 15: a hit behind a fresh
    16k prompt waited 98 ms against a 33 ms allowance, at 1.31 x recompute). Past its
    allowance a request may wait two steps more; a step is how often the scheduler
    asks about it (a few ms here), not the engine's mean computing step."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=8)
    _serve(eng, "fast", prompts[0])
    cost = eng.scheduler.connector.scheduler.l3.cost
    cost.step_s = 1.0  # the engine's steps of late: long prefills
    _prefill_while_reads_hang(eng, "stalled", prompts[1])
    decision = eng.scheduler.connector.scheduler.l3.log.recent[-1]
    assert decision.outcome == "declined:fetch_too_slow", decision.line()
    grace = 2 * (cost.storage.unit_s + 0.1)  # two unit times and two short steps
    assert decision.waited_s < (decision.allowance_s or 0.0) + grace, decision.line()
    eng.run_until_done()
    eng.worker.worker.l3.flush(10)
    eng.worker.shutdown()


def test_a_fetch_given_up_as_too_slow_cancels_the_reads_not_started(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Seen on an H100 (session 9): a request gave up a 64-unit fetch that fell behind
    its measured pace, and recomputed 0.03-0.08 s slower than the engine's other
    prefills, beside the ~60 reads still queued. The reads not started are cancelled:
    only those in flight run, nothing is refused, and the units stay usable."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=2)
    _serve(eng, "fast", prompts[0])  # the storage is measured fast
    l3 = eng.scheduler.connector.scheduler.l3
    # Each read now takes longer than the request waits (its allowance, then two unit
    # and step times without progress): it gives up before any lands.
    slow = throttle(eng.worker.worker.l3.store, get=3.0)
    eng.evict_gpu_kv()
    eng.take_published()
    eng.add_request("stalled", prompts[1], max_tokens=1)
    eng.run_prefill("stalled")
    decision = l3.log.recent[-1]
    assert decision.outcome == "declined:fetch_too_slow", decision.line()
    assert decision.wanted == PROMPT_CHUNKS and decision.landed == 0, decision.line()
    deadline = time.monotonic() + 10
    while l3.fetches.units:  # the reads in flight land in the background
        assert time.monotonic() < deadline, _decisions(eng)
        eng.step()
        time.sleep(0.005)
    eng.run_until_done()
    # one per read thread, in flight at the give-up; the other 6 never started
    assert slow.gets_started == 2, (slow.gets_started, _decisions(eng))
    assert not l3.fetches.take_cancels() and not l3.fetches.take_unsent()
    worker_l3 = eng.worker.worker.l3
    assert not worker_l3._fetches_queued and not worker_l3._fetches_cancelled  # bounded
    published = eng.take_published()
    assert published["l3_declined"] == {"fetch_too_slow": PROMPT_CHUNKS}, published
    assert not published.get("refused"), published  # skipped, not refused
    # Storage still holds the cancelled units: fast again, the prompt hits whole.
    slow._delays["get"] = 0.0
    _serve(eng, "again", prompts[1])
    assert eng.external_hits["again"] == PROMPT_CHUNKS * CHUNK, _decisions(eng)
    eng.worker.shutdown()


def test_never_reads_storage(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "never")
    published = _serve(eng, "never", prompts[0])
    assert eng.external_hits["never"] == 0
    assert "l3" not in published["hits"] and "l3" not in published["misses"]
    eng.worker.shutdown()


def test_unknown_engine_speed_declines_and_probes(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Right after a start with no calibration nothing is known: recompute without
    waiting on storage, and measure the storage with one unit in the background."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)  # an `always` engine: no calibration
    eng = _engine(model_dirs, url, "cost", io_threads=2)
    sched = eng.scheduler.connector.scheduler
    assert sched.l3.cost.prefill.source == "none"
    published = _serve(eng, "cold", prompts[0])
    assert eng.external_hits["cold"] == 0
    assert published["l3_declined"] == {"speed_unknown": PROMPT_CHUNKS}
    assert sched.l3.log.recent[0].found is None  # no request waited on storage
    deadline = time.monotonic() + 10
    while sched.l3.cost.storage.samples == 0:  # the background lookup, then its probe
        assert time.monotonic() < deadline, _decisions(eng)
        eng.step()
        time.sleep(0.005)
    eng.run_until_done()
    eng.worker.shutdown()


def test_unknown_hit_policy_names_the_field() -> None:
    from vllm_draft_offload.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.l3\.hit_policy"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "l3": {"hit_policy": "sometimes"}})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_clock_pairs_steps_with_their_outputs(async_scheduling: bool) -> None:
    """Each step is charged its own device time, whether vLLM schedules one step
    ahead (async scheduling) or not, and an idle engine adds nothing."""
    now = [0.0]
    model = CostModel(256, 1 << 20, 2, clock=lambda: now[0])
    seen: list[tuple[float, float]] = []
    model.prefill.observe = lambda tokens, attention, seconds: seen.append((tokens, seconds))  # type: ignore[method-assign]
    durations = {1: 0.01, 512: 0.2}
    steps = [512, 1, 1, 512, 1]
    if async_scheduling:
        model.step_scheduled([(steps[0], 0)])
        for i, tokens in enumerate(steps):
            if i + 1 < len(steps):
                model.step_scheduled([(steps[i + 1], 0)])  # scheduled while step i runs
            now[0] += durations[tokens]
            model.step_output()
    else:
        for tokens in steps:
            now[0] += 5.0  # idle engine between requests
            model.step_scheduled([(tokens, 0)])
            now[0] += durations[tokens]
            model.step_output()
    assert seen == [(t, pytest.approx(durations[t])) for t in steps]


def test_an_empty_steps_late_output_does_not_shorten_the_next_step() -> None:
    """A request waiting on storage makes vLLM schedule empty steps. With async
    scheduling the 16k-token prefill is scheduled right behind one, and the empty
    step's output can come back only once the prefill has run (its output waits on
    the device). Charging the prefill from that late output timed a 16k-token step
    at 2 ms on an H100, and the fit then priced every recompute near zero."""
    now = [0.0]
    model = CostModel(256, 1 << 20, 2, clock=lambda: now[0])
    seen: list[tuple[float, float]] = []
    model.prefill.observe = lambda tokens, attention, seconds: seen.append((tokens, seconds))  # type: ignore[method-assign]
    model.step_scheduled([])  # the waiting request: nothing scheduled
    now[0] += 0.001
    model.step_scheduled([(16384, 0)])  # it landed (or was declined): the prefill
    now[0] += 0.45
    model.step_output()  # the empty step's output, late
    now[0] += 0.002
    model.step_output()  # the prefill's
    assert seen == [(16384, pytest.approx(0.452))]


def test_declined_chunks_reach_prometheus_and_the_log_line(
    vllm_config: VllmConfig,  # noqa: F811
    clean_registry: Any,  # noqa: F811
) -> None:
    prom = KVConnectorProm(vllm_config, ["model_name", "engine"], {0: ["m", "0"]})

    def declined() -> float | None:
        return clean_registry.get_sample_value(
            PREFIX + "l3_declined_chunks_total",
            {"model_name": "m", "engine": "0", "cause": "slower_than_recompute"},
        )

    assert declined() == 0  # pre-created
    stats = DraftOffloadStats()
    stats.record_l3_declined("slower_than_recompute", 5)
    prom.observe(stats.to_dict(), engine_idx=0)
    assert declined() == 5
    assert stats.reduce()["l3_declined_chunks"] == 5


def test_first_hit_on_slow_storage_waits_only_a_bounded_time(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """A probe slower than its wait allowance is abandoned: the request recomputes and
    the probe still lands later, measuring the storage for the next request."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost")
    # Its probe's allowance is about 40 ms.
    _prefill_while_reads_hang(eng, "first", prompts[0])
    eng.run_until_done()  # the probe lands and times the storage for later requests
    published = eng.take_published()
    assert published["l3_declined"] == {"fetch_too_slow": PROMPT_CHUNKS}
    # The probe: two units.
    assert eng.scheduler.connector.scheduler.l3.cost.storage.samples == 2
    eng.worker.worker.l3.flush(10)
    eng.worker.shutdown()


def test_a_fetch_is_paced_from_its_first_landing_counting_any_order() -> None:
    """H100, session 13, warm restarts: 64 units of 37.7 MB on 8 read threads, about
    0.2 s against 0.44 s of recompute. Priced from the leading units landed since the
    fetch began, one request gave storage up with 5 of 64 in after 46 ms (the rest
    "needed" 0.54 s) and another with 1 of 64 in after 29 ms (1.8 s). Reads sent
    together land together one read's time after they start, and out of order: the
    pace counts every unit landed, from the first landing on."""
    model = CostModel(chunk_size=256, unit_bytes=37_700_000, parallel=8)
    for tokens in (256, 1024, 4096, 8192, 16384):
        model.prefill.observe(tokens, 0.0, 0.002 + 2.65e-5 * tokens)
    model.storage.observe_fetch(0.0208)
    recompute = model.recompute_chunks_s(0, 64)
    assert recompute == pytest.approx(0.436, rel=0.02)
    waited = 1.2 * model.wait_allowance_s(0, 64, 1)  # past the allowance
    args = dict(first_chunk=0, num_chunks=64, landed=1, coming=63)
    # One unit in, just now: no pace yet; the estimate (0.18 s) pays, so it waits.
    assert model.may_wait("fetch", waited, 0.001, landing_s=0.0, fetched=1, **args)[0]
    # A round landed over 16 ms since the first: 56 more at that pace take 0.13 s.
    on_pace = dict(args, landed=5, coming=59)
    assert model.may_wait(
        "fetch", waited, 0.001, landing_s=0.016, fetched=8, outstanding=56, **on_pace
    )[0]
    # Storage slower than priced: 3 units in 0.2 s since the first one never pays.
    assert not model.may_wait(
        "fetch", waited, 0.001, landing_s=0.2, fetched=3, outstanding=61, **args
    )[0]


# H100, session 13 (lease 3), warm restart: the calibration the restarted engine read
# (prefill steps of the engines before it: (tokens, attention, seconds)), and its own
# first steps, a 255-token warm-up and 2-token steps of the benchmark's driver.
SESSION13_PRIOR: list[tuple[float, float, float]] = [
    (16384.0, 134217728.0, 1.4026), (2.0, 2.0, 0.2201), (16384.0, 134217728.0, 0.4774),
    (16384.0, 134217728.0, 0.4975), (16384.0, 134217728.0, 0.4818),
    (16384.0, 134217728.0, 0.5069), (2.0, 2.0, 0.0899), (2.0, 2.0, 0.0305),
    (2.0, 2.0, 0.0294), (2.0, 2.0, 0.037), (255.0, 32512.5, 0.1747), (2.0, 2.0, 0.0561),
    (16384.0, 134217728.0, 0.5013), (2.0, 2.0, 0.0485), (2.0, 2.0, 0.0377),
    (2.0, 2.0, 0.0464), (16384.0, 134217728.0, 0.4659), (16384.0, 134217728.0, 0.4977),
    (2.0, 2.0, 0.2075), (2.0, 2.0, 0.2033), (2.0, 2.0, 0.1309), (2.0, 2.0, 0.0463),
    (16384.0, 134217728.0, 0.4684), (2.0, 2.0, 0.0606), (2.0, 2.0, 0.063),
    (2.0, 2.0, 0.0599), (16384.0, 134217728.0, 0.4728), (16384.0, 134217728.0, 0.501),
    (16384.0, 134217728.0, 0.4834),
]  # fmt: skip
SESSION13_OWN: list[tuple[float, float, float]] = [
    (255.0, 32512.5, 0.1532), (2.0, 2.0, 0.0358), (2.0, 2.0, 0.0298), (2.0, 2.0, 0.0452),
]  # fmt: skip
# 8B shape: 36 layers' KV of 256 tokens; the storage as timed by the restart's first hit.
SESSION13_UNIT_BYTES = 147456 * 256
SESSION13_UNIT_S = 0.0175
SESSION13_PACE_S = 0.15 / 62


def session13_model() -> CostModel:
    """The restarted engine's cost model when its third storage hit was decided."""
    model = CostModel(chunk_size=256, unit_bytes=SESSION13_UNIT_BYTES, parallel=8)
    session13_estimates(model)
    return model


def session13_estimates(model: CostModel) -> None:
    assert model.prefill.set_prior(SESSION13_PRIOR)
    for tokens, attention, seconds in SESSION13_OWN:
        model.prefill.observe(int(tokens), attention, seconds)
    model.storage.observe_fetch(SESSION13_UNIT_S)
    model.storage.observe_pace(SESSION13_PACE_S)


def test_one_decision_prices_every_chunk_count_with_one_estimate() -> None:
    """H100, session 13: after a warm restart, two requests fetched 3 of the 64 units
    storage held ("fetch 3, landed 3; est load 0.0175 s (unit 0.0175 s)": the load of
    one round, not the 0.14 s of 64 units) and recomputed the rest. The CPU tier had
    free slots (24 GiB of 37.7 MB units: 682, at most 256 in use). The engine's own
    fit of its warm-up and 2-token steps prices up to 4 x 255 tokens, so it priced
    counts 1-3 (3 chunks: 0.36 s), the calibration priced 4-64 (64 chunks: 0.45 s):
    3 chunks "saved" more than 64. One decision prices every count it weighs with
    the estimate that prices the whole range."""
    model = session13_model()
    assert model.prefill.source_for(768) == "fit"  # the own fit reaches 3 chunks...
    assert model.prefill.source_for(64 * 256) == "calibration"  # ...not 64
    assert model.chunks_worth_loading(0, 64, round_trip=False) == 64
    # Each count of the range is priced as part of it: by the calibration.
    whole = model.recompute_chunks_s(0, 64)
    three = model.recompute_chunks_s(0, 3, span_chunks=64)
    assert whole == pytest.approx(0.4527, rel=0.01)
    assert three is not None and whole is not None and three < whole * 3 / 64 * 1.5
    # A wait is bounded by the same estimate: what 3 landed chunks save is not the
    # own fit's 0.36 s (which would let the request wait most of a recompute).
    allowance = model.wait_allowance_s(0, 64, 3)
    assert allowance < 0.05 * whole + 1.5 * three


def test_a_request_waits_past_its_allowance_by_its_own_step_cadence() -> None:
    """H100, session 15: a restart's hit right behind a fresh 16k prompt's storage
    writes. Its lookup took 44 ms against a 33 ms allowance, then it waited for units
    until 98 ms in all (1.31 x recompute). The grace past the allowance, "two steps
    more", had used the engine's mean computing step, which the fresh prompt's 0.5 s
    prefill had raised, while the waiting request was asked about every few ms."""
    now = [0.0]
    model = CostModel(
        chunk_size=256, unit_bytes=SESSION13_UNIT_BYTES, parallel=8, clock=lambda: now[0]
    )
    session13_estimates(model)
    model.storage.round_trip_s = 0.003
    model.step_scheduled([(16384, 0)])
    now[0] += 0.5
    model.step_output()  # the fresh prompt's prefill: the engine's recent step time
    assert model.step_s > 0.1
    allowance = model.wait_allowance_s(0, 64, 0)
    assert allowance == pytest.approx(0.022, abs=0.005)
    waited = allowance + 0.012
    args = dict(first_chunk=0, num_chunks=64, landed=0, coming=64)
    # Without the request's own cadence, the lookup keeps waiting...
    assert model.may_wait("lookup", waited, waited, **args)[0]
    # ...asked every 2 ms, two round trips and steps past the allowance are over.
    assert not model.may_wait("lookup", waited, waited, poll_s=0.002, **args)[0]
    # A fetch with nothing landed past 1.5 x its first round's estimate: given up, and
    # the engine's long step gives it no more time (nothing lands sooner for it).
    stalled = 1.5 * model.storage.first_landing_s(64) + 0.001
    assert not model.may_wait("fetch", waited + stalled, stalled, **args)[0]
    assert not model.may_wait("fetch", waited + stalled, stalled, poll_s=0.002, **args)[0]
    # Once units landed, a fetch stalled for two unit times and polls: given up.
    stalled = 2 * (SESSION13_UNIT_S + 0.002) + 0.001
    landed = dict(args, landed=8, coming=56)
    late = model.wait_allowance_s(0, 64, 8) + 0.01
    assert model.may_wait("fetch", late, stalled, fetched=8, **landed)[0]
    assert not model.may_wait("fetch", late, stalled, fetched=8, poll_s=0.002, **landed)[0]
    # On pace, it still waits past the allowance.
    assert model.may_wait("fetch", waited, 0.001, poll_s=0.002, **args)[0]


# H100 host, sessions 15-16 (Llama-3-8B shape + 4-layer drafter, 16,382-token prompt = 64
# units of 37.7 MB, 8 read threads, fs:// on local disk): what each restart's estimates
# were when its hit was decided, how long its lookup took, how often the scheduler asked
# about it, and when its units landed (rounds of 8 reads land together).
def _h100_model(seconds_per_token: float, unit_s: float, pace_s: float) -> CostModel:
    model = CostModel(chunk_size=256, unit_bytes=SESSION13_UNIT_BYTES, parallel=8)
    for tokens in (256, 1024, 4096, 8192, 16384):
        model.prefill.observe(tokens, 0.0, 0.002 + seconds_per_token * tokens)
    model.storage.observe_fetch(unit_s)
    if pace_s:
        model.storage.observe_pace(pace_s, 64)
    model.storage.round_trip_s = 0.003
    return model


def _replay(
    model: CostModel,
    lookup_s: float,
    poll_s: float,
    first_round_s: float,
    round_s: float,
    resident: bool | None = None,
) -> tuple[str, float]:
    """Ask may_wait once per poll as L3Prefetch does, for a 64-unit hit whose lookup
    answers after `lookup_s` (finding the first round `resident` in the page cache, or
    not, or not telling) and whose units land in rounds of 8, the first `first_round_s`
    after the fetch starts (at the poll that sees the lookup) and one more every
    `round_s`. ("taken" | "declined", seconds waited)."""
    units, t, fetch_started = 64, 0.0, None
    while True:
        t += poll_s
        if fetch_started is None and t < lookup_s:
            if not model.may_wait("lookup", t, t, 0, units, 0, units, poll_s=poll_s)[0]:
                return "declined", t
            continue
        if fetch_started is None:
            fetch_started = t
        since = t - fetch_started
        rounds = 0 if since < first_round_s else 1 + int((since - first_round_s) / round_s)
        fetched = min(units, 8 * rounds)
        if fetched == units:
            return "taken", t
        first_landing = fetch_started + first_round_s
        last_landing = first_landing + (rounds - 1) * round_s if rounds else fetch_started
        wait, _ = model.may_wait(
            "fetch",
            t,
            t - last_landing,
            0,
            units,
            landed=fetched,
            coming=units - fetched,
            landing_s=t - first_landing if fetched else 0.0,
            fetched=fetched,
            outstanding=units - fetched,
            poll_s=poll_s,
            first_round_resident=resident,
        )
        if not wait:
            return "declined", t


@pytest.mark.parametrize(
    ("case", "seconds_per_token", "unit_s", "pace_s", "lookup_s", "poll_s", "first", "every"),
    [
        # Cold, behind another prompt's writes (session 16, req 12-bd76b000): priced from
        # the two-unit probe's cold reads (45 ms each, landed together: no pace), 64 units
        # at 0.36 s against 0.58 s of recompute; lookup 26 ms; 8 reads share a disk at
        # ~1.4 GB/s, so a round lands 0.2 s after the fetch starts. It gave up 0.12 s in
        # against a 0.029 s allowance (1.26 x recompute).
        ("cold busy", 3.5e-5, 0.0449, 0.0, 0.026, 0.005, 0.2, 0.2),
        # Warm (page cache), behind writes: a 44 ms lookup against a 33 ms allowance, seen
        # by a scheduler stepping every 20 ms; then rounds of 8 every 25 ms.
        ("warm busy", 4.0e-5, 0.0193, 0.15 / 62, 0.044, 0.02, 0.025, 0.025),
        # Warm and quiet: a 3 ms lookup, rounds of 8 every 21 ms (the whole fetch 0.17 s).
        ("warm quiet", 3.0e-5, 0.0171, 0.15 / 62, 0.003, 0.003, 0.021, 0.021),
    ],
)
def test_h100_restart_waits(
    case: str,
    seconds_per_token: float,
    unit_s: float,
    pace_s: float,
    lookup_s: float,
    poll_s: float,
    first: float,
    every: float,
) -> None:
    """Issue 11, item 4: a restart's hit must cost at most 1.05 x recompute whatever the
    storage speed. Cold storage the estimate overrated is given up within the allowance
    and one poll (not two unit times past the fetch's start); warm hits are still taken,
    the busy one although its lookup alone outlasted the allowance."""
    model = _h100_model(seconds_per_token, unit_s, pace_s)
    recompute = model.recompute_chunks_s(0, 64)
    assert recompute is not None
    allowance = model.wait_allowance_s(0, 64, 0)
    outcome, waited = _replay(model, lookup_s, poll_s, first, every)
    if case == "cold busy":
        assert model.storage.load_s(64) < recompute  # the estimate says: fetch
        assert outcome == "declined"
        assert waited <= allowance + poll_s + 1e-9, (waited, allowance)
    else:
        assert outcome == "taken", (case, waited, allowance)
        assert waited < 0.5 * recompute


def test_storage_slower_than_its_calibration_is_given_up_within_the_allowance(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """H100, session 16: a cold restart's probe timed two reads landing together at 45 ms
    each, so 64 units on 8 threads were priced at 0.36 s, under the 0.58 s recompute,
    and a fetch began. On a disk that one read saturates nothing landed; the request
    waited two unit times past the fetch's start and gave up 0.12 s in against a 0.03 s
    allowance (1.26 x). Here the probe is timed at 60 ms a read (more than the ~40 ms
    allowance, as 45 ms was more than 29 ms there), then the reads hang: the request
    must recompute within its allowance and one poll, not 2 x (60 ms + a step) later."""
    url = f"fs://{tmp_path / 'l3'}"
    prompts = _filled_storage(model_dirs, url)
    eng = _restarted(model_dirs, url, "cost", io_threads=8)
    slow = throttle(eng.worker.worker.l3.store, get=0.06)
    l3 = eng.scheduler.connector.scheduler.l3
    _serve(eng, "probe", prompts[0])  # the probe misses its allowance, lands later
    deadline = time.monotonic() + 10
    while l3.fetches.units:
        assert time.monotonic() < deadline, _decisions(eng)
        eng.step()
        time.sleep(0.005)
    storage = l3.cost.storage
    assert storage.unit_s >= 0.05 and storage.pace_s == 0.0, _decisions(eng)
    assert l3.cost.chunks_worth_loading(0, PROMPT_CHUNKS, True) == PROMPT_CHUNKS
    slow._delays["get"] = 3.0  # the storage is far slower than it was timed
    cold_files(tmp_path / "l3")  # and cold, as the lookup sees
    eng.evict_gpu_kv()
    eng.take_published()
    eng.add_request("slow", prompts[1], max_tokens=1)
    polls: list[float] = []
    must_wait = l3.must_wait

    def timed(*args: Any, **kwargs: Any) -> bool:
        polls.append(time.monotonic())
        return must_wait(*args, **kwargs)

    l3.must_wait = timed  # type: ignore[method-assign]
    eng.run_prefill("slow")
    decision = l3.log.recent[-1]
    assert decision.req_id == "slow" and decision.found == PROMPT_CHUNKS, _decisions(eng)
    assert decision.outcome == "declined:fetch_too_slow", decision.line()
    assert decision.first_round_resident is False, decision.line()
    assert decision.wanted == PROMPT_CHUNKS and decision.landed == 0, decision.line()
    poll = max(b - a for a, b in zip(polls, polls[1:], strict=False))
    assert decision.allowance_s is not None
    assert decision.waited_s <= decision.allowance_s + poll + 0.01, (decision.line(), poll)
    assert eng.external_hits["slow"] == 0
    assert eng.mismatched_positions("slow") == []
    eng.run_until_done()
    eng.worker.shutdown()


# H100, session 18 (restore-speed, Llama-8B shape, fs:// on local disk), a warm restart's
# second prompt: "est load 0.3023 s (unit 0.0339 s) vs recompute 0.5559 s (fit); waited
# 0.0388 s of 0.0278 s (lookup 0.0156 s, fetch 0.0215 s)" -> declined:fetch_too_slow.
# 64 units at 0.3023 s on 8 threads: a pace of 0.3023 / 64 s per unit.
SESSION18 = dict(seconds_per_token=0.5559 / 16384, unit_s=0.0339, pace_s=0.3023 / 64)
# Lease 2 of the same session: "est load 0.1296 s (unit 0.0162 s) vs recompute 0.5632 s".
SESSION18_LEASE2 = dict(seconds_per_token=0.5632 / 16384, unit_s=0.0162, pace_s=0.1296 / 64)


@pytest.mark.parametrize(
    ("case", "model_args", "lookup_s", "poll_s", "first", "every", "resident", "expected"),
    [
        # The warm prompt, its first round found in the page cache: the estimated first
        # landing (38 ms) is past 5 % of the recompute (28 ms), but resident data lands
        # at memory speed; rounds land as the estimate prices them.
        ("warm resident", SESSION18, 0.0156, 0.004, 0.034, 0.034, True, "taken"),
        # The same without a residency answer (not fs://, or the kernel would not tell):
        # today's rule for cold storage, given up at the allowance, as session 18 was.
        ("warm unknown", SESSION18, 0.0156, 0.004, 0.034, 0.034, None, "declined"),
        # Session 16's cold busy restart (see test_h100_restart_waits), found not
        # resident: no bet, given up within the allowance and a poll.
        ("cold busy", dict(seconds_per_token=3.5e-5, unit_s=0.0449, pace_s=0.0),
         0.026, 0.005, 0.2, 0.2, False, "declined"),
        # A resident first round that then lands nowhere near its estimate (evicted
        # between the lookup and the reads, or the host stalls): given up at 1.5 x the
        # estimated first landing from the fetch's start.
        ("resident, turns slow", SESSION18, 0.0156, 0.004, 10.0, 10.0, True, "declined"),
        # Session 18, lease 2, with the residency rule at 1.5 x: the warm restart's
        # second prompt, "est load 0.1296 s (unit 0.0162 s) vs recompute 0.5632 s; resident
        # 8/8; waited 0.0433 s of 0.0282 s (lookup 0.0158 s, fetch 0.0263 s)" ->
        # declined. The next warm prompt's whole fetch took 0.209 s: 26 ms a round, 1.6 x
        # the estimate; the first round (thread start, opens) lands later. Now taken.
        ("warm resident, round at 1.6 x", SESSION18_LEASE2, 0.0158, 0.004, 0.03, 0.026,
         True, "taken"),
        # Behind another prompt's writes (req 24: resident 8/8, lookup 19 ms, nothing
        # landed 44 ms into the fetch): rounds of 50 ms, still within 15 % of R.
        ("warm resident, busy", SESSION18_LEASE2, 0.0192, 0.01, 0.05, 0.05, True, "taken"),
        # The same prompt without a residency answer: the old rule.
        ("warm unknown, round at 1.6 x", SESSION18_LEASE2, 0.0158, 0.004, 0.03, 0.026,
         None, "declined"),
    ],
)  # fmt: skip
def test_a_resident_first_round_is_waited_for_and_a_cold_one_is_not(
    case: str,
    model_args: dict[str, float],
    lookup_s: float,
    poll_s: float,
    first: float,
    every: float,
    resident: bool | None,
    expected: str,
) -> None:
    """Session 18: a warm restart's hit, estimated to load 45 % faster than recomputing,
    was declined because its first round's estimate (one unit time) outgrew 5 % of the
    recompute, the bound kept for cold disks (session 16). The lookup now tells warm
    from cold (the page cache holds the first round's files or not): a resident round is
    waited for within 3 x its estimate and 15 % of the recompute (lease 2: rounds took
    1.6 x their estimate); one not resident, or not known to be, keeps the cold rule and
    its bound."""
    model = _h100_model(**model_args)
    recompute = model.recompute_chunks_s(0, 64)
    assert recompute is not None
    allowance = model.wait_allowance_s(0, 64, 0)
    first_s = model.storage.first_landing_s(64)
    if model_args is SESSION18:
        assert recompute == pytest.approx(0.5559, rel=0.01)
        assert allowance == pytest.approx(0.0278, rel=0.01)
        assert model.storage.load_s(64) == pytest.approx(0.3023, rel=0.001)
        assert first_s > 0.05 * recompute  # no bet on the estimate alone
    outcome, waited = _replay(model, lookup_s, poll_s, first, every, resident)
    assert outcome == expected, (case, waited, allowance)
    if outcome == "taken":
        assert waited < recompute
    elif resident:
        # The resident bet's bound: 3 x the first landing from the fetch's start (at the
        # poll that saw the lookup), never past 15 % of R, and a poll.
        fetch_start = poll_s * math.ceil(lookup_s / poll_s - 1e-9)
        limit = min(RESIDENT_LANDING_FACTOR * first_s, RESIDENT_WAIT_FRACTION * recompute)
        assert waited <= fetch_start + limit + poll_s + 1e-9, waited
    else:
        # No bet past the allowance, or the cold bet: 1.5 x a first landing estimated
        # within 5 % of R.
        fetch_start = poll_s * math.ceil(lookup_s / poll_s - 1e-9)
        cold_bet = fetch_start + 1.5 * first_s if first_s <= 0.05 * recompute else 0.0
        assert waited <= max(allowance, lookup_s, cold_bet) + poll_s + 1e-9, waited


@pytest.mark.parametrize(
    ("stalled_s", "first_s", "worth", "resident", "expected"),
    [
        (0.02, 0.038, True, True, True),  # resident: waits past the cold limit
        (0.02, 0.038, True, False, False),  # not resident: the estimate is past the limit
        (0.02, 0.038, True, None, False),  # unknown: as not resident
        (0.02, 0.025, True, None, True),  # within the cold limit: waits, as before
        (0.035, 0.020, True, None, False),  # not resident, past 1.5 x the estimate
        (0.035, 0.020, True, True, True),  # resident: up to 3 x the estimate
        (0.061, 0.020, True, True, False),  # resident, past 3 x the estimate
        (0.080, 0.038, True, True, True),  # resident: under 3 x and under 15 % of R
        (0.090, 0.038, True, True, False),  # resident: past 15 % of R (0.0834 s)
        (0.02, 0.038, False, True, False),  # the load would not beat recomputing
    ],
)
def test_first_landing_bet_table(
    stalled_s: float, first_s: float, worth: bool, resident: bool | None, expected: bool
) -> None:
    assert (FIRST_LANDING_FACTOR, RESIDENT_LANDING_FACTOR) == (1.5, 3.0)
    assert (
        may_wait_for_first_landing(
            stalled_s,
            first_s,
            cold_limit_s=0.0278,
            load_beats_recompute=worth,
            first_round_resident=resident,
            resident_limit_s=0.0834,
        )
        is expected
    )


@pytest.mark.parametrize(
    ("waited_s", "resident", "expected"),
    [
        (0.03, True, True),  # a resident probe past its allowance: within 15 % of R
        (0.09, True, False),  # past 15 % of R
        (0.03, False, False),  # not resident: no bet without an estimate
        (0.03, None, False),  # unknown: as not resident
    ],
)
def test_resident_probe_table(waited_s: float, resident: bool | None, expected: bool) -> None:
    assert may_wait_for_resident_probe(waited_s, resident, resident_limit_s=0.0834) is expected


def test_a_resident_probe_waits_past_its_allowance_within_the_bound() -> None:
    """Session 18, lease 2: a warm restart's first request probed two units of resident
    files and gave up at its 28 ms allowance ("probe abandoned with 0/2 landed; resident
    8/8; waited 0.0285 s of 0.0282 s"); lease 1's probes landed in 29 ms. A resident
    probe may wait up to 15 % of the recompute; one not known resident, only the
    allowance."""
    model = CostModel(chunk_size=256, unit_bytes=SESSION13_UNIT_BYTES, parallel=8)
    for tokens in (256, 1024, 4096, 8192, 16384):
        model.prefill.observe(tokens, 0.0, 0.002 + 0.5632 / 16384 * tokens)
    assert model.storage.samples == 0
    recompute = model.recompute_chunks_s(0, 64)
    assert recompute is not None
    allowance = model.wait_allowance_s(0, 64, 0)
    for waited, resident, expected in [
        (allowance + 0.001, True, True),
        (0.15 * recompute - 0.001, True, True),
        (0.15 * recompute + 0.001, True, False),
        (allowance + 0.001, None, False),
        (allowance + 0.001, False, False),
    ]:
        wait, _ = model.may_wait(
            "probe", waited, waited, 0, 64, 0, 2, first_round_resident=resident
        )
        assert wait is expected, (waited, resident)
