"""Sampled recompute audit, end to end through the real vLLM Scheduler on CPU tensors.

An audited request gets no hit, so vLLM recomputes its prefix; the stored units
its lookup found are compared with the recomputed KV after the drafter's
forward. The simulated model writes the same KV for the same prefix, so a clean
unit compares equal and a planted corruption is the only possible difference.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from kv_sim import SimEngine, SimSetup, prompt
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from vllm_draft_offload.audit import (
    DEFAULT_TOLERANCE,
    comparable_dtype,
    is_sampled,
    relative_error,
    tolerance_for,
)
from vllm_draft_offload.chunk_keys import ChunkKeyChain
from vllm_draft_offload.config import ConfigError, parse_config
from vllm_draft_offload.connector import DraftOffloadConnector
from vllm_draft_offload.cpu_index import UnitEntry
from vllm_draft_offload.geometry import LayerSlot
from vllm_draft_offload.scheduler_side import DraftOffloadScheduler

CHUNK = 32
FRACTION = 0.5


def request_ids(sampled: bool, count: int) -> list[str]:
    """Request ids the deterministic hash audits (or not) at FRACTION."""
    ids = [f"req-{i}" for i in range(200) if is_sampled(f"req-{i}", FRACTION) == sampled]
    return ids[:count]


AUDITED = request_ids(True, 2)
PLAIN = request_ids(False, 3)


def engine(model_dirs: tuple[Path, Path], eagle: bool = False, **extra: object) -> SimEngine:
    config = {"audit_recompute_fraction": FRACTION, **extra}
    return SimEngine(*model_dirs, SimSetup(eagle=eagle, extra_config=config))


def scheduler(eng: SimEngine) -> DraftOffloadScheduler:
    return eng.scheduler.connector.scheduler


def unit_of_chunk(eng: SimEngine, tokens: list[int], chunk: int) -> UnitEntry:
    """The stored unit of one chunk of `tokens`, with the successors the tokens give."""
    sched = scheduler(eng)
    key = ChunkKeyChain(sched.salt, CHUNK).extend(tokens)[chunk]
    end = (chunk + 1) * CHUNK
    entry = sched.index.get((key, tuple(tokens[end : end + sched.num_successors])))
    assert entry is not None and entry.ready
    return entry


def draft_layer(eng: SimEngine) -> LayerSlot:
    return next(slot for slot in eng.worker.worker.layout.layers if slot.is_draft)


def draft_bytes_of(eng: SimEngine, entry: UnitEntry) -> torch.Tensor:
    """The draft layer's bytes inside a stored host slot (a view: writes plant damage)."""
    draft = draft_layer(eng)
    unit = eng.worker.worker.pool.unit_view(entry.slot)
    return unit[draft.offset : draft.offset + draft.nbytes]


