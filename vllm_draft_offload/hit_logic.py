"""Which stored units a request may reuse, and which of its chunks may be stored.

Pure Python, no torch: the rules that decide correctness live here so they can
be tested exhaustively.

The trailing-block rule. An EAGLE-family drafter builds the draft KV of
position p from the target's hidden state at p and token p+1 (multi-module MTP:
tokens up to p+S). A unit therefore stores the S tokens after its chunk (its
"successors"). When a request reuses chunk k:

* successors equal -> the whole chunk is reused;
* they first differ at successor j -> the unit is still loaded, but the hit
  ends at chunk_end + j - S, so vLLM recomputes the last S - j positions of
  the chunk and the drafter rewrites exactly the draft KV that was stale.
  For EAGLE (S=1) that is one recomputed token instead of vLLM's dropped
  chunk, and stale draft KV is never served.

A chunk is stored once its KV is complete and its successors are known:
chunk_end <= tokens computed by the end of this step, and chunk_end + S <=
tokens known now. A chunk ending on the prompt's last token waits for the
first sampled token; it is stored at the next step, or when the request
finishes (its blocks are held until then).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredUnitView:
    """What hit logic needs to know about a stored unit."""

    handle: object
    successors: tuple[int, ...]
    # Holds the Mamba / linear-attention state at its chunk's end (always True
    # without such a group): only there can a hit end (match_prefix's needs_state).
    has_state: bool = True


# (chunk_key, successors the request needs) -> (exact unit, or any other variant)
Lookup = Callable[[bytes, tuple[int, ...]], tuple[StoredUnitView | None, StoredUnitView | None]]


@dataclass
class PrefixMatch:
    """The units to load and where the reusable prefix ends."""

    start_token: int
    end_token: int
    chunks: list[tuple[int, StoredUnitView]]  # (chunk index, unit), in order

    @property
    def num_tokens(self) -> int:
        return max(0, self.end_token - self.start_token)


def tokens_in_chunks(match: PrefixMatch, chunk_size: int, chosen: Callable[[int], bool]) -> int:
    """Tokens of the match's range [start_token, end_token) that lie in the chunks
    `chosen` picks (by chunk index)."""
    total = 0
    for chunk, _ in match.chunks:
        low = max(match.start_token, chunk * chunk_size)
        high = min(match.end_token, (chunk + 1) * chunk_size)
        if high > low and chosen(chunk):
            total += high - low
    return total


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def match_prefix(
    chunk_keys: Sequence[bytes],
    token_ids: Sequence[int],
    num_computed_tokens: int,
    chunk_size: int,
    num_successors: int,
    lookup: Lookup,
    min_compute_tokens: int = 1,
    can_end: Callable[[int, int], bool] | None = None,
    needs_state: bool = False,
) -> PrefixMatch:
    """Longest reusable prefix starting at `num_computed_tokens`.

    vLLM must compute at least one token of the request, so the prefix ends at
    len(token_ids) - min_compute_tokens (>= 1) at the latest. `can_end(start, end)`
    says whether the units hold every page a restore of [start, end) needs (a
    sliding window reaches back from the end): if not, the hit ends at an
    earlier chunk boundary where they do, never with holes. `needs_state` (a Mamba /
    linear-attention group): the hit ends exactly at the end of a unit that holds the
    state there, the last such one at or before where it would end otherwise.
    """
    num_tokens = len(token_ids)
    limit = num_tokens - max(1, min_compute_tokens)
    match = PrefixMatch(num_computed_tokens, num_computed_tokens, [])
    chunk = num_computed_tokens // chunk_size
    while chunk < len(chunk_keys):
        chunk_start, chunk_end = chunk * chunk_size, (chunk + 1) * chunk_size
        if chunk_end > num_tokens:
            break
        wanted = tuple(token_ids[chunk_end : chunk_end + num_successors])
        exact, variant = lookup(chunk_keys[chunk], wanted)
        if exact is not None and len(wanted) == num_successors:
            match.chunks.append((chunk, exact))
            match.end_token = chunk_end
            chunk += 1
            continue
        # Successors differ or are not known yet: reuse the positions whose
        # draft KV does not depend on the differing tokens, then stop.
        unit = exact or variant
        if unit is not None:
            valid_successors = common_prefix_length(unit.successors, wanted)
            end = chunk_end + valid_successors - num_successors
            if end > max(chunk_start, match.end_token):
                match.chunks.append((chunk, unit))
                match.end_token = end
        break
    if match.end_token > limit:
        match.end_token = limit
        # Drop units that no longer contribute a token.
        match.chunks = [(index, unit) for index, unit in match.chunks if index * chunk_size < limit]

    def ends_well() -> bool:
        if can_end is not None and not can_end(num_computed_tokens, match.end_token):
            return False
        if not needs_state:
            return True
        index, unit = match.chunks[-1]
        return match.end_token == (index + 1) * chunk_size and unit.has_state

    while match.chunks and match.end_token > num_computed_tokens and not ends_well():
        index, _ = match.chunks.pop()
        match.end_token = max(num_computed_tokens, index * chunk_size)
    if match.end_token <= num_computed_tokens:
        return PrefixMatch(num_computed_tokens, num_computed_tokens, [])
    return match


def storable_chunk_limit(
    num_tokens_known: int,
    num_tokens_computed_after_step: int,
    num_prompt_tokens: int,
    chunk_size: int,
    num_successors: int,
    store_decode: bool,
) -> int:
    """Number of leading chunks whose KV is complete and whose successors are known."""
    end = min(num_tokens_computed_after_step, num_tokens_known - num_successors)
    if not store_decode:
        end = min(end, num_prompt_tokens)
    return max(0, end) // chunk_size


def pages_for_chunk(
    chunk_index: int,
    chunk_size: int,
    block_size: int,
    first_token: int,
    end_token: int,
) -> range:
    """Page indices (within the chunk) of a group that cover [first_token, end_token)."""
    chunk_start = chunk_index * chunk_size
    blocks_per_chunk = chunk_size // block_size
    lo = max(0, first_token - chunk_start) // block_size
    hi = min(blocks_per_chunk, -(-(end_token - chunk_start) // block_size))
    return range(lo, max(lo, hi))
