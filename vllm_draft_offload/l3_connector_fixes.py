"""Patches to single LMCache 0.5.6 connector instances, so that several engines can share a
backend safely and the L3 store can use them. Each replaces one or two methods of the one
connector object the store created (never LMCache's classes), keeping LMCache's own code
for everything else; ``l3_backends.create_connector`` applies them. Why each is needed is
in the ``l3_backends`` module docstring; ``tests/test_shared_writes.py`` and
``tests/test_mooncake_store.py`` show the failures they fix.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import types
from collections.abc import Callable
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector
from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector

_TEMP_COUNTER = itertools.count()


def _ignore(*_args: object, **_kwargs: object) -> None:
    return None


class _NoStats:
    """What ``InstrumentedRemoteConnector`` asks of LMCache's stats monitor, keeping
    nothing: its ``update_*`` calls do nothing, and no retrieve is being tracked."""

    def get_current_retrieve_stats(self) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("update_"):
            return _ignore
        raise AttributeError(name)


def without_stats_monitor(conn: RemoteConnector) -> None:
    """Stop the connector's wrapper from feeding LMCache's process-wide stats monitor
    (see the l3_backends docstring): one float per put, kept until LMCache's own engine,
    which does not run here, reads them."""
    if hasattr(conn, "_stats_monitor"):
        conn._stats_monitor = _NoStats()  # type: ignore[attr-defined]


def unique_fs_temp_names(conn: FSConnector) -> None:
    """Make every ``FSConnector.put`` write its own temp file (see the l3_backends docstring).

    ``put`` asks ``_get_file_and_tmp_path`` once and uses that temp path to write, to
    rename and to clean up after a failure, so changing the name here is the whole fix;
    the rest of LMCache's put (metadata, O_DIRECT, cleanup) is unchanged.
    """
    shared_names = conn._get_file_and_tmp_path

    def unique_names(self: FSConnector, key: CacheEngineKey) -> tuple[Any, Any]:
        final_path, tmp_path = shared_names(key)
        unique = f".{os.getpid()}-{threading.get_ident()}-{next(_TEMP_COUNTER)}.tmp"
        return final_path, tmp_path.with_name(tmp_path.stem + unique)

    conn._get_file_and_tmp_path = types.MethodType(unique_names, conn)  # type: ignore[method-assign]


def _serialized_metadata(memory_obj: MemoryObj) -> bytes:
    """LMCache's per-object RemoteMetadata of `memory_obj`, as its connectors write it."""
    return RemoteMetadata(
        len(memory_obj.byte_array),
        memory_obj.get_shapes(),
        memory_obj.get_dtypes(),
        memory_obj.get_memory_format(),
    ).serialize()


def atomic_redis_pairs(conn: RedisConnector) -> None:
    """Write and read a unit's two Redis keys in one transaction (see the l3_backends docstring).

    The key names and values are LMCache's, so objects written before stay readable.
    """

    async def put_pair(self: RedisConnector, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        kv_bytes = memory_obj.byte_array
        metadata = _serialized_metadata(memory_obj)
        name = key.to_string()
        async with self.sem, self.connection.pipeline(transaction=True) as pipe:
            pipe.set(name + "kv_bytes", kv_bytes)
            pipe.set(name + "metadata", metadata)
            await pipe.execute()

    async def get_pair(self: RedisConnector, key: CacheEngineKey) -> MemoryObj | None:
        name = key.to_string()
        async with self.sem, self.connection.pipeline(transaction=True) as pipe:
            pipe.get(name + "metadata")
            pipe.get(name + "kv_bytes")
            metadata_bytes, kv_bytes = await pipe.execute()
        if metadata_bytes is None:
            return None
        if kv_bytes is None:
            # Redis evicted the bytes and kept the metadata; as LMCache does, drop the
            # metadata too so that exists() stops reporting the unit.
            async with self.sem:
                await self.connection.delete(name + "metadata")
            return None
        metadata = RemoteMetadata.deserialize(memoryview(metadata_bytes))
        if metadata.length != len(kv_bytes):
            # classify() maps a get's ValueError to "corrupt".
            raise ValueError(f"metadata says {metadata.length} bytes, stored {len(kv_bytes)}")
        memory_obj = self.local_cpu_backend.allocate(metadata.shapes, metadata.dtypes, metadata.fmt)
        if memory_obj is None:
            return None
        memoryview(memory_obj.byte_array).cast("B")[: metadata.length] = kv_bytes
        return memory_obj

    conn._put = types.MethodType(put_pair, conn)  # type: ignore[method-assign]
    conn._get = types.MethodType(get_pair, conn)  # type: ignore[method-assign]


def checked_mooncake_calls(conn: RemoteConnector, timeout_s: float) -> None:
    """LMCache 0.5.6's Mooncake-store connector, made usable by the L3 store.

    * Its ``get`` raises NotImplementedError ("use batched_get"); a one-key batch it is.
    * Its ``exists`` calls the blocking ``is_exist`` on the event loop and passes its
      negative error codes on as true; here it runs on a thread and errors raise.
    * Its ``put`` ignores the status ``put_parts`` returns, so a put that Mooncake refuses
      (no segment space: -600) looks stored; and it gives up after ``transfer_timeout``
      (1 s by default) with a warning, reporting success. Here a negative status raises
      ``OSError`` (an ``io`` error), and the only time limit is the store's own.
    Mooncake keeps the first of two puts of one key whole and ignores the second, so
    concurrent writers of one unit leave one whole object.
    """
    store = conn.store  # type: ignore[attr-defined]

    async def get_one(self: RemoteConnector, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def exists(self: RemoteConnector, key: CacheEngineKey) -> bool:
        # is_exist answers 1, 0, or a negative error code (which would read as "yes").
        status = await asyncio.to_thread(store.is_exist, key.to_string())
        if status < 0:
            raise ConnectionError(f"mooncake is_exist returned {status}")
        return status == 1

    async def put_checked(self: RemoteConnector, key_str: str, memory_obj: MemoryObj) -> None:
        kv_bytes = memory_obj.byte_array
        metadata = _serialized_metadata(memory_obj)
        status = await asyncio.to_thread(store.put_parts, key_str, metadata, kv_bytes)
        if status < 0:
            raise OSError(f"mooncake put_parts of {key_str} returned {status}")

    conn.config.transfer_timeout = timeout_s  # type: ignore[attr-defined]
    conn.get = types.MethodType(get_one, conn)  # type: ignore[method-assign]
    conn.exists = types.MethodType(exists, conn)  # type: ignore[method-assign]
    conn._put_with_metadata = types.MethodType(put_checked, conn)  # type: ignore[attr-defined]
