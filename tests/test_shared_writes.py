"""Several engines (processes) writing the same unit into one backend never expose a torn or
mixed object: every read returns one writer's whole object, or nothing yet.

Each writer is a separate process with its own L3Store, as two engines sharing one fs://
directory or one Redis would be. L3Store drops a second put of a key only inside one
process, so across processes the backend itself must keep concurrent puts apart.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import blake3

from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_store import L3Store

KEY = "5ea7ed"
WRITE_S = 1.5
EXTRA = {
    "draft_offload.l3_timeout_s": 10.0,
    "draft_offload.l3_namespace": "vdo-shared-test",
    "draft_offload.l3_staging_mb": 64,
    "save_chunk_meta": True,
}


def writer(cfg: dict[str, Any], writer_id: int, go: Any, results: Any) -> None:
    """One engine's writes: KEY over and over, each time another self-checking object.

    An object is 32 bytes of blake3 digest of the rest, then the writer id and a counter,
    then filler. Sizes differ by writer, so a torn file shows as a wrong length as well as
    a wrong digest.
    """
    store = L3Store.from_dict(cfg, timeout_s=10)
    size = (2 << 20) + writer_id * 65536
    go.wait()
    stop_at = time.monotonic() + WRITE_S
    puts, errors, n = 0, [], 0
    while time.monotonic() < stop_at:
        n += 1
        body = bytes([writer_id, n % 256]) * (size // 2)
        try:
            store.put(KEY, blake3.blake3(body).digest() + body)
            puts += 1
        except L3Error as e:
            errors.append(str(e))
    store.close()
    results.put({"puts": puts, "errors": errors[:5], "n_errors": len(errors)})


def whole(blob: bytes) -> bool:
    return len(blob) > 32 and blake3.blake3(blob[32:]).digest() == blob[:32]


def run_writers_and_read(cfg: dict[str, Any], writers: int = 2) -> dict[str, Any]:
    """Start the writer processes, read KEY from this one until they stop; count what was
    seen. Writers come from a forkserver that has imported the store once: a fresh
    interpreter per writer would spend most of the test importing torch and LMCache, and
    a fork of the test process itself could inherit a lock some other thread holds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm_draft_offload.l3_store", "blake3"])
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=writer, args=(cfg, w, go, results)) for w in range(writers)]
    for p in procs:
        p.start()
    seen: dict[str, Any] = {"whole": 0, "torn": 0, "missing": 0, "errors": []}
    writers_seen: set[int] = set()
    store = L3Store.from_dict(cfg, timeout_s=10)
    try:
        go.set()
        # Reads start once the first object is in place: from then on the key must always
        # be there, whole. (Before, a get that finds no file and an exists() that finds the
        # first one renamed in meanwhile would be reported as corrupt, a race of the
        # reader with the very first write, not of the writers.)
        while not store.contains(KEY) and any(p.is_alive() for p in procs):
            time.sleep(0.001)
        while any(p.is_alive() for p in procs):
            try:
                blob = store.get(KEY)
            except L3Error as e:
                seen["errors"].append(str(e))
                continue
            if blob is None:
                seen["missing"] += 1
            elif whole(blob):
                seen["whole"] += 1
                writers_seen.add(blob[32])
            else:
                seen["torn"] += 1
        final = store.get(KEY)
    finally:
        store.close()
    seen["writers"] = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    seen["writers_seen"] = sorted(writers_seen)
    seen["final_whole"] = final is not None and whole(final)
    return seen


def assert_never_torn(seen: dict[str, Any]) -> None:
    # The run must have raced at all: both writers stored many times, and reads saw objects.
    assert all(w["puts"] >= 10 for w in seen["writers"]), seen["writers"]
    assert seen["whole"] >= 10, seen
    assert seen["torn"] == 0, seen
    assert seen["missing"] == 0, seen
    assert seen["errors"] == [], seen["errors"][:5]
    assert [w["n_errors"] for w in seen["writers"]] == [0, 0], seen["writers"]
    assert seen["final_whole"]


def test_fs_concurrent_writers_of_one_unit_never_expose_a_torn_object(tmp_path: Path) -> None:
    base = tmp_path / "l3"
    cfg = {"remote_url": f"fs://{base}", "extra_config": EXTRA}
    seen = run_writers_and_read(cfg)
    assert_never_torn(seen)
    # Nothing but the one object is left: every writer's temp file was renamed or removed.
    assert [p.suffix for p in base.iterdir()] == [".data"]


def test_redis_concurrent_writers_of_one_unit_never_expose_a_mixed_object(
    redis_url: str,
) -> None:
    cfg = {"remote_url": redis_url, "extra_config": EXTRA}
    assert_never_torn(run_writers_and_read(cfg))