def store_then_forget_gpu(eng: SimEngine, req_id: str, tokens: list[int]) -> None:
    """Store `tokens` in the CPU tier, then leave nothing reusable on the GPU."""
    eng.add_request(req_id, tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.take_published()


def assert_no_pins(eng: SimEngine) -> None:
    sched = scheduler(eng)
    assert all(entry.pins == 0 for entry in sched.index._entries.values())
    assert not sched.audit._targets and not sched.audit._jobs


def test_request_ids_cover_both_sides() -> None:
    assert len(AUDITED) == 2 and len(PLAIN) == 3


@pytest.mark.parametrize("eagle", [False, True])
def test_clean_units_pass_and_stay_usable(model_dirs: tuple[Path, Path], eagle: bool) -> None:
    eng = engine(model_dirs, eagle=eagle)
    tokens = prompt(40, 3 * CHUNK + 5)
    store_then_forget_gpu(eng, PLAIN[0], tokens)
    units = [unit_of_chunk(eng, tokens, chunk).unit_id for chunk in range(3)]

    eng.add_request(AUDITED[0], tokens, max_tokens=2)
    eng.run_prefill(AUDITED[0])
    assert eng.external_hits[AUDITED[0]] == 0  # recomputed, not loaded
    assert eng.mismatched_positions(AUDITED[0]) == []
    published = eng.take_published()
    assert published["audit_recompute"] == {"ok": 3}
    assert published["fallbacks"] == {}
    assert "load/cpu" not in published["chunks"]
    assert_no_pins(eng)
    eng.run_until_done()
    assert eng.outputs[AUDITED[0]] == eng.outputs[PLAIN[0]]

    # The audited units still serve requests that are not audited.
    assert all(scheduler(eng).index.get(unit_id) is not None for unit_id in units)
    eng.evict_gpu_kv()
    eng.add_request(PLAIN[1], tokens, max_tokens=2)
    eng.run_prefill(PLAIN[1])
    assert eng.external_hits[PLAIN[1]] == 3 * CHUNK
    assert eng.mismatched_positions(PLAIN[1]) == []


def test_units_of_other_successors_are_not_compared(model_dirs: tuple[Path, Path]) -> None:
    """The last chunk's draft KV legitimately differs when the next token differs."""
    eng = engine(model_dirs, eagle=True)
    shared = prompt(41, 3 * CHUNK)
    stored_tokens = [*shared, 11, *prompt(42, 20)]
    store_then_forget_gpu(eng, PLAIN[0], stored_tokens)
    units = [unit_of_chunk(eng, stored_tokens, chunk).unit_id for chunk in range(3)]

    eng.add_request(AUDITED[0], [*shared, 12, *prompt(43, 20)], max_tokens=2)
    eng.run_prefill(AUDITED[0])
    assert eng.external_hits[AUDITED[0]] == 0
    published = eng.take_published()
    assert published["audit_recompute"] == {"ok": 2}  # chunks 0 and 1 only
    assert published["fallbacks"] == {}
    assert all(scheduler(eng).index.get(unit_id) is not None for unit_id in units)
    assert_no_pins(eng)


def test_planted_draft_corruption_is_caught_and_recomputed(
    model_dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    eng = engine(model_dirs)
    tokens = prompt(44, 3 * CHUNK + 5)
    store_then_forget_gpu(eng, PLAIN[0], tokens)
    victim = unit_of_chunk(eng, tokens, 1)
    healthy = [unit_of_chunk(eng, tokens, chunk).unit_id for chunk in (0, 2)]
    draft_values = draft_bytes_of(eng, victim).view(torch.bfloat16)
    draft_values[3] += 8.0  # one draft element; target layers untouched

    with caplog.at_level(logging.WARNING, logger="vllm_draft_offload.audit"):
        eng.add_request(AUDITED[0], tokens, max_tokens=2)
        eng.run_prefill(AUDITED[0])
    assert eng.external_hits[AUDITED[0]] == 0
    assert eng.mismatched_positions(AUDITED[0]) == []  # the corrupt unit was never loaded
    published = eng.take_published()
    assert published["audit_recompute"] == {"ok": 2, "mismatch": 1}
    assert published["fallbacks"] == {"audit_recompute_mismatch": 1}
    sched = scheduler(eng)
    assert sched.index.get(victim.unit_id) is None
    assert all(sched.index.get(unit_id) is not None for unit_id in healthy)
    assert_no_pins(eng)
    report = [r.getMessage() for r in caplog.records if victim.chunk_key.hex() in r.getMessage()]
    assert len(report) == 1
    assert f"draft layer(s) [{draft_layer(eng).name}] and target layer(s) []" in report[0]
    eng.run_until_done()
    assert eng.outputs[AUDITED[0]] == eng.outputs[PLAIN[0]]

    # A later request loads the chunk before the dropped one and recomputes the rest.
    eng.evict_gpu_kv()
    eng.add_request(PLAIN[1], tokens, max_tokens=2)
    eng.run_prefill(PLAIN[1])
    assert eng.external_hits[PLAIN[1]] == CHUNK
    assert eng.mismatched_positions(PLAIN[1]) == []


@pytest.mark.parametrize(("tolerance", "caught"), [(None, False), (1e-3, True)])
def test_drift_below_the_dtype_tolerance_passes(
    model_dirs: tuple[Path, Path], tolerance: float | None, caught: bool
) -> None:
    """One bf16 ulp on the largest draft element: rounding drift, not corruption."""
    eng = engine(model_dirs, audit_tolerance=tolerance)
    tokens = prompt(45, 3 * CHUNK + 5)
    store_then_forget_gpu(eng, PLAIN[0], tokens)
    victim = unit_of_chunk(eng, tokens, 1)
    draft_bytes = draft_bytes_of(eng, victim)
    largest = int(draft_bytes.view(torch.bfloat16).float().abs().argmax())
    draft_bytes.view(torch.int16)[largest] += 1  # next representable magnitude

    eng.add_request(AUDITED[0], tokens, max_tokens=2)
    eng.run_prefill(AUDITED[0])
    published = eng.take_published()
    if caught:
        assert published["audit_recompute"] == {"ok": 2, "mismatch": 1}
        assert scheduler(eng).index.get(victim.unit_id) is None
    else:
        assert published["audit_recompute"] == {"ok": 3}
        assert scheduler(eng).index.get(victim.unit_id) is not None


def test_pins_are_released_when_an_audited_request_ends_early(
    model_dirs: tuple[Path, Path],
) -> None:
    eng = engine(model_dirs)
    tokens = prompt(46, 20 * CHUNK + 3)  # more than one step's 512-token budget
    store_then_forget_gpu(eng, PLAIN[0], tokens)
    eng.add_request(AUDITED[1], tokens, max_tokens=2)
    compared = eng.step().num_scheduled_tokens[AUDITED[1]] // CHUNK
    assert 0 < compared < 20  # the other chunks are still to compare
    sched = scheduler(eng)
    assert sum(entry.pins for entry in sched.index._entries.values()) == 20 - compared
    eng.scheduler.finish_requests(AUDITED[1], RequestStatus.FINISHED_ABORTED)
    assert_no_pins(eng)
    eng.run_until_done()
    assert eng.take_published()["audit_recompute"] == {"ok": compared}
    assert len(sched.index) == 20


def test_off_by_default(model_dirs: tuple[Path, Path]) -> None:
    eng = SimEngine(*model_dirs, SimSetup())
    tokens = prompt(47, 3 * CHUNK + 5)
    store_then_forget_gpu(eng, AUDITED[0], tokens)
    eng.add_request(AUDITED[1], tokens, max_tokens=2)
    eng.run_prefill(AUDITED[1])
    assert eng.external_hits[AUDITED[1]] == 3 * CHUNK
    assert eng.take_published()["audit_recompute"] == {}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"audit_recompute_fraction": 1.5}, "audit_recompute_fraction"),
        ({"audit_recompute_fraction": -0.1}, "audit_recompute_fraction"),
        ({"audit_tolerance": -1e-3}, "audit_tolerance"),
    ],
)
def test_bad_audit_config_names_the_field(
    model_dirs: tuple[Path, Path], extra: dict[str, object], field: str
) -> None:
    eng = SimEngine(*model_dirs, SimSetup())
    eng.vllm_config.kv_transfer_config.kv_connector_extra_config = {
        "cpu_bytes_to_use": 1 << 30,
        **extra,
    }
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{field}:"):
        DraftOffloadConnector(eng.vllm_config, KVConnectorRole.SCHEDULER, eng.kv_cache_config)


