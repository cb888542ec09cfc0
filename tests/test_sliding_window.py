"""Sliding-window (hybrid) models: units hold what a restore of the window needs.

The simulated engine is Gemma-3-like (kv_sim.SimSetup.sliding_window): one target
layer attends over a sliding window, one over everything, and vLLM's own
SlidingWindowManager frees blocks that leave the window (to its null block).
What a unit stores and a restore loads is checked against that manager's
bookkeeping (the blocks it keeps, ``get_num_skipped_tokens``), not against our rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_sim import SimEngine, SimSetup, groups_managed_by, prompt
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

from vllm_draft_offload.geometry import build_unit_layout
from vllm_draft_offload.hit_logic import StoredUnitView, match_prefix
from vllm_draft_offload.windows import NULL_BLOCK

WINDOW = 32
CHUNK = 64  # twice the window, like gpt-oss's 128-token window in 256-token chunks
# (drafter, speculative method): a draft_model self-draft mirrors the hybrid target;
# EAGLE (S=1) and MTP (S=2, and vLLM retains one extra token below the window) add a
# full-attention head.
DRAFTERS = {
    "draft_model": {},
    "eagle": {"eagle": True},
    "mtp": {"eagle": True, "eagle_method": "mtp"},
}


def engine(model_dirs: tuple[Path, Path], **kwargs: object) -> SimEngine:
    kwargs = {"sliding_window": WINDOW, "chunk_size": CHUNK, **kwargs}
    return SimEngine(*model_dirs, SimSetup(**kwargs))


def all_released(eng: SimEngine) -> None:
    """No hold on vLLM's blocks outlives the requests: every block is free again."""
    sched = eng.scheduler.connector.scheduler
    assert sched.pins.held() == 0
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


def restore_and_compare(
    eng: SimEngine, req_id: str, tokens: list[int], reference: str, max_tokens: int
) -> int:
    """Empty the GPU cache, serve `tokens` again: every restored position holds a
    fresh prefill's KV, the outputs equal `reference`'s and every held block is
    released. Returns the tokens hit."""
    eng.evict_gpu_kv()
    eng.add_request(req_id, tokens, max_tokens=max_tokens)
    eng.run_prefill(req_id)
    assert eng.mismatched_positions(req_id) == []
    eng.run_until_done()
    assert eng.outputs[req_id] == eng.outputs[reference]
    all_released(eng)
    return eng.external_hits[req_id]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_round_trip_is_bit_exact_for_every_layer_of_every_group(
    model_dirs: tuple[Path, Path], drafter: str
) -> None:
    """Store, overwrite every GPU block (the null block too), load: every position
    vLLM keeps, in every layer of every group, target and draft, holds a fresh
    prefill's KV, nothing wrote the null block, and the outputs equal the fresh run."""
    eng = engine(model_dirs, **DRAFTERS[drafter])
    tokens = prompt(2, 4 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=4)
    eng.run_until_done()
    all_released(eng)
    eng.evict_gpu_kv()
    null_before = eng.null_block_bytes()
    eng.add_request("restored", tokens, max_tokens=4)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 4 * CHUNK
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    assert eng.null_block_bytes() == null_before
    all_released(eng)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_restore_of_a_prompt_stored_after_its_window_moved_on(
    model_dirs: tuple[Path, Path], drafter: str
) -> None:
    """The chunk ending on the prompt's last token is stored a step late under EAGLE
    and MTP (its successors are the first sampled tokens), after vLLM freed the
    blocks leaving the window. The same prompt again ends its hit 2 tokens early and
    needs those positions: before the fix they came back as vLLM's null block
    (wrong KV, other outputs); now they are held for the store."""
    eng = engine(model_dirs, **DRAFTERS[drafter])
    tokens = prompt(1, 4 * CHUNK)
    eng.add_request("fresh", tokens, max_tokens=4)
    eng.run_until_done()
    all_released(eng)
    assert restore_and_compare(eng, "restored", tokens, "fresh", 4) == 4 * CHUNK - 2


