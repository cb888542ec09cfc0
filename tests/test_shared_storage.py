"""Two engines, two processes, one storage backend (an fs:// directory or one Redis).

Engine A runs in its own process and keeps serving new prompts, landing every prompt's
units in L3. Engine B starts while A is writing, with an empty CPU tier, and serves prompts
that extend A's: every hit comes from what A wrote, and must equal a fresh prefill in
every target and draft layer. B writes its own new chunks at the same time.

A is a spawned interpreter, not a fork: a process forked from one that has imported vLLM
and torch can deadlock on a lock some other thread held at the fork (seen here). Its
start-up (importing vLLM) is most of this test's time.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from kv_sim import SimEngine, prompt
from test_l3_tier import CHUNK, finish_l3_writes, l3_engine

A_TOKENS = 3 * CHUNK + 9  # three whole chunks; the third's successor is in the prompt
MAX_A_PROMPTS = 40


def a_prompt(i: int) -> list[int]:
    return prompt(300 + i, A_TOKENS)


def engine_a(model_dirs: tuple[Path, Path], urls: list[str], written: Any, stop: Any) -> None:
    """Serve prompt after prompt on one engine per backend; report each prompt once its
    units are in every backend. (One process runs both backends' engines A, since the
    process start, importing vLLM, is most of this test's time.)"""
    try:
        engines = [l3_engine(model_dirs, url, eagle=True) for url in urls]
        i = 0
        while not stop.is_set() and i < MAX_A_PROMPTS:
            for eng in engines:
                eng.add_request(f"a{i}", a_prompt(i), max_tokens=2)
                eng.run_until_done()
                finish_l3_writes(eng)
            written.put(("written", i, None))
            i += 1
        for eng in engines:
            eng.worker.shutdown()
        written.put(("done", i, None))
    except BaseException as exc:  # the parent must hear of it, not time out
        written.put(("error", repr(exc), None))
        raise


def wait_for(written: Any, what: str = "written", timeout_s: float = 60) -> tuple[Any, Any]:
    kind, value, extra = written.get(timeout=timeout_s)
    assert kind == what, (kind, value)
    return value, extra


def check_engine_b(b: SimEngine, url: str, prompts: tuple[int, ...]) -> None:
    for i in prompts:
        req = f"b{i}"
        # B's prompt extends A's by a chunk of its own, which B stores in turn.
        b.add_request(req, a_prompt(i) + prompt(900 + i, CHUNK), max_tokens=2)
        b.run_prefill(req)
        assert b.external_hits[req] == 3 * CHUNK, url
        assert b.mismatched_positions(req) == [], url  # every target and draft layer
        b.run_until_done()
    finish_l3_writes(b)
    published = b.take_published()
    assert published["hits"]["l3"] == 3 * len(prompts), url
    assert published.get("refused", {}) == {}, url
    assert published["chunks"].get("store/l3", 0) >= len(prompts), url  # B's own chunks
    b.worker.shutdown()


def run_two_engines(model_dirs: tuple[Path, Path], urls: list[str]) -> None:
    ctx = multiprocessing.get_context("spawn")
    written, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=engine_a, args=(model_dirs, urls, written, stop))
    proc.start()
    try:
        first, _ = wait_for(written, timeout_s=180)  # A has landed one prompt, goes on
        # B (fresh CPU tier) starts while A writes; prompt 1 lands after B started.
        engines_b = [l3_engine(model_dirs, url, eagle=True) for url in urls]
        latest, _ = wait_for(written)
        assert (first, latest) == (0, 1)
        for b, url in zip(engines_b, urls, strict=True):
            check_engine_b(b, url, (first, latest))
        stop.set()
        # A kept writing the whole time B ran, and stops cleanly.
        kind, value, _ = written.get(timeout=60)
        while kind == "written":
            kind, value, _ = written.get(timeout=60)
        assert kind == "done", value
        assert value >= 2
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_two_engines_share_an_fs_directory_and_a_redis(
    model_dirs: tuple[Path, Path], tmp_path: Path, redis_url: str
) -> None:
    run_two_engines(model_dirs, [f"fs://{tmp_path / 'l3'}", redis_url])
    # Only whole objects are left in the directory: no writer's temp file stays behind.
    assert {p.suffix for p in (tmp_path / "l3").iterdir()} == {".data"}
