"""How the L3 store runs LMCache 0.5.x remote connectors standalone, on any host.

We use the connector layer (``CreateConnector`` -> ``RemoteConnector``) directly, not
``RemoteBackend``/``StorageManager``/``LMCacheEngine``. ``RemoteBackend`` only logs failed
puts and reports connection errors as misses, which would hide exactly the faults the
connector must count. The engine would also need a GPU connector (MOCK on CPU) and
token-chunk keys.

A connector moves exactly one ``MemoryObj`` per key and keeps the bytes unchanged; on
``fs``/``redis`` it adds a 28-byte ``RemoteMetadata`` prefix or key that records shape and
dtype. That lets it store our variable-size units: each unit is a flat uint8 object of
shape ``[1, 1, 1, nbytes]``.

LMCache 0.5.6 behaviours this module works around (verified in the installed source):

* ``LocalCPUBackend.allocate`` retries forever (sleeping 0.1 s) when the pool is full and
  no hot-cache entry can be evicted. Connectors call it on the event loop, so one oversized
  or corrupt-length object would wedge the loop. ``StagingBackend`` never blocks and counts
  failures instead.
* The default CPU allocator (MixedMemoryAllocator) allocates one eager, pinned arena on
  GPU hosts. Only a background thread reads the staging area, so we give it a plain,
  lazily touched ``HostMemoryAllocator``.
* ``RedisConnector.close`` calls the synchronous ``AsyncPQExecutor.shutdown`` from inside
  the loop and deadlocks it (a probe's close() never returned); ``close_connector`` shuts
  it down asynchronously instead.
* ``RedisConnector`` keeps a unit as two keys, ``<key>kv_bytes`` and ``<key>metadata``
  (length, shape), written by two SETs and read by two GETs. Each SET is atomic, but two
  engines storing the same unit with different lengths (the JSON header of a unit holds
  its successor token ids, so two variants can differ by a padding step) can interleave:
  a reader then pairs one writer's metadata with the other's bytes, and the stored pair
  can stay mismatched for good. ``l3_connector_fixes.atomic_redis_pairs`` writes both keys in one
  MULTI/EXEC transaction and reads them in one, so every read sees one writer's pair.
  Its read also checks the lengths before allocating; LMCache's ``_get`` leaked its
  buffer on a mismatch.
* ``LMCServerConnector`` does blocking socket I/O on the loop thread with no timeout.
  It also releases its lock between a GET reply's header and its body, so concurrent
  calls hand each other's bytes back. A 16-thread test reproduces this on 0.5.6. We set
  a socket timeout, and the store serializes every lm:// call.
* LMCache 0.5.6's Mooncake-store connector cannot ``get`` one key, misreads ``exists``
  errors and ignores refused puts; see ``l3_connector_fixes.checked_mooncake_calls``.
* ``InstrumentedRemoteConnector`` (the wrapper ``CreateConnector`` returns) appends every
  put's duration to a list in LMCache's process-wide ``LMCStatsMonitor``, which only
  LMCache's own engine empties (its stats logger, not running here): standalone, one
  entry per unit written, for good. ``l3_connector_fixes.without_stats_monitor`` gives
  the wrapper a monitor that keeps nothing.
* ``FSConnector.get`` returns None for any read error (a truncated file, say). The store
  tells those apart from misses with a follow-up ``exists``.
* The ``fs://`` adapter needs a host:port (``fs:///p`` fails an assertion), so we rewrite
  ``fs:///p`` to ``fs://localhost:0/p``.
* ``FSConnector.put`` writes every put of a key through one shared ``<name>.tmp`` path and
  then renames it into place. Two engines sharing a directory and storing the same unit
  open that one path together: one truncates the other's half-written file, or renames it
  into place while the other is still writing into it, and the loser's rename fails. A
  two-process test reproduces torn objects and failed puts on 0.5.6.
  ``l3_connector_fixes.unique_fs_temp_names`` gives every put its own temp name (pid,
  thread, counter), so each writer renames only a file it wrote whole; ``rename``
  replaces the final name atomically, so a reader sees one writer's whole object.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.exceptions
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.config_base import validate_and_set_config_value
from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector
from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from vllm_draft_offload.l3_connector_fixes import (
    atomic_redis_pairs,
    checked_mooncake_calls,
    unique_fs_temp_names,
    without_stats_monitor,
)

logger = logging.getLogger(__name__)

EXTRA_PREFIX: Final = "draft_offload."
DEFAULT_NAMESPACE: Final = "vllm-draft-offload"
DEFAULT_STAGING_MB: Final = 512
DEFAULT_RETRY_INTERVAL_S: Final = 2.0
# These keep per-object metadata, so variable-size objects come back at their real size.
# RESP, S3, mooncake and the rest read back a fixed chunk-sized buffer and would truncate
# or pad a unit.
SAFE_SCHEMES: Final = frozenset({"fs", "redis", "rediss", "unix", "lm", "mooncakestore"})
# These need LMCache's per-object RemoteMetadata (extra_config save_chunk_meta) to read a
# unit back at its real length.
NEEDS_CHUNK_META: Final = frozenset({"fs", "mooncakestore"})
# These connectors keep a stateful socket that a failed or cancelled call can leave
# mid-message; the only safe recovery is a fresh connector.
RECONNECT_SCHEMES: Final = frozenset({"lm"})
# RemoteMetadata and the lm:// wire header store lengths and shapes as int32.
MAX_OBJECT_BYTES: Final = 2**31 - 1
_NAMESPACE_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,48}$")
_HEX_RE: Final = re.compile(r"^[0-9a-f]{1,96}$")
UNIT_DTYPE: Final = torch.uint8
UNIT_FMT: Final = MemoryFormat.KV_2LTD


class ConfigError(ValueError):
    pass


class StagingExhausted(RuntimeError):
    """The staging pool could not hold an object; raised instead of LMCache's busy wait."""


