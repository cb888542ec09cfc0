"""Property test of the scheduler's per-step fast path: whenever ``no_chunk_completes``
says a request has nothing to store this step, ``store_range`` (what the scheduler ran
before it) agrees, and, for a request that stores at all, leaves its next chunk where
it was. Real vLLM requests,
every combination of computed tokens (a failed load lowers them), decode progress,
successor tokens, prompt length and store settings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.request import Request

from vllm_draft_offload.config import DraftOffloadConfig
from vllm_draft_offload.store_planner import no_chunk_completes, store_range

CHUNK = 16


def request(prompt_tokens: int, output_tokens: int, num_computed: int) -> Request:
    req = Request(
        request_id="r",
        prompt_token_ids=list(range(1, prompt_tokens + 1)),
        sampling_params=SamplingParams(max_tokens=output_tokens + 1),
        pooling_params=None,
    )
    if output_tokens:
        req.append_output_token_ids(list(range(output_tokens)))
    req.num_computed_tokens = num_computed
    return req


@settings(max_examples=600, deadline=None)
@given(
    prompt_tokens=st.integers(1, 6 * CHUNK),
    output_tokens=st.integers(0, 4 * CHUNK),
    computed_share=st.floats(0, 1),
    step_tokens=st.integers(0, 2 * CHUNK),
    next_chunk=st.integers(0, 10),
    successors=st.integers(0, 2),
    store_decode=st.booleans(),
    min_store_tokens=st.sampled_from([0, 3 * CHUNK]),
    allowed=st.booleans(),
)
def test_a_step_the_fast_path_skips_has_nothing_to_store(
    prompt_tokens: int,
    output_tokens: int,
    computed_share: float,
    step_tokens: int,
    next_chunk: int,
    successors: int,
    store_decode: bool,
    min_store_tokens: int,
    allowed: bool,
) -> None:
    total = prompt_tokens + output_tokens
    num_computed = int(computed_share * (total - 1))
    computed_after = min(total, num_computed + step_tokens)
    req = request(prompt_tokens, output_tokens, num_computed)
    config = DraftOffloadConfig(
        cpu_bytes_to_use=1 << 20, store_decode=store_decode, min_store_tokens=min_store_tokens
    )
    skipped = no_chunk_completes(req, next_chunk, computed_after, config, CHUNK, allowed)
    first, limit = store_range(req, next_chunk, computed_after, successors, config, CHUNK, allowed)
    stores_at_all = allowed and total >= min_store_tokens
    if skipped:
        assert limit <= first
        if stores_at_all:
            assert first == next_chunk  # the scheduler keeps its next chunk as it was
    # And it is not vacuous: a step that completes the next chunk of a request that
    # stores is never skipped.
    if stores_at_all and computed_after >= (next_chunk + 1) * CHUNK:
        assert not skipped
