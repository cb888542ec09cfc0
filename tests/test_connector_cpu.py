"""DraftOffloadConnector end to end through the real vLLM Scheduler on CPU tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_sim import SimEngine, SimSetup, prompt
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_draft_offload import pair_kernel
from vllm_draft_offload.config import ConfigError
from vllm_draft_offload.connector import DraftOffloadConnector
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata

CHUNK = 32


def engine(model_dirs: tuple[Path, Path], **kwargs: object) -> SimEngine:
    return SimEngine(*model_dirs, SimSetup(**kwargs))


def index_of(eng: SimEngine):
    return eng.scheduler.connector.scheduler.index


@pytest.mark.parametrize("draft_layout", ["shared_group", "separate_group"])
@pytest.mark.parametrize("eagle", [False, True])
def test_round_trip_is_bit_exact_for_every_layer(
    model_dirs: tuple[Path, Path], draft_layout: str, eagle: bool
) -> None:
    eng = engine(model_dirs, draft_layout=draft_layout, eagle=eagle)
    tokens = prompt(1, 4 * CHUNK + 5)
    eng.add_request("fresh", tokens, max_tokens=4)
    eng.run_until_done()
    assert len(index_of(eng)) == 4

    eng.evict_gpu_kv()
    worker = eng.worker.worker
    eng.take_published()
    eng.add_request("restored", tokens, max_tokens=4)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 4 * CHUNK
    assert eng.mismatched_positions("restored") == []
    moved = eng.take_published()
    assert moved["hits"] == {"cpu": 4}  # counted once per admitted request
    assert moved["chunks"]["load/cpu"] == 4
    assert moved["bytes"]["load/cpu/draft"] == 4 * worker.layout.draft_bytes
    assert moved["bytes"]["load/cpu/target"] == 4 * worker.layout.target_bytes
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_mla_latent_round_trip_is_bit_exact(model_dirs: tuple[Path, Path], method: str) -> None:
    """DeepSeek MLA geometry (one [blocks, 1, block, 512 + 64] latent tensor per layer,
    the MTP layer beside the target's in one group): store -> overwrite -> load
    gives back every byte of latent and rope part, target and draft alike."""
    eng = engine(model_dirs, mla=True, eagle=True, eagle_method=method)
    layout = eng.worker.worker.layout
    assert [g.is_eagle_group for g in layout.groups] == [True]
    assert [s.is_draft for s in layout.layers] == [False, False, True]
    for name, tensor in eng.kv_caches.items():
        assert tuple(tensor.shape[1:]) == (1, 16, 576), name  # no separate K and V
    page = 16 * 576 * 2  # block_size x (kv_lora_rank + rope dim) x bf16
    assert {s.page_bytes for s in layout.layers} == {page}
    assert layout.unit_bytes == 3 * (CHUNK // 16) * page
    tokens = prompt(31, 3 * CHUNK + 7)
    eng.add_request("fresh", tokens, max_tokens=4)
    eng.run_until_done()
    assert len(index_of(eng)) == 3

    eng.evict_gpu_kv()  # every block, latent and rope part, is overwritten
    eng.add_request("restored", tokens, max_tokens=4)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 3 * CHUNK
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]


@pytest.mark.parametrize("copy_path", ["kernel", "auto", "memcpy"])
def test_copy_path_setting_round_trips_and_stores_are_timed(
    model_dirs: tuple[Path, Path], copy_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any copy_path reaches the worker and restores every layer bit for bit; on CPU
    tensors the kernel's share runs the Triton kernel in its interpreter (one launch
    for every layer of a load). Stores carry a duration (the store GB/s of
    `restore-speed`), like loads."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eng = engine(model_dirs, extra_config={"copy_path": copy_path})
    worker = eng.worker.worker
    assert worker.copier.setting == copy_path and worker.copier.path == copy_path
    launches: list[int] = []  # bytes of each kernel launch, either kernel
    kernel = worker.copier.kernel
    if kernel is not None:
        copy = kernel.copy
        monkeypatch.setattr(
            kernel,
            "copy",
            lambda desc, stream: launches.append(desc.num_bytes) or copy(desc, stream),
        )
    pairs = worker.pair_copier.kernel
    if pairs is not None:
        copy_pairs = pairs.copy

        def count(table, first_pair, n_pairs, first_row, n_rows, to_host, stream):  # type: ignore[no-untyped-def]
            rows = pairs.layers[first_row : first_row + n_rows, pair_kernel.PAGE_BYTES]
            launches.append(n_pairs * int(rows.sum()))
            copy_pairs(table, first_pair, n_pairs, first_row, n_rows, to_host, stream)

        monkeypatch.setattr(pairs, "copy", count)
    tokens = prompt(3, 2 * CHUNK + 3)
    eng.take_published()
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    stored = eng.take_published()
    unit = worker.layout.unit_bytes
    assert stored["timed_bytes"]["store/cpu"] == 2 * unit
    assert stored["seconds"]["store/cpu"] > 0
    eng.evict_gpu_kv()
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 2 * CHUNK
    assert eng.mismatched_positions("restored") == []
    # Stores of two chunks, then their load: all by the pair kernel, a launch per
    # KV-cache group (target and draft layers in separate groups).
    if copy_path == "kernel":
        groups = len(worker.layout.groups)
        assert sum(launches) == 4 * unit and sum(launches[-groups:]) == 2 * unit
    elif copy_path == "memcpy":
        assert launches == []


def test_corrupt_host_copy_is_detected(model_dirs: tuple[Path, Path]) -> None:
    """Negative control: the bit-exact check notices a damaged draft layer."""
    eng = engine(model_dirs)
    tokens = prompt(2, 2 * CHUNK + 3)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    worker = eng.worker.worker
    draft = next(slot for slot in worker.layout.layers if slot.is_draft)
    for entry in list(index_of(eng)._entries.values()):
        unit = worker.pool.unit_view(entry.slot)
        unit[draft.offset : draft.offset + draft.nbytes] ^= 0x55
    eng.evict_gpu_kv()
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    bad_layers = {name for name, _ in eng.mismatched_positions("restored")}
    assert bad_layers == {draft.name}


def test_unit_needs_every_worker_part(model_dirs: tuple[Path, Path]) -> None:
    """With two workers, a unit one of them failed to store is never served."""
    eng = engine(model_dirs)
    sched = eng.scheduler.connector.scheduler
    sched.jobs.world_size = 2
    tokens = prompt(3, 2 * CHUNK + 1)
    eng.add_request("a", tokens, max_tokens=1)
    sched_out = eng.scheduler.schedule()
    store_ids = [job.job_id for job in sched_out.kv_connector_metadata.stores]
    assert store_ids
    ok = DraftOffloadWorkerMetadata(completed_jobs=dict.fromkeys(store_ids, 1))
    failed = DraftOffloadWorkerMetadata(failed_jobs=dict.fromkeys(store_ids, 1))
    from vllm.v1.outputs import KVConnectorOutput

    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=ok))
    assert all(not e.ready for e in index_of(eng)._entries.values())
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=ok.aggregate(failed).aggregate(ok))
    )
    assert len(index_of(eng)) == 0
    request = eng.scheduler.requests["a"]
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


def test_eagle_successor_mismatch_recomputes_one_token(model_dirs: tuple[Path, Path]) -> None:
    eng = engine(model_dirs, eagle=True)
    shared = prompt(4, 3 * CHUNK)
    eng.add_request("x", [*shared, 11, *prompt(5, 20)], max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()

    # Same prefix, different token after the chunk boundary: the last chunk is
    # loaded but its last position is recomputed, so its draft KV is rebuilt.
    eng.add_request("y", [*shared, 12, *prompt(6, 20)], max_tokens=2)
    eng.run_prefill("y")
    assert eng.external_hits["y"] == 3 * CHUNK - 1
    assert eng.mismatched_positions("y") == []
    eng.run_until_done()

    eng.evict_gpu_kv()
    eng.add_request("x2", [*shared, 11, *prompt(7, 40)], max_tokens=2)
    eng.run_prefill("x2")
    assert eng.external_hits["x2"] == 3 * CHUNK
    assert eng.mismatched_positions("x2") == []


@pytest.mark.parametrize(("second", "hit"), [((11, 14), 3 * CHUNK - 1), ((12, 13), 3 * CHUNK - 2)])
def test_mtp_successor_mismatch_recomputes_the_stale_positions(
    model_dirs: tuple[Path, Path], second: tuple[int, int], hit: int
) -> None:
    """Multi-module MTP (S = 2): a successor differing at j recomputes S - j positions."""
    eng = engine(model_dirs, eagle=True, eagle_method="mtp")
    assert eng.scheduler.connector.scheduler.num_successors == 2
    shared = prompt(23, 3 * CHUNK)
    eng.add_request("x", [*shared, 11, 13, *prompt(24, 20)], max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.add_request("y", [*shared, *second, *prompt(25, 20)], max_tokens=2)
    eng.run_prefill("y")
    assert eng.external_hits["y"] == hit
    assert eng.mismatched_positions("y") == []


def test_eagle_without_successor_check_would_serve_stale_draft_kv(
    model_dirs: tuple[Path, Path],
) -> None:
    """Negative control: with the successor rule off, the draft KV is stale."""
    eng = engine(model_dirs, eagle=True, extra_config={"successor_tokens": 0})
    shared = prompt(8, 2 * CHUNK)
    eng.add_request("x", [*shared, 11, *prompt(9, 10)], max_tokens=1)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.add_request("y", [*shared, 12, *prompt(10, 10)], max_tokens=1)
    eng.run_prefill("y")
    assert eng.external_hits["y"] == 2 * CHUNK
    stale = eng.mismatched_positions("y")
    assert stale and all(pos == 2 * CHUNK - 1 for _, pos in stale)


def test_chunk_ending_on_prompt_end_is_stored_with_sampled_successor(
    model_dirs: tuple[Path, Path],
) -> None:
    eng = engine(model_dirs, eagle=True)
    tokens = prompt(11, 2 * CHUNK)
    eng.add_request("a", tokens, max_tokens=3)
    eng.run_until_done()
    first_output = eng.outputs["a"][0]
    successors = {entry.successors for entry in index_of(eng)._entries.values()}
    assert (first_output,) in successors
    # A follow-up turn that continues with the model's own answer reuses both chunks.
    eng.evict_gpu_kv()
    eng.add_request("turn2", [*tokens, *eng.outputs["a"], *prompt(12, 9)], max_tokens=1)
    eng.run_prefill("turn2")
    assert eng.external_hits["turn2"] >= 2 * CHUNK
    assert eng.mismatched_positions("turn2") == []


def test_budget_and_lru_under_many_requests(model_dirs: tuple[Path, Path]) -> None:
    eng = engine(model_dirs, cpu_units=6)
    worker = eng.worker.worker
    budget = eng.vllm_config.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"]
    assert worker.pool.buffer.numel() <= budget
    for i in range(12):
        eng.add_request(f"r{i}", prompt(100 + i, 2 * CHUNK + 1), max_tokens=1)
        eng.run_until_done()
        assert len(index_of(eng)) <= 6
    assert index_of(eng).num_evictions == 12 * 2 - 6
    eng.evict_gpu_kv()
    # Under spec decode the derived min_compute_tokens (2) leaves one token of
    # the second chunk to compute.
    for i, expected in ((11, 2 * CHUNK - 1), (0, 0)):
        eng.add_request(f"again{i}", prompt(100 + i, 2 * CHUNK + 1), max_tokens=1)
        eng.run_prefill(f"again{i}")
        assert eng.external_hits[f"again{i}"] == expected
        assert eng.mismatched_positions(f"again{i}") == []
        eng.run_until_done()


def test_failed_load_falls_back_to_recompute(model_dirs: tuple[Path, Path]) -> None:
    eng = engine(model_dirs)
    tokens = prompt(13, 2 * CHUNK + 7)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    # Damage the load plan the scheduler hands the worker: the worker must
    # refuse it and report the blocks, and vLLM must recompute them.
    sched = eng.scheduler.connector.scheduler
    real_alloc = sched.update_state_after_alloc

    def sabotage(request, blocks, num_external_tokens):  # noqa: ANN001, ANN202
        real_alloc(request, blocks, num_external_tokens)
        for job in sched._pending_loads:
            job.host_pages[0][0] = 10**9

    sched.update_state_after_alloc = sabotage
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    assert eng.mismatched_positions("restored") == []
    sched.update_state_after_alloc = real_alloc
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    # The units of the failed load were dropped, and stored again from the KV the
    # request recomputed: a later restore is bit-exact.
    assert len(index_of(eng)) == 2
    eng.evict_gpu_kv()
    eng.add_request("again", tokens, max_tokens=1)
    eng.run_prefill("again")
    assert eng.external_hits["again"] == 2 * CHUNK
    assert eng.mismatched_positions("again") == []


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"cpu_bytes_to_use": 1 << 30, "chunk_sise": 32}, "chunk_sise"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1 << 30, "chunk_size": 24}, "chunk_size"),
        ({"cpu_bytes_to_use": 1000}, "cpu_bytes_to_use"),
        ({}, "cpu_bytes_to_use"),
    ],
)
def test_bad_config_names_the_field(
    model_dirs: tuple[Path, Path], extra: dict[str, object], field: str
) -> None:
    eng = engine(model_dirs)
    eng.vllm_config.kv_transfer_config.kv_connector_extra_config = extra
    with pytest.raises(ConfigError, match=field):
        DraftOffloadConnector(eng.vllm_config, KVConnectorRole.SCHEDULER, eng.kv_cache_config)


def test_layers_and_geometry_come_from_vllm(model_dirs: tuple[Path, Path]) -> None:
    eng = engine(model_dirs, draft_layout="separate_group")
    layout = eng.worker.worker.layout
    drafts = [slot for slot in layout.layers if slot.is_draft]
    assert [slot.name for slot in drafts] == ["draft_model.model.layers.0.self_attn.attn"]
    assert [group.block_size for group in layout.groups] == [16, 32]
    assert layout.unit_bytes == sum(slot.nbytes for slot in layout.layers)
    draft_tensor = eng.kv_caches[drafts[0].name]
    assert draft_tensor.dtype == torch.bfloat16
    assert drafts[0].page_bytes == draft_tensor.stride(0) * draft_tensor.element_size()


def test_audit_catches_corrupt_draft_layer_and_recomputes(model_dirs: tuple[Path, Path]) -> None:
    eng = engine(model_dirs, extra_config={"audit": True})
    tokens = prompt(14, 3 * CHUNK + 2)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    worker = eng.worker.worker
    draft = next(slot for slot in worker.layout.layers if slot.is_draft)
    victim = next(iter(index_of(eng)._entries.values()))
    unit = worker.pool.unit_view(victim.slot)
    unit[draft.offset + 5] ^= 0x01  # one flipped bit in one draft layer
    eng.evict_gpu_kv()
    eng.take_published()
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    assert eng.mismatched_positions("restored") == []
    assert eng.take_published()["fallbacks"] == {"audit_mismatch": 1}
    # The condemned unit is dropped; the recomputed chunk is stored again.
    assert index_of(eng).get(victim.unit_id) is not victim
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    eng.evict_gpu_kv()
    eng.add_request("again", tokens, max_tokens=1)
    eng.run_prefill("again")
    assert eng.external_hits["again"] == 3 * CHUNK
    assert eng.mismatched_positions("again") == []
    assert eng.take_published()["fallbacks"] == {}


def test_acceptance_is_split_by_restored_prefix(model_dirs: tuple[Path, Path]) -> None:
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    eng = engine(model_dirs)
    tokens = prompt(15, 2 * CHUNK + 1)
    seen = {}
    for req_id, accepted in (("fresh", (2, 1)), ("restored", (2, 2))):
        if req_id == "restored":
            eng.scheduler.reset_prefix_cache()
        eng.add_request(req_id, tokens, max_tokens=1)
        metrics = RequestSpecDecodeMetrics.new(2)
        for count in accepted:  # what vLLM observes at each verify step
            metrics.observe(num_draft_tokens=2, num_accepted=count)
        eng.scheduler.requests[req_id].spec_decode_metrics = metrics
        seen["true" if req_id == "restored" else "false"] = metrics
        eng.run_until_done()
    published = eng.take_published()
    # vLLM itself may observe more verify steps; the split must follow the request.
    assert published["drafts"] == {k: sum(m.histogram) for k, m in seen.items()}
    assert published["accepted"] == {"false": 3, "true": 4}
    assert eng.external_hits["restored"] == 2 * CHUNK - 1  # derived min_compute_tokens: 2


def test_short_remainders_wait_for_all_loads_before_the_forward(
    model_dirs: tuple[Path, Path],
) -> None:
    """A step that may be replayed as a full CUDA graph runs no per-layer hooks."""
    eng = engine(model_dirs)
    tokens = prompt(16, 3 * CHUNK + 1)  # a hit leaves exactly one token to compute
    eng.add_request("fresh", tokens, max_tokens=1)
    eng.run_until_done()
    eng.scheduler.reset_prefix_cache()
    eng.add_request("full-hit", tokens, max_tokens=1)
    eng.add_request("long-tail", [*tokens[: 2 * CHUNK], *prompt(17, 3 * CHUNK)], max_tokens=1)
    eng.run_until_done()
    flags = [meta.wait_loads_before_forward for meta in eng.load_metas]
    assert flags == [True]  # both loads share one step; one of them is short
    eng.scheduler.reset_prefix_cache()
    eng.add_request("long-tail-2", [*tokens[: 2 * CHUNK], *prompt(18, 3 * CHUNK)], max_tokens=1)
    eng.run_until_done()
    assert [meta.wait_loads_before_forward for meta in eng.load_metas[1:]] == [False]


def test_hits_leave_two_tokens_to_compute_under_spec_decode(
    model_dirs: tuple[Path, Path],
) -> None:
    """vLLM 0.33's proposers waste the first draft after a one-token first step."""
    eng = engine(model_dirs, extra_config={"min_compute_tokens": None})
    tokens = prompt(19, 2 * CHUNK)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 2 * CHUNK - 2
    assert eng.mismatched_positions("restored") == []


def test_stalled_jobs_stop_holding_the_engine_loop(model_dirs: tuple[Path, Path]) -> None:
    import vllm_draft_offload.scheduler_side as scheduler_side

    eng = engine(model_dirs)
    connector = eng.scheduler.connector
    eng.add_request("a", prompt(20, 2 * CHUNK + 1), max_tokens=1)
    eng.scheduler.schedule()  # store jobs issued; no worker ever reports them
    assert connector.has_pending_push_work()
    connector.scheduler.jobs.last_progress -= scheduler_side.STALL_S + 1
    assert not connector.has_pending_push_work()


def test_unit_evicted_between_lookup_and_load_means_recompute(
    model_dirs: tuple[Path, Path],
) -> None:
    eng = engine(model_dirs)
    tokens = prompt(21, 2 * CHUNK + 3)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    sched = eng.scheduler.connector.scheduler
    real_lookup = sched.get_num_new_matched_tokens

    def lookup_then_evict(request, num_computed_tokens):  # noqa: ANN001, ANN202
        result = real_lookup(request, num_computed_tokens)
        sched.index.clear_unpinned()  # e.g. another request's fetch took the slots
        return result

    sched.get_num_new_matched_tokens = lookup_then_evict
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    sched.get_num_new_matched_tokens = real_lookup
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    assert eng.take_published()["fallbacks"] == {"load_error": 1}


def test_unit_evicted_mid_prefix_keeps_the_chunks_before_it(
    model_dirs: tuple[Path, Path],
) -> None:
    eng = engine(model_dirs)
    tokens = prompt(22, 3 * CHUNK + 3)
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.take_published()
    sched = eng.scheduler.connector.scheduler
    real_lookup = sched.get_num_new_matched_tokens

    def lookup_then_evict_second(request, num_computed_tokens):  # noqa: ANN001, ANN202
        result = real_lookup(request, num_computed_tokens)
        match = sched._requests[request.request_id].pending_match
        sched.index.remove(match.chunks[1][1].handle)  # the second of three chunks
        return result

    sched.get_num_new_matched_tokens = lookup_then_evict_second
    eng.add_request("restored", tokens, max_tokens=2)
    eng.run_prefill("restored")
    sched.get_num_new_matched_tokens = real_lookup
    assert sched.restored_tokens("restored") == CHUNK
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    assert eng.outputs["restored"] == eng.outputs["fresh"]
    published = eng.take_published()
    assert published["fallbacks"] == {"load_error": 1}
    assert published["chunks"]["load/cpu"] == 1  # the first chunk still came from the tier


def test_requests_opt_out_of_stores_and_loads(
    model_dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """kv_transfer_params["draft_offload"]: `store: false` leaves the tier untouched,
    `load: false` recomputes a prefix the tier holds, and a value that is not a
    boolean is logged by its field and read as both (the cache is left alone)."""
    eng = engine(model_dirs, eagle=True)
    tokens = prompt(21, 2 * CHUNK + 1)
    eng.add_request(
        "private", tokens, max_tokens=3, kv_transfer_params={"draft_offload": {"store": False}}
    )
    eng.run_until_done()
    assert len(index_of(eng)) == 0
    with caplog.at_level("WARNING", logger="vllm_draft_offload.request_options"):
        eng.add_request(
            "typo", tokens, max_tokens=3, kv_transfer_params={"draft_offload": {"store": "no"}}
        )
        eng.run_until_done()
    assert len(index_of(eng)) == 0
    assert "kv_transfer_params.draft_offload.store" in caplog.text
    eng.add_request("public", tokens, max_tokens=3)
    eng.run_until_done()
    assert len(index_of(eng)) == 2
    for req_id, options in (("no-load", {"load": False}), ("typo-load", {"lod": False})):
        eng.evict_gpu_kv()
        eng.add_request(req_id, tokens, max_tokens=3, kv_transfer_params={"draft_offload": options})
        eng.run_prefill(req_id)
        assert eng.external_hits[req_id] == 0, req_id
        eng.run_until_done()
    eng.evict_gpu_kv()
    eng.add_request("restored", tokens, max_tokens=3)
    eng.run_prefill("restored")
    assert eng.external_hits["restored"] == 2 * CHUNK - 1
    assert eng.mismatched_positions("restored") == []
    eng.run_until_done()
    outputs = {
        eng.outputs[r] == eng.outputs["private"] for r in ("typo", "public", "no-load", "restored")
    }
    assert outputs == {True}