class CorruptObject(RuntimeError):
    """The backend has the key but could not return a well-formed object."""


def _extra(cfg: LMCacheEngineConfig, name: str, default: Any) -> Any:
    extra = cfg.extra_config or {}
    return extra.get(EXTRA_PREFIX + name, default)


@dataclass(frozen=True, slots=True)
class L3Settings:
    url: str  # exactly what goes to CreateConnector
    plugin_name: str | None
    scheme: str
    timeout_s: float
    namespace: str
    staging_bytes: int
    retry_interval_s: float

    @classmethod
    def from_lmcache_config(
        cls,
        cfg: LMCacheEngineConfig,
        timeout_s: float | None = None,
        min_staging_bytes: int = 0,
    ) -> L3Settings:
        """`min_staging_bytes` raises the default staging pool (not an explicit
        `l3_staging_mb`) to what the caller's concurrent transfers need."""
        if timeout_s is None:
            timeout_s = float(_extra(cfg, "l3_timeout_s", cfg.blocking_timeout_secs))
        if timeout_s <= 0:
            raise ConfigError(f"l3_timeout_s must be > 0, got {timeout_s}")
        namespace = str(_extra(cfg, "l3_namespace", DEFAULT_NAMESPACE))
        if not _NAMESPACE_RE.match(namespace):
            # It becomes the LMCache model_name: part of an fs file name and of a <=150-byte
            # lm:// wire key, and '@' separates key fields.
            raise ConfigError(f"l3_namespace must match {_NAMESPACE_RE.pattern}: {namespace!r}")
        staging_bytes = int(float(_extra(cfg, "l3_staging_mb", DEFAULT_STAGING_MB)) * 2**20)
        if _extra(cfg, "l3_staging_mb", None) is None:
            staging_bytes = max(staging_bytes, min_staging_bytes)
        if staging_bytes <= 0:
            raise ConfigError("l3_staging_mb must be > 0")
        retry = float(_extra(cfg, "l3_retry_interval_s", DEFAULT_RETRY_INTERVAL_S))
        allow_any = bool(_extra(cfg, "l3_allow_any_connector", False))

        plugin_name: str | None = None
        if cfg.remote_url:
            url = str(cfg.remote_url)
            scheme = urlsplit(url).scheme
        elif cfg.remote_storage_plugins:
            plugin_name = str(cfg.remote_storage_plugins[0])
            url = f"plugin://{plugin_name}"
            scheme = plugin_name.split(".", 1)[0]
        else:
            raise ConfigError("no L3 backend: set remote_url or remote_storage_plugins")
        if scheme not in SAFE_SCHEMES and not allow_any:
            raise ConfigError(
                f"remote connector {scheme!r} is not known to keep variable-size objects intact; "
                f"supported: {sorted(SAFE_SCHEMES)} "
                f"(set extra_config {EXTRA_PREFIX}l3_allow_any_connector to override)"
            )
        if scheme in NEEDS_CHUNK_META:
            save_meta = (cfg.extra_config or {}).get("save_chunk_meta", True)
            if not save_meta:
                # Without the per-object RemoteMetadata, the connector reads a fixed
                # chunk-sized buffer and cannot know how long a unit is.
                raise ConfigError(f"{scheme}:// needs extra_config save_chunk_meta=true")
        if scheme == "fs" and plugin_name is None and url.startswith("fs:///"):
            url = "fs://localhost:0/" + url[len("fs:///") :]
        if scheme in ("redis", "rediss", "unix") and plugin_name is None:
            url = _with_socket_timeouts(url, timeout_s)
        return cls(url, plugin_name, scheme, timeout_s, namespace, staging_bytes, retry)


