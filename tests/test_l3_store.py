"""L3Store against real LMCache connectors and real backends: an fs path, redis-server, and
LMCache's own lm:// server. Faults are real (killed or stopped processes, file-size limits,
redis OOM, truncated objects), never mocks.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import pytest
from redis_fixture import RedisServer, free_port, redis_server_binary, wait_for_port

from vllm_draft_offload.l3_backends import L3Settings, load_lmcache_config, make_key
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.unit_codec import UnitIdentity, UnitRejected, pack_unit
from vllm_draft_offload.unit_verify import ExpectedUnit, decode_unit

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0
RETRY_S = 0.5
NS = "vdo-test"

needs_redis = pytest.mark.skipif(
    redis_server_binary() is None, reason="redis-server not installed (apt install redis-server)"
)


# ---- helpers ---------------------------------------------------------------------------------
def _extra(**over: Any) -> dict[str, Any]:
    extra = {
        "draft_offload.l3_timeout_s": TIMEOUT_S,
        "draft_offload.l3_retry_interval_s": RETRY_S,
        "draft_offload.l3_namespace": NS,
        "draft_offload.l3_staging_mb": 64,
    }
    extra.update({f"draft_offload.{k}": v for k, v in over.items()})
    return extra


def open_store(url: str, **over: Any) -> L3Store:
    return L3Store.from_dict({"remote_url": url, "extra_config": _extra(**over)})


def fs_url(path: Path) -> str:
    return f"fs://{path}"  # path is absolute, so this is the fs:///abs form


def new_key(rng: random.Random) -> str:
    return rng.randbytes(16).hex()


def realistic_unit(
    rng: random.Random, key: str, target_layer_bytes: int = 1 << 20
) -> tuple[bytes, ExpectedUnit]:
    """Four target layers and two smaller drafter layers (the drafter has fewer KV heads)."""
    layers = [
        (f"model.layers.{i}.attn", False, rng.randbytes(target_layer_bytes)) for i in range(4)
    ]
    draft_bytes = target_layer_bytes * 3 // 32
    layers += [(f"draft.layers.{i}.attn", True, rng.randbytes(draft_bytes)) for i in range(2)]
    header, blob = pack_unit(
        UnitIdentity(
            key=key,
            geometry_fingerprint="tiny-llama|bf16|blk16",
            drafter_id="eagle3-tiny@1",
            num_tokens=256,
            successor_tokens=[rng.randrange(32000)],
        ),
        layers,
    )
    expected = ExpectedUnit(
        key=key,
        geometry_fingerprint=header.geometry_fingerprint,
        drafter_id=header.drafter_id,
        layers=header.layer_specs(),
        successor_tokens=header.successor_tokens,
    )
    return blob, expected


def digest(b: bytes | None) -> str | None:
    return None if b is None else blake3.blake3(b).hexdigest()


def run_child(code: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO), LMCACHE_LOG_LEVEL="WARNING")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


class LMServer:
    """LMCache's own cache server (``python -m lmcache.v1.server HOST PORT cpu``)."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_dir / f"lmserver-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"

    def start(self) -> LMServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port), "cpu"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, LMCACHE_LOG_LEVEL="WARNING"),
            )
        wait_for_port(self.port, 90.0, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def lm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMServer]:
    server = LMServer(tmp_path_factory.mktemp("lm")).start()
    yield server
    server.kill()


@pytest.fixture(params=["fs", "redis", "lm"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, L3Store]]:
    kind = request.param
    if kind == "fs":
        store = open_store(fs_url(tmp_path / "l3"))
    elif kind == "redis":
        store = open_store(request.getfixturevalue("redis_server").url)
    else:
        store = open_store(request.getfixturevalue("lm_server").url)
    try:
        yield kind, store
    finally:
        store.close()


def assert_fast(t0: float, limit_s: float = 0.3) -> None:
    assert time.monotonic() - t0 < limit_s, f"took {time.monotonic() - t0:.2f}s, not failing fast"


