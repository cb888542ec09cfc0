"""Blocking, time-bounded L3 object store for encoded units, built on LMCache's own connectors.

One ``L3Store`` owns one LMCache ``RemoteConnector`` (fs://, redis://, lm://), one
event-loop thread that every connector coroutine runs on, and a staging pool from which
LMCache allocates the ``MemoryObj`` that carries a unit. Public methods may be called from
any number of threads. Each call returns or raises ``L3Error`` within ``timeout_s``, so a
hung backend costs a caller a bounded wait and never a stall. ``close`` takes at most
about 3 x ``timeout_s``.

A failed call classed as ``timeout`` or ``unavailable`` opens a circuit breaker. Until
``retry_interval_s`` has passed, calls fail at once with kind ``unavailable``; after that,
one call is let through as a probe. Object-level failures (``io``, ``corrupt``) leave the
breaker closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, Literal, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector

from vllm_draft_offload.l3_backends import (
    MAX_OBJECT_BYTES,
    PROBE_HEX_KEY,
    RECONNECT_SCHEMES,
    ConfigError,
    CorruptObject,
    L3Settings,
    StagingBackend,
    StagingExhausted,
    classify,
    close_connector,
    config_from_extra_config,
    create_connector,
    inner_connector,
    load_lmcache_config,
    make_key,
    make_metadata,
)
from vllm_draft_offload.l3_fs_reads import DeadlineExceeded, ObjectFile, open_object_file

logger = logging.getLogger(__name__)

T = TypeVar("T")

L3ErrorKind = Literal[
    "config",  # bad configuration; raised by the constructor only
    "unavailable",  # backend unreachable, or circuit breaker open
    "timeout",  # the call hit timeout_s
    "io",  # the backend answered with an error (disk full, redis OOM, ...)
    "corrupt",  # the key exists but no well-formed object could be read
    "staging_exhausted",  # staging pool full; raise l3_staging_mb or lower concurrency
    "too_large",  # object larger than the staging pool or LMCache's int32 limit
    "unsupported",  # e.g. remove() on a connector without deletion
    "invalid_key",
    "closed",
]
_TRIPS_BREAKER = frozenset({"timeout", "unavailable"})


class L3Error(Exception):
    def __init__(
        self,
        kind: L3ErrorKind,
        message: str,
        *,
        op: str | None = None,
        key: str | None = None,
    ) -> None:
        where = " ".join(x for x in (op, key) if x)
        super().__init__(f"[{kind}] {where}: {message}" if where else f"[{kind}] {message}")
        self.kind: L3ErrorKind = kind
        self.op = op
        self.key = key


class L3Store:
    def __init__(
        self,
        lmcache_config: LMCacheEngineConfig,
        *,
        timeout_s: float | None = None,
        min_staging_bytes: int = 0,
    ) -> None:
        """``timeout_s`` overrides extra_config ``draft_offload.l3_timeout_s``;
        ``min_staging_bytes`` raises the default staging pool (see L3Settings)."""
        try:
            self.settings = L3Settings.from_lmcache_config(
                lmcache_config, timeout_s, min_staging_bytes
            )
        except ConfigError as e:
            raise L3Error("config", str(e)) from e
        self._cfg = lmcache_config
        s = self.settings
        self._metadata = make_metadata(s.namespace)
        self._backend = StagingBackend(lmcache_config, self._metadata, s.staging_bytes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"l3-{s.scheme}-loop", daemon=True
        )
        self._thread.start()
        # Connector construction blocks (lm:// connects in __init__). It gets its own
        # thread, so that a black-holed host costs a bounded wait and not the loop.
        self._connect_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"l3-{s.scheme}-connect"
        )
        # lm://: one stateful socket; calls must not overlap and a failed call poisons it.
        self._fragile_socket = s.scheme in RECONNECT_SCHEMES
        self._op_lock: asyncio.Lock | None = None  # created on the loop, lm:// only
        self._state = threading.Lock()
        self._conn: RemoteConnector | None = None
        self._connect_future: concurrent.futures.Future[RemoteConnector] | None = None
        self._healthy = False
        self._retry_at = 0.0
        self._closed = False
        self._puts_in_flight: set[str] = set()
        self.last_error: L3Error | None = None
        self.check_health()

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_lmcache(
        cls,
        config_file: str | os.PathLike[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        min_staging_bytes: int = 0,
    ) -> L3Store:
        """``config_file`` (else ``$LMCACHE_CONFIG_FILE``) plus ``LMCACHE_*`` env vars; then
        ``overrides``, which are LMCache keys without the ``lmcache.`` prefix."""
        try:
            cfg = load_lmcache_config(config_file, overrides)
        except (ConfigError, OSError) as e:
            raise L3Error("config", str(e)) from e
        return cls(cfg, timeout_s=timeout_s, min_staging_bytes=min_staging_bytes)

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any],
        config_file: str | os.PathLike[str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> L3Store:
        """From vLLM ``kv_connector_extra_config``: ``lmcache.*`` entries over file/env."""
        try:
            cfg = config_from_extra_config(extra, config_file)
        except (ConfigError, OSError) as e:
            raise L3Error("config", str(e)) from e
        return cls(cfg, timeout_s=timeout_s)

    @classmethod
    def from_dict(
        cls, lmcache_keys: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> L3Store:
        """Plain LMCache keys (no ``lmcache.`` prefix), with no file or env involved."""
        return cls(LMCacheEngineConfig.from_dict(dict(lmcache_keys)), timeout_s=timeout_s)

    # ---- public API ---------------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return self.settings.scheme

    @property
    def supports_remove(self) -> bool:
        # Of the safe connectors only FSConnector implements remove_sync.
        return self.settings.scheme == "fs"

    def staging_in_use(self) -> int:
        """Bytes of the staging pool held right now; 0 when idle (a gauge, and a leak check)."""
        return self._backend.bytes_in_use()

    def healthy(self) -> bool:
        """Cached state, no I/O: False after a failed probe or call, until one succeeds."""
        with self._state:
            return self._healthy and not self._closed

    def check_health(self) -> bool:
        """Live probe (exists on a never-written key) that ignores the retry interval."""
        with self._state:
            if self._closed:
                return False
            self._retry_at = 0.0
        try:
            self._run(
                "probe",
                None,
                make_key(self.settings.namespace, PROBE_HEX_KEY),
                lambda c, k: c.exists(k),
            )
        except L3Error:
            return False
        return True

    def put(self, key: str, blob: bytes | bytearray | memoryview) -> None:
        mv = memoryview(blob).cast("B")

        def copy_in(buf: memoryview) -> None:
            buf[:] = mv

        self.put_with(key, mv.nbytes, copy_in)

    def put_with(self, key: str, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        """Write an ``nbytes`` object that ``fill`` writes straight into LMCache's staging buffer.

        The staging buffer is the one copy a write needs: it belongs to LMCache, so a
        timed-out put that finishes later in the background never reads a caller
        buffer that has since been reused. ``fill`` runs on the calling thread; once
        it returns, the caller's source may be reused. If it raises, nothing is
        written and the buffer goes back to the pool. Waits up to ``timeout_s`` for
        staging room held by other calls.
        """
        limit = min(self.settings.staging_bytes, MAX_OBJECT_BYTES)
        if nbytes <= 0 or nbytes > limit:
            raise L3Error("too_large", f"{nbytes} bytes; limit is {limit}", op="put", key=key)
        lkey = self._key(key, "put")
        with self._state:
            # FSConnector writes every put of a key through one shared "<name>.tmp" path, so
            # two concurrent writers could interleave. Like LMCache's RemoteBackend
            # (put_tasks), we drop the second put: a key names its content.
            if key in self._puts_in_flight:
                return
            self._puts_in_flight.add(key)
        try:
            deadline = time.monotonic() + self.settings.timeout_s
            conn = self._acquire("put", key, deadline)
            obj = self._allocate_until(nbytes, deadline)
            if obj is None:
                raise L3Error("staging_exhausted", f"no room for {nbytes} bytes", op="put", key=key)
            try:
                fill(obj.byte_array.cast("B"))
            except BaseException:
                obj.ref_count_down()
                raise
            # The allocator frees obj when the connector is done with it
            # (InstrumentedRemoteConnector.put drops the reference).
            self._run("put", key, lkey, lambda c, k: c.put(k, obj), conn=conn, deadline=deadline)
        finally:
            with self._state:
                self._puts_in_flight.discard(key)

    def _allocate_until(self, nbytes: int, deadline: float) -> MemoryObj | None:
        """A staging buffer, waiting for other calls to free room (no free-event exists)."""
        while True:
            obj = self._backend.allocate_unit(nbytes, count_failure=False)
            if obj is not None or time.monotonic() >= deadline or self._closed:
                return obj
            time.sleep(0.002)

    def get(self, key: str) -> bytes | None:
        """Returns the stored bytes unchanged, or None when the key is absent."""
        return self.get_into(key, lambda data: data.tobytes())

    def get_into(self, key: str, consume: Callable[[memoryview], T]) -> T | None:
        """``consume(stored bytes)``, or None when the key is absent.

        ``consume`` sees LMCache's own buffer, valid only during the call: a caller
        that decodes and copies the object straight into its destination saves a
        full copy of every unit it reads.
        """
        lkey = self._key(key, "get")
        backend = self._backend

        async def _get(conn: RemoteConnector, k: CacheEngineKey) -> MemoryObj | None:
            before = backend.alloc_failures
            obj = await conn.get(k)
            if obj is None:
                if backend.alloc_failures != before:
                    raise StagingExhausted("staging pool too small for the stored object")
                if await conn.exists(k):
                    raise CorruptObject("key exists but the object could not be read")
            return obj

        obj = self._run("get", key, lkey, _get, release=_release)
        if obj is None:
            return None
        # The consumer runs here and not on the loop, so a large unit does not hold up
        # other threads' calls.
        try:
            return consume(memoryview(obj.byte_array).cast("B"))
        finally:
            obj.ref_count_down()

    @property
    def reads_files(self) -> bool:
        """``read_file`` works: fs://, whose objects are files this process can open."""
        return self.settings.scheme == "fs"

    def read_file(self, key: str, consume: Callable[[ObjectFile], T]) -> T | None:
        """``consume(the object's file)`` on the calling thread; None when the key is absent.

        fs:// only (``reads_files``): no staging buffer and no event loop, so ``consume``
        can read the object straight into its destination, in pieces it verifies as they
        land. The same timeout and circuit breaker apply as to ``get``: each
        ``ObjectFile.readinto`` checks the deadline first, so ``consume`` has stopped
        writing when this returns or raises.
        """
        lkey = self._key(key, "get")
        deadline = time.monotonic() + self.settings.timeout_s
        conn = self._acquire("get", key, deadline)
        fs = inner_connector(conn)
        if not isinstance(fs, FSConnector):
            raise L3Error("unsupported", f"{type(fs).__name__} has no files", op="get", key=key)
        try:
            file = open_object_file(fs, lkey, deadline)
            if file is None:
                result = None
            else:
                with file:
                    result = consume(file)
        except DeadlineExceeded as e:
            msg = f"no answer within {self.settings.timeout_s}s ({e})"
            raise self._fail("timeout", msg, "get", key, conn) from e
        except CorruptObject as e:
            raise self._fail("corrupt", str(e), "get", key, conn) from e
        except OSError as e:
            raise self._fail("io", f"{type(e).__name__}: {e}", "get", key, conn) from e
        with self._state:
            self._healthy = True
            self._retry_at = 0.0
        return result

    def contains(self, key: str) -> bool:
        return bool(
            self._run("contains", key, self._key(key, "contains"), lambda c, k: c.exists(k))
        )

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """One round of concurrent exists calls under one timeout, not a prefix count."""
        keys = list(keys)
        if not keys:
            return []
        lkeys = [self._key(k, "contains_many") for k in keys]

        async def _many(conn: RemoteConnector, _: None) -> list[bool]:
            return list(await asyncio.gather(*(conn.exists(k) for k in lkeys)))

        return self._run("contains_many", f"{len(keys)} keys", None, _many)

    def remove(self, key: str) -> bool:
        """True if the object was there and is now gone."""
        if not self.supports_remove:
            raise L3Error("unsupported", f"{self.scheme}:// has no delete", op="remove", key=key)
        loop = self._loop

        async def _remove(conn: RemoteConnector, k: CacheEngineKey) -> bool:
            # Checked first because FSConnector.remove_sync logs a missing file as an error.
            if not await conn.exists(k):
                return False
            return bool(await loop.run_in_executor(None, conn.remove_sync, k))

        return self._run("remove", key, self._key(key, "remove"), _remove)

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            conn, self._conn = self._conn, None
            self._healthy = False
        if conn is not None:
            fut = asyncio.run_coroutine_threadsafe(close_connector(conn), self._loop)
            try:
                fut.result(self.settings.timeout_s)
            except Exception as e:  # close must not raise; the process may be exiting
                logger.warning("L3 %s connector close failed: %r", self.scheme, e)
        # aiofiles (fs://) runs its file I/O on the loop's default executor.
        fut = asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop)
        try:
            fut.result(self.settings.timeout_s)
        except Exception as e:
            logger.warning("L3 %s executor shutdown failed: %r", self.scheme, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.settings.timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
        else:
            logger.warning("L3 %s loop thread did not stop; abandoning it", self.scheme)
        self._connect_pool.shutdown(wait=False, cancel_futures=True)
        self._backend.close()

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"L3Store({self.settings.url!r}, healthy={self.healthy()})"

    # ---- internals ----------------------------------------------------------------------
    def _key(self, key: str, op: str) -> CacheEngineKey:
        try:
            return make_key(self.settings.namespace, key)
        except ValueError as e:
            raise L3Error("invalid_key", str(e), op=op, key=key) from e

    def _acquire(self, op: str, key: str | None, deadline: float) -> RemoteConnector:
        with self._state:
            if self._closed:
                raise L3Error("closed", "store is closed", op=op, key=key)
            now = time.monotonic()
            if not self._healthy:
                if now < self._retry_at:
                    raise L3Error(
                        "unavailable",
                        f"backend down ({self.last_error}); retry in {self._retry_at - now:.1f}s",
                        op=op,
                        key=key,
                    )
                # This call becomes the probe; concurrent ones keep failing fast until it ends.
                self._retry_at = now + self.settings.retry_interval_s
            conn = self._conn
            if conn is None and self._connect_future is None:
                self._connect_future = self._connect_pool.submit(
                    create_connector,
                    self.settings,
                    self._loop,
                    self._backend,
                    self._cfg,
                    self._metadata,
                )
            fut = self._connect_future
        if conn is not None:
            return conn
        assert fut is not None
        try:
            conn = fut.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            # The pending attempt stays registered, so a later call can still collect it.
            raise self._fail("timeout", "connecting timed out", op, key, None) from None
        except Exception as e:
            with self._state:
                if self._connect_future is fut:
                    self._connect_future = None
            msg = f"connect failed: {type(e).__name__}: {e}"
            raise self._fail("unavailable", msg, op, key, None) from e
        with self._state:
            if self._connect_future is fut:
                self._connect_future = None
                self._conn = conn
            if self._closed:
                raise L3Error("closed", "store closed while connecting", op=op, key=key)
            return self._conn or conn

    def _run(
        self,
        op: str,
        key: str | None,
        lkey: Any,
        call: Callable[[RemoteConnector, Any], Coroutine[Any, Any, T]],
        *,
        conn: RemoteConnector | None = None,
        deadline: float | None = None,
        release: Callable[[Any], None] | None = None,
    ) -> T:
        if deadline is None:
            deadline = time.monotonic() + self.settings.timeout_s
        if conn is None:
            conn = self._acquire(op, key, deadline)
        fut = asyncio.run_coroutine_threadsafe(self._guard(call(conn, lkey)), self._loop)
        try:
            result = fut.result(max(0.0, deadline - time.monotonic()))
        except Exception as e:
            err = self._error_for(e, fut, op, key, conn, release)
            # The future's done-callbacks reference the asyncio task, and the task keeps
            # the connector's traceback, whose frames can hold a staging MemoryObj
            # (RedisConnector._get leaks its buffer on a length mismatch). This frame lives
            # on in err.__traceback__, so it must let go of the future.
            del fut
            raise err from e
        with self._state:
            self._healthy = True
            self._retry_at = 0.0
        return result

    def _error_for(
        self,
        e: Exception,
        fut: concurrent.futures.Future[Any],
        op: str,
        key: str | None,
        conn: RemoteConnector,
        release: Callable[[Any], None] | None,
    ) -> L3Error:
        if isinstance(e, concurrent.futures.TimeoutError):
            if not fut.cancel() and release is not None:
                # The result landed between the timeout and cancel(); nobody will read it.
                fut.add_done_callback(lambda f: _release_late(f, release))
            return self._fail(
                "timeout", f"no answer within {self.settings.timeout_s}s", op, key, conn
            )
        if isinstance(e, concurrent.futures.CancelledError):
            # Only close() cancels work on the loop from outside a timeout.
            return self._fail("closed", "cancelled by close()", op, key, conn)
        kind = classify(e, op, self.settings.scheme)
        msg = f"{type(e).__name__}: {e}{_origin(e)}"
        # Same reason as in _run: the frames must not outlive the call. _origin has already
        # kept the raise site for the log.
        e.with_traceback(None)
        return self._fail(kind, msg, op, key, conn)  # type: ignore[arg-type]

    async def _guard(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._fragile_socket:
            return await coro
        if self._op_lock is None:
            self._op_lock = asyncio.Lock()
        async with self._op_lock:
            return await coro

    def _fail(
        self,
        kind: L3ErrorKind,
        message: str,
        op: str,
        key: str | None,
        conn: RemoteConnector | None,
    ) -> L3Error:
        err = L3Error(kind, message, op=op, key=key)
        stale: RemoteConnector | None = None
        with self._state:
            # A separate instance without __cause__ or traceback, so it pins no frames.
            self.last_error = L3Error(kind, message, op=op, key=key)
            if kind in _TRIPS_BREAKER:
                if self._healthy:
                    logger.warning("L3 %s backend marked unavailable: %s", self.scheme, err)
                self._healthy = False
                self._retry_at = time.monotonic() + self.settings.retry_interval_s
            if conn is not None and self._fragile_socket and self._conn is conn:
                # The socket may be mid-message (see l3_backends); only a new one is safe.
                stale, self._conn = conn, None
        if stale is not None and not self._closed:
            asyncio.run_coroutine_threadsafe(close_connector(stale), self._loop)
        return err


def _origin(e: BaseException) -> str:
    tb = e.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})"


def _release(obj: Any) -> None:
    if isinstance(obj, MemoryObj):
        obj.ref_count_down()


def _release_late(fut: concurrent.futures.Future[Any], release: Callable[[Any], None]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        release(fut.result())