@pytest.mark.parametrize("drafter", ["draft_model", "eagle"])
def test_next_turn_restores_through_chunks_stored_while_decoding(
    model_dirs: tuple[Path, Path], drafter: str
) -> None:
    """Multi-turn: decode chunks are stored a step or more after the window left
    their first pages. A next turn (prompt, answer, new text) restores through them."""
    eng = engine(model_dirs, **DRAFTERS[drafter])
    first = prompt(3, CHUNK + 7)
    eng.add_request("turn1", first, max_tokens=2 * CHUNK)
    eng.run_until_done()
    turn2 = [*first, *eng.outputs["turn1"], *prompt(4, 20)]
    eng.add_request("recomputed", turn2, max_tokens=4)
    sched = eng.scheduler.connector.scheduler
    lookup = sched.get_num_new_matched_tokens
    sched.get_num_new_matched_tokens = lambda request, computed: (0, False)
    eng.run_until_done()
    sched.get_num_new_matched_tokens = lookup
    assert restore_and_compare(eng, "turn2", turn2, "recomputed", 4) >= 3 * CHUNK


def test_a_chunk_whose_window_pages_vllm_never_allocated_is_not_stored(
    model_dirs: tuple[Path, Path],
) -> None:
    """EAGLE, other successor: the hit ends one token before the chunk's end, so
    vLLM allocates that chunk's window from one token later than its unit holds. A
    unit for the new successor cannot be copied (its first window page is the null
    block): it is not stored, nor any later chunk of the request (unreachable), and
    the request still computes the right thing."""
    eng = engine(model_dirs, eagle=True)
    sched = eng.scheduler.connector.scheduler
    stored = prompt(7, 4 * CHUNK + 9)
    eng.add_request("first", stored, max_tokens=2)
    eng.run_until_done()
    units = len(sched.index)
    other = [*stored[: 4 * CHUNK], 999, *prompt(8, 2 * CHUNK)]
    given_up: list[str] = []
    give_up = sched.pins.give_up
    sched.pins.give_up = lambda req_id: (given_up.append(req_id), give_up(req_id))
    eng.evict_gpu_kv()
    eng.add_request("other", other, max_tokens=2)
    eng.run_until_done()
    assert eng.external_hits["other"] == 4 * CHUNK - 1
    assert given_up and set(given_up) == {"other"}
    assert len(sched.index) == units  # no variant of chunk 3, nothing after it
    assert restore_and_compare(eng, "again", other, "other", 2) == 4 * CHUNK - 1


