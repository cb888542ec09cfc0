"""decode-overhead's timed batches: their prompts (the same in every engine, new to each
batch), the order of a pair's ``on`` and ``off`` arms, and each arm's request options."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_draft_offload.bench.speed.decode_configs import STORING
from vllm_draft_offload.bench.speed.shapes import VOCAB

FIRST_TOKEN = 500  # token ids below this are left alone (specials of real vocabularies)
OFF_REP_OFFSET = 1000  # an off batch's prompts: batch_prompts(OFF_REP_OFFSET + rep)


def tokens(seed: int, n: int) -> list[int]:
    """``n`` random token ids, the same for a seed in every configuration."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(FIRST_TOKEN, VOCAB - 1000, n)]


def batch_prompts(rep: int, batch: int, length: int) -> list[list[int]]:
    """Batch ``rep``'s prompts (rep -1: the warm-up): new to every engine and rep."""
    return [tokens(1_000_003 * (rep + 2) + i, length) for i in range(batch)]


def batch_arms(reps: int, paired: bool) -> list[tuple[int, str]]:
    """The timed batches of an engine, in order: (rep, arm). Paired, each rep runs an
    ``on`` and an ``off`` batch, in the order on-off, off-on, on-off, ... so that a
    drift over the engine's life weighs on both arms alike."""
    if not paired:
        return [(rep, "on") for rep in range(reps)]
    return [
        (rep, arm)
        for rep in range(reps)
        for arm in (("on", "off") if rep % 2 == 0 else ("off", "on"))
    ]


def arm_prompts(rep: int, arm: str, batch: int, length: int) -> list[list[int]]:
    """An arm's prompts: ``on`` batches get ``batch_prompts(rep)`` (the same in every
    engine), ``off`` batches prompts of their own (new to the engine: no prefix hit)."""
    return batch_prompts(rep if arm == "on" else OFF_REP_OFFSET + rep, batch, length)


def arm_params(config: str, arm: str) -> dict[str, Any] | None:
    """An arm's ``kv_transfer_params``: an ``off`` batch of an engine that stores opts
    out of stores (request_options.py), so the pair differs by the stores alone; every
    other batch is plain (in ``none``, ``idle``, ``null`` and ``native`` engines the
    pair measures the method's own noise)."""
    if arm == "off" and config in STORING:
        return {"draft_offload": {"store": False}}
    return None
