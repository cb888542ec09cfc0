"""Answers that differ from the reference: where each first differs, and whether the
reference's pick there was a near-tie (numerics) rather than a confident one (wrong KV)."""

from __future__ import annotations

import argparse
from typing import Any

# A greedy output that first differs from the reference where the reference's pick led
# the runner-up by less than this (nats) is a numerics near-tie, not wrong KV. On an H100
# (bf16), the GPU prefix cache alone, with no connector, flipped such picks.
NEAR_TIE_NATS = 0.1


def add_near_tie_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--near-tie-nats",
        type=float,
        default=None,
        help="an answer that first differs from the reference where the reference's pick "
        f"led by less than this is a numerics near-tie (default {NEAR_TIE_NATS})",
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First output position where two answers differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def flips(
    run: list[dict[str, Any]], reference: list[dict[str, Any]], near_tie: float
) -> list[dict[str, Any]]:
    """Every answer of ``run`` that differs from the reference's: where it first differs,
    the reference's margin there (its pick's lead over the runner-up, when recorded), and
    whether that makes it a near-tie."""
    out = []
    for got, ref in zip(run, reference, strict=True):
        first = first_difference(got["output"], ref["output"])
        if first is None:
            continue
        margins = ref.get("margins") or []
        margin = margins[first] if first < len(margins) else None
        out.append(
            {
                "seq": got.get("seq"),
                "first_diff": first,
                "cached": got.get("cached"),
                "reference_margin": margin,
                "near_tie": margin is not None and margin < near_tie,
            }
        )
    return out
