"""Sliding-window groups: which of a chunk's pages a unit holds, and a restore loads.

vLLM 0.33's ``SlidingWindowManager`` keeps, for a request that has computed ``n``
tokens, the blocks from ``(n - reach) // block_size`` on, where ``reach =
sliding_window - 1 + extra_retained_tokens`` (``get_num_skipped_tokens``); the
entries before are freed and point at the null block (block 0), which every
request shares and which must stay zero (vLLM's worker points straddling KV
tiles at it). A restore that ends at token ``e`` is allocated exactly that way:
real blocks from ``(e - reach) // block_size`` on, nulls before. So a restore
loads exactly those blocks, whole (vLLM publishes them in its prefix cache under
their hashes), and never touches a null.

A hit into chunk ``k`` (end ``E``) ends at ``E`` or at most ``hit_slack`` tokens
before it (the successor rule and the tokens a request computes itself, see
hit_logic), and a hit ending in a later chunk needs even less of chunk ``k``. So
unit ``k`` holds the pages of its chunk covering ``[E - hit_slack - reach, E)``:
every hit can then be restored, and the rest of the chunk, out of every window a
restore needs, is neither stored nor expected. A group without a window (full
attention) holds every page.

A Mamba / linear-attention group (``MambaSpec``, vLLM's "align" cache mode) holds
no per-token KV but one state per block boundary that vLLM materialized; unit
``k`` holds that group's state at its chunk's end, when vLLM computed one there
(docs/hybrid.md): ``group_kind`` says which kind a group is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_draft_offload.config import ConfigError
from vllm_draft_offload.hit_logic import pages_for_chunk

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

# Why a prefix-cached group type cannot be restored (the refusal names it).
UNSUPPORTED = {
    "ChunkedLocalAttentionSpec": "chunked local attention frees blocks by attention chunk",
    "RSWASpec": "R-SWA frees blocks between the prompt and the decode window",
}

# vLLM's BlockPool reserves block 0 as its null block
# (vllm.v1.attention.backends.utils.NULL_BLOCK_ID; tests/test_sliding_window.py checks).
NULL_BLOCK = 0


# What a Mamba group's mamba_cache_mode lacks (docs/hybrid.md has the evidence).
MAMBA_MODE_REFUSALS = {
    "none": (
        "vLLM keeps one running state per request there, updated in place every step, "
        "and no state at any block boundary (MambaManager, vLLM's prefix caching off), "
        "so there is no state at a chunk's end to store or to restore; enable prefix "
        "caching, which makes vLLM use mamba_cache_mode='align'"
    ),
}


def is_state_group(group_id: int, group: KVCacheGroupSpec) -> bool:
    """Whether a group holds Mamba / linear-attention state (one page per block
    boundary, "align" mode) rather than per-token KV.

    Raises ConfigError naming the mode for a Mamba group in any other mode.
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = group.kv_cache_spec
    if not isinstance(spec, MambaSpec):
        return False
    mode = spec.mamba_cache_mode
    if mode != "align":
        why = MAMBA_MODE_REFUSALS.get(
            mode, "only the 'align' mode keeps a state per block boundary that a restore can use"
        )
        raise ConfigError(
            f"DraftOffloadConnector restores Mamba / linear-attention state only in "
            f"mamba_cache_mode='align'; KV-cache group {group_id} "
            f"({', '.join(group.layer_names[:3])}{', ...' if len(group.layer_names) > 3 else ''}"
            f") has mamba_cache_mode={mode!r}: {why}"
        )
    return True


def group_reach(group_id: int, group: KVCacheGroupSpec) -> int | None:
    """Tokens before a position whose KV a restore of this group needs (None: all).

    Raises ConfigError for prefix-cached groups we cannot restore correctly,
    naming the spec type: attention that frees blocks by another rule than a
    sliding window (chunked local attention, R-SWA), and any other type but a Mamba
    group (is_state_group handles those).
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        RSWASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    spec = group.kv_cache_spec
    specs = (
        list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    )
    reaches: list[int | None] = []
    for layer_spec in specs:
        if isinstance(layer_spec, SlidingWindowSpec):
            reaches.append(layer_spec.sliding_window - 1 + layer_spec.extra_retained_tokens)
        elif isinstance(layer_spec, FullAttentionSpec) and not isinstance(layer_spec, RSWASpec):
            reaches.append(None)
        else:
            kind = type(layer_spec).__name__
            what = UNSUPPORTED.get(kind, "KV it cannot restore")
            raise ConfigError(
                f"DraftOffloadConnector restores full-attention and sliding-window KV "
                f"only; KV-cache group {group_id} ({', '.join(group.layer_names[:3])}"
                f"{', ...' if len(group.layer_names) > 3 else ''}) holds {kind} ({what}), "
                "which is not supported yet"
            )
    if any(reach is None for reach in reaches):
        if any(reach is not None for reach in reaches):
            raise ConfigError(
                f"DraftOffloadConnector: KV-cache group {group_id} mixes sliding-window "
                "and full-attention layers"
            )
        return None
    # One block table serves the group: the widest window decides what is kept.
    return max(reach for reach in reaches if reach is not None)


def first_unit_page(
    chunk_size: int, block_size: int, reach: int | None, hit_slack: int, state: bool = False
) -> int:
    """The first page of its chunk a unit holds for a group (a state group: the
    chunk's last block, whose state is the one at the chunk's end)."""
    if state:
        return chunk_size // block_size - 1
    if reach is None:
        return 0
    return max(0, (chunk_size - hit_slack - reach) // block_size)


def restore_pages(
    chunk: int,
    chunk_size: int,
    block_size: int,
    reach: int | None,
    start_token: int,
    end_token: int,
    state: bool = False,
) -> range:
    """Pages of `chunk` a restore of [start_token, end_token) writes: those vLLM
    allocates real blocks for (every page of the range, for a group without a window;
    for a state group, the chunk's last page when the restore ends at its end: vLLM
    allocates one block for the state, at index end // block_size - 1)."""
    if state:
        last = chunk_size // block_size - 1
        chunk_end = (chunk + 1) * chunk_size
        return range(last, last + 1) if start_token < end_token == chunk_end else range(0)
    first = start_token if reach is None else max(start_token, end_token - reach)
    return pages_for_chunk(chunk, chunk_size, block_size, first, end_token)
