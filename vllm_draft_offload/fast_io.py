"""Reading (or copying) a unit's bytes into its destination and hashing them on the way, in
one call: natively without the GIL when the C extension ``_fastread`` was built, else in
Python. Fetches and writes both go through here.

A fetch lands each piece of a unit in its destination and hashes it right after, while it
is still in the CPU cache (unit_fetch). In Python every read (or copy) and every hash call
gives up the GIL and takes it back; beside vLLM's engine thread, which steps while a
request waits on storage, each take can wait out the engine's Python, so the Python loop's
pieces are large (4 MiB) to take it few times. But on many threads a 4 MiB piece has left
the cache before it is hashed: on an H100 host, warm, the fetch moved each byte through
memory three times where a plain read moves it twice, and reached 0.58-0.65 × the raw read
on 8-16 threads (0.47-0.50 beside a busy engine thread). ``_fastread`` runs the whole loop,
every piece's ``pread`` (or ``memcpy``) and hash, inside one release of the GIL, so its
pieces can be as small as a core's L2 holds (the caller picks: unit_fetch, unit_write) at
no GIL cost.

A write (unit_write) copies a unit's payload from its host slot into the storage's buffer
with ``copy_hash_layers_into``: each piece, right after it was copied, is hashed for the
payload's digest and for the digest of every layer it overlaps. Natively a write gives up
the GIL once; the Python loop gives it up and takes it back for every piece's copy and
for each of its hash calls.

Both loops have the same signatures and results: a digest is the canonical XXH3-128 digest
of its bytes (``xxhash.xxh3_128(dest).digest()``, ``unit_codec.checksum`` in hex; a layer's
of its range of ``dest``), arguments that cannot be (a piece of 0 bytes, lengths or layer
sizes that disagree) raise the same ``ValueError``, a file that ends early raises
``EndOfFile(bytes filled)``, a deadline (``time.monotonic``) passed before a piece raises
``DeadlinePassed(bytes filled)``, a stop flag set before a piece (the first byte of a
``stop`` buffer another thread sets: a fetch given up, l3_worker) raises
``Stopped(bytes filled)``, and nothing is written after any of them, and any other failed
read raises ``OSError``. ``l3_fs_reads.ObjectFile`` turns the read errors into its
storage errors.

A storage lookup asks of many stored files whether they exist (``files_exist``) and, for
those a fetch would read first, whether the page cache holds them whole
(``files_resident``). Natively each list is answered in one release of the GIL; in Python
every file's ``stat`` (or ``open``, ``mmap`` and ``mincore``) gives it up and takes it
back, and beside a busy engine thread each take can wait out a switch interval (2-core
box, beside a busy thread at 0.5 ms: a 64-key lookup took 6.7 ms in Python, 1.6 ms
natively, against 0.5 ms quiet).

``NATIVE`` says which loop runs (the "reader", for fetches and writes alike); it is read at
every call, so tests and the ``l3-stages`` benchmark can switch it. Setting
``VLLM_DRAFT_OFFLOAD_NATIVE_IO=0`` in the environment before the process imports this
module keeps the Python loop (for comparison, or as an escape hatch should the native loop
misbehave on some host). An extension built from an older ``_fastread.c``, without every
function called here, is not used at all (``reader()`` says to rebuild it).
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

import numpy as np

from vllm_draft_offload.l3_residency import file_resident
from vllm_draft_offload.unit_codec import Buffer, payload_hasher

# The extension's functions this module calls. One built from an older _fastread.c (an
# editable install not rebuilt after an update) lacks some; it is then not used at all,
# rather than failing every call to a missing function.
_FUNCTIONS: Final = (
    "pread_hash_into",
    "pread_hash_layers_into",
    "copy_hash_into",
    "copy_hash_layers_into",
    "files_exist",
    "files_resident",
)

try:
    from vllm_draft_offload import _fastread
except ImportError as exc:  # not built: no C compiler or no Python headers at install time
    _fastread = None
    _MISSING: str | None = f"not built: {exc}"
else:
    _MISSING = None
    if _lacks := [name for name in _FUNCTIONS if not hasattr(_fastread, name)]:
        _MISSING = (
            f"stale: {_fastread.__file__} has no {', '.join(_lacks)}; rebuild it "
            "(pip install -e ., or python setup.py build_ext --inplace)"
        )
        _fastread = None

# The Python loop's pieces, for fetches (unit_fetch) and writes (unit_write): small enough
# to stay in the last-level cache between landing and hashing (several threads' pieces at
# once; a write hashes each twice, the payload's digest and its layers'), large enough
# that a unit takes the GIL a few dozen times. Also the size of a spread fetch's runs of
# layers.
PIECE_BYTES: Final = 4 << 20
# The native loop's pieces: it keeps the GIL released between them, so they need only be
# small enough that a piece is still in the core's own L2 (1-2 MiB on current server
# CPUs, shared with the read's kernel copy) when it is hashed right after landing.
NATIVE_PIECE_BYTES: Final = 256 << 10

# Most threads one layered read may use (_fastread's MAX_READ_THREADS).
MAX_READ_THREADS: Final = 64

ENV_VAR: Final = "VLLM_DRAFT_OFFLOAD_NATIVE_IO"
# The extension could be imported and has every function called here (whether or not it
# is used).
AVAILABLE: Final = _fastread is not None
_DISABLED: Final = os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")
NATIVE: bool = AVAILABLE and not _DISABLED


class _EndOfFile(Exception):
    """The file ended early; ``args[0]``: the destination's bytes filled."""


