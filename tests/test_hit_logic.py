"""Table tests of hit_logic's rules, each expectation worked out by hand from the
module docstring (C = chunk size, S = successor tokens):

* a chunk whose unit has the request's successors is reused whole;
* successors that first differ at j end the hit at chunk_end + j - S (so the last
  S - j positions are recomputed), and the walk stops there;
* the hit ends at len(tokens) - max(1, min_compute_tokens) at the latest;
* a chunk is storable once chunk_end <= tokens computed after the step and
  chunk_end + S <= tokens known (and <= the prompt without store_decode).
"""

from __future__ import annotations

import pytest

from vllm_draft_offload.hit_logic import (
    PrefixMatch,
    StoredUnitView,
    common_prefix_length,
    match_prefix,
    pages_for_chunk,
    storable_chunk_limit,
    tokens_in_chunks,
)

C = 4
BASE = 100  # token at position p is BASE + p


def tokens_of(n: int) -> list[int]:
    return [BASE + p for p in range(n)]


def keys_of(n: int) -> list[bytes]:
    return [f"k{i}".encode() for i in range(n // C)]


def succ(chunk: int, s: int) -> tuple[int, ...]:
    """The true successors of a chunk: the S tokens after its end."""
    return tuple(BASE + (chunk + 1) * C + i for i in range(s))


def differ_at(chunk: int, s: int, j: int) -> tuple[int, ...]:
    """Successors equal to the true ones before position j, different at j."""
    true = list(succ(chunk, s))
    true[j] = 7
    return tuple(true)


def run(
    n: int,
    stored: dict[int, list[tuple[int, ...]]],
    s: int,
    computed: int = 0,
    min_compute: int = 1,
) -> tuple[int, int, list[int]]:
    """Match against a tier holding `stored[chunk]` = successor tuples of its units.

    The lookup is the index's contract: the unit with exactly the wanted
    successors, else the variant sharing the longest successor prefix.
    """

    def lookup(key: bytes, wanted: tuple[int, ...]):  # noqa: ANN202
        variants = stored.get(int(key[1:]), [])
        if wanted in variants:
            return StoredUnitView(("exact", wanted), wanted), None
        if not variants:
            return None, None
        best = max(variants, key=lambda v: common_prefix_length(v, wanted))
        return None, StoredUnitView(("variant", best), best)

    match = match_prefix(keys_of(n), tokens_of(n), computed, C, s, lookup, min_compute)
    return match.start_token, match.end_token, [chunk for chunk, _ in match.chunks]


# (S, j, expected end): chunks 0-1 have the request's successors, chunk 2's
# first differ at successor j -> end = 3*C + j - S = 12 + j - S.
MISMATCH_AT_J = [
    (1, 0, 11),
    (2, 0, 10),
    (2, 1, 11),
    (3, 0, 9),
    (3, 1, 10),
    (3, 2, 11),
]


@pytest.mark.parametrize(("s", "j", "end"), MISMATCH_AT_J)
def test_successor_mismatch_at_every_position(s: int, j: int, end: int) -> None:
    stored = {0: [succ(0, s)], 1: [succ(1, s)], 2: [differ_at(2, s, j)], 3: [succ(3, s)]}
    assert run(24, stored, s) == (0, end, [0, 1, 2])  # stops: chunk 3 is not reached


# (S, j, expected end) with the mismatch in chunk 0: end = C + j - S = 4 + j - S.
MISMATCH_IN_FIRST_CHUNK = [(1, 0, 3), (2, 0, 2), (2, 1, 3), (3, 0, 1), (3, 1, 2), (3, 2, 3)]


@pytest.mark.parametrize(("s", "j", "end"), MISMATCH_IN_FIRST_CHUNK)
def test_successor_mismatch_in_the_first_chunk(s: int, j: int, end: int) -> None:
    assert run(24, {0: [differ_at(0, s, j)], 1: [succ(1, s)]}, s) == (0, end, [0])


@pytest.mark.parametrize("s", [1, 2, 3])
def test_exact_variant_is_preferred_over_a_mismatching_one(s: int) -> None:
    stored = {0: [differ_at(0, s, 0), succ(0, s)], 1: [succ(1, s)]}
    assert run(24, stored, s) == (0, 8, [0, 1])  # chunk 2 missing: ends at 8


@pytest.mark.parametrize(
    ("n", "s", "stored_chunks", "expected"),
    [
        # 10 tokens: chunks 0-1 whole, chunk 2 (8..11) is partial and never matched;
        # the limit is 10 - 1 = 9, so the hit ends at chunk 1's end, 8.
        (10, 1, 3, (0, 8, [0, 1])),
        (10, 0, 3, (0, 8, [0, 1])),
        # 8 tokens, S=1: chunk 1 ends on the last token; its successor is unknown,
        # so j = 0 and the hit ends at 8 - 1 = 7 (= the limit 8 - 1 as well).
        (8, 1, 2, (0, 7, [0, 1])),
        # 9 tokens, S=3: one successor of chunk 1 is known and equal (j = 1):
        # end = 8 + 1 - 3 = 6.
        (9, 3, 2, (0, 6, [0, 1])),
        # 10 tokens, S=3: two known and equal (j = 2): end = 8 + 2 - 3 = 7.
        (10, 3, 2, (0, 7, [0, 1])),
        # 5 tokens, S=3: chunk 0's one known successor is equal: end = 4 + 1 - 3 = 2.
        (5, 3, 1, (0, 2, [0])),
        # 4 tokens, S=2: no successor known, j = 0: end = 4 - 2 = 2; limit 3.
        (4, 2, 1, (0, 2, [0])),
        # 3 tokens: no whole chunk, nothing to reuse.
        (3, 1, 1, (0, 0, [])),
    ],
)
def test_partial_final_chunk_and_prompt_shorter_than_s(
    n: int, s: int, stored_chunks: int, expected: tuple[int, int, list[int]]
) -> None:
    # Units were stored by a longer request whose successors continue the sequence.
    stored = {chunk: [succ(chunk, s)] for chunk in range(stored_chunks)}
    assert run(n, stored, s) == expected


@pytest.mark.parametrize(
    ("n", "s", "last", "expected"),
    [
        # Multi-module MTP, the last chunk's unit holds `last` (None: its true successors)
        # and only n - chunk_end of its S successors are known to the request:
        # j = common prefix of the known ones, end = chunk_end + j - S.
        # S=2, 10 tokens: chunk 1's two successors known and equal; chunk 2 partial.
        (10, 2, None, (0, 8, [0, 1])),
        # S=2, 9 tokens: one successor of chunk 1 known and equal (j=1): 8 + 1 - 2.
        (9, 2, None, (0, 7, [0, 1])),
        # ... and different (j=0): 8 + 0 - 2.
        (9, 2, (7, 109), (0, 6, [0, 1])),
        # S=2, 5 tokens (prompt shorter than S past chunk 0): j=1 -> 3, j=0 -> 2.
        (5, 2, None, (0, 3, [0])),
        (5, 2, (7, 105), (0, 2, [0])),
        # S=3, 6 tokens: two of three known, equal (j=2) -> 3; second differs (j=1) -> 2.
        (6, 3, None, (0, 3, [0])),
        (6, 3, (104, 7, 106), (0, 2, [0])),
        (6, 3, (7, 105, 106), (0, 1, [0])),
        # S=3, 11 tokens: chunk 1's three known and equal; chunk 2 (8..12) partial.
        (11, 3, None, (0, 8, [0, 1])),
        # ... the last of them differs (j = S - 1 = 2): 8 + 2 - 3.
        (11, 3, (108, 109, 7), (0, 7, [0, 1])),
        # ... the first differs (j = 0): 8 - 3, inside chunk 1.
        (11, 3, (7, 109, 110), (0, 5, [0, 1])),
    ],
)
def test_multi_module_successor_windows_at_the_prompt_end(
    n: int, s: int, last: tuple[int, ...] | None, expected: tuple[int, int, list[int]]
) -> None:
    chunks = len(expected[2])
    stored = {chunk: [succ(chunk, s)] for chunk in range(chunks)}
    if last is not None:
        stored[chunks - 1] = [last]
    assert run(n, stored, s) == expected


@pytest.mark.parametrize(
    ("min_compute", "expected"),
    [
        # 12 tokens, chunks 0-2 stored, S=0: limit = 12 - max(1, m).
        (0, (0, 11, [0, 1, 2])),  # treated as 1
        (1, (0, 11, [0, 1, 2])),
        (2, (0, 10, [0, 1, 2])),
        (4, (0, 8, [0, 1])),  # chunk 2 (from 8) no longer contributes a token
        (5, (0, 7, [0, 1])),
        (8, (0, 4, [0])),
        (11, (0, 1, [0])),
        (12, (0, 0, [])),  # limit 0: no hit at all
    ],
)
def test_min_compute_tokens_limits_the_hit(
    min_compute: int, expected: tuple[int, int, list[int]]
) -> None:
    stored = {0: [()], 1: [()], 2: [()]}
    assert run(12, stored, 0, min_compute=min_compute) == expected


@pytest.mark.parametrize(
    ("computed", "stored", "expected"),
    [
        # 16 tokens, S=0. Computed 6 (inside chunk 1): the walk starts at chunk 1.
        (6, {0: [()], 1: [()], 2: [()], 3: [()]}, (6, 15, [1, 2, 3])),
        (6, {0: [()], 2: [()], 3: [()]}, (6, 6, [])),  # chunk 1 missing: no hit
        (8, {2: [()]}, (8, 12, [2])),  # chunk 0-1 need not be stored
        (12, {3: [()]}, (12, 15, [3])),
        (15, {3: [()]}, (15, 15, [])),  # nothing left to reuse below the limit
    ],
)
def test_num_computed_tokens_mid_chunk(
    computed: int, stored: dict[int, list[tuple[int, ...]]], expected: tuple[int, int, list[int]]
) -> None:
    assert run(16, stored, 0, computed=computed) == expected


@pytest.mark.parametrize(
    ("computed", "expected"),
    [
        # S=1, chunk 2's successor differs (j=0): its reusable part ends at 11.
        (8, (8, 11, [2])),
        (10, (10, 11, [2])),
        (11, (11, 11, [])),  # already computed up to where the reusable part ends
    ],
)
def test_mismatch_behind_computed_tokens(computed: int, expected: tuple) -> None:
    stored = {2: [differ_at(2, 1, 0)]}
    assert run(24, stored, 1, computed=computed) == expected


@pytest.mark.parametrize(
    ("known", "computed", "prompt", "s", "store_decode", "chunks"),
    [
        (10, 10, 10, 0, True, 2),  # 10 // 4
        (10, 10, 10, 1, True, 2),  # min(10, 9) = 9
        (8, 8, 8, 1, True, 1),  # chunk 1 ends on the last token: waits for its successor
        (9, 8, 8, 1, True, 2),  # first sampled token known: min(8, 8)
        (9, 7, 8, 1, True, 1),  # chunk 1's KV not complete yet
        (11, 11, 8, 3, True, 2),  # min(11, 8) = 8
        (10, 10, 8, 3, True, 1),  # min(10, 7) = 7
        (20, 20, 8, 0, False, 2),  # capped at the prompt
        (20, 20, 8, 0, True, 5),
        (20, 20, 8, 1, False, 2),  # min(20, 19, 8) = 8
        (2, 2, 2, 3, True, 0),  # known - S < 0
        (0, 0, 0, 0, True, 0),
    ],
)
def test_storable_chunk_limit(
    known: int, computed: int, prompt: int, s: int, store_decode: bool, chunks: int
) -> None:
    assert storable_chunk_limit(known, computed, prompt, C, s, store_decode) == chunks


@pytest.mark.parametrize(
    ("chunk", "first", "end", "pages"),
    [
        # chunk_size 32, block 16: chunk 1 covers tokens 32..63 in pages 0 and 1.
        (1, 0, 64, range(0, 2)),
        (1, 32, 64, range(0, 2)),
        (1, 40, 64, range(0, 2)),  # first page holds tokens 32..47: still needed
        (1, 48, 64, range(1, 2)),
        (1, 0, 50, range(0, 2)),  # ends inside page 1
        (1, 0, 48, range(0, 1)),
        (1, 0, 47, range(0, 1)),
        (1, 0, 32, range(0, 0)),  # ends before the chunk
        (1, 0, 1000, range(0, 2)),  # beyond the chunk: capped
        (1, 70, 80, range(2, 2)),  # starts after the chunk
        (2, 0, 65, range(0, 1)),  # chunk 2 starts at 64
    ],
)
def test_pages_for_chunk(chunk: int, first: int, end: int, pages: range) -> None:
    assert pages_for_chunk(chunk, 32, 16, first, end) == pages


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [((), (), 0), ((1,), (), 0), ((1, 2), (1, 2), 2), ((1, 2, 3), (1, 5, 3), 1), ((1,), (1, 2), 1)],
)
def test_common_prefix_length(a: tuple, b: tuple, n: int) -> None:
    assert common_prefix_length(a, b) == n


def test_tokens_in_chunks_counts_only_the_matched_range() -> None:
    """A hit from token 6 to 17 over chunks 1..4 of C=4 tokens: chunk 1 holds 2 of
    its tokens in range (6, 7), chunk 4 one (16); picking chunks 1 and 4 counts 3."""
    view = StoredUnitView(("u", ()), ())
    match = PrefixMatch(6, 17, [(chunk, view) for chunk in range(1, 5)])
    assert tokens_in_chunks(match, C, lambda chunk: True) == 11
    assert tokens_in_chunks(match, C, lambda chunk: chunk in (1, 4)) == 3
    assert tokens_in_chunks(match, C, lambda chunk: chunk == 2) == C
    assert tokens_in_chunks(PrefixMatch(8, 8, []), C, lambda chunk: True) == 0
