"""Prompts of the divergent-successor plan (``accept --divergent-successors``).

An EAGLE/MTP drafter's KV at position p depends on the S tokens after p (S = 1,
or the module count of multi-module MTP). A stored chunk therefore carries its S
successor tokens, and a request whose tokens after the chunk first differ from
them at successor j may reuse the chunk only up to ``chunk_end + j - S``.

The plan stores each base prompt (the writer), then runs, per position j, the
same prompt with the token at ``boundary + j`` replaced (``boundary``: a chunk
boundary inside the shared prefix). Each such request should be restored up to
``boundary + j - S`` tokens, with the outputs and acceptance of a fresh run of
the very same prompt (run first, under its own cache salt, so that nothing it
stores is reused).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_draft_offload.bench.fixtures.data import FIRST_WORD_ID

# Base prompts end in 16 random tokens and a 16-token cue (build_prompts): the
# divergence goes before them, into the shared prefix.
PROMPT_TAIL = 32


def successor_positions(successors: int) -> list[int]:
    """The successor positions j the plan diverges at: 0, 1 and S - 1."""
    return sorted({j for j in (0, 1, successors - 1) if 0 <= j < successors})


def divergence_boundary(prompt_tokens: int, chunk_size: int, successors: int) -> int:
    """The last chunk boundary whose S successors lie before the prompt's tail."""
    boundary = (prompt_tokens - PROMPT_TAIL - successors) // chunk_size * chunk_size
    if boundary < chunk_size:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} leaves no whole chunk of {chunk_size} tokens "
            f"before the last {PROMPT_TAIL + successors}"
        )
    return boundary


def diverge(prompt: list[int], boundary: int, j: int, vocab_size: int) -> list[int]:
    """``prompt`` with the token at ``boundary + j`` replaced by another word."""
    out = list(prompt)
    words = vocab_size - FIRST_WORD_ID
    out[boundary + j] = FIRST_WORD_ID + (out[boundary + j] - FIRST_WORD_ID + 1) % words
    return out


def expected_hit(boundary: int, j: int, successors: int) -> int:
    """Tokens a restore of the diverged prompt reuses (DraftOffloadConnector's rule)."""
    return boundary + j - successors


def draft_successors(method: str, model: str, k: int) -> int:
    """S: tokens after a position its draft KV depends on (as vLLM and the connector
    derive it): EAGLE/EAGLE3/MTP 1, multi-module MTP num_speculative_tokens."""
    if method in ("eagle", "eagle3"):
        return 1
    if method != "mtp":
        raise SystemExit(
            f"--divergent-successors needs an EAGLE-family or MTP drafter, not {method}"
        )
    config = json.loads((Path(model) / "config.json").read_text())
    return k if min(int(config.get("num_nextn_predict_layers", 1)), k) > 1 else 1