def test_audit_config_defaults() -> None:
    config = parse_config({"cpu_bytes_to_use": 1})
    assert config.audit_recompute_fraction == 0.0 and config.audit_tolerance is None


# ------------------------------------------------------------ comparison rules


def test_sampling_is_deterministic_and_follows_the_fraction() -> None:
    ids = [f"chat-{i}" for i in range(2000)]
    picked = [is_sampled(req_id, 0.25) for req_id in ids]
    assert picked == [is_sampled(req_id, 0.25) for req_id in ids]
    assert 0.2 < sum(picked) / len(ids) < 0.3
    assert not any(is_sampled(req_id, 0.0) for req_id in ids)
    assert all(is_sampled(req_id, 1.0) for req_id in ids)


def test_relative_error_rules() -> None:
    fresh = torch.linspace(-4, 4, 256, dtype=torch.bfloat16)
    assert relative_error(fresh.clone(), fresh) == 0.0
    drifted = (fresh.view(torch.int16) + 1).view(torch.bfloat16)  # one ulp everywhere
    assert 0 < relative_error(drifted, fresh) <= 2**-7 < tolerance_for(torch.bfloat16, None)
    assert relative_error(drifted, fresh) > tolerance_for(torch.bfloat16, 1e-3)

    # A wrong ordinary value beside an outlier channel: normalising by the layer's
    # maximum (0.01 here) would let it pass.
    outlier = torch.ones(128, dtype=torch.float32)
    outlier[0] = 100.0
    wrong = outlier.clone()
    wrong[5] = 2.0
    assert relative_error(wrong, outlier) > DEFAULT_TOLERANCE[torch.float32] * 10

    # Rounding noise on near-zero elements is judged against the layer's RMS.
    tiny = torch.tensor([1.0, -1.0, 1e-6, 0.0])
    noisy = torch.tensor([1.0, -1.0, 2e-6, 1e-7])
    assert relative_error(noisy, tiny) < 1e-5

    nan = torch.tensor([1.0, float("nan")])
    assert relative_error(nan.clone(), nan) == 0.0
    assert relative_error(torch.tensor([1.0, 2.0]), nan) == float("inf")
    assert relative_error(torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 2.0])) == float(
        "inf"
    )


def test_fp8_one_step_passes_but_two_do_not() -> None:
    fresh = torch.tensor([1.0, -1.0, 1.0, -1.0]).to(torch.float8_e4m3fn)
    bits = fresh.view(torch.uint8)
    # 1.0 -> 1.125 -> 1.25: the coarsest relative step of e4m3 is 1/8.
    one_step = (bits + torch.tensor([1, 0, 0, 0], dtype=torch.uint8)).view(torch.float8_e4m3fn)
    two_steps = (bits + torch.tensor([2, 0, 0, 0], dtype=torch.uint8)).view(torch.float8_e4m3fn)
    tolerance = tolerance_for(torch.float8_e4m3fn, None)
    assert relative_error(one_step, fresh) <= tolerance < relative_error(two_steps, fresh)


def test_byte_formats() -> None:
    assert comparable_dtype(torch.bfloat16, "auto") == torch.bfloat16
    assert comparable_dtype(torch.uint8, "fp8") == torch.float8_e4m3fn
    assert comparable_dtype(torch.uint8, "fp8_e5m2") == torch.float8_e5m2
    # Packed formats carry scales beside the values: no element-wise tolerance.
    assert comparable_dtype(torch.uint8, "int4_per_token_head") is None
    assert comparable_dtype(torch.int8, "int8_per_token_head") is None
