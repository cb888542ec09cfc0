"""The LMCache tier at the connector level: real Scheduler, real connector halves,
real LMCache backends (a persistent fs:// path and a redis-server on loopback).

A "restart" is a new SimEngine: new scheduler, new worker, new host pool and new
L3 clients, with nothing shared with the old one but the storage backend.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from kv_sim import SimEngine, SimSetup, prompt, write_tiny_llama

from vllm_draft_offload import unit_fetch
from vllm_draft_offload.l3_fs_reads import ObjectFile
from vllm_draft_offload.l3_objects import object_key
from vllm_draft_offload.unit_codec import layer_view, pack_unit, read_header

CHUNK = 32
L3_EXTRA = {
    "draft_offload.l3_timeout_s": 2.0,
    "draft_offload.l3_retry_interval_s": 0.5,
    "draft_offload.l3_namespace": "vdo-tier-test",
    "draft_offload.l3_staging_mb": 16,
    "save_chunk_meta": True,
}


def l3_engine(
    model_dirs: tuple[Path, Path], url: str, draft_path: Path | None = None, **setup: object
) -> SimEngine:
    extra = {
        # The read path itself is under test here, not the cost policy (test_l3_cost.py).
        "l3": {"enabled": True, "timeout_s": 2.0, "hit_policy": "always"},
        "lmcache.remote_url": url,
        "lmcache.extra_config": L3_EXTRA,
        **setup.pop("extra_config", {}),  # type: ignore[dict-item]
    }
    target, draft = model_dirs
    return SimEngine(target, draft_path or draft, SimSetup(extra_config=extra, **setup))


def finish_l3_writes(eng: SimEngine) -> None:
    l3 = eng.worker.worker.l3
    assert l3 is not None and l3.store is not None
    l3.flush(10)
    eng.step()  # report the snapshots


def fill_l3(
    model_dirs: tuple[Path, Path], url: str, tokens: list[int], max_tokens: int = 1, **setup: object
) -> SimEngine:
    """One engine serves request "fresh", lands its L3 writes and stops."""
    first = l3_engine(model_dirs, url, **setup)
    first.add_request("fresh", tokens, max_tokens=max_tokens)
    first.run_until_done()
    finish_l3_writes(first)
    first.worker.shutdown()
    return first


def run_restart(
    model_dirs: tuple[Path, Path], url: str, eagle: bool, draft_layout: str = "shared_group"
) -> None:
    tokens = prompt(21, 3 * CHUNK + 9)
    first = fill_l3(model_dirs, url, tokens, max_tokens=3, eagle=eagle, draft_layout=draft_layout)

    second = l3_engine(model_dirs, url, eagle=eagle, draft_layout=draft_layout)
    sched = second.scheduler.connector.scheduler
    real_lookup, answers = sched.get_num_new_matched_tokens, []

    def recording_lookup(request, num_computed_tokens):  # noqa: ANN001, ANN202
        answers.append(real_lookup(request, num_computed_tokens))
        return answers[-1]

    sched.get_num_new_matched_tokens = recording_lookup
    second.add_request("after-restart", tokens, max_tokens=3)
    second.run_prefill("after-restart")
    # The request waits for its lookup and fetches (None), then loads from the CPU tier:
    # asynchronously when the drafter has its own KV-cache group, or, with
    # l3.overlap_restore, admitted with its fetches under way as an asynchronous load
    # that restores each unit as it lands.
    overlap = sched.config.l3.overlap_restore
    assert all(answer == (None, False) for answer in answers[:-1])
    assert answers[-1] == (3 * CHUNK, overlap or draft_layout == "separate_group")
    assert second.external_hits["after-restart"] == 3 * CHUNK
    assert second.mismatched_positions("after-restart") == []
    second.run_until_done()
    assert second.outputs["after-restart"] == first.outputs["fresh"]
    data = second.take_published()
    assert data["hits"]["l3"] == 3
    # The read threads' clocks: three units read, each with some CPU time of its own.
    reads = data["l3_thread_seconds"]
    assert reads["read/wall"] > 0 and 0 < reads["read/cpu"] <= reads["read/wall"] + 1e-3
    second.worker.shutdown()


@pytest.mark.parametrize("eagle", [False, True])
def test_restart_restores_from_persistent_path(
    model_dirs: tuple[Path, Path], tmp_path: Path, eagle: bool
) -> None:
    run_restart(model_dirs, f"fs://{tmp_path / 'l3'}", eagle)


def test_restart_restores_with_each_unit_spread_over_threads(
    model_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """l3.spread_reads: every unit's layers read by several threads (pieces small enough
    that each unit has several runs): restored KV bit-exact, target and draft, and the
    same output."""
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(23, 3 * CHUNK + 9)
    first = fill_l3(model_dirs, url, tokens, max_tokens=3, eagle=True)
    assert first.worker.worker.l3._spread_pool is None  # off by default
    spread_fetches = []
    real = unit_fetch._read_runs

    def counting(file, span, dest, runs, piece_bytes, spread):  # type: ignore[no-untyped-def]
        spread_fetches.append(len(runs))
        real(file, span, dest, runs, piece_bytes, spread)

    monkeypatch.setattr(unit_fetch, "_read_runs", counting)
    spread = {"enabled": True, "timeout_s": 2.0, "hit_policy": "always", "spread_reads": True}
    second = l3_engine(model_dirs, url, eagle=True, extra_config={"l3": spread})
    l3 = second.worker.worker.l3
    assert l3 is not None
    l3.fetch_piece_bytes = 1024
    second.add_request("after-restart", tokens, max_tokens=3)
    second.run_prefill("after-restart")
    assert second.external_hits["after-restart"] == 3 * CHUNK
    assert len(spread_fetches) == 3 and min(spread_fetches) > 1, spread_fetches
    assert second.mismatched_positions("after-restart") == []
    second.run_until_done()
    assert second.outputs["after-restart"] == first.outputs["fresh"]
    second.worker.shutdown()


def test_restart_restores_with_each_unit_split_over_threads_in_one_call(
    model_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """l3.threads_per_unit 2 of 4 read threads: two units at a time, each one read call
    split over two threads; restored KV bit-exact, target and draft, and the same
    output."""
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(24, 3 * CHUNK + 9)
    first = fill_l3(model_dirs, url, tokens, max_tokens=3, eagle=True)
    split_reads: list[int] = []
    real = ObjectFile.readinto_layers_hashed

    def counting(file, pos, buf, sizes, piece, threads=1):  # type: ignore[no-untyped-def]
        split_reads.append(threads)
        return real(file, pos, buf, sizes, piece, threads)

    monkeypatch.setattr(ObjectFile, "readinto_layers_hashed", counting)
    l3 = {"enabled": True, "timeout_s": 2.0, "hit_policy": "always", "io_threads": 4}
    second = l3_engine(
        model_dirs, url, eagle=True, extra_config={"l3": {**l3, "threads_per_unit": 2}}
    )
    assert second.worker.worker.l3._read_pool._max_workers == 2
    second.add_request("after-restart", tokens, max_tokens=3)
    second.run_prefill("after-restart")
    assert second.external_hits["after-restart"] == 3 * CHUNK
    assert split_reads == [2, 2, 2], split_reads
    assert second.mismatched_positions("after-restart") == []
    second.run_until_done()
    assert second.outputs["after-restart"] == first.outputs["fresh"]
    second.worker.shutdown()


def test_restart_restores_into_separate_draft_group(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    run_restart(model_dirs, f"fs://{tmp_path / 'l3'}", eagle=True, draft_layout="separate_group")


def test_restart_restores_from_redis(model_dirs: tuple[Path, Path], redis_url: str) -> None:
    run_restart(model_dirs, redis_url, eagle=True)


def test_other_drafter_never_reuses_objects(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(22, 2 * CHUNK + 1)
    fill_l3(model_dirs, url, tokens)
    other_draft = write_tiny_llama(
        tmp_path / "other-draft", layers=1, heads=2, kv_heads=2, head_dim=64
    )
    other = l3_engine(model_dirs, url, draft_path=other_draft)
    other.add_request("other", tokens, max_tokens=1)
    other.run_prefill("other")
    assert other.external_hits["other"] == 0


def _reencode(blob: bytes, *, drop_draft: bool = False, drafter_id: str | None = None) -> bytes:
    """Rewrite a stored unit as a faulty writer would: a valid object, wrong content."""
    header, payload = read_header(blob)
    layers = [
        (entry.name, entry.is_draft, layer_view(payload, entry))
        for entry in header.layers
        if not (drop_draft and entry.is_draft)
    ]
    identity = replace(header.identity, drafter_id=drafter_id or header.drafter_id)
    _, new_blob = pack_unit(identity, layers)
    return new_blob


FAULTS = {
    "truncated": lambda blob: blob[: len(blob) // 2],
    "checksum_mismatch": lambda blob: blob[:-9] + bytes([blob[-9] ^ 0xFF]) + blob[-8:],
    "draft_part_missing": lambda blob: _reencode(blob, drop_draft=True),
    "drafter_mismatch": lambda blob: _reencode(blob, drafter_id="some-other-drafter"),
}


@pytest.mark.parametrize("cause", [*FAULTS, "object_missing"])
def test_faulty_objects_mean_recompute(
    model_dirs: tuple[Path, Path], tmp_path: Path, cause: str
) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(23, 2 * CHUNK + 5)
    first = l3_engine(model_dirs, url)
    first.add_request("fresh", tokens, max_tokens=2)
    first.run_until_done()
    finish_l3_writes(first)
    store = first.worker.worker.l3.store
    # Damage the object of the prompt's second chunk; the first stays intact.
    second_key = _second_chunk_key(first, tokens)
    name = object_key(second_key, 0)
    blob = store.get(name)
    header = read_header(blob)[0] if blob is not None else None
    assert header is not None and header.key == second_key.hex()
    assert '"method": "draft_model"' in header.drafter_id  # the header names the drafter
    if cause == "object_missing":
        assert store.remove(name)
    else:
        store.put(name, FAULTS[cause](blob))
    first.worker.shutdown()

    second = l3_engine(model_dirs, url)
    second.add_request("after", tokens, max_tokens=2)
    second.run_prefill("after")
    assert second.external_hits["after"] == CHUNK  # the intact first chunk only
    assert second.mismatched_positions("after") == []
    second.run_until_done()
    assert second.outputs["after"] == first.outputs["fresh"]
    published = second.take_published()
    expected = {} if cause == "object_missing" else {cause: 1}
    assert published.get("refused", {}) == expected
    # Present in storage (a lookup hit) is not the same as usable.
    assert published["hits"]["l3"] == (1 if cause == "object_missing" else 2)


def _second_chunk_key(eng: SimEngine, tokens: list[int]) -> bytes:
    from vllm_draft_offload.chunk_keys import ChunkKeyChain

    sched = eng.scheduler.connector.scheduler
    return ChunkKeyChain(sched.salt, CHUNK).extend(tokens)[1]


def test_unreachable_backend_serves_from_cpu_tier(model_dirs: tuple[Path, Path]) -> None:
    # Nothing listens on this loopback port: L3 is down from the start.
    eng = l3_engine(model_dirs, "redis://127.0.0.1:9")
    tokens = prompt(24, 2 * CHUNK + 3)
    started = time.monotonic()
    eng.add_request("fresh", tokens, max_tokens=2)
    eng.run_until_done()
    eng.evict_gpu_kv()
    eng.add_request("again", tokens, max_tokens=2)
    eng.run_prefill("again")
    assert eng.external_hits["again"] == 2 * CHUNK  # from the CPU tier
    assert eng.mismatched_positions("again") == []
    eng.run_until_done()
    assert time.monotonic() - started < 60
    fallbacks = eng.take_published()["fallbacks"]
    assert fallbacks.get("l3_write_dropped", 0) + fallbacks.get("store_failed", 0) >= 1


def test_store_job_larger_than_write_backlog_writes_its_first_units(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    probe = l3_engine(model_dirs, url)
    unit_bytes = probe.worker.worker.layout.unit_bytes
    probe.worker.shutdown()
    # Room for one unit: a 3-chunk prefill stores 3 units in one job.
    l3 = {"enabled": True, "timeout_s": 2.0, "max_pending_write_bytes": unit_bytes * 3 // 2}
    tokens = prompt(25, 3 * CHUNK + 5)
    first = fill_l3(model_dirs, url, tokens, extra_config={"l3": l3})
    assert first.take_published()["fallbacks"].get("l3_write_dropped") == 2

    second = l3_engine(model_dirs, url)
    second.add_request("after-restart", tokens, max_tokens=1)
    second.run_prefill("after-restart")
    assert second.external_hits["after-restart"] == CHUNK
    assert second.mismatched_positions("after-restart") == []
    second.worker.shutdown()


def test_write_backlog_below_one_unit_is_a_config_error(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    from vllm_draft_offload.config import ConfigError

    l3 = {"enabled": True, "max_pending_write_bytes": 1024}
    with pytest.raises(ConfigError, match=r"l3\.max_pending_write_bytes"):
        l3_engine(model_dirs, f"fs://{tmp_path / 'l3'}", extra_config={"l3": l3})


def test_fetch_does_not_wait_behind_writes(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    import threading

    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(26, 3 * CHUNK + 2)
    fill_l3(model_dirs, url, tokens)

    second = l3_engine(model_dirs, url)
    l3 = second.worker.worker.l3
    assert l3 is not None
    # Every write thread busy (a long prompt's write-behind) while a request waits on L3.
    release = threading.Event()
    for _ in range(l3.config.io_threads):
        l3._write_pool.submit(release.wait, 30)
    try:
        second.add_request("after-restart", tokens, max_tokens=2)
        second.run_prefill("after-restart")
        assert second.external_hits["after-restart"] == 3 * CHUNK
        assert second.mismatched_positions("after-restart") == []
    finally:
        release.set()
    second.worker.shutdown()
