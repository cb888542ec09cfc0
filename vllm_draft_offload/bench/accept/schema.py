"""The JSON an ``accept`` run writes (:class:`AcceptCheckResult`) and its run config.

Shared by the command (check.py), the engine process (engine.py) and the table
(table.py); plain pydantic, no vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

SCHEMA_VERSION = 1


class PhaseSpec(BaseModel):
    name: str
    prompts: Literal["base", "extended"]
    reset_before: bool = False  # llm.reset_prefix_cache() before the phase
    corrupt_draft_kv: bool = False  # requests ask the probe connector to corrupt draft KV
    reference: str | None = None  # phase whose outputs / acceptance this one is compared to
    # divergent plan: the token at RunConfig.divergence_boundary + diverge_at is replaced
    diverge_at: int | None = None
    cache_salt: str | None = None
    expected_cached_tokens: int | None = None  # per request, with DraftOffloadConnector


class RequestResult(BaseModel):
    index: int
    group: int
    prompt_len: int
    num_cached_tokens: int | None
    output_token_ids: list[int]
    acceptance_length: float | None = None  # per-request: 1 + accepted / drafts
    num_drafts: int | None = None
    num_accepted: int | None = None
    matches_reference: bool | None = None
    first_mismatch: int | None = None


class PhaseResult(BaseModel):
    spec: PhaseSpec
    wall_s: float
    # deltas of vLLM counters over the phase, summed over labels except those named
    counters: dict[str, float] = Field(default_factory=dict)
    cached_tokens_by_source: dict[str, float] = Field(default_factory=dict)
    accepted_per_position: list[float] = Field(default_factory=list)
    acceptance_length: float | None = None  # phase-level, from the counters
    requests: list[RequestResult] = Field(default_factory=list)


class Comparison(BaseModel):
    phase: str
    reference: str
    acceptance_length: float | None
    reference_acceptance_length: float | None
    ratio: float | None  # phase / reference acceptance length
    outputs_match: int
    outputs_compared: int
    mean_cached_tokens: float | None
    expected_cached_tokens: int | None = None
    cached_as_expected: int | None = None  # requests whose num_cached_tokens is the expected


class Summary(BaseModel):
    comparisons: list[Comparison] = Field(default_factory=list)
    acceptance_ratio: float | None = None  # restored / fresh (default plan)
    corruption_ratio: float | None = None  # extended_corrupt / extended (corrupt plan)
    corruption_drop: float | None = None  # 1 - corruption_ratio
    sensitivity_pass: bool | None = None  # corruption_drop >= SENSITIVITY_MIN_DROP
    all_outputs_match: bool | None = None
    hits_as_expected: bool | None = None  # divergent plan: every request's hit as expected


class Environment(BaseModel):
    gpu: str
    python: str
    platform: str
    versions: dict[str, str | None]


class AcceptCheckResult(BaseModel):
    schema_version: int = SCHEMA_VERSION
    created: str
    env: Environment
    config: dict[str, Any]  # the resolved RunConfig + LLM kwargs, as run
    prompts: dict[str, Any] = Field(default_factory=dict)
    init_s: float | None = None
    phases: list[PhaseResult] = Field(default_factory=list)
    probe_report: dict[str, Any] | None = None
    summary: Summary = Field(default_factory=Summary)
    error: str | None = None  # engine crash / timeout, recorded instead of lost


class RunConfig(BaseModel):
    model: str
    speculative_config: dict[str, Any] | None = None
    kv_transfer_config: dict[str, Any] | None = None
    corrupt_draft_kv: bool = False
    corrupt_mode: Literal["zero", "noise"] = "zero"
    prompt_tokens: int = 384
    num_prompts: int = 4
    prompts_per_group: int = 2
    max_tokens: int = 48
    prompt_seed: int = 0
    divergence_boundary: int | None = None  # divergent plan: a chunk boundary
    dtype: str = "auto"
    block_size: int | None = None
    enforce_eager: bool = False
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)
    phases: list[PhaseSpec] = Field(default_factory=list)
