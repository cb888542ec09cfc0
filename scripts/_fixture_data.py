"""Synthetic copy corpus, offline tokenizer and shared-prefix prompts for the fixtures.

The corpus is built so that a model's greedy continuation depends on its KV cache:
each sequence is a chain of random token spans, and about half of the segments
copy an earlier stretch of the same sequence.  After a few tokens of a copy, the
rest is predictable only by looking back into the context (induction), so a drafter
whose KV for that context is wrong loses most of its accepted tokens.

Everything here is pure Python + numpy and deterministic given the numpy Generator.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import numpy as np

SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
FIRST_WORD_ID = len(SPECIAL_TOKENS)


@dataclass(frozen=True)
class CorpusSpec:
    """Shape of the synthetic copy corpus (stored in every fixture's meta)."""

    vocab_size: int
    min_span: int = 8
    max_span: int = 32
    p_copy: float = 0.5
    min_copy: int = 16
    max_copy: int = 256

    def __post_init__(self) -> None:
        if self.vocab_size <= FIRST_WORD_ID + 1:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no word tokens")
        if not (0 < self.min_span <= self.max_span and 0 < self.min_copy <= self.max_copy):
            raise ValueError(f"bad span/copy bounds in {self}")
        if not 0.0 <= self.p_copy < 1.0:
            raise ValueError(f"p_copy must be in [0, 1): {self.p_copy}")

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def for_length(self, length: int) -> CorpusSpec:
        """Shrink spans and copies for short training sequences, so a short
        sequence still holds several copy events (each one an induction lesson)."""
        max_span = min(self.max_span, max(self.min_span, length // 8))
        max_copy = min(self.max_copy, max(self.min_copy, length // 2))
        return replace(self, max_span=max_span, max_copy=max_copy)

    @classmethod
    def from_dict(cls, data: dict[str, float | int]) -> CorpusSpec:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})  # type: ignore[arg-type]


def random_span(rng: np.random.Generator, spec: CorpusSpec, length: int) -> list[int]:
    return rng.integers(FIRST_WORD_ID, spec.vocab_size, size=length).tolist()


def make_sequence(rng: np.random.Generator, length: int, spec: CorpusSpec) -> list[int]:
    """One training sequence: BOS, then random spans interleaved with copies of
    earlier stretches (source start uniform over the context: long-range copies).

    A copy's source ends at least ``min_copy`` tokens before the copy begins: a
    source right behind the copy would make a tandem repeat, and repeats of
    repeats grow into short loops that a drafter predicts from the last few
    tokens alone, without the context's KV.
    """
    seq: list[int] = [BOS_ID]
    while len(seq) < length:
        n = int(rng.integers(spec.min_copy, spec.max_copy + 1))
        latest = len(seq) - spec.min_copy - n  # last source start for a full, distant copy
        if latest >= 1 and rng.random() < spec.p_copy:
            start = int(rng.integers(1, latest + 1))
            seq.extend(seq[start : start + n])
        else:
            n = int(rng.integers(spec.min_span, spec.max_span + 1))
            seq.extend(random_span(rng, spec, n))
    return seq[:length]


def make_batch(rng: np.random.Generator, batch: int, length: int, spec: CorpusSpec) -> np.ndarray:
    return np.asarray([make_sequence(rng, length, spec) for _ in range(batch)], dtype=np.int64)


# ----------------------------------------------------------------------------- prompts


@dataclass
class PromptSet:
    """Prompts for the acceptance harness.

    ``base[i]`` = shared group prefix + a private tail that ends in a cue (the start
    of a copy of some stretch of the prefix), so the greedy continuation copies the
    prefix.  ``extended[i]`` = ``base[i]`` + a continuation with a second cue into
    the same prefix: it extends a cached prompt and again depends on the prefix KV.
    """

    base: list[list[int]]
    extended: list[list[int]]
    group_of: list[int]
    shared_prefix_len: int
    expected_copy: list[list[int]] = field(default_factory=list)

    def to_summary(self) -> dict[str, object]:
        return {
            "num_prompts": len(self.base),
            "num_groups": len(set(self.group_of)),
            "shared_prefix_len": self.shared_prefix_len,
            "base_lens": [len(p) for p in self.base],
            "extended_lens": [len(p) for p in self.extended],
        }


def _ngram_counts(tokens: list[int], n: int) -> Counter[tuple[int, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _cue(
    rng: np.random.Generator, prefix: list[int], cue_len: int, room: int
) -> tuple[int, list[int]]:
    """Pick a copy source in ``prefix`` with ``room`` tokens left after the cue.

    Prefers a source whose cue occurs once in the prefix (unambiguous) and whose
    continuation repeats no 8-gram (so the text to copy lies back in the prefix,
    not in the last few tokens, where a drafter could copy it without the prefix).
    """
    hi = len(prefix) - cue_len - room
    if hi <= 1:
        raise ValueError(
            f"prefix of {len(prefix)} tokens too short for a {cue_len}-token cue + {room} tokens"
        )
    cues = _ngram_counts(prefix, cue_len)
    for _ in range(200):
        start = int(rng.integers(1, hi + 1))
        cue = tuple(prefix[start : start + cue_len])
        region = prefix[start : start + cue_len + room]
        if cues[cue] == 1 and max(_ngram_counts(region, 8).values()) == 1:
            break
    return start, list(cue)


def build_prompts(
    spec: CorpusSpec,
    seed: int,
    num_prompts: int,
    prompt_tokens: int,
    prompts_per_group: int = 2,
    max_tokens: int = 64,
    cue_len: int = 16,
    gap_len: int = 16,
) -> PromptSet:
    """Deterministic shared-prefix prompts of exactly ``prompt_tokens`` tokens."""
    if num_prompts < 1 or prompts_per_group < 1:
        raise ValueError("num_prompts and prompts_per_group must be >= 1")
    tail_len = gap_len + cue_len
    shared_len = prompt_tokens - tail_len
    if shared_len < 2 * (cue_len + max_tokens):
        raise ValueError(
            f"prompt_tokens={prompt_tokens} too small for max_tokens={max_tokens}, cue={cue_len}"
        )
    rng = np.random.default_rng([seed, 0xACCE])
    num_groups = math.ceil(num_prompts / prompts_per_group)
    prefixes = [make_sequence(rng, shared_len, spec) for _ in range(num_groups)]
    base: list[list[int]] = []
    extended: list[list[int]] = []
    group_of: list[int] = []
    expected: list[list[int]] = []
    for i in range(num_prompts):
        g = i // prompts_per_group
        prefix = prefixes[g]
        start, cue = _cue(rng, prefix, cue_len, max_tokens)
        prompt = prefix + random_span(rng, spec, gap_len) + cue
        _, cue2 = _cue(rng, prefix, cue_len, max_tokens)
        base.append(prompt)
        extended.append(prompt + random_span(rng, spec, gap_len) + cue2)
        group_of.append(g)
        expected.append(prefix[start + cue_len : start + cue_len + max_tokens])
    return PromptSet(base, extended, group_of, shared_len, expected)


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(vocab_size: int, model_max_length: int):  # -> PreTrainedTokenizerFast
    """Offline WordLevel tokenizer: specials, then words ``w0 .. w{V-5}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=model_max_length,
    )
