"""What one request asks of the connector: ``kv_transfer_params["draft_offload"]``.

    {"draft_offload": {"store": false}}   # never offload this request's KV
    {"draft_offload": {"load": false}}    # never restore a prefix for it (recompute)

Through the OpenAI server: ``"kv_transfer_params": {...}`` in the request body; through
``LLM``: ``SamplingParams(extra_args={"kv_transfer_params": {...}})``. Both default to
true. A request that must not leave the GPU (a tenant's private document) sets
``store: false``; one whose latency must not depend on the cache sets ``load: false``.
The benchmarks use them to compare batches with and without stores inside one engine.

A value that is not a JSON boolean, or an unknown key, cannot be refused from the
scheduler (an exception there would stop the engine for every request). It is logged
with the field's name, and the request gets the safe reading: neither stored nor
restored, so a mistyped opt-out never offloads what its sender meant to keep out.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, ValidationError

from vllm_draft_offload.config import field_problems

logger = logging.getLogger(__name__)

KEY: Final = "draft_offload"


class RequestOptions(BaseModel):
    """One request's options; the defaults are the connector's normal behaviour."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    store: bool = True
    load: bool = True


DEFAULT: Final = RequestOptions()
# What a request whose options cannot be read gets: the cache is left alone.
UNREADABLE: Final = RequestOptions(store=False, load=False)


def request_options(kv_transfer_params: dict[str, Any] | None, req_id: str = "") -> RequestOptions:
    """The options in a request's ``kv_transfer_params`` (``None``: the defaults)."""
    if not kv_transfer_params or KEY not in kv_transfer_params:
        return DEFAULT
    raw = kv_transfer_params[KEY]
    try:
        return RequestOptions.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(field_problems(exc, f"kv_transfer_params.{KEY}"))
        logger.warning(
            "DraftOffloadConnector: request %s: %s (got %r). The request is neither "
            "stored nor restored.",
            req_id,
            problems,
            raw,
        )
        return UNREADABLE