class _DeadlinePassed(Exception):
    """The deadline passed before a piece; ``args[0]``: the destination's bytes filled."""


class _Stopped(Exception):
    """The caller's stop flag was set before a piece; ``args[0]``: the destination's bytes
    filled."""


# One class per error whichever reader raised it: the extension's when it is there.
EndOfFile: Final[type[Exception]] = getattr(_fastread, "EndOfFile", _EndOfFile)
DeadlinePassed: Final[type[Exception]] = getattr(_fastread, "DeadlinePassed", _DeadlinePassed)
Stopped: Final[type[Exception]] = getattr(_fastread, "Stopped", _Stopped)


def reader() -> str:
    """Which reader runs, and why not the native one when it does not (for logs and reports)."""
    if NATIVE:
        return "native"
    if not AVAILABLE:
        return f"python (_fastread {_MISSING})"
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
    fd: int,
    file_offset: int,
    dest: memoryview,
    piece_bytes: int,
    deadline: float,
    stop: bytearray | None = None,
) -> bytes:
    """Fill ``dest`` with ``fd``'s bytes from ``file_offset``, ``piece_bytes`` at a time,
    each piece hashed right after it landed; returns the 16-byte XXH3-128 digest of ``dest``.
    Checks ``deadline`` (``time.monotonic``) and ``stop[0]`` before each piece."""
    if NATIVE:
        return _fastread.pread_hash_into(fd, file_offset, dest, piece_bytes, deadline, stop)  # type: ignore[union-attr]
    out = _read_destination(dest, file_offset, piece_bytes)
    hasher = payload_hasher()
    for _, piece in _read_pieces(fd, file_offset, out, piece_bytes, deadline, stop):
        hasher.update(piece)
    return hasher.digest()


def copy_hash_into(src: Buffer, dest: memoryview, piece_bytes: int) -> bytes:
    """Copy ``src`` into ``dest`` (of the same length), ``piece_bytes`` at a time, each piece
    hashed in ``dest`` right after it was copied; returns the 16-byte XXH3-128 digest."""
    if NATIVE:
        return _fastread.copy_hash_into(src, dest, piece_bytes)  # type: ignore[union-attr]
    source, out = _copy_arrays(src, dest, piece_bytes)
    hasher = payload_hasher()
    for _, piece in _copied_pieces(source, out, piece_bytes):
        hasher.update(piece)
    return hasher.digest()


