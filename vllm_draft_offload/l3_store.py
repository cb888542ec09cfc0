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

The connection, its loop thread and the breaker live in the base class
(``l3_channel.L3Channel``); this module adds object names, the staging rules of a put and
the put/get/exists/remove API. ``L3Error`` lives in ``l3_errors``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector

from vllm_draft_offload import fast_io
from vllm_draft_offload.l3_backends import (
    MAX_OBJECT_BYTES,
    ConfigError,
    CorruptObject,
    L3Settings,
    StagingExhausted,
    config_from_extra_config,
    inner_connector,
    load_lmcache_config,
    make_key,
)
from vllm_draft_offload.l3_channel import L3Channel, release_staged
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_fs_reads import (
    DeadlineExceeded,
    ObjectFile,
    ReadStopped,
    open_object_file,
)

T = TypeVar("T")


class L3Store(L3Channel):
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
        super().__init__(lmcache_config, self.settings)
        # Keys with a put under way (see put_with); guarded by the channel's _state lock.
        self._puts_in_flight: set[str] = set()
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
    def supports_remove(self) -> bool:
        # Of the safe connectors only FSConnector implements remove_sync.
        return self.settings.scheme == "fs"

    def staging_in_use(self) -> int:
        """Bytes of the staging pool held right now; 0 when idle (a gauge, and a leak check)."""
        return self._backend.bytes_in_use()

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

        obj = self._run("get", key, lkey, _get, release=release_staged)
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
        land. The same timeout and circuit breaker apply as to ``get``: ``ObjectFile``'s
        reads check the deadline before each piece, so ``consume`` has stopped writing
        when this returns or raises. ``ReadStopped`` (the file's stop flag was set while
        ``consume`` read) passes through; the backend answered, so it counts as up.
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
        except ReadStopped:
            self._succeeded()  # the backend answered; the caller gave the read up
            raise
        except DeadlineExceeded as e:
            msg = f"no answer within {self.settings.timeout_s}s ({e})"
            raise self._fail("timeout", msg, "get", key, conn) from e
        except CorruptObject as e:
            raise self._fail("corrupt", str(e), "get", key, conn) from e
        except OSError as e:
            raise self._fail("io", f"{type(e).__name__}: {e}", "get", key, conn) from e
        self._succeeded()
        return result

    def contains(self, key: str) -> bool:
        return bool(
            self._run("contains", key, self._key(key, "contains"), lambda c, k: c.exists(k))
        )

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """One round of concurrent exists calls under one timeout, not a prefix count.

        fs:// checks the files on the calling thread instead (``_files_exist``)."""
        keys = list(keys)
        if not keys:
            return []
        lkeys = [self._key(k, "contains_many") for k in keys]
        if self.reads_files:
            found = self._files_exist(lkeys)
            if found is not None:
                return found

        async def _many(conn: RemoteConnector, _: None) -> list[bool]:
            return list(await asyncio.gather(*(conn.exists(k) for k in lkeys)))

        return self._run("contains_many", f"{len(keys)} keys", None, _many)

    def _files_exist(self, lkeys: list[CacheEngineKey]) -> list[bool] | None:
        """fs://: which objects' files exist, by the connector's own path rule, asked on
        this thread (None: the connector has no files).

        LMCache's ``exists`` sends each stat from its event loop to an executor thread
        and back: several hand-offs of the GIL per key, which a 64-chunk lookup paid
        hundreds of times while the engine's loop, fetches and write-behind wanted the
        GIL too. ``fast_io.files_exist`` stats the whole list in one release of the GIL
        (natively; one release per file in Python). The deadline is checked between
        stats; a stat stuck in the kernel (a hung network mount) holds this thread, as a
        read does (``read_file``).
        """
        op, what = "contains_many", f"{len(lkeys)} keys"
        deadline = time.monotonic() + self.settings.timeout_s
        conn = self._acquire(op, what, deadline)
        fs = inner_connector(conn)
        if not isinstance(fs, FSConnector):
            return None
        try:
            # As FSConnector.exists: an error (a missing directory) means absent.
            found = fast_io.files_exist([fs._get_file_path(lkey) for lkey in lkeys], deadline)
        except fast_io.DeadlinePassed as e:
            msg = f"no answer within {self.settings.timeout_s}s ({e.args[0]} of {len(lkeys)})"
            raise self._fail("timeout", msg, op, what, conn) from e
        self._succeeded()
        return found

    def files_resident(self, keys: Iterable[str]) -> list[bool | None] | None:
        """fs://: is each object's file wholly in the page cache (l3_residency.py)? None
        for a backend without files or a store that cannot be reached; an entry is None
        where the kernel would not tell. Never raises: this only informs a wait."""
        if not self.reads_files:
            return None
        deadline = time.monotonic() + self.settings.timeout_s
        try:
            lkeys = [self._key(k, "files_resident") for k in keys]
            fs = inner_connector(self._acquire("files_resident", None, deadline))
        except L3Error:
            return None
        if not isinstance(fs, FSConnector):
            return None
        return fast_io.files_resident([fs._get_file_path(lkey) for lkey in lkeys])

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