def test_units_hold_exactly_what_vllm_keeps_for_a_restore(model_dirs: tuple[Path, Path]) -> None:
    """Stored pages: for each point a hit can end at (the chunk's end, and up to
    min_compute_tokens before it), the blocks vLLM's SlidingWindowManager keeps
    for a request that has computed that many tokens, and nothing else. Loaded
    pages: exactly the blocks vLLM allocated for the restore (non-null)."""
    eng = engine(model_dirs)  # draft_model: hits end at a chunk's end or 2 tokens before
    sched = eng.scheduler.connector.scheduler
    slack = sched.min_compute_tokens
    assert slack == 2 and sched.num_successors == 0
    layout = sched.layout
    tokens = prompt(5, 4 * CHUNK)
    eng.add_request("fresh", tokens, max_tokens=2)
    stores = []
    while eng.scheduler.has_requests():
        out = eng.scheduler.schedule()
        stores += [job for job in out.kv_connector_metadata.stores if job.num_pages]
        eng.execute(out)
    groups = groups_managed_by(eng, SlidingWindowManager)
    assert len(groups) == 1  # the target's and the self-draft's window layers share it
    g, _, manager = groups[0]
    block_size = manager.block_size
    per_chunk = CHUNK // block_size
    stored_pages = sorted(
        (page // layout.groups[g].pages_per_unit, page % layout.groups[g].pages_per_unit)
        for job in stores
        for page in job.host_pages[g]
    )
    assert len({slot for slot, _ in stored_pages}) == 4  # one unit per chunk

    def kept_pages(chunk: int, end: int) -> set[int]:
        """Pages of `chunk` vLLM keeps for a request with `end` computed tokens."""
        first_block = manager.get_num_skipped_tokens(end) // block_size
        return {
            b - chunk * per_chunk
            for b in range(first_block, -(-end // block_size))
            if chunk * per_chunk <= b < (chunk + 1) * per_chunk
        }

    for chunk in range(4):
        end = (chunk + 1) * CHUNK
        needed = set().union(
            *(kept_pages(chunk, e) for e in range(end - slack, end + 1)),
            *(kept_pages(chunk, e) for e in range(end + 1, 4 * CHUNK + 1)),
        )
        held = {
            page + layout.groups[g].first_page for page in range(layout.groups[g].pages_per_unit)
        }
        assert held == needed, chunk
    assert layout.groups[g].pages_per_unit < per_chunk  # out-of-window pages are not stored

    eng.evict_gpu_kv()
    eng.load_metas.clear()
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 4 * CHUNK - slack
    (load,) = [job for meta in eng.load_metas for job in meta.loads]
    table = eng.scheduler.kv_cache_manager.get_block_ids("restored")
    for g, group in enumerate(layout.groups):
        allocated = [b for b in table[group.group_id][: -(-(4 * CHUNK - slack) // block_size)]]
        assert sorted(load.gpu_blocks[g]) == sorted(b for b in allocated if b != NULL_BLOCK)
        assert NULL_BLOCK not in load.gpu_blocks[g]


def test_a_hit_ending_where_units_lack_the_window_is_shortened(
    model_dirs: tuple[Path, Path],
) -> None:
    """Units laid out for hits ending only at chunk ends (slack 0) cannot restore a
    hit that ends 2 tokens early: it is cut back to the last chunk end whose window
    they hold, never served with holes. With the slack the hit rules need it is not."""
    eng = engine(model_dirs)
    tokens = prompt(6, 3 * CHUNK)

    def lookup(key: bytes, successors: tuple[int, ...]):
        return StoredUnitView(key, successors), None

    keys = [bytes([i]) for i in range(3)]
    for slack, expected_end in ((0, 2 * CHUNK), (2, 3 * CHUNK - 2)):
        layout = build_unit_layout(eng.kv_cache_config, CHUNK, hit_slack=slack)
        match = match_prefix(keys, tokens, 0, CHUNK, 0, lookup, 2, can_end=layout.restorable)
        assert match.end_token == expected_end, slack
        assert layout.restorable(0, match.end_token)
    assert not build_unit_layout(eng.kv_cache_config, CHUNK).restorable(0, 3 * CHUNK - 2)


@pytest.mark.parametrize("kind", ["mamba_none", "chunked_local"])
def test_groups_it_cannot_restore_are_refused_at_start_by_type(
    model_dirs: tuple[Path, Path], kind: str
) -> None:
    """A group it cannot restore stops the engine at start: chunked local attention
    named by its type, Mamba state outside vLLM's "align" mode by its mode (align
    itself is restored: tests/test_mamba_state.py)."""
    from kv_sim import make_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
    )

    from vllm_draft_offload.config import ConfigError
    from vllm_draft_offload.connector import DraftOffloadConnector

    vllm_config = make_vllm_config(*model_dirs, SimSetup())
    vllm_config.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] = 1 << 24
    shape = {"block_size": 16, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
    other = (
        MambaSpec(
            block_size=16,
            shapes=((8, 32), (4, 64)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="none",  # one running state per request, no boundary states
        )
        if kind == "mamba_none"
        else ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64)
    )
    specs = {"model.layers.0.self_attn.attn": FullAttentionSpec(**shape), "model.layers.1.x": other}
    groups = get_kv_cache_groups(vllm_config, specs)
    config = get_kv_cache_config_from_groups(vllm_config, groups, 4096 * 100)
    assert other.prefix_cacheable
    if kind == "mamba_none":
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(
                ConfigError, match="group 1 \\(model.layers.1.x\\) has mamba_cache_mode='none'"
            ):
                DraftOffloadConnector(vllm_config, role, config)
        return
    name = type(other).__name__
    with pytest.raises(ConfigError, match=f"group 1 \\(model.layers.1.x\\) holds {name}"):
        DraftOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, config)
    worker = DraftOffloadConnector(vllm_config, KVConnectorRole.WORKER, config)
    with pytest.raises(ConfigError, match=name):
        worker.register_kv_caches({})


def test_copy_plans_never_name_the_null_block(model_dirs: tuple[Path, Path]) -> None:
    """The worker refuses (recompute) a copy plan naming vLLM's null block, which
    is block 0 in vLLM's BlockPool."""
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    eng = engine(model_dirs)
    assert (
        NULL_BLOCK == NULL_BLOCK_ID == eng.scheduler.kv_cache_manager.block_pool.null_block.block_id
    )
    worker = eng.worker.worker
    region = worker.regions[0]
    from vllm_draft_offload.transfers import layer_descriptors

    with pytest.raises(ValueError, match="null block"):
        layer_descriptors(region, worker.pool, [0, 1], [5, NULL_BLOCK], to_host=False)
    assert layer_descriptors(region, worker.pool, [0], [5], to_host=False).num_bytes > 0


def test_held_blocks_are_bounded_and_released(model_dirs: tuple[Path, Path]) -> None:
    """A request whose stores stall holds the window pages of at most MAX_CHUNKS
    chunks ahead of its next store, and gives them back."""
    from vllm_draft_offload.window_pins import MAX_CHUNKS, WindowPins

    eng = engine(model_dirs)
    sched = eng.scheduler.connector.scheduler
    pool = eng.scheduler.kv_cache_manager.block_pool
    pins = WindowPins(sched.layout)
    pins.bind(pool)
    ((g, group_id, _),) = groups_managed_by(eng, SlidingWindowManager)
    group = sched.layout.groups[g]
    blocks = pool.get_new_blocks(8 * group.blocks_per_chunk)
    table = [[] for _ in eng.kv_cache_config.kv_cache_groups]
    table[group_id] = [b.block_id for b in blocks]
    free = pool.get_num_free_blocks()
    pins.track("r", 0, 8 * CHUNK, tuple(table))
    assert pins.held() == MAX_CHUNKS * group.pages_per_unit
    # vLLM frees the request's blocks: the held ones stay out of the pool.
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == free + len(blocks) - pins.held()
    freed = [[NULL_BLOCK] * len(row) for row in table]
    overlaid = pins.block_table("r", tuple(freed))
    assert sum(b != NULL_BLOCK for b in overlaid[group_id]) == pins.held()
    # Chunk 0 was found stored, chunks 1 and 6 are stored now: the job holds what it
    # reads (chunk 6 was not held while waiting; its blocks are still the request's).
    table6 = [list(row) for row in overlaid]
    row = table6[group_id]
    start = 6 * group.blocks_per_chunk
    row[start : start + group.blocks_per_chunk] = table[group_id][
        start : start + group.blocks_per_chunk
    ]
    for block in blocks[start : start + group.blocks_per_chunk]:
        pool.touch([block])  # as if the request still held chunk 6's blocks
    taken = pins.settle("r", [1, 6], next_chunk=7, block_ids=tuple(table6))
    assert len(taken) == 2 * group.pages_per_unit
    assert pins.held() == 0  # chunks 2 and 3 are below next_chunk now: released
    pool.free_blocks(blocks[start : start + group.blocks_per_chunk])
    pins.release(taken)
    pins.forget("r")
    assert pins.held() == 0 and pool.get_num_free_blocks() == free + len(blocks)


# (name, layers, every n-th layer full attention, window, KV heads, head size, chunk)
SHAPES = [
    ("gpt-oss-20b-like", 24, 2, 128, 8, 64, 256),
    ("Gemma-3 fixture (6 layers, 5:1)", 6, 6, 128, 2, 64, 256),
    ("Gemma-3-27B-like", 62, 6, 1024, 16, 128, 256),
    ("Gemma-3-27B-like", 62, 6, 1024, 16, 128, 2048),
]


def unit_bytes_by_group(
    vllm_config: object, layers: int, every: int, window: int, heads: int, head: int, chunk: int
) -> tuple[int, int, int, int]:
    """(bytes of one full-attention layer in a unit, of one sliding-window layer,
    whole unit, whole unit if every page were stored), from vLLM's own grouping and
    placement of bf16 KV in 16-token blocks, hits ending up to 2 tokens early."""
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    shape = {"block_size": 16, "num_kv_heads": heads, "head_size": head, "dtype": torch.bfloat16}
    specs = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(**shape)
        if (i + 1) % every == 0
        else SlidingWindowSpec(**shape, sliding_window=window)
        for i in range(layers)
    }
    groups = get_kv_cache_groups(vllm_config, specs)  # type: ignore[arg-type]
    page = FullAttentionSpec(**shape).page_size_bytes
    config = get_kv_cache_config_from_groups(vllm_config, groups, page * layers * 64)  # type: ignore[arg-type]
    layout = build_unit_layout(config, chunk, hit_slack=2)
    by_kind = {
        isinstance(specs[slot.name], SlidingWindowSpec): slot.nbytes for slot in layout.layers
    }
    full_unit = build_unit_layout(config, chunk, hit_slack=chunk).unit_bytes  # no window cut
    return by_kind[False], by_kind[True], layout.unit_bytes, full_unit


def test_unit_bytes_by_group(model_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    """Bytes per unit of a sliding-window layer next to a full-attention layer, at
    real shapes (vLLM's own grouping and placement): the README's table (pytest -s)."""
    from kv_sim import make_vllm_config

    vllm_config = make_vllm_config(*model_dirs, SimSetup())
    lines = ["| shape | chunk | window | full-attention layer | sliding-window layer | unit |"]
    for name, layers, every, window, heads, head, chunk in SHAPES:
        full, sliding, unit, uncut = unit_bytes_by_group(
            vllm_config, layers, every, window, heads, head, chunk
        )
        lines.append(
            f"| {name} | {chunk} | {window} | {full // 1024} KiB | {sliding // 1024} KiB "
            f"({sliding / full:.2f}) | {unit / 2**20:.1f} MiB ({unit / uncut:.2f} of every page) |"
        )
        assert sliding <= full and unit <= uncut
        # A window shorter than the chunk stores only the window's pages.
        assert (sliding < full) == (window - 1 + 2 <= chunk - 16), name
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_fingerprint_names_the_window_cut_only_where_there_is_one(
    model_dirs: tuple[Path, Path],
) -> None:
    """Full-attention layouts keep the fingerprint (and so the keys) they had before
    windows were handled; a window group's cut is part of its fingerprint."""
    plain = SimEngine(*model_dirs, SimSetup()).kv_cache_config
    assert (
        build_unit_layout(plain, 32, hit_slack=0).fingerprint()
        == build_unit_layout(plain, 32, hit_slack=5).fingerprint()
    )
    hybrid = engine(model_dirs).kv_cache_config
    cuts = {build_unit_layout(hybrid, CHUNK, hit_slack=s).fingerprint() for s in (0, 2, 40)}
    assert len(cuts) == 3


def _shape_specs(shape: dict, is_draft: bool, prefix: str) -> dict[str, object]:
    """vLLM's KV-cache spec of each attention layer of a restore-speed shape."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    geometry = {
        "block_size": 16,
        "num_kv_heads": shape["num_key_value_heads"],
        "head_size": shape["head_dim"],
        "dtype": torch.bfloat16,
    }
    kinds = shape.get("layer_types", ["full_attention"] * shape["num_hidden_layers"])
    return {
        f"{prefix}.layers.{i}.self_attn.attn": SlidingWindowSpec(
            **geometry, sliding_window=shape["sliding_window"]
        )
        if kind == "sliding_attention"
        else FullAttentionSpec(**geometry, is_draft=is_draft)
        for i, kind in enumerate(kinds)
    }


def test_gptoss_shape_keeps_its_drafter_in_one_group(model_dirs: tuple[Path, Path]) -> None:
    """vLLM 0.33's proposer asserts that every drafter layer sits in one KV-cache group.
    The restore-speed gpt-oss-20b-like shape and its drafter pass vLLM's own grouping
    (16 full-attention layers against 12 window layers: one group each); a drafter of
    twice the layers would be split, as a CPU engine showed (the assertion, with no
    connector too)."""
    from kv_sim import make_vllm_config
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    from vllm_draft_offload.bench.speed.shapes import SHAPES

    vllm_config = make_vllm_config(*model_dirs, SimSetup())
    target, draft = SHAPES["gptoss20b"]

    def draft_groups(draft_shape: dict) -> int:
        specs = {
            **_shape_specs(target, False, "model"),
            **_shape_specs(draft_shape, True, "draft_model.model"),
        }
        groups = get_kv_cache_groups(vllm_config, specs)  # type: ignore[arg-type]
        return sum(
            any(name.startswith("draft_model.") for name in group.layer_names) for group in groups
        )

    assert draft_groups(draft) == 1
    assert draft_groups({**draft, "num_hidden_layers": 8}) > 1
