"""How many entries each long-lived container of the connector holds (a leak finder).

`container_sizes` walks the object graph of a connector half: every attribute of
every object whose class comes from ``vllm_draft_offload`` or LMCache (what the
storage tier drives: its staging backend, allocator, connectors, stats monitor),
and records the length of each dict, list, set, deque or sorted list it finds
(``scheduler.l3.fetches.units: 3``), the backlog of each queue and thread pool, and
the tasks of each event loop. Containers are counted, not entered; vLLM objects,
tensors and arrays are not walked. A container that grows with requests, units or
faults shows as a path whose count climbs while the load is steady.

Used by the soak (a sample per second, `connector_state` through ``collective_rpc``)
and by the bounded-state tests. Imports nothing heavy; the product never imports it.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import sys
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Classes from these packages are walked (their attributes); everything else is a leaf.
WALKED = ("vllm_draft_offload", "lmcache")
SORTED = ("SortedList", "SortedKeyList", "SortedDict", "SortedSet")


def _walked(obj: object) -> bool:
    module = type(obj).__module__ or ""
    return module.split(".", 1)[0] in WALKED


def _attributes(obj: object) -> list[tuple[str, Any]]:
    names = list(getattr(obj, "__dict__", {}).items())
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot != "__dict__" and hasattr(obj, slot):
                names.append((slot, getattr(obj, slot)))
    return names


def container_sizes(root: object, prefix: str) -> dict[str, int]:
    """``{path: entries}`` of every container reachable from ``root`` (see module doc)."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    # Breadth first: an object reachable along several paths is named by the shortest.
    todo: deque[tuple[str, object]] = deque([(prefix, root)])
    while todo:
        path, obj = todo.popleft()
        if id(obj) in seen:
            continue  # a shared object (the LMCache stats monitor) counts once
        seen.add(id(obj))
        if isinstance(obj, dict | list | set | deque) or type(obj).__name__ in SORTED:
            sizes[path] = len(obj)  # type: ignore[arg-type]
        elif isinstance(obj, queue.SimpleQueue | queue.Queue):
            sizes[path] = obj.qsize()
        elif isinstance(obj, ThreadPoolExecutor):
            sizes[f"{path}.backlog"] = obj._work_queue.qsize()
        elif isinstance(obj, asyncio.AbstractEventLoop):
            sizes[f"{path}.tasks"] = _tasks(obj)
        elif _walked(obj):
            for name, value in sorted(_attributes(obj), key=lambda item: item[0]):
                todo.append((f"{path}.{name}", value))
    return sizes


def _tasks(loop: asyncio.AbstractEventLoop) -> int:
    for _ in range(3):  # the loop's thread may add a task while we count
        try:
            return len(asyncio.all_tasks(loop))
        except RuntimeError:
            continue
    return -1


# ------------------------------------------------------------------ inside an engine

_scheduler_half: weakref.ref[Any] | None = None
_scanned_for_scheduler = False


# How an object on this thread's call stack reaches the scheduler half: vLLM's
# EngineCore holds the Scheduler, whose KV connector holds our scheduler half.
SCHEDULER_PATH = ("scheduler", "connector", "_scheduler")


def half_on_stack(cls: type, path: tuple[str, ...] = SCHEDULER_PATH) -> Any | None:
    """The first ``self.<path>`` of a frame on this thread's stack that is a ``cls``.
    A worker's ``collective_rpc`` runs inside EngineCore's busy loop when the worker
    shares its process (the `uni` executor), so EngineCore is on the stack then."""
    frame = sys._getframe(1)
    while frame is not None:
        obj: Any = frame.f_locals.get("self")
        for name in path:
            obj = getattr(obj, name, None)
        if isinstance(obj, cls):
            return obj
        frame = frame.f_back
    return None


def _find_scheduler_half() -> Any | None:
    """The scheduler half of this process's connector, found once and then held
    weakly: on the call stack (EngineCore's), else by a scan of the garbage collector's
    objects. The scan alone never found it on a GPU: vLLM freezes the collector's heap
    once EngineCore has started (``freeze_gc_heap``), and ``gc.get_objects`` leaves
    frozen objects out. It lives in the EngineCore process, where vLLM runs the worker
    of a one-GPU engine too (the `uni` executor); None in a worker process of its own
    (tensor parallelism, vLLM's CPU platform)."""
    global _scheduler_half, _scanned_for_scheduler
    if _scheduler_half is not None:
        return _scheduler_half()
    from vllm_draft_offload.scheduler_side import DraftOffloadScheduler

    found = half_on_stack(DraftOffloadScheduler)  # cheap: tried on every call
    if found is None and not _scanned_for_scheduler:
        _scanned_for_scheduler = True  # a scan of every object: once
        found = next((o for o in gc.get_objects() if isinstance(o, DraftOffloadScheduler)), None)
    if found is None:
        return None
    _scheduler_half = weakref.ref(found)
    return found


def connector_state(worker: Any = None) -> dict[str, int]:
    """On a worker (``collective_rpc``): container sizes of this process's connector
    halves, worker side under ``worker.``, scheduler side under ``scheduler.``."""
    out: dict[str, int] = {}
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        half = getattr(get_kv_transfer_group(), "_worker", None)
        if half is not None:
            out.update(container_sizes(half, "worker"))
    scheduler = _find_scheduler_half()
    if scheduler is not None:
        out.update(container_sizes(scheduler, "scheduler"))
    return out
