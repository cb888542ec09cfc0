"""decode_stores_dma: a step that computes no prompt token (decode only) stores by DMA,
the others as copy_path says. Through the real vLLM Scheduler on CPU tensors (kv_sim):
the scheduler marks each step's metadata (prompt_step), the worker routes each step's
store batch by it, and what either route stored restores bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kv_sim import SimEngine, SimSetup, prompt

from vllm_draft_offload.metadata import DraftOffloadMetadata
from vllm_draft_offload.store_issuer import StoreBatch

CHUNK = 32


def _record_routes(eng: SimEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, Any]]:
    """(the step's prompt_step, its store batch's path) for every step that stores."""
    worker = eng.worker.worker
    routes: list[tuple[bool, Any]] = []
    step: dict[str, bool] = {}
    wait_for_save, copy_stores = worker.wait_for_save, worker._copy_stores

    def save(meta: DraftOffloadMetadata) -> None:
        step["prompt"] = meta.prompt_step
        wait_for_save(meta)

    def copy(batch: StoreBatch) -> None:
        routes.append((step["prompt"], batch.path))
        copy_stores(batch)

    monkeypatch.setattr(worker, "wait_for_save", save)
    monkeypatch.setattr(worker, "_copy_stores", copy)
    return routes


@pytest.mark.parametrize("decode_dma", [True, False])
def test_decode_steps_store_by_dma_and_restore_bit_exact(
    model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, decode_dma: bool
) -> None:
    extra = {"store_decode": True, "decode_stores_dma": decode_dma}
    eng = SimEngine(*model_dirs, SimSetup(extra_config=extra))
    routes = _record_routes(eng, monkeypatch)
    tokens = prompt(21, 2 * CHUNK + 5)
    # Decoding past 3 * CHUNK completes a chunk of prompt and answer in a decode step.
    eng.add_request("a", tokens, max_tokens=CHUNK + 8)
    eng.run_until_done()
    prompt_steps = [path for in_prompt, path in routes if in_prompt]
    decode_steps = [path for in_prompt, path in routes if not in_prompt]
    assert prompt_steps and decode_steps, routes
    assert set(prompt_steps) == {None}  # copy_path's route, whatever the setting
    assert set(decode_steps) == ({"memcpy"} if decode_dma else {None})
    # A next turn on the answer restores the prompt's chunks and the decoded one.
    eng.evict_gpu_kv()
    eng.add_request("turn2", [*tokens, *eng.outputs["a"], *prompt(22, 9)], max_tokens=1)
    eng.run_prefill("turn2")
    assert eng.external_hits["turn2"] >= 3 * CHUNK
    assert eng.mismatched_positions("turn2") == []