def _with_socket_timeouts(url: str, timeout_s: float) -> str:
    """Bound redis-py's socket waits so a hung server cannot occupy the connector's workers.

    RedisConnector runs every call through four AsyncPQExecutor workers. Cancelling our
    caller's future does not cancel a worker's in-flight redis await, so without a socket
    timeout, four hung calls would block every later one.
    """
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.setdefault("socket_timeout", f"{timeout_s:g}")
    query.setdefault("socket_connect_timeout", f"{timeout_s:g}")
    return urlunsplit(parts._replace(query=urlencode(query)))


def load_lmcache_config(
    config_file: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LMCacheEngineConfig:
    """Load the config the way LMCache itself does for vLLM.

    The base is the file (``config_file``, else ``$LMCACHE_CONFIG_FILE``) plus ``LMCACHE_*``
    environment variables, or the environment alone when there is no file. Overrides are
    applied as LMCache's vLLM adapter applies ``lmcache.*`` entries of
    ``kv_connector_extra_config``; the keys here carry no ``lmcache.`` prefix.
    """
    path = config_file if config_file is not None else os.environ.get("LMCACHE_CONFIG_FILE")
    if path:
        cfg = LMCacheEngineConfig.from_file(os.fspath(path))
        cfg.update_config_from_env()
    else:
        cfg = LMCacheEngineConfig.from_env()
    for key, value in (overrides or {}).items():
        if not validate_and_set_config_value(cfg, key, value):
            raise ConfigError(f"invalid LMCache config entry {key}={value!r}")
    return cfg


def config_from_extra_config(
    extra: Mapping[str, Any], config_file: str | os.PathLike[str] | None = None
) -> LMCacheEngineConfig:
    """``kv_connector_extra_config`` style: only ``lmcache.<key>`` entries are applied."""
    overrides = {k[len("lmcache.") :]: v for k, v in extra.items() if k.startswith("lmcache.")}
    return load_lmcache_config(config_file, overrides)


def make_metadata(namespace: str) -> LMCacheMetadata:
    # The shapes here only size the *default* read buffer, which the safe connectors
    # never use: they allocate from the stored RemoteMetadata or the lm:// reply header.
    return LMCacheMetadata(
        model_name=namespace,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=UNIT_DTYPE,
        kv_shape=(1, 1, 1, 1, 1),
        role="worker",
        chunk_size=1,
    )


def make_key(namespace: str, hex_key: str) -> CacheEngineKey:
    """Map our hex chunk key to an LMCache key; the same in every process.

    chunk_hash is an int, and LMCache prints it without leading zeros. A sentinel leading
    1 nibble keeps the mapping injective ("0ab" and "ab" stay distinct). dtype=uint8 and
    our own model_name keep unit keys apart from real LMCache KV in a shared store.
    """
    if not _HEX_RE.match(hex_key):
        raise ValueError(f"L3 keys must be 1-96 lowercase hex digits, got {hex_key!r}")
    return CacheEngineKey(namespace, 1, 0, int("1" + hex_key, 16), UNIT_DTYPE)


PROBE_HEX_KEY: Final = "0"  # never written; exists() on it is a cheap round trip


class StagingBackend(LocalCPUBackend):
    """LocalCPUBackend used only as the connectors' allocator; it never blocks and never evicts."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata, nbytes: int):
        # HostMemoryAllocator's frees go straight to its TensorMemoryAllocator without its
        # lock. That is still safe across threads: the AddressManager underneath takes its
        # own lock, and only a debug counter is racy.
        super().__init__(
            config,
            metadata,
            dst_device="cpu",
            memory_allocator=HostMemoryAllocator(nbytes),
        )
        self._fail_lock = threading.Lock()
        self.alloc_failures = 0

    def allocate(  # type: ignore[override]
        self,
        shapes: torch.Size | list[torch.Size],
        dtypes: torch.dtype | list[torch.dtype],
        fmt: MemoryFormat | None = None,
        eviction: bool = True,
        busy_loop: bool = True,
    ) -> MemoryObj | None:
        obj = super().allocate(shapes, dtypes, fmt, eviction=False, busy_loop=False)
        if obj is None:
            with self._fail_lock:
                self.alloc_failures += 1
        return obj

    def batched_allocate(  # type: ignore[override]
        self,
        shapes: torch.Size | list[torch.Size],
        dtypes: torch.dtype | list[torch.dtype],
        batch_size: int,
        fmt: MemoryFormat | None = None,
        eviction: bool = True,
        busy_loop: bool = True,
    ) -> list[MemoryObj] | None:
        objs = super().batched_allocate(
            shapes, dtypes, batch_size, fmt, eviction=False, busy_loop=False
        )
        if objs is None:
            with self._fail_lock:
                self.alloc_failures += 1
        return objs

    def bytes_in_use(self) -> int:
        return int(self.memory_allocator.allocator.total_allocated_size)  # type: ignore[attr-defined]

    def allocate_unit(self, nbytes: int, *, count_failure: bool = True) -> MemoryObj | None:
        shape = torch.Size([1, 1, 1, nbytes])
        if count_failure:
            return self.allocate(shape, UNIT_DTYPE, UNIT_FMT)
        # A writer polling for room: its misses must not look like a failed read's
        # (get() compares alloc_failures before and after the connector's call).
        return LocalCPUBackend.allocate(
            self, shape, UNIT_DTYPE, UNIT_FMT, eviction=False, busy_loop=False
        )


def create_connector(
    settings: L3Settings,
    loop: asyncio.AbstractEventLoop,
    backend: StagingBackend,
    cfg: LMCacheEngineConfig,
    metadata: LMCacheMetadata,
) -> RemoteConnector:
    """Blocking, because lm:// connects its socket in the constructor; run it off the loop."""
    conn = CreateConnector(
        settings.url, loop, backend, cfg, metadata, plugin_name=settings.plugin_name
    )
    conn.post_init()
    without_stats_monitor(conn)
    inner = inner_connector(conn)
    if isinstance(inner, FSConnector):
        unique_fs_temp_names(inner)
    if isinstance(inner, RedisConnector):
        atomic_redis_pairs(inner)
    if type(inner).__name__ == "MooncakestoreConnector":
        checked_mooncake_calls(inner, settings.timeout_s)
    sock = getattr(inner, "client_socket", None)
    if settings.scheme == "lm" and sock is not None:
        # Without this a stalled server blocks the shared event loop thread forever.
        sock.settimeout(settings.timeout_s)
    return conn


def inner_connector(conn: RemoteConnector) -> RemoteConnector:
    get_inner = getattr(conn, "getWrappedConnector", None)
    return get_inner() if callable(get_inner) else conn


async def close_connector(conn: RemoteConnector) -> None:
    inner = inner_connector(conn)
    pq = getattr(inner, "pq_executor", None)
    redis_conn = getattr(inner, "connection", None)
    if pq is not None and redis_conn is not None and hasattr(redis_conn, "aclose"):
        # RedisConnector.close would deadlock the loop (see the module docstring).
        await pq.shutdown_async(wait=False)
        await redis_conn.aclose()
        return
    await conn.close()


# redis-py's errors do not derive from the builtin ConnectionError/TimeoutError.
_UNREACHABLE: Final = (ConnectionError, EOFError, redis.exceptions.ConnectionError)
_TIMEOUT: Final = (TimeoutError, redis.exceptions.TimeoutError)


def classify(exc: BaseException, op: str, scheme: str) -> str:
    """Map an exception from a connector call to an L3Error kind."""
    if isinstance(exc, StagingExhausted):
        return "staging_exhausted"
    if isinstance(exc, CorruptObject):
        return "corrupt"
    if isinstance(exc, _TIMEOUT):
        return "timeout"
    if isinstance(exc, _UNREACHABLE):
        return "unavailable"
    if isinstance(exc, struct.error):
        # lm:// unpacks a reply header straight from recv(); a short read means the server
        # closed the socket. Elsewhere it is a stored RemoteMetadata that is too short.
        return "unavailable" if scheme == "lm" else "corrupt"
    if op == "get" and isinstance(exc, ValueError):
        # RedisConnector copies kv_bytes into a buffer sized from its metadata key; a
        # length disagreement surfaces as a memoryview ValueError.
        return "corrupt"
    return "io"
