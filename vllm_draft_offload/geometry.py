"""Which KV layers make up a stored unit, and how their bytes are laid out.

Everything here is derived from the `KVCacheConfig` vLLM hands to both the
scheduler and the workers, never from model-config arithmetic: the set of
layers is what vLLM actually allocated, drafter layers included, with each
layer's own page size (a drafter may differ from the target in heads, head
size or dtype, and may sit in its own group with its own block size).

The scheduler's copy of the config replaces per-layer specs of a mixed group
with one representative spec, so page sizes are read from
`kv_cache_tensors` (the placement both sides share), not from specs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_draft_offload.config import ConfigError, DraftOffloadConfig
from vllm_draft_offload.windows import (
    NULL_BLOCK,
    first_unit_page,
    group_reach,
    is_state_group,
    restore_pages,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

DRAFT_MODEL_PREFIX = "draft_model."


@dataclass(frozen=True)
class LayerSlot:
    """One layer's region inside a unit: its group's `pages_per_unit` pages back to back."""

    name: str
    group_id: int
    page_bytes: int
    offset: int  # byte offset inside the unit
    nbytes: int  # pages_per_unit * page_bytes
    is_draft: bool


@dataclass(frozen=True)
class GroupLayout:
    group_id: int
    block_size: int
    blocks_per_chunk: int
    is_eagle_group: bool
    layer_names: tuple[str, ...]
    # Sliding window: tokens before a hit's end whose KV a restore needs (windows.py);
    # None for full attention.
    reach: int | None = None
    # The first page of its chunk a unit holds (0 for full attention).
    first_page: int = 0
    # Mamba / linear-attention state ("align" mode): a unit holds the chunk's last
    # page, the state at the chunk's end, when vLLM materialized one (windows.py).
    state: bool = False

    @property
    def pages_per_unit(self) -> int:
        return self.blocks_per_chunk - self.first_page

    def host_page(self, slot: int, page: int) -> int:
        """Index of a chunk page in the host pool: slot * pages_per_unit + page in unit."""
        return slot * self.pages_per_unit + page - self.first_page


@dataclass(frozen=True)
class UnitLayout:
    """Byte layout of one chunk's unit: every offloaded layer of every group."""

    chunk_size: int
    groups: tuple[GroupLayout, ...]
    layers: tuple[LayerSlot, ...]
    unit_bytes: int
    kv_cache_layout: str

    @property
    def draft_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers if layer.is_draft)

    @property
    def target_bytes(self) -> int:
        return self.unit_bytes - self.draft_bytes

    @property
    def has_eagle_group(self) -> bool:
        return any(group.is_eagle_group for group in self.groups)

    @property
    def state_groups(self) -> tuple[int, ...]:
        """Layout indices of the Mamba / linear-attention state groups."""
        return tuple(g for g, group in enumerate(self.groups) if group.state)

    def add_unit_pages(
        self,
        host_pages: list[list[int]],
        gpu_blocks: list[list[int]],
        slot: int,
        chunk: int,
        block_ids: tuple[list[int], ...],
        skip_freed: bool = False,
        state_blocks: dict[int, int] | None = None,
    ) -> bool:
        """Pair every page a chunk's unit holds with its GPU block, per group (stores,
        compares). A page whose block vLLM has freed (its null block) cannot be copied:
        the call adds nothing and returns False, or with `skip_freed` leaves that page out.

        A state group's page is the block vLLM named for the state at the chunk's end
        (`state_blocks`, by layout group index), never a position in the block table;
        without one for every state group the unit holds no state (`unit_has_state`)."""
        with_state = self.unit_has_state(state_blocks)
        pairs: list[list[tuple[int, int]]] = []
        for g, group in enumerate(self.groups):
            if group.state:
                row = []
                if with_state:
                    assert state_blocks is not None
                    block = state_blocks[g]
                    assert block != NULL_BLOCK, "vLLM named its null block as a state"
                    row.append((group.host_page(slot, group.first_page), block))
                pairs.append(row)
                continue
            blocks = block_ids[group.group_id]
            row = []
            for page in range(group.first_page, group.blocks_per_chunk):
                index = chunk * group.blocks_per_chunk + page
                block = blocks[index] if index < len(blocks) else NULL_BLOCK
                if block == NULL_BLOCK:
                    if not skip_freed:
                        return False
                    continue
                row.append((group.host_page(slot, page), block))
            pairs.append(row)
        for g, row in enumerate(pairs):
            host_pages[g] += [page for page, _ in row]
            gpu_blocks[g] += [block for _, block in row]
        return True

    def unit_has_state(self, state_blocks: dict[int, int] | None) -> bool:
        """Whether a unit stored with these state blocks holds the state of every state
        group (a layout without one: trivially)."""
        return all(g in (state_blocks or {}) for g in self.state_groups)

    def add_restore_pages(
        self,
        host_pages: list[list[int]],
        gpu_blocks: list[list[int]],
        slot: int,
        chunk: int,
        block_ids: tuple[list[int], ...],
        first_token: int,
        end_token: int,
    ) -> None:
        """Pair a chunk's host pages with the GPU blocks a restore of [first, end) writes:
        for a sliding-window group, only the blocks vLLM allocated (windows.py)."""
        for g, group in enumerate(self.groups):
            for page in restore_pages(
                chunk,
                self.chunk_size,
                group.block_size,
                group.reach,
                first_token,
                end_token,
                group.state,
            ):
                host_pages[g].append(group.host_page(slot, page))
                gpu_blocks[g].append(
                    block_ids[group.group_id][chunk * group.blocks_per_chunk + page]
                )

    def restorable(self, first_token: int, end_token: int) -> bool:
        """Whether units hold every page a restore of [first, end) writes, in every group."""
        if end_token <= first_token:
            return True
        if self.state_groups and end_token % self.chunk_size:
            return False  # a state exists only at a chunk's end (windows.py)
        chunks = range(first_token // self.chunk_size, -(-end_token // self.chunk_size))
        return all(
            not pages or pages.start >= group.first_page
            for group in self.groups
            if group.first_page and not group.state
            for chunk in chunks
            for pages in (
                restore_pages(
                    chunk, self.chunk_size, group.block_size, group.reach, first_token, end_token
                ),
            )
        )

    def fingerprint(self) -> str:
        """Identity of the byte layout: two engines share units only if equal."""
        desc = {
            "chunk_size": self.chunk_size,
            "layout": self.kv_cache_layout,
            # A window group's part of a unit is named by its window (what a full-attention
            # group's was stays as it was: units stored before windows were handled keep
            # their keys).
            "groups": [
                [g.block_size, g.blocks_per_chunk, g.is_eagle_group]
                + ([g.reach, g.first_page] if g.reach is not None else [])
                + (["state", g.first_page] if g.state else [])
                for g in self.groups
            ],
            "layers": [
                [layer.name, layer.group_id, layer.page_bytes, layer.is_draft]
                for layer in self.layers
            ],
        }
        return hashlib.blake2b(json.dumps(desc).encode(), digest_size=16).hexdigest()


def _page_bytes(tensor: KVCacheTensor, num_blocks: int) -> int:
    # Layer-outermost placement gives each layer a contiguous region
    # (layer_stride = page * num_blocks); block-outermost packs all layers of a
    # block together (layer_stride = page).
    if len(tensor.layers) == 1 or tensor.layer_stride >= tensor.block_stride * num_blocks:
        return tensor.block_stride
    return tensor.layer_stride


def transferable_group_ids(kv_cache_config: KVCacheConfig) -> list[int]:
    """Groups whose KV is prefix-cached and transferable: the ones a hit covers."""
    return [
        group_id
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        if group.enable_kv_transfer
        and not group.host_resident
        and group.kv_cache_spec.prefix_cacheable
    ]


def check_state_groups(kv_cache_config: KVCacheConfig, config: DraftOffloadConfig) -> None:
    """Refuse, at start, what cannot carry a Mamba / linear-attention group's state
    (and any Mamba mode but "align", naming it)."""
    state_groups = [
        group_id
        for group_id in transferable_group_ids(kv_cache_config)
        if is_state_group(group_id, kv_cache_config.kv_cache_groups[group_id])
    ]
    if not state_groups:
        return
    what = f"KV-cache group {state_groups[0]} holds Mamba / linear-attention state"
    if config.l3.enabled:
        raise ConfigError(
            f"kv_connector_extra_config.l3: the storage tier does not carry Mamba / "
            f"linear-attention state yet ({what}); turn it off for this model"
        )
    if config.audit_recompute_fraction > 0:
        raise ConfigError(
            f"kv_connector_extra_config.audit_recompute_fraction: the recompute audit "
            f"compares per-token KV only ({what}); set it to 0 for this model"
        )


def is_draft_layer_name(name: str, draft_layer_names: frozenset[str]) -> bool:
    return name in draft_layer_names or name.startswith(DRAFT_MODEL_PREFIX)


def build_unit_layout(
    kv_cache_config: KVCacheConfig,
    chunk_size: int,
    draft_layer_names: frozenset[str] = frozenset(),
    hit_slack: int = 0,
) -> UnitLayout:
    """Lay out one chunk of every offloaded layer, target and draft.

    `draft_layer_names` comes from the worker's forward context where known;
    the `draft_model.` prefix marks standalone drafters on either side.
    `hit_slack`: how many tokens before a chunk's end a hit into it may end
    (hit_end_slack); a sliding-window group's unit holds what such a restore needs.
    """
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    page_by_layer: dict[str, int] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        page = _page_bytes(tensor, kv_cache_config.num_blocks_of(tensor))
        for name in tensor.layers:
            page_by_layer[name] = page

    groups: list[GroupLayout] = []
    layers: list[LayerSlot] = []
    offset = 0
    for group_id in transferable_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[group_id]
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        state = is_state_group(group_id, group)  # refuses Mamba modes we cannot restore
        reach = None if state else group_reach(group_id, group)  # refuses the rest
        block_size = spec.block_size
        if chunk_size % block_size:
            raise ConfigError(
                f"kv_connector_extra_config.chunk_size={chunk_size} must be a multiple of "
                f"KV-cache group {group_id}'s block size {block_size}"
            )
        blocks_per_chunk = chunk_size // block_size
        first_page = first_unit_page(chunk_size, block_size, reach, hit_slack, state)
        for name in group.layer_names:
            if name not in page_by_layer:
                raise ConfigError(f"KV layer {name!r} has no KV-cache tensor placement")
            page = page_by_layer[name]
            layer_spec = specs.get(name)
            if layer_spec is not None and layer_spec.page_size_bytes > page:
                raise ConfigError(f"KV layer {name!r}: page larger than its placement")
            nbytes = (blocks_per_chunk - first_page) * page
            is_draft = is_draft_layer_name(name, draft_layer_names) or bool(
                layer_spec is not None and layer_spec.is_draft
            )
            layers.append(LayerSlot(name, group_id, page, offset, nbytes, is_draft))
            offset += nbytes
        groups.append(
            GroupLayout(
                group_id,
                block_size,
                blocks_per_chunk,
                group.is_eagle_group,
                tuple(group.layer_names),
                reach,
                first_page,
                state,
            )
        )
    if not layers:
        raise ConfigError("DraftOffloadConnector found no transferable KV layers")
    return UnitLayout(
        chunk_size=chunk_size,
        groups=tuple(groups),
        layers=tuple(layers),
        unit_bytes=offset,
        kv_cache_layout=str(kv_cache_config.kv_cache_layout),
    )


def successor_tokens_needed(vllm_config: VllmConfig, has_eagle_group: bool) -> int:
    """How many tokens after a chunk its stored draft KV depends on.

    EAGLE/EAGLE3/MTP build draft KV at position i from token i+1; multi-module
    MTP reads up to num_speculative_tokens ahead. A standalone draft model
    depends only on the prefix. The method is read from the speculative config
    as well as `is_eagle_group`, because vLLM leaves groups unflagged when the
    block drop is disabled, and a stale draft position would go unnoticed.
    """
    spec = vllm_config.speculative_config
    needs = has_eagle_group
    if spec is not None and spec.needs_eagle_block_drop():
        needs = True
    if not needs:
        return 0
    if spec is not None and spec.use_multi_module_mtp():
        return int(spec.num_speculative_tokens)
    return 1


def default_min_compute_tokens(vllm_config: VllmConfig) -> int:
    """Tokens a restored request should compute itself (measured on vLLM 0.33).

    vLLM's proposers treat a request whose first step computes a single token
    like a decode step and waste its first draft: restored-prefix acceptance
    came out at 0.92 of fresh on the CPU fixtures (draft_model and EAGLE3) with
    one computed token, 1.00 with two. Without a drafter one token is enough.
    """
    return 2 if vllm_config.speculative_config is not None else 1


@dataclass(frozen=True)
class HitRules:
    """Where hits may end; both connector halves derive it, so their layouts agree."""

    num_successors: int  # tokens after a chunk its draft KV depends on
    min_compute_tokens: int  # tokens a restored request computes itself

    @property
    def hit_slack(self) -> int:
        """How many tokens before a chunk's end a hit into it may end: the successor
        rule ends it up to `num_successors` early, the prompt's end up to
        `min_compute_tokens` (hit_logic.match_prefix)."""
        return max(self.num_successors, self.min_compute_tokens, 1)


def hit_rules(
    vllm_config: VllmConfig, config: DraftOffloadConfig, kv_cache_config: KVCacheConfig
) -> HitRules:
    has_eagle_group = any(
        kv_cache_config.kv_cache_groups[group_id].is_eagle_group
        for group_id in transferable_group_ids(kv_cache_config)
    )
    return HitRules(
        config.successor_tokens
        if config.successor_tokens is not None
        else successor_tokens_needed(vllm_config, has_eagle_group),
        config.min_compute_tokens or default_min_compute_tokens(vllm_config),
    )
