"""The soak's load mix and the pressure run's request list, as token ids.

Pure Python + numpy (like `workloads.specs`, whose copy-corpus `TokenSource` builds
every prompt): each request ends in a cue into its own context, so the greedy answer
copies and the accepted draft tokens depend on the KV of that context.

Soak stream kinds (assigned round-robin over the streams):

* ``system``: one of a few shared system prompts + a new user turn (one-shot).
* ``chat``: multi-turn; the next turn is the previous prompt + the engine's answer +
  a new user turn (decode KV is reused), restarting after ``chat_turns`` turns.
* ``docqa``: a question about one of several documents that together exceed the GPU
  KV cache, so their prefixes come back from the CPU or storage tier.
* ``divergent``: a shared prefix ending on a chunk boundary, then a different next
  token per request (the successor rule of EAGLE-family units).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from vllm_draft_offload.bench.workloads.specs import TokenSource

KINDS: tuple[str, ...] = ("system", "chat", "docqa", "divergent")
Next = Callable[[list[int] | None], tuple[str, list[int], int] | None]


@dataclass(frozen=True)
class SoakLoad:
    """Sizes of the soak's load (defaults: the GPU run on the gpu-preset fixtures)."""

    streams: int = 64
    system_prompts: int = 4
    system_len: int = 2048
    chat_turns: int = 4
    user_len: int = 64
    docs: int = 8
    doc_len: int = 16384
    question_len: int = 32
    div_prefix: int = 4096
    div_cont: int = 32
    answer: int = 32
    chunk_size: int = 256
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SoakLoad:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def validate(self) -> None:
        if self.div_prefix % self.chunk_size:
            raise ValueError(f"div_prefix {self.div_prefix} % chunk_size {self.chunk_size} != 0")
        if min(self.user_len, self.question_len, self.div_cont) <= _cue(self):
            raise ValueError("user_len, question_len and div_cont must exceed the 16-token cue")

    def longest_request(self) -> int:
        chat = self.system_len + self.chat_turns * (self.user_len + self.answer)
        doc = self.doc_len + self.question_len + self.answer
        div = self.div_prefix + self.div_cont + self.answer
        return max(chat, doc, div) + 8


def _cue(load: SoakLoad) -> int:
    return max(2, min(16, load.user_len // 2, load.question_len // 2, load.div_cont // 2))


class SoakStreams:
    """Shared contexts and one generator closure per stream (deterministic per seed)."""

    def __init__(self, load: SoakLoad, vocab: int) -> None:
        load.validate()
        self.load, self.vocab = load, vocab
        src = TokenSource(vocab, load.seed, "soak-shared")
        self.systems = [src.text(load.system_len) for _ in range(load.system_prompts)]
        self.documents = [src.text(load.doc_len) for _ in range(load.docs)]
        self.div_prefix = src.text(load.div_prefix)

    def kind_of(self, stream: int) -> str:
        return KINDS[stream % len(KINDS)]

    def make(self, stream: int) -> Next:
        load, cue = self.load, _cue(self.load)
        src = TokenSource(self.vocab, load.seed, f"soak-stream-{stream}")
        kind = self.kind_of(stream)
        state: dict[str, Any] = {"prompt": None, "turn": 0}

        def pick(seq: list[list[int]]) -> list[int]:
            return seq[int(src.rng.integers(0, len(seq)))]

        def nxt(last: list[int] | None) -> tuple[str, list[int], int]:
            if kind == "system":
                ctx = pick(self.systems)
                return kind, ctx + src.turn(ctx, load.user_len, cue, load.answer), load.answer
            if kind == "docqa":
                ctx = pick(self.documents)
                q = src.turn(ctx, load.question_len, cue, load.answer)
                return kind, ctx + q, load.answer
            if kind == "divergent":
                # a different first token after the chunk-aligned prefix every time
                cont = src.turn(self.div_prefix, load.div_cont, cue, load.answer)
                return kind, self.div_prefix + cont, load.answer
            # chat: extend the previous prompt with the engine's own answer
            if state["prompt"] is None or last is None or state["turn"] >= load.chat_turns:
                ctx = pick(self.systems)
                state["turn"] = 0
            else:
                ctx = state["prompt"] + last
            prompt = ctx + src.turn(ctx, load.user_len, cue, load.answer)
            state["prompt"], state["turn"] = prompt, state["turn"] + 1
            return kind, prompt, load.answer

        return nxt


# ----------------------------------------------------------------------------- pressure


@dataclass(frozen=True)
class PressurePlan:
    """Request list of the pressure run: shared prefixes visited over several rounds.

    ``prefixes`` distinct chunk-aligned prefixes make the working set
    (``ws_factor`` x the GPU KV capacity). Each round visits every prefix once in a
    shuffled order (cold visits, mostly beyond the CPU tier's reach by the next round)
    and, after each cold visit, one of ``hot`` prefixes, whose reuse distance is
    beyond the GPU cache but within the CPU tier: both tiers evict, both hit.
    """

    streams: int
    prefix_len: int
    suffix_len: int
    answer: int
    rounds: int
    gpu_tokens: int
    prefixes: int
    hot: int
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def working_set_tokens(self) -> int:
        return self.prefixes * self.prefix_len


def plan_pressure(
    *,
    streams: int,
    prefix_len: int,
    suffix_len: int,
    answer: int,
    rounds: int,
    block_size: int,
    ws_factor: float,
    gpu_factor: float,
    seed: int,
) -> PressurePlan:
    """GPU capacity = ``gpu_factor`` x what the streams hold running (so they fit, barely)."""
    req = prefix_len + suffix_len + answer + 8
    gpu_tokens = math.ceil(gpu_factor * streams * req / block_size) * block_size
    prefixes = math.ceil(ws_factor * gpu_tokens / prefix_len)
    hot = max(1, math.ceil(0.65 * gpu_tokens / prefix_len))
    return PressurePlan(
        streams, prefix_len, suffix_len, answer, rounds, gpu_tokens, prefixes, hot, seed
    )


def pressure_requests(plan: PressurePlan, vocab: int) -> list[tuple[str, list[int], int]]:
    src = TokenSource(vocab, plan.seed, "pressure")
    prefixes = [src.text(plan.prefix_len) for _ in range(plan.prefixes)]
    cue = max(2, min(16, plan.suffix_len // 2))
    order_rng = np.random.default_rng(plan.seed)
    out: list[tuple[str, list[int], int]] = []
    for _ in range(plan.rounds):
        for j, i in enumerate(order_rng.permutation(plan.prefixes)):
            for kind, p in (("cold", prefixes[int(i)]), ("hot", prefixes[j % plan.hot])):
                out.append((kind, p + src.turn(p, plan.suffix_len, cue, plan.answer), plan.answer))
    return out
