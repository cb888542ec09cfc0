"""The scheduler half's record of one request (scheduler_side.py keeps one a request).

A module of its own so that what drives part of it (restore_overlap.py's
`OverlappedLoads`) can name it without importing the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_draft_offload.chunk_keys import ChunkKeyChain
from vllm_draft_offload.cpu_index import UnitId
from vllm_draft_offload.hit_logic import PrefixMatch
from vllm_draft_offload.request_options import DEFAULT, RequestOptions

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class RequestState:
    request: Request
    keys: ChunkKeyChain
    # Chunks below this index were stored or found already stored.
    next_store_chunk: int = 0
    pending_match: PrefixMatch | None = None
    inflight_jobs: set[int] = field(default_factory=set)
    restored_tokens: int = 0
    # Of the last admitted hit, tokens in units storage supplied while it waited.
    storage_tokens: int = 0
    # The pending match takes units still landing from storage: placeholder -> fetch
    # job (an overlapped restore, restore_overlap.py); None: it takes none.
    pending_fetches: dict[UnitId, int] | None = None
    # Where the last admitted hit starts (its restore is counted from there).
    hit_start: int = 0
    # What the request's kv_transfer_params ask (request_options.py).
    options: RequestOptions = DEFAULT