# ---- every backend ----------------------------------------------------------------------------
def test_round_trip_of_a_realistic_unit(any_store: tuple[str, L3Store]) -> None:
    _, store = any_store
    rng = random.Random(1)
    key, other = new_key(rng), new_key(rng)
    blob, expected = realistic_unit(rng, key)
    assert store.healthy()
    assert not store.contains(key)
    assert store.get(key) is None

    store.put(key, blob)

    assert store.contains(key)
    assert store.contains_many([key, other, key]) == [True, False, True]
    got = store.get(key)
    assert got == blob
    header, payload = decode_unit(got, expected)
    assert [e.is_draft for e in header.layers] == [False] * 4 + [True] * 2
    assert payload.nbytes == 4 * (1 << 20) + 2 * (3 << 15)
    assert store.get(other) is None
    # get_into hands LMCache's buffer to the consumer and returns what it returns.
    into = bytearray(len(blob))

    def copy_out(data: memoryview) -> int:
        into[:] = data
        return data.nbytes

    assert store.get_into(key, copy_out) == len(blob) and into == blob
    assert store.get_into(other, copy_out) is None
    assert store.staging_in_use() == 0


def test_concurrent_callers_get_their_own_bytes(any_store: tuple[str, L3Store]) -> None:
    """Big puts racing small gets from 16 threads.

    On lm:// this returns other callers' bytes unless the store serializes its calls:
    LMCServerConnector releases its lock between a GET reply's header and its body.
    """
    _, store = any_store
    rng = random.Random(2)
    small = {new_key(rng): rng.randbytes(256 << 10) for _ in range(8)}
    for key, data in small.items():
        store.put(key, data)
    big = {new_key(rng): rng.randbytes(4 << 20) for _ in range(8)}
    small_keys, big_items = list(small), list(big.items())

    def work(i: int) -> bool:
        if i % 2:
            store.put(*big_items[(i // 2) % 8])
            return True
        key = small_keys[(i // 2) % 8]
        return store.get(key) == small[key]

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(work, range(64)))
    assert all(store.get(k) == v for k, v in big.items())
    assert store.staging_in_use() == 0


def test_calls_leave_nothing_behind_in_lmcache(any_store: tuple[str, L3Store]) -> None:
    """LMCache's connectors record every put's time in a process-wide stats monitor that
    only LMCache's own engine drains; the store runs them without it, so a long-running
    server must not collect one entry per write there (nor anything else per call)."""
    from lmcache.observability import LMCStatsMonitor

    from vllm_draft_offload.bench.stress.state import container_sizes

    _, store = any_store
    rng = random.Random(4)
    before = container_sizes(LMCStatsMonitor.GetOrCreate(), "lmcache")
    for _ in range(20):
        key = new_key(rng)
        store.put(key, rng.randbytes(4096))
        assert store.contains(key) and store.get(key) is not None
    assert container_sizes(LMCStatsMonitor.GetOrCreate(), "lmcache") == before
    assert store.staging_in_use() == 0


def test_stored_bytes_are_ours_unchanged_so_a_truncated_unit_is_caught_by_the_codec(
    any_store: tuple[str, L3Store],
) -> None:
    _, store = any_store
    rng = random.Random(3)
    key = new_key(rng)
    blob, expected = realistic_unit(rng, key, target_layer_bytes=64 << 10)
    store.put(key, blob[:-100])
    with pytest.raises(UnitRejected) as exc:
        decode_unit(store.get(key) or b"", expected)
    assert exc.value.cause == "truncated"


def test_keys_map_to_stable_lmcache_names() -> None:
    """The mapping names objects already on disk/in redis; changing it orphans them."""
    assert make_key(NS, "ab").to_string() == f"{NS}@1@0@1ab@uint8"
    assert make_key(NS, "0ab").to_string() == f"{NS}@1@0@10ab@uint8"
    with pytest.raises(ValueError):
        make_key(NS, "AB")


def test_misuse_is_reported_as_typed_errors(tmp_path: Path) -> None:
    with open_store(fs_url(tmp_path / "l3"), l3_staging_mb=1) as store:
        with pytest.raises(L3Error) as exc:
            store.put("not-hex", b"x")
        assert exc.value.kind == "invalid_key"
        with pytest.raises(L3Error) as exc:
            store.put("ab", bytes(2 << 20))
        assert exc.value.kind == "too_large"
    with pytest.raises(L3Error) as exc:
        store.get("ab")
    assert exc.value.kind == "closed"


# ---- fs ---------------------------------------------------------------------------------------
CHILD_READ = """
    import json, sys, blake3
    from vllm_draft_offload.l3_store import L3Store
    store = L3Store.from_lmcache(sys.argv[1])
    out = {}
    for k in json.loads(sys.argv[2]):
        b = store.get(k)
        out[k] = None if b is None else blake3.blake3(b).hexdigest()
    out["_healthy"] = store.healthy()
    store.close()
    print("RESULT " + json.dumps(out))
"""


def test_fs_objects_survive_a_process_restart(tmp_path: Path) -> None:
    cfg = tmp_path / "lmcache-fs.yaml"
    cfg.write_text(
        json.dumps({"remote_url": fs_url(tmp_path / "l3"), "extra_config": _extra()})
    )  # JSON is YAML; written the way LMCache reads it: LMCacheEngineConfig.from_file
    rng = random.Random(4)
    units = {}
    with L3Store.from_lmcache(cfg) as store:
        for _ in range(3):
            key = new_key(rng)
            units[key] = realistic_unit(rng, key, target_layer_bytes=256 << 10)[0]
            store.put(key, units[key])
    missing = new_key(rng)

    got = run_child(CHILD_READ, str(cfg), json.dumps([*units, missing]))

    assert got.pop("_healthy") is True
    assert got == {**{k: digest(v) for k, v in units.items()}, missing: None}


def test_fs_lookups_stat_the_files_without_lmcaches_event_loop(tmp_path: Path) -> None:
    """fs:// existence checks run on the caller's thread (no hop to LMCache's loop and
    its executor per key): they answer, the same as LMCache's own exists, while the
    store's event loop is busy."""
    with open_store(fs_url(tmp_path / "l3")) as store:
        keys = [f"{i:02x}" for i in range(1, 65)]
        for key in keys[::2]:
            store.put(key, b"unit " + key.encode())
        expected = [store.contains(key) for key in keys]  # LMCache's FSConnector.exists
        assert expected == [i % 2 == 0 for i in range(64)]
        loop_busy = threading.Event()
        store._loop.call_soon_threadsafe(lambda: (loop_busy.set(), time.sleep(1.5)))
        assert loop_busy.wait(5)
        t0 = time.monotonic()
        assert store.contains_many(keys) == expected
        assert_fast(t0)


def test_fs_remove(tmp_path: Path) -> None:
    with open_store(fs_url(tmp_path / "l3")) as store:
        store.put("ab", b"unit")
        assert store.remove("ab") is True
        assert store.remove("ab") is False
        assert store.get("ab") is None
        assert list((tmp_path / "l3").iterdir()) == []


def test_fs_truncated_file_is_corrupt_not_a_miss(tmp_path: Path) -> None:
    with open_store(fs_url(tmp_path / "l3")) as store:
        store.put("ab", os.urandom(100_000))
        (path,) = (tmp_path / "l3").glob("*.data")
        path.write_bytes(path.read_bytes()[:50_000])
        with pytest.raises(L3Error) as exc:
            store.get("ab")
        assert exc.value.kind == "corrupt"
        assert store.healthy()  # one bad object does not take the tier down
        store.put("cd", b"fine")
        assert store.get("cd") == b"fine"


CHILD_FULL_DISK = """
    import json, os, resource, signal, sys
    from vllm_draft_offload.l3_errors import L3Error
    from vllm_draft_offload.l3_store import L3Store
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
    store = L3Store.from_lmcache(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    out = {}
    try:
        store.put("ab", os.urandom(1 << 20))
        out["big_put"] = "stored"
    except L3Error as e:
        out["big_put"] = e.kind
    out["healthy"] = store.healthy()
    out["big_get"] = store.get("ab")
    store.put("cd", b"small")
    out["small_get"] = store.get("cd").decode()
    out["files"] = sorted(os.listdir(sys.argv[2]))
    store.close()
    print("RESULT " + json.dumps(out))
"""


def test_fs_failed_put_raises_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A put that hits a write limit (EFBIG, as a full disk would give ENOSPC)."""
    cfg = tmp_path / "cfg.yaml"
    base = tmp_path / "l3"
    cfg.write_text(json.dumps({"remote_url": fs_url(base), "extra_config": _extra()}))
    got = run_child(CHILD_FULL_DISK, str(cfg), str(base))
    assert got["big_put"] == "io"
    assert got["healthy"] is True
    assert got["big_get"] is None
    assert got["small_get"] == "small"
    assert len(got["files"]) == 1 and got["files"][0].endswith(".data")  # no stray .tmp


def test_fs_unusable_path_at_start_reports_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with open_store(fs_url(blocker / "l3")) as store:
        assert not store.healthy()
        assert store.last_error is not None and store.last_error.kind == "unavailable"
        t0 = time.monotonic()
        for op in (lambda: store.put("ab", b"x"), lambda: store.get("ab")):
            with pytest.raises(L3Error) as exc:
                op()
            assert exc.value.kind == "unavailable"
        assert_fast(t0)
        # Once the path is usable, the store recovers on its own.
        blocker.unlink()
        time.sleep(RETRY_S + 0.1)
        store.put("ab", b"x")
        assert store.healthy() and store.get("ab") == b"x"


# ---- redis ------------------------------------------------------------------------------------
@needs_redis
def test_redis_objects_survive_store_and_server_restart(tmp_path: Path) -> None:
    rng = random.Random(5)
    with RedisServer(tmp_path / "redis", persistent=True) as server:
        units = {}
        with open_store(server.url) as store:
            for _ in range(3):
                key = new_key(rng)
                units[key] = realistic_unit(rng, key, target_layer_bytes=256 << 10)[0]
                store.put(key, units[key])
        server.restart()  # graceful stop; the AOF was fsynced on every write
        with open_store(server.url) as store:
            for key, blob in units.items():
                assert store.get(key) == blob


@needs_redis
def test_redis_unreachable_at_start_then_recovers(tmp_path: Path) -> None:
    port = free_port()
    with open_store(f"redis://127.0.0.1:{port}") as store:
        assert not store.healthy()
        t0 = time.monotonic()
        with pytest.raises(L3Error) as exc:
            store.put("ab", b"x")
        assert exc.value.kind == "unavailable"
        with pytest.raises(L3Error):
            store.contains("ab")
        assert_fast(t0)
        with RedisServer(tmp_path / "redis", port=port):
            time.sleep(RETRY_S + 0.1)
            store.put("ab", b"x")
            assert store.healthy() and store.get("ab") == b"x"


@needs_redis
def test_redis_killed_mid_run_raises_fast_and_recovers(redis_server: RedisServer) -> None:
    with open_store(redis_server.url) as store:
        store.put("ab", b"before")
        redis_server.kill()
        t0 = time.monotonic()
        with pytest.raises(L3Error) as exc:
            store.get("ab")
        assert exc.value.kind == "unavailable"
        assert_fast(t0, 1.0)
        assert not store.healthy()
        t0 = time.monotonic()
        with pytest.raises(L3Error) as exc:
            store.put("cd", b"x")
        assert exc.value.kind == "unavailable" and "retry in" in str(exc.value)
        assert_fast(t0)
        redis_server.start()  # same port, empty (not persistent)
        time.sleep(RETRY_S + 0.1)
        assert store.get("ab") is None
        store.put("cd", b"after")
        assert store.get("cd") == b"after" and store.healthy()


@needs_redis
def test_redis_hung_server_is_time_bounded(redis_server: RedisServer) -> None:
    with open_store(redis_server.url) as store:
        store.put("ab", b"x")
        redis_server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(L3Error) as exc:
                store.get("ab")
            assert exc.value.kind == "timeout"
            assert time.monotonic() - t0 < TIMEOUT_S + 1.0
            t0 = time.monotonic()
            with pytest.raises(L3Error):
                store.put("cd", b"y")
            assert_fast(t0)
        finally:
            redis_server.resume()
        time.sleep(RETRY_S + 0.1)
        assert store.get("ab") == b"x"


@needs_redis
def test_redis_put_into_full_server_fails_without_tripping(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    # At the current usage, any sizeable SET is refused with an OOM error.
    client.config_set("maxmemory", str(client.info("memory")["used_memory"]))
    with open_store(redis_server.url) as store:
        with pytest.raises(L3Error) as exc:
            store.put("ab", os.urandom(4 << 20))
        assert exc.value.kind == "io" and "OutOfMemory" in str(exc.value)
        assert store.healthy()
        client.config_set("maxmemory", "0")
        assert store.get("ab") is None
        store.put("ab", b"x")
        assert store.get("ab") == b"x"


@needs_redis
def test_redis_truncated_object_is_corrupt(redis_server: RedisServer) -> None:
    with open_store(redis_server.url) as store:
        store.put("ab", os.urandom(10_000))
        name = make_key(NS, "ab").to_string() + "kv_bytes"
        client = redis_server.client()
        client.set(name, client.get(name)[:5000])  # type: ignore[index]
        with pytest.raises(L3Error) as exc:
            store.get("ab")
        assert exc.value.kind == "corrupt"
        assert store.healthy()
        # RedisConnector._get drops its buffer on this path; the store must not let the
        # exception pin it.
        assert store.staging_in_use() == 0


@needs_redis
def test_redis_has_no_remove(redis_server: RedisServer) -> None:
    with open_store(redis_server.url) as store, pytest.raises(L3Error) as exc:
        store.remove("ab")
    assert exc.value.kind == "unsupported"


@needs_redis
def test_object_larger_than_reader_staging_fails_fast_instead_of_wedging(
    redis_server: RedisServer,
) -> None:
    """LMCache's allocator would spin forever on the event loop; ours reports it."""
    with open_store(redis_server.url, l3_staging_mb=8) as writer:
        writer.put("ab", os.urandom(3 << 20))
    with open_store(redis_server.url, l3_staging_mb=2) as reader:
        t0 = time.monotonic()
        with pytest.raises(L3Error) as exc:
            reader.get("ab")
        assert exc.value.kind == "staging_exhausted"
        assert_fast(t0, 1.0)
        reader.put("cd", b"x")  # the loop is still serving
        assert reader.get("cd") == b"x"


# ---- lm:// ------------------------------------------------------------------------------------
def test_lm_unreachable_at_start() -> None:
    with open_store(f"lm://127.0.0.1:{free_port()}") as store:
        assert not store.healthy()
        t0 = time.monotonic()
        with pytest.raises(L3Error) as exc:
            store.get("ab")
        assert exc.value.kind == "unavailable"
        assert_fast(t0)


def test_lm_server_killed_then_replaced(tmp_path: Path) -> None:
    server = LMServer(tmp_path).start()
    replacement = LMServer(tmp_path, port=server.port)
    try:
        with open_store(server.url) as store:
            store.put("ab", b"x" * 1000)
            assert store.get("ab") == b"x" * 1000
            server.kill()
            t0 = time.monotonic()
            with pytest.raises(L3Error) as exc:
                store.get("ab")
            assert exc.value.kind in ("unavailable", "timeout")
            assert time.monotonic() - t0 < TIMEOUT_S + 1.0
            assert not store.healthy()
            replacement.start()
            time.sleep(RETRY_S + 0.1)
            # A fresh connector on a fresh socket; the server kept nothing (RAM only).
            assert store.get("ab") is None
            store.put("ab", b"y")
            assert store.get("ab") == b"y"
    finally:
        server.kill()
        replacement.kill()


# ---- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "scheme"),
    [
        ("lmcache-fs.yaml", "fs"),
        ("lmcache-redis.yaml", "redis"),
        ("lmcache-lm.yaml", "lm"),
        ("lmcache-mooncake.yaml", "mooncakestore"),
    ],
)
def test_shipped_configs_parse_with_lmcache(name: str, scheme: str) -> None:
    cfg = load_lmcache_config(REPO / "configs" / name)
    s = L3Settings.from_lmcache_config(cfg)
    assert s.scheme == scheme
    assert s.namespace == "vllm-draft-offload"
    assert s.staging_bytes == 512 << 20
    if scheme == "fs":
        assert s.url == "fs://localhost:0/var/lib/vllm-draft-offload/l3"
    if scheme == "redis":
        assert "socket_timeout=2" in s.url


def test_vllm_extra_config_overrides_file(tmp_path: Path) -> None:
    extra = {
        "lmcache.remote_url": fs_url(tmp_path / "l3"),
        "lmcache.extra_config": _extra(),
        "cpu_bytes_to_use": 123,  # not ours: ignored
    }
    with L3Store.from_extra_config(
        extra, REPO / "configs" / "lmcache-fs.yaml", timeout_s=1.5
    ) as store:
        assert store.settings.timeout_s == 1.5
        assert store.settings.namespace == NS
        store.put("ab", b"x")
    assert len(list((tmp_path / "l3").glob(f"{NS}@*.data"))) == 1


def test_lmcache_plugin_form_of_fs(tmp_path: Path) -> None:
    keys = {
        "remote_storage_plugins": ["fs"],
        "extra_config": {**_extra(), "remote_storage_plugin.fs.base_path": str(tmp_path)},
    }
    with L3Store.from_dict(keys) as store:
        assert store.settings.url == "plugin://fs"
        store.put("ab", b"x")
        assert store.get("ab") == b"x"
    assert [p.name for p in tmp_path.iterdir()] == [f"{NS}@1@0@1ab@uint8.data"]


@pytest.mark.parametrize(
    "lmcache_keys",
    [
        {"remote_url": "resp://127.0.0.1:6379"},  # fixed-size reads would truncate units
        {"remote_url": "fs:///tmp/x", "extra_config": {"save_chunk_meta": False}},
        {},
        {"remote_url": "fs:///tmp/x", "extra_config": {"draft_offload.l3_namespace": "a@b"}},
    ],
)
def test_bad_config_is_a_config_error(lmcache_keys: dict[str, Any]) -> None:
    with pytest.raises(L3Error) as exc:
        L3Store.from_dict(lmcache_keys)
    assert exc.value.kind == "config"
