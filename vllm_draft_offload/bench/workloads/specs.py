"""Sizes, prompts and engine configurations of the spec-decode offload benchmark.

Pure Python + numpy (no vllm, no torch) so that the parent process, the engine
worker subprocesses and the tests all build byte-identical prompts from the same
sizes and seed.

Prompts follow the fixtures' copy-corpus shape: random token spans interleaved with
copies of earlier stretches, and every request ends in a *cue* (the start of a
stretch of its own context). The greedy answer then continues copying out of the
context, so how many draft tokens are accepted depends on the KV of that context,
which is exactly what a wrong or stale restored draft KV would damage.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from vllm_draft_offload.bench.kv_configs import native_offloading_config

CONFIGS: tuple[str, ...] = ("none", "gpu_prefix", "native", "lmcache", "ours_cpu", "ours_disk")
WORKLOADS: tuple[str, ...] = ("chat", "docqa", "divergent", "nohit")
# Drafter methods whose draft KV at position p is built from token p+1 (the
# "trailing block" the connector handles with successor tokens).
EAGLE_METHODS: frozenset[str] = frozenset({"eagle", "eagle3", "mtp", "deepseek_mtp"})
FIRST_TOKEN_ID = 4  # fixtures reserve 0..3 for <unk> <s> </s> <pad>
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    """Every size of a run. Defaults = the GPU run; ``dry_run_sizes()`` = CPU."""

    # multi-turn chat: shared system prompt, then turns that append answer + user tokens
    chat_system: int = 2048
    chat_convs: int = 4
    chat_turns: int = 3
    chat_user: int = 64
    chat_answer: int = 64
    # document QA under GPU-cache pressure
    doc_lengths: tuple[int, ...] = (8192, 16384, 32000)
    doc_questions: int = 3
    doc_question_len: int = 32
    doc_answer: int = 32
    # divergent successors: shared chunk-aligned prefix, different continuations
    div_prefix: int = 4096
    div_requests: int = 8
    div_cont: int = 32
    div_answer: int = 32
    # no-hit decode throughput: unique prompts, long answers
    nohit_prompts: int = 16
    nohit_len: int = 128
    nohit_answer: int = 256
    # TTFT vs prefix length (prompt = prefix + 1 token, max_tokens=1)
    ttft_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    ttft_reps: int = 3
    warmup_len: int = 64
    # engine
    chunk_size: int = 256
    block_size: int = 16
    num_spec_tokens: int = 3
    dtype: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.85
    # GPU KV capacity = this x the longest request (then +1 null block): the longest
    # request fits, the documents together do not, so doc QA evicts and restores.
    gpu_cache_factor: float = 1.25
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    cpu_bytes: int = 4 * GIB
    lmcache_cpu_gb: float = 4.0
    l3_staging_mb: int = 1024
    # ours_disk: "fresh-engine" restores in a second engine whose CPU tier is empty,
    # "small-cpu" keeps one engine with a CPU tier of disk_cpu_bytes.
    disk_mode: str = "fresh-engine"
    disk_cpu_bytes: int = 256 * MIB
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sizes:
        known = {f.name for f in fields(cls)}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        return cls(**kw)

    def validate(self) -> None:
        """Refuse sizes whose chunk-boundary semantics would be silently wrong."""
        if self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.chunk_size} % block_size {self.block_size} != 0")
        if self.div_prefix % self.chunk_size:
            raise ValueError(
                f"div_prefix {self.div_prefix} must be a multiple of chunk_size {self.chunk_size}"
            )
        if self.disk_mode not in ("fresh-engine", "small-cpu"):
            raise ValueError(f"disk_mode {self.disk_mode!r}")
        cue = self._cue_len()
        for name, ctx, room in (
            ("chat_system", self.chat_system, self.chat_answer),
            ("doc_lengths", min(self.doc_lengths), self.doc_answer),
            ("div_prefix", self.div_prefix, self.div_answer),
            ("nohit_len", self.nohit_len, 0),
        ):
            if ctx < 2 * cue + room + 2:
                raise ValueError(f"{name}={ctx} too short for a {cue}-token cue + {room} answer")
        if self.chat_user <= cue or self.doc_question_len <= cue or self.div_cont <= cue:
            raise ValueError(f"user/question/continuation lengths must exceed the cue ({cue})")

    def _cue_len(self) -> int:
        return max(2, min(16, self.chat_user // 2, self.doc_question_len // 2, self.div_cont // 2))

    def longest_request(self) -> int:
        """Tokens of the longest single request (prompt + answer + spec lookahead)."""
        chat = self.chat_system + self.chat_turns * (self.chat_user + self.chat_answer)
        doc = max(self.doc_lengths) + self.doc_question_len + self.doc_answer
        div = self.div_prefix + self.div_cont + self.div_answer
        ttft = max(self.ttft_lengths, default=0) + 2
        nohit = self.nohit_len + self.nohit_answer
        return max(chat, doc, div, ttft, nohit, self.warmup_len + 8) + self.num_spec_tokens + 1

    def max_model_len(self) -> int:
        return _round_up(self.longest_request(), self.block_size)

    def num_gpu_blocks(self) -> int:
        """GPU KV blocks: the longest request fits (vLLM's admission check), 8k+ docs don't."""
        blocks = math.ceil(self.gpu_cache_factor * self.max_model_len() / self.block_size)
        return blocks + 1  # vLLM holds one null block back


def dry_run_sizes() -> Sizes:
    """CPU-friendly tiny sizes (fixture preset ``tiny``: vocab 256, 2k positions)."""
    return Sizes(
        chat_system=96,
        chat_convs=2,
        chat_turns=2,
        chat_user=16,
        chat_answer=8,
        doc_lengths=(128, 160, 192),
        doc_questions=2,
        doc_question_len=12,
        doc_answer=8,
        div_prefix=64,
        div_requests=3,
        div_cont=12,
        div_answer=8,
        nohit_prompts=3,
        nohit_len=32,
        nohit_answer=16,
        ttft_lengths=(64, 128),
        ttft_reps=2,
        warmup_len=16,
        chunk_size=32,
        block_size=32,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        cpu_bytes=64 * MIB,
        lmcache_cpu_gb=0.25,
        l3_staging_mb=64,
        disk_cpu_bytes=4 * MIB,
    )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ----------------------------------------------------------------------------- prompts


class TokenSource:
    """Deterministic copy-corpus token stream; one numpy Generator per (seed, tag)."""

    def __init__(self, vocab_size: int, seed: int, tag: str) -> None:
        if vocab_size <= FIRST_TOKEN_ID + 8:
            raise ValueError(f"vocab_size {vocab_size} too small")
        self.vocab = vocab_size
        digest = hashlib.sha256(f"{seed}/{tag}".encode()).digest()
        self.rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))

    def span(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(FIRST_TOKEN_ID, self.vocab, size=n)]

    def text(self, n: int, copy_p: float = 0.5) -> list[int]:
        """Random spans interleaved with copies of earlier stretches of itself."""
        out: list[int] = []
        while len(out) < n:
            if len(out) > 32 and self.rng.random() < copy_p:
                k = int(self.rng.integers(8, 33))
                start = int(self.rng.integers(0, len(out) - 8))
                out.extend(out[start : start + k])
            else:
                out.extend(self.span(int(self.rng.integers(4, 17))))
        return out[:n]

    def turn(self, context: list[int], n: int, cue: int, room: int) -> list[int]:
        """``n`` new tokens ending in a cue into ``context``, so the answer copies it."""
        hi = len(context) - cue - room
        start = int(self.rng.integers(0, max(1, hi)))
        return self.span(n - cue) + context[start : start + cue]


@dataclass
class Workload:
    """Prompts of one workload.

    ``fill``: first seen in the fill phase (fresh prefill) and replayed identically in
    the restore phase (so fresh and restored acceptance compare the same tokens).
    ``cont``: continuation rounds whose prompts extend ``fill`` prompts with different
    tokens; None for chat, whose next turns are built from the fill answers.
    ``cont_hit``: per continuation prompt, the whole-chunk prefix a connector can
    serve (None when not known in advance).
    """

    name: str
    fill: list[list[int]]
    max_tokens: int
    cont: list[list[list[int]]] | None = None
    cont_hit: list[list[int | None]] | None = None
    params: dict[str, Any] = field(default_factory=dict)


def build_workload(name: str, sizes: Sizes, vocab: int) -> Workload:
    cue = sizes._cue_len()
    if name == "chat":
        src = TokenSource(vocab, sizes.seed, "chat")
        system = src.text(sizes.chat_system)
        fill = [
            system + src.turn(system, sizes.chat_user, cue, sizes.chat_answer)
            for _ in range(sizes.chat_convs)
        ]
        return Workload(
            name,
            fill,
            sizes.chat_answer,
            params={
                "system": sizes.chat_system,
                "convs": sizes.chat_convs,
                "turns": sizes.chat_turns,
                "user": sizes.chat_user,
            },
        )
    if name == "docqa":
        src = TokenSource(vocab, sizes.seed, "docqa")
        docs = [src.text(n) for n in sizes.doc_lengths]
        questions = [
            [
                src.turn(d, sizes.doc_question_len, cue, sizes.doc_answer)
                for _ in range(sizes.doc_questions)
            ]
            for d in docs
        ]
        fill = [d + q[0] for d, q in zip(docs, questions, strict=True)]
        # Later questions interleaved across documents: doc i's next question comes
        # after every other document passed through the small GPU cache.
        round_ = [
            d + q[k]
            for k in range(1, sizes.doc_questions)
            for d, q in zip(docs, questions, strict=True)
        ]
        hits = [
            _round_down(len(d), sizes.chunk_size)
            for _ in range(1, sizes.doc_questions)
            for d in docs
        ]
        return Workload(
            name,
            fill,
            sizes.doc_answer,
            cont=[round_] if round_ else [],
            cont_hit=[list(hits)] if round_ else [],
            params={
                "doc_lengths": list(sizes.doc_lengths),
                "questions": sizes.doc_questions,
                "total_doc_tokens": sum(sizes.doc_lengths),
            },
        )
    if name == "divergent":
        src = TokenSource(vocab, sizes.seed, "divergent")
        prefix = src.text(sizes.div_prefix)
        fill = [
            prefix + src.turn(prefix, sizes.div_cont, cue, sizes.div_answer)
            for _ in range(sizes.div_requests)
        ]
        cont = [
            prefix + src.turn(prefix, sizes.div_cont, cue, sizes.div_answer)
            for _ in range(sizes.div_requests)
        ]
        return Workload(
            name,
            fill,
            sizes.div_answer,
            cont=[cont],
            cont_hit=[[sizes.div_prefix] * len(cont)],
            params={"prefix": sizes.div_prefix, "requests": sizes.div_requests},
        )
    if name == "nohit":
        src = TokenSource(vocab, sizes.seed, "nohit")
        fill = [src.text(sizes.nohit_len) for _ in range(sizes.nohit_prompts)]
        return Workload(name, fill, sizes.nohit_answer, params={"prompts": sizes.nohit_prompts})
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def chat_next_turn(
    sizes: Sizes, vocab: int, prompts: list[list[int]], answers: list[list[int]], turn: int
) -> list[list[int]]:
    """Turn ``turn`` (2-based) of every conversation: previous prompt + its answer + user."""
    src = TokenSource(vocab, sizes.seed, f"chat-turn{turn}")
    cue = sizes._cue_len()
    out = []
    for p, a in zip(prompts, answers, strict=True):
        ctx = p + a
        out.append(ctx + src.turn(ctx, sizes.chat_user, cue, sizes.chat_answer))
    return out


def unique_prompt(vocab: int, seed: int, tag: str, n: int) -> list[int]:
    return TokenSource(vocab, seed, tag).text(n)


def restore_expected_hit(prompt_len: int, chunk: int) -> int:
    """Whole chunks a connector can serve for a replayed prompt: vLLM computes >= 1 token."""
    return _round_down(prompt_len - 1, chunk)


def _round_down(n: int, m: int) -> int:
    return (n // m) * m


def digest(prompts: list[list[int]]) -> str:
    """Short hash of a prompt list; equal across configs proves they saw the same tokens."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Drafter:
    method: str
    path: str

    @property
    def label(self) -> str:
        return f"{self.method}:{Path(self.path).name}"

    @property
    def eagle_family(self) -> bool:
        return self.method in EAGLE_METHODS


def parse_drafters(spec: str, fixtures: str | None) -> list[Drafter]:
    """``method:path,...``; a bare fixture name (``eagle3``) resolves under --fixtures."""
    known = {
        "eagle3": "eagle3",
        "eagle": "eagle",
        "small-draft": "draft_model",
        "self-draft": "draft_model",
    }
    out: list[Drafter] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if ":" in item:
            method, path = item.split(":", 1)
        elif item in known and fixtures:
            method, path = known[item], str(Path(fixtures) / item)
        else:
            raise ValueError(f"drafter {item!r}: use METHOD:PATH or a fixture name with --fixtures")
        out.append(Drafter(method, path))
    if not out:
        raise ValueError("no drafters given")
    return out


def engine_kwargs(
    config: str, model: str, drafter: Drafter, sizes: Sizes, l3_url: str | None
) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` of one configuration; identical except for caching/connector."""
    kw: dict[str, Any] = {
        "model": model,
        "dtype": sizes.dtype,
        "max_model_len": sizes.max_model_len(),
        "block_size": sizes.block_size,
        "enforce_eager": sizes.enforce_eager,
        "seed": sizes.seed,
        "gpu_memory_utilization": sizes.gpu_memory_utilization,
        "num_gpu_blocks_override": sizes.num_gpu_blocks(),
        "max_num_seqs": sizes.max_num_seqs,
        "disable_log_stats": False,  # TTFT timestamps and Prometheus counters need stats
        "enable_prefix_caching": config != "none",
        "per_request_spec_decode_metrics": "summary",
        "speculative_config": {
            "method": drafter.method,
            "model": drafter.path,
            "num_speculative_tokens": sizes.num_spec_tokens,
        },
    }
    if sizes.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = sizes.max_num_batched_tokens
    if config == "native":
        kw["kv_transfer_config"] = native_offloading_config(sizes.cpu_bytes)
    elif config == "lmcache":
        kw["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    elif config in ("ours_cpu", "ours_disk"):
        extra: dict[str, Any] = {
            "cpu_bytes_to_use": sizes.cpu_bytes,
            "chunk_size": sizes.chunk_size,
        }
        if config == "ours_disk":
            if l3_url is None:
                raise ValueError("ours_disk needs an l3 url")
            if sizes.disk_mode == "small-cpu":
                extra["cpu_bytes_to_use"] = sizes.disk_cpu_bytes
            extra["l3"] = {"enabled": True}
            extra["lmcache.remote_url"] = l3_url
            extra["lmcache.extra_config"] = {
                "save_chunk_meta": True,
                "draft_offload.l3_staging_mb": sizes.l3_staging_mb,
            }
        kw["kv_transfer_config"] = {
            "kv_connector": "DraftOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    elif config not in ("none", "gpu_prefix"):
        raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    return kw


def engine_env(config: str, sizes: Sizes) -> dict[str, str]:
    """Extra environment of a config's subprocess (LMCache reads its config from env)."""
    if config != "lmcache":
        return {}
    return {
        "LMCACHE_CHUNK_SIZE": str(sizes.chunk_size),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(sizes.lmcache_cpu_gb),
    }


def with_overrides(sizes: Sizes, **kw: Any) -> Sizes:
    return replace(sizes, **{k: v for k, v in kw.items() if v is not None})
