"""Is a stored object's file in the page cache? Warm storage told from cold before a fetch.

Before any unit of a fetch lands, the cost policy (l3_cost.py) has only an estimate of
when its first round will: a unit time measured on earlier reads, warm or cold. A warm
restart and a cold one can be priced alike (H100, session 18: a warm first round
estimated at 34 ms, over its 28 ms allowance, was given up 39 ms in, just before it
would have landed), so the estimate alone cannot tell a bet worth making from one that
is not. For fs:// the kernel can: ``mincore`` on a mapping of the file says, page by
page, whether the file's bytes are cached, without reading them, faulting them in or
starting any I/O (a ``preadv`` with ``RWF_NOWAIT`` that misses starts readahead, so it
is not a pure observation, and it samples a few offsets where this sees every page).

The lookup (``SchedulerL3``) asks this of the files its fetch's first round will read,
right after it found them, before any read was sent: ``Presence.first_round`` carries
the answer to the request's decision. Only a file whose every page is cached counts as
resident. Anything that cannot be told (not Linux, a mapping or ``mincore`` refused, a
backend without files) is unknown, and the policy then keeps its rule for cold storage.

Since Linux 5.2 ``mincore`` reports the page cache of a file only to a process that owns
it or may write to it (others see only pages they mapped themselves): files another user
wrote read as not resident, which costs warm hits, never a bound.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

logger = logging.getLogger(__name__)

# Only the lowest bit of each byte mincore returns is defined (resident); the others
# are reserved, so they are masked off before counting.
_RESIDENT_BIT: Final = bytes(b & 1 for b in range(256))


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC: Final = _load_libc()
_MAP_FAILED: Final = ctypes.c_void_p(-1).value


def fd_resident(fd: int, size: int) -> bool | None:
    """Are all `size` bytes of open file `fd` in the page cache? None: cannot tell."""
    if _LIBC is None or size <= 0:
        return None
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None  # a filesystem that cannot map its files
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        if _LIBC.mincore(addr, size, vec) != 0:
            return None
        return vec.raw.translate(_RESIDENT_BIT).count(0) == 0
    finally:
        _LIBC.munmap(addr, size)


def file_resident(path: str | os.PathLike[str]) -> bool | None:
    """Is the whole file at `path` in the page cache? False when it is gone (a fetch
    of it would fail, not land at memory speed); None: cannot tell."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        return fd_resident(fd, os.fstat(fd).st_size)
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Residency:
    """How much of a fetch's first round (one unit per read thread, every TP rank's
    object of it) the page cache held when the lookup found it."""

    probed: int  # files asked about
    resident: int  # of them, files whose every page was cached

    @property
    def all_resident(self) -> bool:
        return self.probed > 0 and self.resident == self.probed

    def label(self) -> str:
        return f"{self.resident}/{self.probed}"


def residency_of(answers: list[bool | None]) -> Residency | None:
    """The first round's residency from each file's answer; None (unknown) when any
    file could not be told or there is none."""
    if not answers or any(answer is None for answer in answers):
        return None
    return Residency(len(answers), sum(1 for answer in answers if answer))


def first_round_residency(
    files_resident: Callable[[list[str]], list[bool | None] | None],
    chunk_keys: Sequence[bytes],
    present: Sequence[bool],
    round_units: int,
    object_names: Callable[[bytes], list[str]],
) -> Residency | None:
    """Residency of the files a fetch of the leading hits among `chunk_keys` reads first:
    every object (`object_names`: one per TP rank) of the first `round_units` of them.
    Asked before any read of them is sent, as a read under way would make a cold file
    look partly warm. None: no hit, or unknown (a failed probe included: it only
    informs a wait, and must never fail the lookup that asks it)."""
    hits = next((i for i, found in enumerate(present) if not found), len(present))
    first_round = chunk_keys[: min(hits, round_units)]
    if not first_round:
        return None
    try:
        answers = files_resident([name for key in first_round for name in object_names(key)])
    except Exception:
        logger.debug("DraftOffloadConnector: page-cache probe failed", exc_info=True)
        return None
    return None if answers is None else residency_of(answers)


class Presence(list[bool]):
    """A lookup's answer (is each chunk in storage, in order), and the residency of the
    first round a fetch of its leading hits would read (None: not probed or unknown).
    A list, so callers that only want the answer need not know about residency."""

    first_round: Residency | None = None
    # time.perf_counter() when the lookup had its answer: what it waited after that is
    # the scheduler's step cadence, not storage (None: not timed).
    answered_at: float | None = None
