"""Mamba / linear-attention state in the simulated engine (`kv_sim.SimSetup.mamba`).

The model is Qwen3-Next / Nemotron-H shaped: target layers that keep a recurrent
state (conv state + SSM state, as vLLM's MambaBase lays them out in one page),
full-attention target layers, and an MTP/EAGLE head (full attention). The cache
config is what vLLM's own config code makes of it with prefix caching on
(MambaModelConfig.verify_and_update_config: mamba_cache_mode "align",
mamba_block_size = block_size; the platform pads the Mamba page to the attention
page), and the spec is built as MambaBase.get_kv_cache_spec builds it.

`StateForward` is vLLM's align-mode model runner for the state
(mamba_utils.preprocess_mamba): a request's running state lives in block
``cdiv(computed + scheduled, block_size) - 1`` of each Mamba group; when that index
moves, the previous block's state is copied there first (for a new request the
previous block is ``(num_computed_tokens - 1) // block_size``, where a prefix hit's
state is); then the step reads the state, advances it over the step's tokens and
writes it back. A state read that is not the one a fresh prefill has at that
position propagates (the next state is wrong too) and changes the sampled token,
as a wrong SSM state would.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING

import torch
from vllm.model_executor.models.config import MambaModelConfig
from vllm.v1.kv_cache_interface import MambaSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MAMBA_LAYERS = [f"model.layers.{i}.linear_attn" for i in range(6)]
# (conv state, SSM state): shapes and dtypes of one layer's state, vLLM's order.
STATE_SHAPES = ((8, 3), (2, 8, 16))
STATE_DTYPES = (torch.bfloat16, torch.float32)
STATE_BYTES = sum(
    prod(shape) * dtype.itemsize for shape, dtype in zip(STATE_SHAPES, STATE_DTYPES, strict=True)
)


def configure_cache(vllm_config: VllmConfig, attention_page_bytes: int) -> None:
    """What vLLM's config code does for a hybrid Mamba model with prefix caching."""
    MambaModelConfig.verify_and_update_config(vllm_config)
    cache = vllm_config.cache_config
    assert cache.mamba_cache_mode == "align" and cache.mamba_block_size == cache.block_size
    # platforms/interface.py (update_block_size_for_backend): the Mamba page is padded
    # to exactly the attention page, so one block pool serves both.
    assert attention_page_bytes >= STATE_BYTES
    cache.mamba_page_size_padded = attention_page_bytes


def mamba_spec(vllm_config: VllmConfig) -> MambaSpec:
    """As MambaBase.get_kv_cache_spec (model_executor/layers/mamba/abstract.py) builds it."""
    cache = vllm_config.cache_config
    assert cache.mamba_block_size is not None
    return MambaSpec(
        shapes=STATE_SHAPES,
        dtypes=STATE_DTYPES,
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=vllm_config.num_speculative_tokens,
    )


def expected_state(name: str, prefix: tuple[int, ...]) -> bytes:
    """A layer's (conv, SSM) state after `prefix`, as the page's first STATE_BYTES."""
    from kv_sim import kv_value

    parts = []
    for i, (shape, dtype) in enumerate(zip(STATE_SHAPES, STATE_DTYPES, strict=True)):
        value = kv_value(f"{name}/state{i}", prefix)
        values = value + torch.arange(prod(shape), dtype=torch.float32) % 4
        parts.append(values.to(dtype).view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def wrong_state(name: str, read: bytes, tokens: tuple[int, ...]) -> bytes:
    """The state after advancing a wrong one: still wrong (differs from every fresh one)."""
    import hashlib

    digest = hashlib.blake2b(read + repr((name, tokens)).encode(), digest_size=16).digest()
    return (digest * (STATE_BYTES // 16 + 1))[:STATE_BYTES]


class StateForward:
    """The state half of the simulated forward, per request (see the module doc)."""

    def __init__(
        self,
        kv_caches: list[dict[str, torch.Tensor]],
        group_of: dict[str, int],
        block_size: int,
    ) -> None:
        self.rank_kv_caches = kv_caches
        self.group_of = group_of
        self.block_size = block_size
        self.state_idx: dict[str, int] = {}  # vLLM's mamba_state_idx
        # (request, layer, position) of every state read that was not a fresh prefill's.
        self.bad_reads: list[tuple[str, str, int]] = []

    def forget(self, req_ids: object) -> None:
        """mamba_utils.cleanup_mamba_state_idx: finished, preempted, resumed requests."""
        for req_id in req_ids:  # type: ignore[attr-defined]
            self.state_idx.pop(req_id, None)

    def page(self, name: str, block: int, rank: int = 0) -> torch.Tensor:
        """The state bytes of `name`'s page in `block` (a view)."""
        assert block != 0, f"{name}: a state in vLLM's null block"
        return self.rank_kv_caches[rank][name][block].view(-1)[:STATE_BYTES]

    def step(
        self, req_id: str, start: int, end: int, tokens: list[int], block_ids: tuple[list[int], ...]
    ) -> bytes:
        """Advance the request's state over [start, end); return every layer's state
        after it (what the sampled token depends on)."""
        block = self.block_size
        prev = self.state_idx.get(req_id, (start - 1) // block)
        curr = -(-end // block) - 1
        self.state_idx[req_id] = curr
        after = []
        for name in MAMBA_LAYERS:
            table = block_ids[self.group_of[name]]
            for rank in range(len(self.rank_kv_caches)):
                if prev not in (-1, curr):
                    self.page(name, table[curr], rank).copy_(self.page(name, table[prev], rank))
                if start == 0:
                    ok, read = True, b""
                else:
                    read = self.page(name, table[curr], rank).numpy().tobytes()
                    ok = read == expected_state(name, tuple(tokens[:start]))
                    if not ok:
                        self.bad_reads.append((req_id, name, start))
                new = (
                    expected_state(name, tuple(tokens[:end]))
                    if ok
                    else wrong_state(name, read, tuple(tokens[start:end]))
                )
                target = self.page(name, table[curr], rank)
                target.copy_(torch.frombuffer(bytearray(new), dtype=torch.uint8).view(torch.int8))
            after.append(self.page(name, table[curr]).numpy().tobytes())
        return b"".join(after)

    def wrong_states(
        self, req_id: str, tokens: list[int], computed: int, block_ids: tuple[list[int], ...]
    ) -> list[str]:
        """Layers whose running state is not a fresh prefill's after `computed` tokens."""
        idx = self.state_idx.get(req_id)
        if idx is None or computed == 0:
            return []
        return [
            name
            for name in MAMBA_LAYERS
            if self.page(name, block_ids[self.group_of[name]][idx]).numpy().tobytes()
            != expected_state(name, tuple(tokens[:computed]))
        ]
