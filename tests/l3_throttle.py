"""A latency throttle around a real LMCache connector (not a mock of the tier).

Every `exists`/`get` the L3Store sends to its connector first sleeps on the
store's event loop, so concurrent calls overlap the way a remote backend's do.
fs:// fetches read the object's file on the calling thread (`L3Store.read_file`),
and fs:// lookups stat the files there (`L3Store._files_exist`), without the
connector: each sleeps `get` (a read) or `exists` (a lookup's round) there first, on
its own thread. `disk` (seconds per fs:// read) makes the reads share one device
instead: they run one at a time, so k reads sent at once land after 1, 2, ..., k
times that, as on a disk whose bandwidth one read already fills.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_draft_offload.bench.speed.disk_baseline import evict_from_page_cache
from vllm_draft_offload.l3_residency import file_resident
from vllm_draft_offload.l3_store import L3Store


class SlowConnector:
    def __init__(self, inner: Any, delays: dict[str, float]) -> None:
        self._inner = inner
        self._delays = delays
        # Calls sleeping at once, and reads started in all.
        self.gets_in_flight = self.max_gets_in_flight = 0
        self.gets_started = 0
        self.exists_in_flight = self.max_exists_in_flight = 0
        self._lock = threading.Lock()  # read_file sleeps on the callers' threads
        self._disk = threading.Lock()  # the one device of `disk` reads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _exists_started(self) -> None:
        with self._lock:
            self.exists_in_flight += 1
            self.max_exists_in_flight = max(self.max_exists_in_flight, self.exists_in_flight)

    def _exists_ended(self) -> None:
        with self._lock:
            self.exists_in_flight -= 1

    async def exists(self, key: Any) -> bool:
        self._exists_started()
        try:
            await asyncio.sleep(self._delays.get("exists", 0.0))
        finally:
            self._exists_ended()
        return await self._inner.exists(key)

    def files_exist(self, check: Callable[..., Any], lkeys: Any) -> Any:
        self._exists_started()
        try:
            time.sleep(self._delays.get("exists", 0.0))
        finally:
            self._exists_ended()
        return check(lkeys)

    async def get(self, key: Any) -> Any:
        self.gets_started += 1
        self.gets_in_flight += 1
        self.max_gets_in_flight = max(self.max_gets_in_flight, self.gets_in_flight)
        try:
            await asyncio.sleep(self._delays.get("get", 0.0))
        finally:
            self.gets_in_flight -= 1
        return await self._inner.get(key)

    def read_file(self, read: Callable[..., Any], key: str, consume: Any) -> Any:
        with self._lock:
            self.gets_started += 1
            self.gets_in_flight += 1
            self.max_gets_in_flight = max(self.max_gets_in_flight, self.gets_in_flight)
        try:
            time.sleep(self._delays.get("get", 0.0))
            if "disk" in self._delays:
                with self._disk:
                    time.sleep(self._delays["disk"])
        finally:
            with self._lock:
                self.gets_in_flight -= 1
        return read(key, consume)


def throttle(store: L3Store | None, **delays: float) -> SlowConnector:
    """Delay `store`'s connector calls, e.g. throttle(store, exists=0.05, get=0.1), or
    make its fs:// reads share one device: throttle(store, disk=0.1)."""
    assert store is not None and store.check_health(), "throttle needs a connected store"
    assert store._conn is not None
    slow = SlowConnector(store._conn, delays)
    store._conn = slow  # type: ignore[assignment]
    read = store.read_file
    store.read_file = lambda key, consume: slow.read_file(read, key, consume)  # type: ignore[method-assign]
    check = store._files_exist
    store._files_exist = lambda lkeys: slow.files_exist(check, lkeys)  # type: ignore[method-assign]
    return slow


def cold_files(root: Path) -> None:
    """Drop every file under `root` from the page cache (written back first).

    A throttled fs:// read stands for a cold or slow disk, but the files stay cached:
    the lookup would see the fetch's first round resident (l3_residency.py) and bet on
    it landing at memory speed, which the throttle then denies. Skips the test where
    the kernel keeps the pages (tmpfs, or a filesystem that ignores the advice)."""
    files = [path for path in root.rglob("*") if path.is_file()]
    for path in files:
        evict_from_page_cache(path)
    if any(file_resident(path) for path in files):
        pytest.skip(f"the page cache kept files under {root}: storage cannot be made cold")
