"""The phases of an ``accept`` run, by plan (see check.py's docstring)."""

from __future__ import annotations

from vllm_draft_offload.bench.accept.divergent import expected_hit, successor_positions
from vllm_draft_offload.bench.accept.schema import PhaseSpec


def plan_divergent(boundary: int, successors: int) -> list[PhaseSpec]:
    """fresh_jJ (salted references), seed (stores the base prompts), diverge_jJ."""
    positions = successor_positions(successors)
    fresh = [
        PhaseSpec(name=f"fresh_j{j}", prompts="base", diverge_at=j, cache_salt=f"fresh-j{j}")
        for j in positions
    ]
    seed = PhaseSpec(name="seed", prompts="base", reset_before=True)
    diverged = [
        PhaseSpec(
            name=f"diverge_j{j}",
            prompts="base",
            reset_before=True,
            diverge_at=j,
            reference=f"fresh_j{j}",
            expected_cached_tokens=expected_hit(boundary, j, successors),
        )
        for j in positions
    ]
    return [*fresh, seed, *diverged]


# The restart plan's phase run by the restarted engine (engine 1).
RESTORED_STORAGE = "restored_storage"


def plan_restart() -> list[PhaseSpec]:
    """fresh in engine 0 (which then writes its units to storage and shuts down);
    restored_storage in a new engine process whose CPU tier starts empty."""
    return [
        PhaseSpec(name="fresh", prompts="base"),
        PhaseSpec(name=RESTORED_STORAGE, prompts="base", engine=1, reference="fresh"),
    ]


# The corrupt plans' phase with the corrupted KV: the drafter's, the target's windows.
EXTENDED_CORRUPT, EXTENDED_CORRUPT_WINDOW = "extended_corrupt", "extended_corrupt_window"


def plan_phases(
    corrupt_draft_kv: bool, prefix_cache_hit: bool = False, corrupt_target_window: bool = False
) -> list[PhaseSpec]:
    if prefix_cache_hit:
        # the same prompts again, no reset: all but their last block from the GPU
        # prefix cache (a connector adds nothing), against the fresh computation
        return [
            PhaseSpec(name="fresh", prompts="base"),
            PhaseSpec(name="cached", prompts="base", reference="fresh"),
        ]
    if corrupt_draft_kv or corrupt_target_window:
        return [
            PhaseSpec(name="fresh", prompts="base"),
            PhaseSpec(name="extended", prompts="extended"),
            PhaseSpec(name="refill", prompts="base", reset_before=True, reference="fresh"),
            PhaseSpec(
                name=EXTENDED_CORRUPT_WINDOW if corrupt_target_window else EXTENDED_CORRUPT,
                prompts="extended",
                corrupt_draft_kv=True,
                reference="extended",
            ),
        ]
    return [
        PhaseSpec(name="fresh", prompts="base"),
        PhaseSpec(name="restored", prompts="base", reset_before=True, reference="fresh"),
        PhaseSpec(name="extended", prompts="extended", reset_before=True),
    ]
