"""Model shapes the speed benchmarks build (random weights, `load_format="dummy"`):
their config.json, KV bytes per token and page size."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}

DRAFT_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}

# Llama-3.2-1B's KV geometry (16 layers, 8 KV heads x 64, hidden 2048), drafter of 2 layers.
SMALL = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}

SMALL_DRAFT = {**SMALL, "num_hidden_layers": 2}

TINY = {  # a smoke-test shape (CPU dry run), not a benchmark
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

SHAPES = {"llama8b": (LLAMA8B, DRAFT_SHAPE), "small": (SMALL, SMALL_DRAFT), "tiny": (TINY, TINY)}

BLOCK_SIZE = 16  # vLLM's default on CUDA: a page holds K and V of 16 tokens

VOCAB = 128256


def write_config(path: Path, shape: dict[str, int], max_len: int) -> str:
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


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    """K and V, bf16, every layer."""
    return 2 * 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]


def page_bytes(shape: dict[str, int]) -> int:
    """One layer's page: K and V of a block, bf16."""
    return kv_bytes_per_token({**shape, "num_hidden_layers": 1}) * BLOCK_SIZE
