"""The simulator is a sound oracle: its outputs depend on the KV it reads, and its
speculative settings come from vLLM's own SpeculativeConfig.

If the simulated forward did not read the KV cache, every output-equality
assert in the connector tests would pass with wrong KV restored. These tests
restore one damaged page (one layer, one block, one byte) and require the
outputs to differ, next to a control where nothing is damaged and they match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kv_sim import SimEngine, SimSetup, prompt

from vllm_draft_offload.chunk_keys import ChunkKeyChain

CHUNK = 32
PROMPT = prompt(40, 3 * CHUNK + 5)


def serve_fresh_then_restored(
    model_dirs: tuple[Path, Path], setup: SimSetup, damage: str | None
) -> SimEngine:
    """Serve PROMPT, flip one byte of one page of the stored unit of chunk 1
    (the `damage` kind of layer: "draft" or "target"), and serve it again from
    the CPU tier alone."""
    eng = SimEngine(*model_dirs, setup)
    eng.add_request("fresh", PROMPT, max_tokens=4)
    eng.run_until_done()
    if damage is not None:
        sched = eng.scheduler.connector.scheduler
        key = ChunkKeyChain(sched.salt, CHUNK).extend(PROMPT)[1]
        successors = tuple(PROMPT[2 * CHUNK : 2 * CHUNK + sched.num_successors])
        entry = sched.index.get((key, successors))
        assert entry is not None and entry.ready
        worker = eng.worker.worker
        layer = next(s for s in worker.layout.layers if s.is_draft == (damage == "draft"))
        # The middle of the layer's last page in the unit: one position of one block.
        byte = layer.offset + layer.nbytes - layer.page_bytes // 2
        worker.pool.unit_view(entry.slot)[byte] ^= 0x01
    eng.evict_gpu_kv()
    eng.add_request("restored", PROMPT, max_tokens=4)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 3 * CHUNK
    return eng


SETUPS = [
    pytest.param(SimSetup(), id="draft_model"),
    pytest.param(SimSetup(draft_layout="separate_group"), id="draft_model-separate"),
    pytest.param(SimSetup(eagle=True), id="eagle"),
    pytest.param(SimSetup(eagle=True, eagle_method="eagle3"), id="eagle3"),
    pytest.param(SimSetup(eagle=True, eagle_method="mtp"), id="mtp"),
]


@pytest.mark.parametrize("setup", SETUPS)
def test_restored_kv_equal_gives_equal_outputs(
    model_dirs: tuple[Path, Path], setup: SimSetup
) -> None:
    """Control: nothing damaged, so the outputs match the fresh run's."""
    eng = serve_fresh_then_restored(model_dirs, setup, damage=None)
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]


@pytest.mark.parametrize("damage", ["draft", "target"])
@pytest.mark.parametrize("setup", SETUPS)
def test_one_wrong_restored_page_changes_the_outputs(
    model_dirs: tuple[Path, Path], setup: SimSetup, damage: str
) -> None:
    eng = serve_fresh_then_restored(model_dirs, setup, damage=damage)
    bad = eng.mismatched_positions("restored")
    # Exactly one position of one layer, inside chunk 1, is wrong ...
    assert len(bad) == 1
    ((name, position),) = bad
    assert (name in eng.draft_names) == (damage == "draft")
    assert CHUNK <= position < 2 * CHUNK
    eng.run_until_done()
    # ... and the equality check the connector tests rely on catches it.
    assert eng.outputs["restored"] != eng.outputs["fresh"]


@pytest.mark.parametrize(
    ("setup", "method", "successors"),
    [
        (SimSetup(), "draft_model", 0),
        (SimSetup(eagle=True), "eagle", 1),
        (SimSetup(eagle=True, eagle_method="eagle3"), "eagle3", 1),
        (SimSetup(eagle=True, eagle_method="mtp"), "mtp", 2),  # multi-module: S = 2 tokens
    ],
    ids=["draft_model", "eagle", "eagle3", "mtp"],
)
def test_speculative_settings_are_derived_from_vllm_config(
    model_dirs: tuple[Path, Path], setup: SimSetup, method: str, successors: int
) -> None:
    eng = SimEngine(*model_dirs, setup)
    spec = eng.vllm_config.speculative_config
    assert spec is not None and spec.method == method
    extra = eng.vllm_config.kv_transfer_config.kv_connector_extra_config
    assert "successor_tokens" not in extra and "min_compute_tokens" not in extra
    sched = eng.scheduler.connector.scheduler
    assert sched.num_successors == successors == eng.draft_successors
    assert sched.min_compute_tokens == 2  # any drafter: vLLM 0.33 wastes a one-token first step


def test_mtp_with_too_few_successors_would_serve_stale_draft_kv(
    model_dirs: tuple[Path, Path],
) -> None:
    """Negative control: the simulated MTP drafter really reads two tokens ahead,
    so pinning successor_tokens to EAGLE's 1 leaves one stale draft position."""
    setup = SimSetup(eagle=True, eagle_method="mtp", extra_config={"successor_tokens": 1})
    eng = SimEngine(*model_dirs, setup)
    shared = prompt(41, 3 * CHUNK)
    eng.add_request("x", [*shared, 11, 13, *prompt(42, 20)], max_tokens=1)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.add_request("y", [*shared, 11, 14, *prompt(43, 20)], max_tokens=1)
    eng.run_prefill("y")
    assert eng.external_hits["y"] == 3 * CHUNK
    stale = eng.mismatched_positions("y")
    assert stale and all(pos == 3 * CHUNK - 1 for _, pos in stale)
