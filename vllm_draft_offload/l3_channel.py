"""The time-bounded, breaker-guarded channel under ``L3Store``: one LMCache connector,
one event-loop thread, one staging pool.

Every connector coroutine runs on the channel's loop thread; a caller waits for its
result at most until its deadline, so a hung backend costs a bounded wait and never a
stall. Failures classed ``timeout`` or ``unavailable`` open a circuit breaker (see
``l3_store``). ``L3Store`` adds the object API (names, put/get/exists/remove) on top; this
module holds only the connection's life cycle and the rules for running one call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from vllm_draft_offload.l3_backends import (
    PROBE_HEX_KEY,
    RECONNECT_SCHEMES,
    L3Settings,
    StagingBackend,
    classify,
    close_connector,
    create_connector,
    make_key,
    make_metadata,
)
from vllm_draft_offload.l3_errors import L3Error, L3ErrorKind

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRIPS_BREAKER = frozenset({"timeout", "unavailable"})


class L3Channel:
    """Connector, loop thread and breaker state; ``L3Store`` subclasses it."""

    def __init__(self, lmcache_config: LMCacheEngineConfig, settings: L3Settings) -> None:
        self.settings = settings
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
        self.last_error: L3Error | None = None

    @property
    def scheme(self) -> str:
        return self.settings.scheme

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
        self._succeeded()
        return result

    def _succeeded(self) -> None:
        """A call answered: the backend is up (ends a probe after an outage)."""
        with self._state:
            self._healthy = True
            self._retry_at = 0.0

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


def release_staged(obj: Any) -> None:
    if isinstance(obj, MemoryObj):
        obj.ref_count_down()


def _release_late(fut: concurrent.futures.Future[Any], release: Callable[[Any], None]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        release(fut.result())
