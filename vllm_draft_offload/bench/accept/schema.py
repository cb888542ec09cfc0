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
    # requests ask the probe connector to corrupt their cached KV: the draft layers', or
    # with RunConfig.corrupt_target_window_kv the target's sliding-window layers'
    corrupt_draft_kv: bool = False
    reference: str | None = None  # phase whose outputs / acceptance this one is compared to
    # divergent plan: the token at RunConfig.divergence_boundary + diverge_at is replaced
    diverge_at: int | None = None
    cache_salt: str | None = None
    expected_cached_tokens: int | None = None  # per request, with DraftOffloadConnector
    # engine process that runs the phase: 0 the first; 1 a new process started after
    # engine 0 shut down, on the same storage (the restart-from-storage plan)
    engine: int = 0


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
    # deltas of DraftOffloadConnector's counters over the phase, per label set
    # ("vllm:draft_offload_loaded_chunks{tier=l3}"); empty with other connectors
    connector_counters: dict[str, float] = Field(default_factory=dict)
    # bytes of KV cache zeroed after the phase's prefix-cache reset (None: no reset,
    # and left out of the JSON, as in results recorded before it existed): whatever of
    # the prefix the phase reads came from a connector or was recomputed
    kv_cache_zeroed_bytes: int | None = Field(default=None, exclude_if=lambda v: v is None)


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


class StorageReads(BaseModel):
    """The restarted engine's hits (restart-from-storage plan): its CPU tier started
    empty and its prompts share no prefix, so what it restored came from storage."""

    requests: int
    requests_hit: int  # requests with num_cached_tokens > 0
    hit_tokens: int  # sum of num_cached_tokens
    prompt_tokens: int
    lookup_hit_chunks: float  # units storage lookups found (lookup_hit_chunks{tier=l3})
    fetched_chunks: float  # units fetched from storage into the CPU tier (loaded, tier=l3)
    restored_chunks: float  # units loaded from the CPU tier into the GPU (loaded, tier=cpu)
    # bytes fetched from storage by KV part (target, draft): the drafter's KV came too
    fetched_bytes: dict[str, float] = Field(default_factory=dict)
    device_cached_tokens: float  # hits of the GPU prefix cache (source=device); 0 expected
    declined_chunks: dict[str, float] = Field(default_factory=dict)  # l3_declined, by cause
    fallbacks: dict[str, float] = Field(default_factory=dict)  # nonzero, by cause
    refusals: dict[str, float] = Field(default_factory=dict)  # nonzero, by cause
    # every request hit, and every unit restored had been fetched from storage
    from_storage: bool


class Summary(BaseModel):
    comparisons: list[Comparison] = Field(default_factory=list)
    # restored / fresh (default plan); restored_storage / fresh (restart plan)
    acceptance_ratio: float | None = None
    # extended_corrupt (or extended_corrupt_window) / extended (corrupt plans)
    corruption_ratio: float | None = None
    corruption_drop: float | None = None  # 1 - corruption_ratio
    # draft KV: corruption_drop >= SENSITIVITY_MIN_DROP; the target's sliding-window
    # KV: some output changed, or |corruption_drop| >= SENSITIVITY_MIN_DROP
    sensitivity_pass: bool | None = None
    all_outputs_match: bool | None = None
    hits_as_expected: bool | None = None  # divergent plan: every request's hit as expected
    storage_reads: StorageReads | None = None  # restart plan: the restarted engine's hits


class Environment(BaseModel):
    gpu: str
    python: str
    platform: str
    versions: dict[str, str | None]


class StorageWrites(BaseModel):
    """Engine 0's storage writes (restart-from-storage plan), before it shut down."""

    settle_s: float  # waited for the writes to stop (files and counters unchanged)
    settled: bool  # False: still changing when the wait's limit ran out
    stored_chunks: float  # units written (stored_chunks{tier=l3})
    write_dropped: float  # fallbacks{cause=l3_write_dropped}
    store_failed: float  # fallbacks{cause=store_failed}
    # unit objects in the directory once engine 0's process exited (after its
    # shutdown flush); None until then
    units_in_storage: int | None = None
    bytes_in_storage: int | None = None


class StorageRun(BaseModel):
    """The storage the restart-from-storage plan's engines share."""

    l3_url: str
    l3_dir_kept: bool = False  # False: a temporary directory, removed after the run
    writes: StorageWrites | None = None
    restart_init_s: float | None = None  # engine 1's start
    # the restarted engine's storage decisions (logger vllm.draft_offload.l3)
    decisions: list[str] = Field(default_factory=list)


class AcceptCheckResult(BaseModel):
    schema_version: int = SCHEMA_VERSION
    created: str
    env: Environment
    config: dict[str, Any]  # the resolved RunConfig + LLM kwargs, as run
    prompts: dict[str, Any] = Field(default_factory=dict)
    init_s: float | None = None
    phases: list[PhaseResult] = Field(default_factory=list)
    probe_report: dict[str, Any] | None = None
    storage: StorageRun | None = None  # restart-from-storage plan
    summary: Summary = Field(default_factory=Summary)
    error: str | None = None  # engine crash / timeout, recorded instead of lost


class RunConfig(BaseModel):
    model: str
    speculative_config: dict[str, Any] | None = None
    kv_transfer_config: dict[str, Any] | None = None
    corrupt_draft_kv: bool = False
    # the corrupt plan on the target's sliding-window layers instead of the draft's
    corrupt_target_window_kv: bool = False
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
    # restart-from-storage plan: the fs:// directory of the storage tier, and whether
    # this engine waits for its storage writes to settle before it shuts down
    l3_dir: str | None = None
    wait_l3_writes: bool = False