def copy_hash_layers_into(
    src: Buffer, dest: memoryview, layer_sizes: Iterable[int], piece_bytes: int
) -> tuple[bytes, list[bytes]]:
    """Copy ``src`` into ``dest`` (of the same length), ``piece_bytes`` at a time, each piece
    hashed in ``dest`` right after it was copied, for the whole and for each layer it
    overlaps; the layers are back-to-back byte ranges of ``layer_sizes`` bytes, in order,
    covering ``dest``. Returns the 16-byte XXH3-128 digests of the whole and of each layer
    (an empty layer's is the empty input's)."""
    if NATIVE:
        return _fastread.copy_hash_layers_into(src, dest, layer_sizes, piece_bytes)  # type: ignore[union-attr]
    source, out = _copy_arrays(src, dest, piece_bytes)
    ends = _layer_ends(layer_sizes, out.nbytes)
    whole = payload_hasher()
    layers = _LayerHashers(ends)
    for start, piece in _copied_pieces(source, out, piece_bytes):
        whole.update(piece)
        layers.update(start, piece)
    return whole.digest(), layers.digests()


def pread_hash_layers_into(
    fd: int,
    file_offset: int,
    dest: memoryview,
    layer_sizes: Iterable[int],
    piece_bytes: int,
    deadline: float,
    threads: int = 1,
    stop: bytearray | None = None,
) -> list[bytes]:
    """``pread_hash_into``, hashing each piece into each layer it overlaps instead of the
    whole (layers as ``copy_hash_layers_into``'s): the 16-byte XXH3-128 digest of each
    layer. A spread fetch reads a run of layers in one call (one release of the GIL).

    ``threads`` > 1 (1 to ``MAX_READ_THREADS``): natively, the layers are split into up to
    that many groups of whole layers of about equal bytes, each read on a thread of its
    own within the one call, so a unit lands in about 1 / threads of one thread's time
    (``l3.threads_per_unit``); ``EndOfFile`` / ``DeadlinePassed`` / ``Stopped`` then give
    where the earliest group that failed stopped (each checks ``stop`` before its pieces).
    The Python loop reads on the calling thread alone."""
    if not 1 <= threads <= MAX_READ_THREADS:
        raise ValueError(f"threads must be in 1..{MAX_READ_THREADS}, not {threads}")
    if NATIVE:
        return _fastread.pread_hash_layers_into(  # type: ignore[union-attr]
            fd, file_offset, dest, layer_sizes, piece_bytes, deadline, threads, stop
        )
    out = _read_destination(dest, file_offset, piece_bytes)
    layers = _LayerHashers(_layer_ends(layer_sizes, out.nbytes))
    for start, piece in _read_pieces(fd, file_offset, out, piece_bytes, deadline, stop):
        layers.update(start, piece)
    return layers.digests()


def _read_destination(dest: memoryview, file_offset: int, piece_bytes: int) -> memoryview:
    """``dest`` as bytes, where it, ``file_offset`` and ``piece_bytes`` make a read (else
    the ValueError ``_fastread`` raises)."""
    if piece_bytes <= 0 or file_offset < 0:
        raise ValueError("piece_bytes must be > 0 and file_offset >= 0")
    return dest.cast("B") if dest.format != "B" else dest


def _read_pieces(
    fd: int,
    file_offset: int,
    out: memoryview,
    piece_bytes: int,
    deadline: float,
    stop: bytearray | None = None,
) -> Iterator[tuple[int, memoryview]]:
    """Fill ``out`` from ``fd`` piece by piece, yielding each piece's offset and its view
    right after it landed (the Python loop of both reads); the stop flag and the deadline
    are checked before each piece."""
    if stop is not None and len(stop) < 1:
        raise ValueError("stop must be a buffer of at least one byte")
    for start in range(0, out.nbytes, piece_bytes):
        if stop is not None and stop[0]:
            raise Stopped(start)
        if time.monotonic() > deadline:
            raise DeadlinePassed(start)
        piece = out[start : start + piece_bytes]
        try:
            pread_into(fd, file_offset + start, piece)
        except EndOfFile as exc:
            raise EndOfFile(start + exc.args[0]) from None
        yield start, piece


