"""Mamba / linear-attention state (Qwen3-Next, Nemotron-H shapes): units carry the
state at their chunk's end where vLLM materialized one (docs/hybrid.md).

The simulated engine (kv_sim.SimSetup.mamba, tests/mamba_sim.py) has two Mamba
groups, a full-attention group with the MTP/EAGLE head, and vLLM's own
MambaManager in "align" mode deciding which block holds which state. Where a hit
ends is checked against vLLM's own prefix cache (what it would reuse itself), the
block a restore writes against the manager's ``last_state_block_idx``, and every
state the simulated forward reads against a fresh prefill's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from kv_sim import SimEngine, SimSetup, groups_managed_by, prompt
from mamba_sim import MAMBA_LAYERS, expected_state
from vllm import SamplingParams
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request

from vllm_draft_offload.config import ConfigError, parse_config
from vllm_draft_offload.geometry import build_unit_layout, check_state_groups
from vllm_draft_offload.hit_logic import StoredUnitView, match_prefix

BLOCK = 16
DRAFTERS = {"eagle": {"eagle_method": "eagle"}, "mtp": {"eagle_method": "mtp"}}


def engine(model_dirs: tuple[Path, Path], **kwargs: object) -> SimEngine:
    kwargs = {"eagle": True, "mamba": True, "chunk_size": BLOCK, **kwargs}
    return SimEngine(*model_dirs, SimSetup(**kwargs))  # type: ignore[arg-type]


def vllm_own_hit(eng: SimEngine, tokens: list[int]) -> int:
    """Tokens vLLM's own prefix cache would reuse for `tokens` (its Mamba manager finds
    a state where the hit ends, or shortens it)."""
    probe = Request(
        request_id="probe",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=eng.block_hasher,
    )
    _, hit, *_ = eng.scheduler.kv_cache_manager.get_computed_blocks(probe)
    return hit


def all_released(eng: SimEngine) -> None:
    sched = eng.scheduler.connector.scheduler
    assert sched.pins.held() == 0
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


def serve_restored(eng: SimEngine, req_id: str, tokens: list[int], max_tokens: int) -> int:
    """Empty the GPU cache, serve `tokens`: check at its load that the state lands in
    the block vLLM's Mamba manager takes the hit's state from, and that it holds the
    state a fresh prefill has there. Returns the tokens hit."""
    eng.evict_gpu_kv()
    null_before = eng.null_block_bytes()
    eng.add_request(req_id, tokens, max_tokens=max_tokens)
    loads_before = len(eng.load_metas)
    checked = False
    while req_id in eng.scheduler.requests and not checked:
        eng.step()
        jobs = [job for meta in eng.load_metas[loads_before:] for job in meta.loads]
        if not jobs and eng.scheduler.requests[req_id].num_computed_tokens == 0:
            continue
        checked = True
        assert eng.mismatched_positions(req_id) == []
        hit = eng.scheduler.connector.scheduler.restored_tokens(req_id)
        if not hit:
            assert not jobs
            break
        (job,) = jobs
        table = eng.scheduler.kv_cache_manager.get_block_ids(req_id)
        for g, group_id, manager in groups_managed_by(eng, MambaManager):
            # vLLM's own bookkeeping: the new request's hit state is its block
            # `last_state_block_idx`, which the model runner copies the state from.
            index = manager.last_state_block_idx[req_id]
            assert index == hit // BLOCK - 1
            assert job.gpu_blocks[g] == [table[group_id][index]]
            for name in MAMBA_LAYERS:
                if eng.group_of[name] == group_id:
                    page = eng.state.page(name, table[group_id][index]).numpy().tobytes()
                    assert page == expected_state(name, tuple(tokens[:hit]))
    eng.run_until_done()
    assert eng.state.bad_reads == []
    assert eng.null_block_bytes() == null_before
    all_released(eng)
    return eng.external_hits[req_id]


@pytest.mark.parametrize("chunk_size", [BLOCK, 2 * BLOCK])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_restore_is_exact_and_ends_where_vllm_keeps_the_state(
    model_dirs: tuple[Path, Path], drafter: str, chunk_size: int
) -> None:
    """Store, overwrite every block, load: the hit ends where vLLM's own prefix cache
    would end it (the state vLLM materialized at the prompt's checkpoint), the state
    lands where vLLM's Mamba manager reads it, every attention position of every
    layer (draft included) and every state read is a fresh prefill's, outputs equal."""
    eng = engine(model_dirs, chunk_size=chunk_size, **DRAFTERS[drafter])
    tokens = prompt(1, 116)  # vLLM's checkpoint: 116 // 16 * 16 - 16 (EAGLE drop) = 96
    eng.add_request("a", tokens, max_tokens=8)
    eng.run_until_done()
    own = vllm_own_hit(eng, tokens)
    assert own == 96
    assert serve_restored(eng, "b", tokens, max_tokens=8) == own
    assert eng.outputs["b"] == eng.outputs["a"]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_decode_states_make_the_next_turn_hit_deeper(
    model_dirs: tuple[Path, Path], drafter: str
) -> None:
    """With vLLM retaining every block boundary's state (prefix_cache_retention_interval
    None), decode materializes a state at each boundary; the store of a chunk ending
    there waits for its successor tokens while vLLM frees that block, so the block is
    held. The next turn hits at the last one: a block deeper than vLLM's own prefix
    cache, which drops the last block for the EAGLE/MTP head where the successor rule
    keeps it."""
    eng = engine(model_dirs, retention_interval=None, **DRAFTERS[drafter])
    first = prompt(2, 100)
    eng.add_request("a", first, max_tokens=40)
    eng.run_until_done()
    stored = {entry.unit_id: entry.has_state for entry in eng.scheduler.connector.scheduler.index}
    assert sum(stored.values()) >= 3  # the prompt's checkpoint and decode boundaries
    follow_up = first + eng.outputs["a"] + prompt(3, 20)
    own = vllm_own_hit(eng, follow_up)
    assert own == 112  # 139 tokens computed: 8 full blocks, less the EAGLE block
    reference = engine(model_dirs, retention_interval=None, **DRAFTERS[drafter])
    reference.add_request("fresh", follow_up, max_tokens=6)
    reference.run_until_done()
    assert serve_restored(eng, "c", follow_up, max_tokens=6) == 128
    assert eng.outputs["c"] == reference.outputs["fresh"]


def test_a_hit_is_shortened_to_a_stored_state(model_dirs: tuple[Path, Path]) -> None:
    """vLLM's default retention keeps a state at the prompt's checkpoint only. A prompt
    sharing more than that with a stored one hits exactly at the checkpoint; one whose
    successor tokens differ there (the hit would end inside the chunk) gets no hit, as
    with vLLM's own prefix cache: a state exists at no earlier chunk end."""
    eng = engine(model_dirs, eagle_method="mtp")
    first = prompt(4, 100)  # checkpoint at 80
    eng.add_request("a", first, max_tokens=4)
    eng.run_until_done()
    longer = first[:96] + prompt(5, 30)
    diverging = first[:81] + prompt(6, 30)  # successors of the chunk ending at 80 differ
    own = {name: vllm_own_hit(eng, tokens) for name, tokens in (("l", longer), ("d", diverging))}
    assert own == {"l": 80, "d": 0}
    assert serve_restored(eng, "l", longer, max_tokens=4) == 80
    assert serve_restored(eng, "d", diverging, max_tokens=4) == 0


def test_a_state_replaces_a_stored_unit_without_one(model_dirs: tuple[Path, Path]) -> None:
    """A chunk stored without a state (no step ended there) is stored again when another
    request materializes the state at its end: its end becomes a hit end."""
    eng = engine(model_dirs, eagle_method="mtp")
    first = prompt(7, 100)  # checkpoint at 80: the chunk ending at 96 has no state
    eng.add_request("a", first, max_tokens=4)
    eng.run_until_done()
    index = eng.scheduler.connector.scheduler.index
    assert [entry.has_state for entry in index] == [False] * 4 + [True, False]
    second = first[:100] + prompt(8, 12)  # 112 tokens: its checkpoint is at 96
    assert serve_restored(eng, "b", second, max_tokens=4) == 80
    assert sum(entry.has_state for entry in index) == 2  # 80 and, now, 96
    third = first[:100] + prompt(9, 20)
    assert serve_restored(eng, "c", third, max_tokens=4) == 96


def test_match_prefix_ends_only_at_a_unit_with_the_state() -> None:
    """The hit rule alone: the last unit with the state at its end, never inside a chunk."""
    chunk = 16
    tokens = list(range(10, 10 + 6 * chunk))
    keys = [bytes([i]) for i in range(6)]
    with_state = {1, 3}

    def lookup(
        key: bytes, successors: tuple[int, ...]
    ) -> tuple[StoredUnitView | None, StoredUnitView | None]:
        index = key[0]
        if index == 4:  # stored with other successors: the hit would end inside it
            return None, StoredUnitView(index, (0,), index in with_state)
        return StoredUnitView(index, successors, index in with_state), None

    def hit(start: int, states: bool) -> tuple[int, int]:
        match = match_prefix(keys, tokens, start, chunk, 1, lookup, 2, needs_state=states)
        return match.start_token, match.end_token

    assert hit(0, states=False) == (0, 5 * chunk - 1)  # one token into chunk 4
    assert hit(0, states=True) == (0, 4 * chunk)  # chunk 3 holds the state at 64
    assert hit(4 * chunk, states=True) == (4 * chunk, 4 * chunk)  # nothing further
    with_state.discard(3)
    assert hit(0, states=True) == (0, 2 * chunk)
    with_state.clear()
    assert hit(0, states=True) == (0, 0)


def _with_mode(eng: SimEngine, mode: str) -> object:
    config = dataclasses.replace(eng.kv_cache_config)
    config.kv_cache_groups = [
        dataclasses.replace(
            group, kv_cache_spec=dataclasses.replace(group.kv_cache_spec, mamba_cache_mode=mode)
        )
        if isinstance(group.kv_cache_spec, MambaSpec)
        else group
        for group in eng.kv_cache_config.kv_cache_groups
    ]
    assert all(isinstance(g, KVCacheGroupSpec) for g in config.kv_cache_groups)
    return config


@pytest.mark.parametrize("mode", ["none", "all"])
def test_other_mamba_modes_are_refused_naming_the_mode(
    model_dirs: tuple[Path, Path], mode: str
) -> None:
    """vLLM 0.33 keeps a state per block boundary only in "align" mode ("none": one
    running state per request, updated in place); any other mode is refused at start."""
    eng = engine(model_dirs)
    config = _with_mode(eng, mode)
    with pytest.raises(ConfigError, match=f"mamba_cache_mode='{mode}'") as error:
        build_unit_layout(config, BLOCK)  # type: ignore[arg-type]
    assert "KV-cache group 0" in str(error.value)
    if mode == "none":
        assert "updated in place" in str(error.value)
    assert build_unit_layout(eng.kv_cache_config, BLOCK).state_groups == (0, 1)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"l3": {"enabled": True}}, "kv_connector_extra_config.l3"),
        ({"audit_recompute_fraction": 0.5}, "kv_connector_extra_config.audit_recompute_fraction"),
    ],
)
def test_what_cannot_carry_the_state_is_refused(
    model_dirs: tuple[Path, Path], extra: dict[str, object], field: str
) -> None:
    eng = engine(model_dirs)
    config = parse_config({"cpu_bytes_to_use": 1 << 30, "chunk_size": BLOCK, **extra})
    with pytest.raises(ConfigError, match=field):
        check_state_groups(eng.kv_cache_config, config)


def test_stored_and_loaded_chunks_count_units_without_the_state(
    model_dirs: tuple[Path, Path],
) -> None:
    """The chunk counters count every unit a store or load moves, also the units whose
    first group (a Mamba group) has no page because no state was kept at their end."""
    eng = engine(model_dirs, eagle_method="mtp")
    tokens = prompt(13, 100)  # checkpoint at 80: units 0..4 end with no state but 4's
    eng.add_request("a", tokens, max_tokens=4)
    eng.run_until_done()
    index = eng.scheduler.connector.scheduler.index
    stored = eng.take_published()["chunks"]["store/cpu"]
    assert stored == len(list(index)) == 6
    assert serve_restored(eng, "b", tokens, max_tokens=4) == 80
    assert eng.take_published()["chunks"]["load/cpu"] == 80 // BLOCK
