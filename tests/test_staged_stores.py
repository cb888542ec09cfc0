"""store_staging_units: the pair kernel gathers each stored unit into a GPU-side buffer,
then one copy a unit moves it to its host slot (staged_stores.py). Through the real vLLM
Scheduler on CPU tensors (kv_sim): every store batch it can take goes staged, in waves
when a batch has more units than the buffer, and what it stored restores bit for bit,
target and draft layers."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from kv_sim import SimEngine, SimSetup, prompt

from vllm_draft_offload import staged_stores
from vllm_draft_offload.staged_stores import (
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_UNITS,
    StagedStores,
    staging_units,
)
from vllm_draft_offload.transfers import PairBatch

CHUNK = 32


def _staged_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of units of every batch that went staged."""
    units: list[int] = []
    run = StagedStores.run

    def counted(self, batch, slots, stream):  # noqa: ANN001, ANN202
        units.append(len(slots))
        return run(self, batch, slots, stream)

    monkeypatch.setattr(StagedStores, "run", counted)
    return units


@pytest.mark.parametrize(
    ("buffer_units", "store_thread"), [(1, False), (2, False), (3, False), (8, False), (8, True)]
)
def test_staged_stores_restore_bit_exact(
    model_dirs: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    buffer_units: int,
    store_thread: bool,
) -> None:
    """Also with the copies issued on the store thread (store_thread), as the next GPU
    run pairs them."""
    units = _staged_runs(monkeypatch)
    extra = {
        "store_decode": True,
        "store_staging_units": buffer_units,
        "store_thread": store_thread,
    }
    eng = SimEngine(*model_dirs, SimSetup(extra_config=extra))
    staged = eng.worker.worker._staged
    assert staged is not None and staged.units == buffer_units
    assert (eng.worker.worker._issuer is not None) == store_thread
    tokens = prompt(31, 3 * CHUNK + 5)
    eng.add_request("a", tokens, max_tokens=CHUNK + 8)  # a decode step completes a chunk
    eng.run_until_done()
    # The prompt's three units in one batch (waves alternate the buffer's halves: of one
    # unit with a 1- or 2-unit buffer, of two then one with a 3-unit buffer, the second
    # wave into slot 2), then the decoded one.
    assert units == [3, 1], units
    eng.evict_gpu_kv()
    eng.add_request("turn2", [*tokens, *eng.outputs["a"], *prompt(32, 9)], max_tokens=1)
    eng.run_prefill("turn2")
    assert eng.external_hits["turn2"] >= 4 * CHUNK
    assert eng.mismatched_positions("turn2") == []