class _LayerHashers:
    """One hasher per layer (layer i ends at ``ends[i]``), fed pieces in order: the Python
    loops' per-layer digests."""

    def __init__(self, ends: list[int]) -> None:
        self.ends = ends
        self.hashers = [payload_hasher() for _ in ends]
        self.layer = 0  # the first layer not yet wholly hashed

    def update(self, start: int, piece: memoryview) -> None:
        """Each layer the piece at ``start`` overlaps takes its part. Empty layers are
        passed over; the last layer ends at the end of dest, so one ends past ``at``."""
        at, end = start, start + piece.nbytes
        while at < end:
            while self.ends[self.layer] <= at:
                self.layer += 1
            stop = min(self.ends[self.layer], end)
            self.hashers[self.layer].update(piece[at - start : stop - start])
            at = stop

    def digests(self) -> list[bytes]:
        return [hasher.digest() for hasher in self.hashers]


def files_exist(paths: Sequence[str | os.PathLike[str]], deadline: float) -> list[bool]:
    """Whether each file exists (``os.path.exists``). Raises ``DeadlinePassed(done)`` when
    ``deadline`` (``time.monotonic``) passed before the path at ``done``."""
    if NATIVE:
        return [bool(b) for b in _fastread.files_exist(paths, deadline)]  # type: ignore[union-attr]
    found = []
    for done, path in enumerate(paths):
        if time.monotonic() > deadline:
            raise DeadlinePassed(done)
        found.append(os.path.exists(os.fspath(path)))  # fspath: an int is no path
    return found


# files_resident's answer bytes: 0 not resident (or missing), 1 resident, 2 cannot tell.
_RESIDENCY: Final = (False, True, None)


def files_resident(paths: Sequence[str | os.PathLike[str]]) -> list[bool | None]:
    """Whether the page cache holds each whole file (``l3_residency.file_resident``): False
    for a missing file, None where the kernel would not tell."""
    if NATIVE:
        return [_RESIDENCY[b] for b in _fastread.files_resident(paths)]  # type: ignore[union-attr]
    return [file_resident(os.fspath(path)) for path in paths]


def _copy_arrays(src: Buffer, dest: memoryview, piece_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``src`` and ``dest`` as arrays of bytes, where they and ``piece_bytes`` make a copy
    (else the ValueError ``_fastread`` raises)."""
    source = np.frombuffer(src, dtype=np.uint8)
    out = np.frombuffer(dest, dtype=np.uint8)
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be > 0, not {piece_bytes}")
    if source.nbytes != out.nbytes:
        raise ValueError(f"src has {source.nbytes} bytes, dest {out.nbytes}: they must be as many")
    return source, out


def _copied_pieces(
    source: np.ndarray, out: np.ndarray, piece_bytes: int
) -> Iterator[tuple[int, memoryview]]:
    """Copy ``source`` into ``out`` piece by piece, yielding each piece's offset and its view
    in ``out`` right after it was copied (the Python loop of both copies)."""
    view = memoryview(out)
    for start in range(0, out.nbytes, piece_bytes):
        end = min(start + piece_bytes, out.nbytes)
        out[start:end] = source[start:end]  # numpy copies without the GIL
        yield start, view[start:end]


def _layer_ends(layer_sizes: Iterable[int], nbytes: int) -> list[int]:
    """Where each layer ends in a destination of ``nbytes``, its layers' sizes checked to be
    >= 0 and to add up to ``nbytes`` (else the ValueError ``_fastread`` raises)."""
    ends: list[int] = []
    end = 0
    for i, size in enumerate(layer_sizes):
        size = operator.index(size)
        if size < 0:
            raise ValueError(f"layer_sizes[{i}] is negative")
        if size > nbytes - end:
            raise ValueError(
                f"layer_sizes add up to more than dest's {nbytes} bytes (at layer {i})"
            )
        end += size
        ends.append(end)
    if end != nbytes:
        raise ValueError(f"layer_sizes add up to {end} bytes, dest has {nbytes}")
    return ends
