"""Comparison of an ``accept`` run's phases with their references (pure functions).

Used by the command (check.py) on the engines' results, by the engine process for
acceptance lengths, and by the table; no vLLM.
"""

from __future__ import annotations

from vllm_draft_offload.bench.accept.plans import (
    EXTENDED_CORRUPT,
    EXTENDED_CORRUPT_WINDOW,
    RESTORED_STORAGE,
)
from vllm_draft_offload.bench.accept.restart import storage_reads
from vllm_draft_offload.bench.accept.schema import Comparison, PhaseResult, Summary

SENSITIVITY_MIN_DROP = 0.30  # corrupted draft KV must cost >= 30% of the acceptance length


def acceptance_length(num_drafts: float, num_accepted: float) -> float | None:
    """vLLM's mean acceptance length: 1 + accepted draft tokens per verify step."""
    return 1.0 + num_accepted / num_drafts if num_drafts > 0 else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mark_matches(phase: PhaseResult, reference: PhaseResult) -> None:
    """Fill matches_reference / first_mismatch of ``phase`` against ``reference``."""
    ref = {r.index: r.output_token_ids for r in reference.requests}
    for r in phase.requests:
        if r.index in ref:
            r.first_mismatch = first_mismatch(r.output_token_ids, ref[r.index])
            r.matches_reference = r.first_mismatch is None


def compare(phase: PhaseResult, reference: PhaseResult) -> Comparison:
    compared = [r for r in phase.requests if r.matches_reference is not None]
    cached = [r.num_cached_tokens for r in phase.requests if r.num_cached_tokens is not None]
    expected = phase.spec.expected_cached_tokens
    return Comparison(
        expected_cached_tokens=expected,
        cached_as_expected=None if expected is None else sum(c == expected for c in cached),
        phase=phase.spec.name,
        reference=reference.spec.name,
        acceptance_length=phase.acceptance_length,
        reference_acceptance_length=reference.acceptance_length,
        ratio=ratio(phase.acceptance_length, reference.acceptance_length),
        outputs_match=sum(bool(r.matches_reference) for r in compared),
        outputs_compared=len(compared),
        mean_cached_tokens=sum(cached) / len(cached) if cached else None,
    )


def summarize(phases: list[PhaseResult]) -> Summary:
    """Comparisons of every phase with its reference, and the headline ratios."""
    by_name = {p.spec.name: p for p in phases}
    comps = []
    for p in phases:
        ref = by_name.get(p.spec.reference or "")
        if ref is not None:
            mark_matches(p, ref)
            comps.append(compare(p, ref))
    by_phase = {c.phase: c for c in comps}
    summary = Summary(comparisons=comps)
    if "restored" in by_phase:
        summary.acceptance_ratio = by_phase["restored"].ratio
    if RESTORED_STORAGE in by_phase:
        summary.acceptance_ratio = by_phase[RESTORED_STORAGE].ratio
        summary.storage_reads = storage_reads(by_name[RESTORED_STORAGE])
    if EXTENDED_CORRUPT in by_phase and by_phase[EXTENDED_CORRUPT].ratio is not None:
        summary.corruption_ratio = by_phase[EXTENDED_CORRUPT].ratio
        summary.corruption_drop = 1.0 - summary.corruption_ratio
        summary.sensitivity_pass = summary.corruption_drop >= SENSITIVITY_MIN_DROP
    if EXTENDED_CORRUPT_WINDOW in by_phase:
        # the target read zeroed window KV: its outputs (or acceptance) must change
        c = by_phase[EXTENDED_CORRUPT_WINDOW]
        changed = c.outputs_match < c.outputs_compared
        if c.ratio is not None:
            summary.corruption_ratio = c.ratio
            summary.corruption_drop = 1.0 - c.ratio
            changed = changed or abs(summary.corruption_drop) >= SENSITIVITY_MIN_DROP
        summary.sensitivity_pass = changed
    if comps:
        summary.all_outputs_match = all(c.outputs_match == c.outputs_compared for c in comps)
    hits = [(c, by_name[c.phase]) for c in comps if c.expected_cached_tokens is not None]
    if hits:
        summary.hits_as_expected = all(c.cached_as_expected == len(p.requests) for c, p in hits)
    return summary
