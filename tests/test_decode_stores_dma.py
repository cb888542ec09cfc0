"""decode_stores_dma: a step that computes no prompt token (decode only) stores by DMA,
the others as copy_path says. Through the real vLLM Scheduler on CPU tensors (kv_sim):
the scheduler marks each step's metadata (prompt_step), the worker routes each step's
store batch by it, and what either route stored restores bit for bit. By default it is
on under copy_path auto where every page is at least 48 KiB."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kv_sim import SimEngine, SimSetup, prompt

from vllm_draft_offload import copy_rules
from vllm_draft_offload.copy_rules import DECODE_STORE_DMA_MIN_PAGE_BYTES, decode_stores_by_dma
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


def test_by_default_decode_stores_go_by_dma_only_for_large_pages_under_auto() -> None:
    floor = DECODE_STORE_DMA_MIN_PAGE_BYTES
    assert decode_stores_by_dma(None, "auto", [64 << 10, 64 << 10])  # the 8B shape
    assert decode_stores_by_dma(None, "auto", [floor])
    # One layer's small pages (a small drafter) keep the whole step on the kernel.
    assert not decode_stores_by_dma(None, "auto", [64 << 10, floor - 1024])
    assert not decode_stores_by_dma(None, "auto", [32 << 10])  # the small shape
    assert not decode_stores_by_dma(None, "auto", [])
    # A forced copy_path is what the user asked for every copy.
    assert not decode_stores_by_dma(None, "kernel", [64 << 10])
    assert not decode_stores_by_dma(None, "memcpy", [64 << 10])
    # An explicit setting wins either way.
    assert decode_stores_by_dma(True, "kernel", [4 << 10])
    assert not decode_stores_by_dma(False, "auto", [64 << 10])


@pytest.mark.parametrize(
    ("setting", "min_page", "decode_dma"),
    [
        (True, None, True),
        (False, None, False),
        (None, None, False),  # the fixtures' pages are below the default's floor
        (None, 0, True),  # the default where every page clears it
    ],
)
def test_decode_steps_store_by_dma_and_restore_bit_exact(
    model_dirs: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    setting: bool | None,
    min_page: int | None,
    decode_dma: bool,
) -> None:
    extra: dict[str, Any] = {"store_decode": True}
    if setting is not None:
        extra["decode_stores_dma"] = setting
    if min_page is not None:
        monkeypatch.setattr(copy_rules, "DECODE_STORE_DMA_MIN_PAGE_BYTES", min_page)
    eng = SimEngine(*model_dirs, SimSetup(extra_config=extra))
    routes = _record_routes(eng, monkeypatch)
    layout = eng.worker.worker.layout
    assert layout is not None
    assert min(slot.page_bytes for slot in layout.layers) < DECODE_STORE_DMA_MIN_PAGE_BYTES
    tokens = prompt(21, 2 * CHUNK + 5)
    # Decoding past 3 * CHUNK completes a chunk of prompt and answer in a decode step.
    eng.add_request("a", tokens, max_tokens=CHUNK + 8)
    eng.run_until_done()
    prompt_steps = [path for in_prompt, path in routes if in_prompt]
    decode_steps = [path for in_prompt, path in routes if not in_prompt]
    assert prompt_steps and decode_steps, routes
    assert set(prompt_steps) == {None}  # copy_path's route, whatever the setting
    assert set(decode_steps) == ({"memcpy"} if decode_dma else {None})
    assert eng.worker.worker._decode_stores_dma is decode_dma
    # A next turn on the answer restores the prompt's chunks and the decoded one.
    eng.evict_gpu_kv()
    eng.add_request("turn2", [*tokens, *eng.outputs["a"], *prompt(22, 9)], max_tokens=1)
    eng.run_prefill("turn2")
    assert eng.external_hits["turn2"] >= 3 * CHUNK
    assert eng.mismatched_positions("turn2") == []