@pytest.mark.parametrize("units", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("count", [0, 1, 4, 5, 17])
def test_waves_take_every_slot_once_alternating_the_buffers_halves(units: int, count: int) -> None:
    """Consecutive waves fill different halves (so one can be gathered while the other
    drains), never more slots than the half holds, and the halves do not overlap."""
    regions = staged_stores.buffer_regions(units)
    assert sum(size for _, size in regions) == units
    assert all(first + size <= units for first, size in regions)
    if len(regions) == 2:
        assert regions[0][0] + regions[0][1] == regions[1][0]
    slots = np.arange(100, 100 + count)
    plan = staged_stores.waves(slots, regions)
    assert np.array_equal(np.concatenate([w for _, w in plan] or [slots[:0]]), slots)
    for index, (region, wave) in enumerate(plan):
        assert region == index % len(regions)
        assert 0 < len(wave) <= regions[region][1]
    assert len(regions) == (1 if units < 2 else 2)


MIB = 1 << 20


def test_default_units_on_cuda_under_auto_within_the_memory_caps() -> None:
    """The default stages on CUDA under copy_path auto where the kernel moves every
    layer: 8 units (the 8B shape's 37.7 MB units: 302 MB), fewer where 512 MiB or a
    quarter of the free GPU memory holds fewer, none where not one fits."""
    unit = 37_748_736  # the 8B shape's unit

    def plenty() -> int:  # free GPU memory is passed as a query, asked only if needed
        return 64 << 30

    assert staging_units(None, "auto", True, True, unit, plenty) == DEFAULT_STAGING_UNITS == 8
    assert staging_units(None, "auto", True, True, 100 * MIB, plenty) == 5  # 512 MiB cap
    # A quarter of the free memory holds three units.
    assert staging_units(None, "auto", True, True, unit, lambda: 4 * 3 * unit) == 3
    assert staging_units(None, "auto", True, True, unit, lambda: 4 * unit - 1) == 0
    assert staging_units(None, "auto", True, True, DEFAULT_STAGING_BYTES + 1, plenty) == 0
    assert staging_units(None, "auto", True, True, unit, None) == 8
    # Off CUDA (a host copy more), under a forced copy_path, or without the kernel: off.
    assert staging_units(None, "auto", False, True, unit, None) == 0
    assert staging_units(None, "kernel", True, True, unit, plenty) == 0
    assert staging_units(None, "memcpy", True, True, unit, plenty) == 0
    assert staging_units(None, "auto", True, False, unit, plenty) == 0
    # An explicit setting wins, whatever the memory and the path.
    assert staging_units(0, "auto", True, True, unit, plenty) == 0
    assert staging_units(12, "memcpy", False, True, unit, lambda: 0) == 12


def test_the_worker_sizes_the_default_buffer_from_free_gpu_memory(
    model_dirs: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Wiring: with the setting unset, a worker on CUDA asks the free GPU memory and
    allocates what staging_units allows (the allocation made on CPU here: no CUDA)."""
    from vllm_draft_offload import staged_stores, worker_side

    eng = SimEngine(*model_dirs, SimSetup(extra_config={"store_decode": True}))
    worker = eng.worker.worker
    assert worker._staged is None  # off CUDA the default is off
    unit = worker.layout.unit_bytes
    free = {"bytes": 4 * 3 * unit}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free["bytes"], 1 << 40))
    monkeypatch.setattr(
        worker_side,
        "StagedStores",
        lambda copier, units, on_device: StagedStores(copier, units, False),
    )
    monkeypatch.setattr(worker, "_on_device", True)
    staged = worker._staging_buffer(unit)
    assert staged is not None and staged.units == 3
    assert staged.buffer.numel() == 3 * unit
    free["bytes"] = 4 * unit - 1
    with caplog.at_level(logging.INFO, logger=staged_stores.logger.name):
        assert worker._staging_buffer(unit) is None
    assert "stores not staged" in caplog.text  # an operator can tell why
    explicit = worker.config.model_copy(update={"store_staging_units": 2})
    monkeypatch.setattr(worker, "config", explicit)  # explicit: as asked
    staged = worker._staging_buffer(unit)
    assert staged is not None and staged.units == 2


def test_a_buffer_that_does_not_fit_names_the_setting(
    model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_draft_offload import staged_stores

    eng = SimEngine(*model_dirs, SimSetup(extra_config={"store_decode": True}))

    def out_of_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(staged_stores.torch, "zeros", out_of_memory)
    with pytest.raises(RuntimeError, match="store_staging_units=4 needs"):
        StagedStores(eng.worker.worker.pair_copier, 4, False)


def test_batches_it_cannot_take_keep_their_route(
    model_dirs: tuple[Path, Path],
) -> None:
    eng = SimEngine(*model_dirs, SimSetup(extra_config={"store_staging_units": 2}))
    staged = eng.worker.worker._staged
    assert staged is not None
    per_unit = staged._per_unit
    whole = PairBatch(
        [np.arange(2 * n, 4 * n) for n in per_unit],  # slots 2 and 3, every page
        [np.arange(2 * n) + 1 for n in per_unit],
    )
    assert staged.slots(whole).tolist() == [2, 3]
    # A unit missing a page: the DMA of its whole slot would write pages not stored.
    cut = PairBatch([p[:-1] for p in whole.host_pages], [b[:-1] for b in whole.gpu_blocks])
    assert staged.slots(cut) is None
    # A layer the pair kernel cannot move (here: all of them) keeps the usual route.
    staged.copier.fits = [False] * len(staged.copier.fits)
    assert staged.slots(whole) is None


def test_decode_built_chunks_do_not_merge_which_is_why_staging_exists(
    model_dirs: tuple[Path, Path],
) -> None:
    """vLLM's own block pool, requests decoding in lockstep: each takes its next block
    in turn, so a chunk built while decoding has no two adjacent blocks (one DMA copy a
    page), where a prompt's chunk is one run. If vLLM ever allocates otherwise, the
    reason for store_staging_units (staged_stores.py) is gone."""
    eng = SimEngine(*model_dirs, SimSetup(extra_config={"store_decode": True}))
    runs: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    execute = eng.execute

    def capture(sched_out):  # noqa: ANN001, ANN202
        meta = sched_out.kv_connector_metadata
        for job in meta.stores:
            for blocks in job.gpu_blocks:
                blocks = np.asarray(blocks)
                breaks = int(np.sum(np.diff(blocks) != 1)) if len(blocks) else 0
                runs[meta.prompt_step].append((len(blocks), 1 + breaks))
        return execute(sched_out)

    eng.execute = capture  # type: ignore[method-assign]
    for i in range(8):
        eng.add_request(f"r{i}", prompt(100 + i, CHUNK + 8), max_tokens=3 * CHUNK)
    eng.run_until_done()
    assert runs[True] and all(count == 1 for _, count in runs[True]), runs[True]
    assert runs[False] and all(count == blocks > 1 for blocks, count in runs[False]), runs[False]


def test_no_buffer_where_the_kernel_cannot_move_every_layer(
    model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPU memory is spent on a buffer no batch could use: without the pair kernel
    (here its build refused) the setting is ignored, with a warning."""
    from vllm_draft_offload import copy_routes

    monkeypatch.setattr(copy_routes, "fits_kernel", lambda *args: False)
    eng = SimEngine(*model_dirs, SimSetup(extra_config={"store_staging_units": 2}))
    assert eng.worker.worker.pair_copier.kernel is None
    assert eng.worker.worker._staged is None


def test_staged_units_reach_storage_and_restore_after_a_restart(
    model_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What went staged into the CPU tier is what storage gets (fs://): a restarted
    engine, staging off, restores it bit-exact, target and draft."""
    from test_l3_tier import fill_l3, l3_engine

    units = _staged_runs(monkeypatch)
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(41, 3 * CHUNK + 9)
    fill_l3(model_dirs, url, tokens, extra_config={"store_staging_units": 2})
    assert units and sum(units) >= 3, units
    second = l3_engine(model_dirs, url)
    second.add_request("after-restart", tokens, max_tokens=1)
    second.run_prefill("after-restart")
    assert second.external_hits["after-restart"] == 3 * CHUNK
    assert second.take_published()["hits"]["l3"] == 3
    assert second.mismatched_positions("after-restart") == []
    second.worker.shutdown()
