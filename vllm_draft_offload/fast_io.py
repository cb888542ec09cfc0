"""Reading (or copying) a unit's bytes into its destination and hashing them on the way, in
one call: natively without the GIL when the C extension ``_fastread`` was built, else in
Python.

A fetch lands each piece of a unit in its destination and hashes it right after, while it
is still in the CPU cache (unit_fetch). In Python every read and every hash call gives up
the GIL and takes it back; beside vLLM's engine thread, which steps while a request waits
on storage, each take can wait out the engine's Python, so the Python loop's pieces are
large (4 MiB) to take it few times. But on many threads a 4 MiB piece has left the cache
before it is hashed: on an H100 host, warm, the fetch moved each byte through memory three
times where a plain read moves it twice, and reached 0.58-0.65 × the raw read on 8-16
threads (0.47-0.50 beside a busy engine thread). ``_fastread`` runs the whole loop, every
piece's ``pread`` (or ``memcpy``) and hash, inside one release of the GIL, so its pieces
can be as small as a core's L2 holds (the caller picks: unit_fetch) at no GIL cost.

Both readers have the same signatures and results: the digest is the canonical XXH3-128
digest of the destination (``xxhash.xxh3_128(dest).digest()``, ``unit_codec.checksum`` in
hex), a file that ends early raises ``EndOfFile(bytes filled)``, a deadline
(``time.monotonic``) passed before a piece raises ``DeadlinePassed(bytes filled)``, and
nothing is written after either, and any other failed read raises ``OSError``.
``l3_fs_reads.ObjectFile`` turns the first two into its storage errors.

``NATIVE`` says which reader runs; it is read at every call, so tests and the ``l3-stages``
benchmark can switch it. Setting ``VLLM_DRAFT_OFFLOAD_NATIVE_IO=0`` in the environment
before the process imports this module keeps the Python reader (for comparison, or as an
escape hatch should the native loop misbehave on some host).
"""

from __future__ import annotations

import os
import time
from typing import Final

import numpy as np

from vllm_draft_offload.unit_codec import Buffer, payload_hasher

try:
    from vllm_draft_offload import _fastread
except ImportError as exc:  # not built: no C compiler or no Python headers at install time
    _fastread = None
    _MISSING: str | None = str(exc)
else:
    _MISSING = None

ENV_VAR: Final = "VLLM_DRAFT_OFFLOAD_NATIVE_IO"
# The extension could be imported (whether or not it is used).
AVAILABLE: Final = _fastread is not None
_DISABLED: Final = os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")
NATIVE: bool = AVAILABLE and not _DISABLED


class _EndOfFile(Exception):
    """The file ended early; ``args[0]``: the destination's bytes filled."""


class _DeadlinePassed(Exception):
    """The deadline passed before a piece; ``args[0]``: the destination's bytes filled."""


# One class per error whichever reader raised it: the extension's when it is there.
EndOfFile: Final[type[Exception]] = getattr(_fastread, "EndOfFile", _EndOfFile)
DeadlinePassed: Final[type[Exception]] = getattr(_fastread, "DeadlinePassed", _DeadlinePassed)


def reader() -> str:
    """Which reader runs, and why not the native one when it does not (for logs and reports)."""
    if NATIVE:
        return "native"
    if not AVAILABLE:
        return f"python (_fastread not built: {_MISSING})"
    if _DISABLED:
        return f"python ({ENV_VAR}={os.environ.get(ENV_VAR)})"
    return "python"


def pread_into(fd: int, file_offset: int, dest: memoryview) -> None:
    """Fill ``dest`` with ``fd``'s bytes from ``file_offset`` (the Python reader's read,
    also used for headers). Raises ``EndOfFile`` when the file ends first."""
    done = 0
    while done < dest.nbytes:
        n = os.preadv(fd, [dest[done:]], file_offset + done)
        if n <= 0:
            raise EndOfFile(done)
        done += n


def pread_hash_into(
    fd: int, file_offset: int, dest: memoryview, piece_bytes: int, deadline: float
) -> bytes:
    """Fill ``dest`` with ``fd``'s bytes from ``file_offset``, ``piece_bytes`` at a time,
    each piece hashed right after it landed; returns the 16-byte XXH3-128 digest of ``dest``.
    Checks ``deadline`` (``time.monotonic``) before each piece."""
    if NATIVE:
        return _fastread.pread_hash_into(fd, file_offset, dest, piece_bytes, deadline)  # type: ignore[union-attr]
    if piece_bytes <= 0 or file_offset < 0:
        raise ValueError("piece_bytes must be > 0 and file_offset >= 0")
    out = dest.cast("B") if dest.format != "B" else dest
    hasher = payload_hasher()
    for start in range(0, out.nbytes, piece_bytes):
        if time.monotonic() > deadline:
            raise DeadlinePassed(start)
        piece = out[start : start + piece_bytes]
        try:
            pread_into(fd, file_offset + start, piece)
        except EndOfFile as exc:
            raise EndOfFile(start + exc.args[0]) from None
        hasher.update(piece)
    return hasher.digest()


def copy_hash_into(src: Buffer, dest: memoryview, piece_bytes: int) -> bytes:
    """Copy ``src`` into ``dest`` (of the same length), ``piece_bytes`` at a time, each piece
    hashed in ``dest`` right after it was copied; returns the 16-byte XXH3-128 digest."""
    if NATIVE:
        return _fastread.copy_hash_into(src, dest, piece_bytes)  # type: ignore[union-attr]
    source = np.frombuffer(src, dtype=np.uint8)
    out = np.frombuffer(dest, dtype=np.uint8)
    if piece_bytes <= 0 or source.nbytes != out.nbytes:
        raise ValueError(
            f"piece_bytes must be > 0 and src ({source.nbytes} bytes) as long as dest "
            f"({out.nbytes})"
        )
    view = memoryview(out)
    hasher = payload_hasher()
    for start in range(0, out.nbytes, piece_bytes):
        end = min(start + piece_bytes, out.nbytes)
        out[start:end] = source[start:end]  # numpy copies without the GIL
        hasher.update(view[start:end])
    return hasher.digest()
