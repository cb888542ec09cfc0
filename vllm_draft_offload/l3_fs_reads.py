"""Reading an LMCache ``fs://`` object straight into a caller's buffer, on the calling thread.

``FSConnector.get`` reads a whole object into a buffer it allocates from the staging
pool, and it cannot read into one of ours. A fetch then needs a second full copy
(staging buffer to host slot) and a separate hashing pass over memory, which held warm
fetches to about a third of a raw page-cache read. Here the object's file, found by the
connector's own path rule (``_get_file_path``: base paths, file name), is opened and
read with ``preadv`` wherever the caller says, in pieces it can verify while they are
still in the CPU cache.

The file is what ``FSConnector.put`` wrote: LMCache's ``RemoteMetadata`` (the object's
length, shape and dtype), then the object's bytes. A file whose size disagrees with its
metadata is reported as corrupt, as a failed ``FSConnector.get`` of an existing key is.

Opening an object costs one read for LMCache's metadata, the unit's framing and header
together (``HEAD_BYTES``): every system call gives up the GIL and has to take it back,
which under a busy engine thread (vLLM's loop steps while a request waits on storage)
can cost more than the call itself.

``ObjectFile.readinto_hashed`` reads a span and returns its digest in one call
(fast_io: a GIL-free native loop when the extension was built, else the Python one),
hashing each piece right after it landed, which a fetch checks against the unit's header.

Reads are blocking and cannot be cancelled once in the kernel, so ``ObjectFile``
checks the caller's deadline and stop flag before each piece: a slow disk costs at most
the timeout plus one piece, a fetch given up stops within a piece, and nothing is written
into the caller's buffer after the call returns.
A read stuck inside one piece (a hung network mount) holds its thread, and the caller
its buffer, until the kernel returns; LMCache's path held a thread of its executor
instead and left a staging buffer behind. The request waiting on it stops waiting
after the timeout either way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from lmcache.utils import CacheEngineKey
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector

from vllm_draft_offload import fast_io
from vllm_draft_offload.l3_backends import CorruptObject

# A file read this far ahead of the reader tells the kernel that the access is
# sequential (a larger readahead window for cold files; no cost when cached).
_SEQUENTIAL: Final = getattr(os, "POSIX_FADV_SEQUENTIAL", None)
# Read with LMCache's metadata when a file is opened: the unit's framing and header
# (about 130 bytes per layer) fit for any model with up to a few hundred layers; a
# longer header costs one more read.
HEAD_BYTES: Final = 64 << 10


class DeadlineExceeded(TimeoutError):
    """The caller's time ran out between two pieces of a read."""


class ReadStopped(Exception):
    """The caller set its stop flag (``ObjectFile.stop``) between two pieces of a read: a
    fetch given up. Neither a storage failure nor a success (no circuit breaker counts it);
    nothing is written into the caller's buffer after it is raised."""


class ObjectFile:
    """One stored object's bytes in an open file: ``nbytes`` bytes from ``start``.

    ``head`` holds the object's first bytes, read when the file was opened.
    """

    def __init__(
        self, fd: int, start: int, nbytes: int, deadline: float, head: bytes = b""
    ) -> None:
        self.fd = fd
        self.start = start
        self.nbytes = nbytes
        self.deadline = deadline
        self.head = head[:nbytes]
        # The reader's stop flag (its first byte, set from another thread: the fetch was
        # given up): checked before each piece as the deadline is (``ReadStopped``).
        self.stop: bytearray | None = None

    def readinto(self, pos: int, buf: memoryview) -> None:
        """Fill ``buf`` with the object's bytes from ``pos``; a short file is corrupt."""
        if self.stop is not None and self.stop[0]:
            raise ReadStopped(f"stopped at object byte {pos}")
        if time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"deadline passed at object byte {pos}")
        self._check_span(pos, buf)
        with self._errors(pos):
            fast_io.pread_into(self.fd, self.start + pos, buf)

    def readinto_hashed(self, pos: int, buf: memoryview, piece_bytes: int) -> bytes:
        """Fill ``buf`` with the object's bytes from ``pos``, ``piece_bytes`` at a time,
        each piece hashed right after it landed and the deadline checked before it; returns
        the XXH3-128 digest of ``buf`` (``fast_io.pread_hash_into``'s)."""
        self._check_span(pos, buf)
        with self._errors(pos):
            return fast_io.pread_hash_into(
                self.fd, self.start + pos, buf, piece_bytes, self.deadline, self.stop
            )

    def readinto_layers_hashed(
        self, pos: int, buf: memoryview, layer_sizes: list[int], piece_bytes: int, threads: int = 1
    ) -> list[bytes]:
        """``readinto_hashed`` for back-to-back layers of ``layer_sizes`` bytes covering
        ``buf``: the XXH3-128 digest of each (``fast_io.pread_hash_layers_into``'s, the
        layers split over ``threads`` threads)."""
        self._check_span(pos, buf)
        with self._errors(pos):
            return fast_io.pread_hash_layers_into(
                self.fd,
                self.start + pos,
                buf,
                layer_sizes,
                piece_bytes,
                self.deadline,
                threads,
                self.stop,
            )

    def _check_span(self, pos: int, buf: memoryview) -> None:
        if pos < 0 or pos + buf.nbytes > self.nbytes:
            raise ValueError(f"[{pos}, {pos + buf.nbytes}) is outside the object")

    @contextmanager
    def _errors(self, pos: int) -> Iterator[None]:
        """fast_io's errors of a read from object byte ``pos`` as the storage's."""
        try:
            yield
        except fast_io.EndOfFile as e:
            # The file shrank after it was opened (truncated in place).
            at = pos + e.args[0]
            raise CorruptObject(f"file ended at object byte {at} of {self.nbytes}") from None
        except fast_io.DeadlinePassed as e:
            raise DeadlineExceeded(f"deadline passed at object byte {pos + e.args[0]}") from None
        except fast_io.Stopped as e:
            raise ReadStopped(f"stopped at object byte {pos + e.args[0]}") from None

    def read(self, pos: int, nbytes: int) -> bytes:
        """The object's bytes [pos, pos + nbytes): from ``head`` when it holds them."""
        if pos >= 0 and pos + nbytes <= len(self.head):
            return self.head[pos : pos + nbytes]
        out = bytearray(nbytes)
        self.readinto(pos, memoryview(out))
        return bytes(out)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_object_file(conn: FSConnector, key: CacheEngineKey, deadline: float) -> ObjectFile | None:
    """The object of ``key``, or None when its file does not exist."""
    path = conn._get_file_path(key)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        meta_bytes = conn.remote_metadata_bytes
        raw = os.pread(fd, meta_bytes + HEAD_BYTES, 0)
        size = os.fstat(fd).st_size
        if len(raw) < meta_bytes:
            raise CorruptObject(f"{path.name}: {size} bytes, shorter than LMCache's metadata")
        try:
            length = RemoteMetadata.deserialize(raw[:meta_bytes]).length
        except (ValueError, KeyError) as e:  # an unknown format or dtype code
            raise CorruptObject(f"{path.name}: unreadable LMCache metadata ({e})") from e
        if length <= 0 or size != meta_bytes + length:
            raise CorruptObject(
                f"{path.name}: {size - meta_bytes} bytes after the metadata, which says {length}"
            )
        if _SEQUENTIAL is not None:
            os.posix_fadvise(fd, meta_bytes, length, _SEQUENTIAL)
        return ObjectFile(fd, meta_bytes, length, deadline, raw[meta_bytes:])
    except BaseException:
        os.close(fd)
        raise
