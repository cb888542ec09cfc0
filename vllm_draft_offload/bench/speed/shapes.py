"""Model shapes the speed benchmarks build (random weights, `load_format="dummy"`):
their config.json, KV bytes per token and page size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# A config.json's model fields: sizes, and for hybrid shapes `layer_types` and
# `sliding_window` (vLLM 0.33's Llama reads them per layer).
Shape = dict[str, Any]
SLIDING = "sliding_attention"

LLAMA8B: Shape = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}

DRAFT_SHAPE: Shape = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}

# Llama-3.2-1B's KV geometry (16 layers, 8 KV heads x 64, hidden 2048), drafter of 2 layers.
SMALL: Shape = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}

SMALL_DRAFT: Shape = {**SMALL, "num_hidden_layers": 2}

# gpt-oss-20b's attention layout: 24 layers alternating 128-token sliding-window and
# full attention, 8 KV heads x 64, hidden 2880, 64 query heads. As a dense Llama whose
# MLP is as wide as its 4 active experts (4 x 2880): the KV, its window groups and
# about its active compute per token, not its MoE routing or attention sinks.
GPTOSS20B: Shape = {
    "hidden_size": 2880,
    "intermediate_size": 4 * 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "layer_types": [SLIDING, "full_attention"] * 12,
}
# Its drafter: 4 full-attention layers of the target's KV geometry, so vLLM puts them in
# one group with the target's 12 full-attention layers (16 against 12 window layers is
# within vLLM 0.33's 1.5 x rule, as for gpt-oss-20b with EAGLE). A drafter of another
# geometry, or more layers, is split across groups, which vLLM's proposer refuses.
GPTOSS20B_DRAFT: Shape = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}

TINY: Shape = {  # a smoke-test shape (CPU dry run), not a benchmark
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

SHAPES: dict[str, tuple[Shape, Shape]] = {
    "llama8b": (LLAMA8B, DRAFT_SHAPE),
    "small": (SMALL, SMALL_DRAFT),
    "gptoss20b": (GPTOSS20B, GPTOSS20B_DRAFT),
    "tiny": (TINY, TINY),
}


def has_windows(shape: Shape) -> bool:
    return SLIDING in shape.get("layer_types", ())


def draft_model_config(draft: str | None) -> dict[str, Any] | None:
    """The speed benchmarks' speculative config: the DRAFT_SHAPE model at `draft` as a
    `draft_model` drafter proposing 3 tokens (None: no drafter)."""
    if not draft:
        return None
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}


BLOCK_SIZE = 16  # vLLM's default on CUDA: a page holds K and V of 16 tokens

VOCAB = 128256


def write_config(path: Path, shape: Shape, max_len: int) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        **shape,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _layer_bytes_per_token(shape: Shape) -> int:
    """K and V of one token in one layer, bf16."""
    return 2 * 2 * shape["num_key_value_heads"] * shape["head_dim"]


def kv_bytes_per_token(shape: Shape) -> int:
    """K and V, bf16, of every layer whose KV grows with the prefix: all of them, or
    with sliding windows the full-attention ones (a window layer holds at most its
    window, whatever the prefix)."""
    layers = shape["num_hidden_layers"]
    if has_windows(shape):
        layers = sum(kind != SLIDING for kind in shape["layer_types"])
    return layers * _layer_bytes_per_token(shape)


def page_bytes(shape: Shape) -> int:
    """One layer's page: K and V of a block, bf16."""
    return _layer_bytes_per_token(shape) * BLOCK_SIZE
