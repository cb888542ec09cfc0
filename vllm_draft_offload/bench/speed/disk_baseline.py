"""Raw sequential bandwidth of a directory's storage, the way `dd`/`fio` measure it.

The L3 benchmarks put their figures next to these, measured in the same run on the same
directory:

* ``write``: one file written sequentially with O_DIRECT (no page cache), then fsync'd;
  the time includes the fsync. Where the filesystem refuses O_DIRECT (tmpfs, some FUSE
  mounts), it is written buffered and fsync'd, and ``direct`` says so.
* ``read_direct``: the file read back with O_DIRECT: the device, cold, by construction.
* ``read_cold``: a buffered read after the file's pages were evicted: ``drop_caches``
  when root and allowed, else ``posix_fadvise(DONTNEED)`` on the file (no root needed;
  it evicts clean pages of that file only). This is what a cold LMCache ``fs://`` read
  sees, since its reads are buffered.
* ``read_warm``: a buffered read of the file while its pages are cached.
* ``read_warm_into_memory`` (``into_memory=True``): the same warm read, but each thread's
  range lands in a buffer of its own as large as the range (touched beforehand, like the
  host pool's slots), instead of one 8 MiB buffer read over and over. ``dd`` and ``fio``
  reuse one buffer, which stays in the CPU cache, so ``read_warm`` never pays for writing
  the bytes to memory; a fetch must, since a unit has to land in its host slot.

Reads can run on several threads, each reading its own contiguous range with ``preadv``,
which is how ``fio --numjobs`` loads a device; an L3 fetch on N threads is compared with
the raw read on N threads. Buffers are anonymous ``mmap``s, page aligned, as O_DIRECT
needs. With ``reps`` > 1 every read figure is the best of that many passes, as the
benchmarks' own figures are.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BLOCK = 8 << 20  # bytes per I/O call; a multiple of every logical block size in use
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def _aligned(nbytes: int, fill: bool = False) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # page aligned, zeroed
    if fill:
        buf.write(os.urandom(min(nbytes, 1 << 20)) * (nbytes // min(nbytes, 1 << 20)))
        buf.seek(0)
    return buf


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """(fd, direct): O_DIRECT where the filesystem allows it, else buffered."""
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o644), False


def write_pass(directory: Path, total_bytes: int, block: int = BLOCK) -> dict[str, Any]:
    """Write ``total_bytes`` (rounded down to whole blocks) to a new file, then fsync."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".disk-baseline-{os.getpid()}.bin"
    blocks = max(1, total_bytes // block)
    buf = _aligned(block, fill=True)
    fd, direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        start = time.perf_counter()
        for _ in range(blocks):
            os.write(fd, buf)
        os.fsync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        buf.close()
    nbytes = blocks * block
    return {
        "path": str(path),
        "bytes": nbytes,
        "seconds": seconds,
        "GBps": nbytes / seconds / 1e9,
        "direct": direct,
    }


def evict(paths: Iterable[Path], drop_caches: bool = False) -> str:
    """Take files out of the page cache; returns the method used.

    ``drop_caches`` (root only; it empties the whole host's page cache) is used when asked
    and possible. Otherwise each file is fsync'd (dirty pages cannot be dropped) and
    ``posix_fadvise(DONTNEED)`` drops its cached pages.
    """
    paths = list(paths)
    if drop_caches and os.geteuid() == 0:
        try:
            os.sync()
            DROP_CACHES.write_text("3\n")
            return "drop_caches"
        except OSError:
            pass  # e.g. a read-only /proc in a container: fall back to per-file eviction
    for path in paths:
        evict_from_page_cache(path)
    return "fadvise_dontneed"


def evict_from_page_cache(path: Path) -> None:
    """Drop one file's pages from the page cache, written back first (the kernel keeps
    dirty pages); no root needed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cache(paths: Iterable[Path], threads: int = 4) -> dict[str, Any]:
    """Read files whole (buffered), so that their pages are in the page cache: what a
    warm storage read then finds. The read's own figures come back with the count."""
    paths = list(paths)
    start = time.perf_counter()

    def read_whole(path: Path) -> int:
        return _read_range(path, 0, path.stat().st_size, BLOCK, direct=False, dest=None)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        nbytes = sum(pool.map(read_whole, paths))
    seconds = time.perf_counter() - start
    return {
        "method": "read",
        "files": len(paths),
        "bytes": nbytes,
        "seconds": seconds,
        "GBps": nbytes / seconds / 1e9 if seconds > 0 else None,
    }


def _read_range(
    path: Path, offset: int, length: int, block: int, direct: bool, dest: mmap.mmap | None
) -> int:
    """Read ``length`` bytes into one reused block buffer, or along ``dest``."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    own = _aligned(block) if dest is None else None
    done = 0
    try:
        with memoryview(dest if own is None else own) as buf:
            while done < length:
                at = 0 if own is not None else done
                n = os.preadv(fd, [buf[at : at + min(block, length - done)]], offset + done)
                if n <= 0:
                    break
                done += n
    finally:
        os.close(fd)
        if own is not None:
            own.close()
    return done


def _touched(nbytes: int) -> mmap.mmap:
    """A destination whose pages exist already, as a host pool's slots do."""
    buf = mmap.mmap(-1, nbytes)
    page = mmap.PAGESIZE
    for pos in range(0, nbytes, page):
        buf[pos] = 1
    return buf


def read_pass(
    path: Path,
    threads: int = 1,
    direct: bool = False,
    block: int = BLOCK,
    into_memory: bool = False,
) -> float:
    """GB/s of reading the whole file, split in ``threads`` block-aligned ranges.

    ``into_memory``: each range lands in its own touched buffer of the range's size."""
    size = path.stat().st_size
    per = -(-size // threads // block) * block
    ranges = [(i * per, min(per, size - i * per)) for i in range(threads) if i * per < size]
    dests = [_touched(length) if into_memory else None for _, length in ranges]
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(ranges)) as pool:
            got = sum(
                pool.map(
                    lambda r, d: _read_range(path, r[0], r[1], block, direct, d), ranges, dests
                )
            )
        seconds = time.perf_counter() - start
    finally:
        for dest in dests:
            if dest is not None:
                dest.close()
    if got != size:
        raise RuntimeError(f"read {got} of {size} bytes of {path}")
    return size / seconds / 1e9


def measure(
    directory: Path,
    total_bytes: int,
    threads: Iterable[int] = (1,),
    drop_caches: bool = False,
    keep: bool = False,
    reps: int = 1,
    into_memory: bool = False,
) -> dict[str, Any]:
    """Every raw pass on one file in ``directory``; reads by thread count, each the best
    of ``reps`` passes; ``into_memory`` adds ``read_warm_into_memory_GBps``."""
    write = write_pass(directory, total_bytes)
    path = Path(write["path"])
    report: dict[str, Any] = {
        "directory": str(directory),
        "bytes": write["bytes"],
        "write_GBps": write["GBps"],
        "write_direct": write["direct"],
        "read_direct_GBps": {},
        "read_cold_GBps": {},
        "read_warm_GBps": {},
    }
    if into_memory:
        report["read_warm_into_memory_GBps"] = {}

    def cold(n: int) -> float:
        report["cold_method"] = evict([path], drop_caches)
        return read_pass(path, n)

    try:
        for n in threads:
            t = str(n)
            if write["direct"]:
                report["read_direct_GBps"][t] = max(
                    read_pass(path, n, direct=True) for _ in range(reps)
                )
            report["read_cold_GBps"][t] = max(cold(n) for _ in range(reps))
            read_pass(path, n)  # the pages are cached now
            report["read_warm_GBps"][t] = max(read_pass(path, n) for _ in range(reps))
            if into_memory:
                report["read_warm_into_memory_GBps"][t] = max(
                    read_pass(path, n, into_memory=True) for _ in range(reps)
                )
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    return report
