"""fast_io: the native read-and-hash loops (``_fastread``) and their Python fallbacks land
the same bytes and return python-xxhash's XXH3-128 digests of them (the whole's, and each
layer's for a write's copy), whatever the sizes, layers and pieces; a file that ends early,
a deadline already passed, a bad descriptor and impossible arguments fail the same way on
both, and through ``ObjectFile`` as the storage's errors. The native loops keep the GIL
released while they read or copy. Reads are from real files.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from vllm_draft_offload import fast_io
from vllm_draft_offload.l3_backends import CorruptObject
from vllm_draft_offload.l3_fs_reads import DeadlineExceeded, ObjectFile, ReadStopped

# Sizes around XXH3's internal boundaries (16, 128, 240 bytes; its 1 KiB stripes' blocks)
# and a piece size that divides none of the larger ones.
SIZES = [0, 1, 15, 16, 17, 128, 129, 240, 241, 1023, 1025, 65536 + 3, (1 << 20) + 7]
PIECES = [7, 64, 4096, 1000 + 1, 256 << 10, 4 << 20]
# Every size with every piece, except the pairs of over 20,000 pieces (1 MiB in 7-byte
# pieces through the Python loop would take most of a minute and test nothing new).
SIZES_PIECES = [(size, piece) for size in SIZES for piece in PIECES if size // piece <= 20_000]
OFFSET = 13  # the data starts mid-file, as a payload does behind its header
LATER = 1e18  # a deadline that never passes


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, bytes]]:
    data = random.Random(0).randbytes(max(SIZES))
    path = tmp_path_factory.mktemp("fast_io") / "data"
    path.write_bytes(b"h" * OFFSET + data)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, data
    finally:
        os.close(fd)


def test_the_extension_is_built_where_a_compiler_is() -> None:
    """An install with a C compiler builds ``_fastread`` (setup.py, ``optional=True``): a
    build that failed would only warn, and every fetch would quietly run the slower
    Python loop."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None and shutil.which("cc") is None:
        pytest.skip("no C compiler: the Python reader is the expected one")
    assert fast_io.AVAILABLE, fast_io.reader()
    if os.environ.get(fast_io.ENV_VAR, "1") not in ("0", "false", "no", "off"):
        assert fast_io.NATIVE and fast_io.reader() == "native"


def test_a_stale_extension_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension built from an older ``_fastread.c`` (an editable install not rebuilt
    after an update) lacks the newer functions: the Python loops run, for fetches as well
    as writes, and ``reader()`` says to rebuild it (every write would fail otherwise)."""
    import importlib.util
    import types

    import vllm_draft_offload

    old = types.ModuleType("vllm_draft_offload._fastread")
    old.__file__ = "/old/_fastread.so"
    old.pread_hash_into = old.copy_hash_into = lambda *args: b""  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, old.__name__, old)
    monkeypatch.setattr(vllm_draft_offload, "_fastread", old, raising=False)
    monkeypatch.delenv(fast_io.ENV_VAR, raising=False)
    spec = importlib.util.spec_from_file_location("fast_io_stale", fast_io.__file__)
    assert spec is not None and spec.loader is not None
    stale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stale)
    assert not stale.AVAILABLE and not stale.NATIVE
    assert stale.reader().startswith("python (_fastread stale: /old/_fastread.so has no ")
    assert "copy_hash_layers_into" in stale.reader() and "rebuild" in stale.reader()
    dest = bytearray(3)
    assert stale.copy_hash_layers_into(b"abc", memoryview(dest), [1, 2], 2) == _layers_want(
        b"abc", [1, 2]
    )


@pytest.mark.parametrize(("size", "piece"), SIZES_PIECES)
def test_digest_is_python_xxhash_and_the_bytes_land_exact(
    reader: str, data_file: tuple[int, bytes], size: int, piece: int
) -> None:
    fd, data = data_file
    want = xxhash.xxh3_128(data[:size]).digest()
    dest = bytearray(b"\xaa" * (size + 1))
    got = fast_io.pread_hash_into(fd, OFFSET, memoryview(dest)[:size], piece, LATER)
    assert got == want and got.hex() == xxhash.xxh3_128_hexdigest(data[:size])
    assert dest[:size] == data[:size] and dest[size] == 0xAA
    copied = bytearray(size)
    assert fast_io.copy_hash_into(data[:size], memoryview(copied), piece) == want
    assert copied == data[:size]


def test_any_destination_buffer_of_bytes(reader: str, data_file: tuple[int, bytes]) -> None:
    """A memoryview of another format (a host slot's view) is read as its bytes."""
    fd, data = data_file
    dest = memoryview(bytearray(4096)).cast("I")
    assert fast_io.pread_hash_into(fd, OFFSET, dest, 1000, LATER) == (
        xxhash.xxh3_128(data[:4096]).digest()
    )
    assert dest.tobytes() == data[:4096]


def test_a_file_that_ends_early_says_how_much_landed(
    reader: str, data_file: tuple[int, bytes]
) -> None:
    fd, data = data_file
    have = len(data) - 100  # from file offset OFFSET + 100
    dest = bytearray(len(data))
    with pytest.raises(fast_io.EndOfFile) as exc:
        fast_io.pread_hash_into(fd, OFFSET + 100, memoryview(dest), 4096, LATER)
    assert exc.value.args[0] == have
    assert dest[:have] == data[100:]


def test_a_passed_deadline_writes_nothing(reader: str, data_file: tuple[int, bytes]) -> None:
    fd, _ = data_file
    dest = bytearray(b"\xaa" * 10_000)
    with pytest.raises(fast_io.DeadlinePassed) as exc:
        fast_io.pread_hash_into(fd, OFFSET, memoryview(dest), 4096, time.monotonic() - 0.001)
    assert exc.value.args[0] == 0
    assert dest == b"\xaa" * 10_000


@pytest.mark.parametrize("threads", [1, 4])
def test_a_set_stop_flag_writes_nothing(
    reader: str, data_file: tuple[int, bytes], threads: int
) -> None:
    """A stop flag set before the call: Stopped(0) from either read, every group of a
    layered read on threads too, and nothing written; a flag left at 0 changes nothing."""
    fd, data = data_file
    quarter = len(data) // 4
    sizes = [quarter, quarter, quarter, len(data) - 3 * quarter]
    threads = threads if reader == "native" else 1
    for stop_at in (b"\x01", b"\xff\x00"):
        untouched = bytearray(b"\xaa" * len(data))
        with pytest.raises(fast_io.Stopped) as whole:
            fast_io.pread_hash_into(
                fd, OFFSET, memoryview(untouched), 4096, LATER, bytearray(stop_at)
            )
        assert whole.value.args[0] == 0
        with pytest.raises(fast_io.Stopped) as layered:
            fast_io.pread_hash_layers_into(
                fd, OFFSET, memoryview(untouched), sizes, 4096, LATER, threads, bytearray(stop_at)
            )
        assert layered.value.args[0] == 0 and untouched == b"\xaa" * len(data)
    dest = bytearray(len(data))
    assert fast_io.pread_hash_into(fd, OFFSET, memoryview(dest), 4096, LATER, bytearray(1)) == (
        xxhash.xxh3_128(data).digest()
    )
    assert dest == data
    with pytest.raises(ValueError, match="stop must be a buffer of at least one byte"):
        fast_io.pread_hash_into(fd, OFFSET, memoryview(dest), 4096, LATER, bytearray())


@pytest.mark.parametrize("threads", [1, 3])
def test_a_stop_flag_set_during_a_read_stops_it_within_a_piece(
    reader: str, tmp_path: Path, threads: int
) -> None:
    """Set from another thread while a long read runs (64 MiB of a sparse file in 4 KiB
    pieces, several thousand reads): the read raises Stopped with less than the whole
    destination filled, the bytes up to it in place."""
    path = tmp_path / "sparse"
    size = 64 << 20
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        threads = threads if reader == "native" else 1
        dest = bytearray(b"\xaa" * size)
        stop = bytearray(1)
        timer = threading.Timer(0.002, lambda: stop.__setitem__(0, 1))
        timer.start()
        try:
            with pytest.raises(fast_io.Stopped) as stopped:
                fast_io.pread_hash_layers_into(
                    fd,
                    0,
                    memoryview(dest),
                    [size // 3, size // 3, size - 2 * (size // 3)],
                    4096,
                    LATER,
                    threads,
                    stop,
                )
        finally:
            timer.join()
        done = stopped.value.args[0]
        assert 0 <= done < size
        assert dest[:done] == bytes(done)  # what landed before the stop is the file's
    finally:
        os.close(fd)


def test_a_bad_descriptor_is_an_os_error(reader: str, tmp_path: Path) -> None:
    dest = memoryview(bytearray(100))
    with pytest.raises(OSError):
        fast_io.pread_hash_into(-1, 0, dest, 64, LATER)
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: EISDIR
    try:
        with pytest.raises(OSError):
            fast_io.pread_hash_into(fd, 0, dest, 64, LATER)
    finally:
        os.close(fd)


def test_impossible_arguments_are_refused(reader: str, data_file: tuple[int, bytes]) -> None:
    fd, _ = data_file
    dest = memoryview(bytearray(10))
    with pytest.raises(ValueError):
        fast_io.pread_hash_into(fd, 0, dest, 0, LATER)
    with pytest.raises(ValueError):
        fast_io.pread_hash_into(fd, -1, dest, 64, LATER)
    with pytest.raises(ValueError):
        fast_io.copy_hash_into(b"x" * 11, dest, 64)
    with pytest.raises(ValueError):
        fast_io.copy_hash_into(b"x" * 10, dest, 0)
    with pytest.raises((TypeError, BufferError)):  # a read-only destination
        fast_io.pread_hash_into(fd, 0, memoryview(bytes(10)), 64, LATER)


def _layers_want(data: bytes, sizes: list[int]) -> tuple[bytes, list[bytes]]:
    """python-xxhash's digests of ``data`` and of its layers of ``sizes`` bytes."""
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    starts = [end - size for end, size in zip(ends, sizes, strict=True)]
    return xxhash.xxh3_128(data).digest(), [
        xxhash.xxh3_128(data[start:end]).digest() for start, end in zip(starts, ends, strict=True)
    ]


# (layer sizes, piece sizes): empty layers (first, last, in a row, all), one-byte layers,
# layers straddling pieces and ending on their boundaries, pieces larger than the payload.
LAYOUTS = [
    ([], [1, 64]),
    ([0], [1, 64]),
    ([0, 0, 0], [7]),
    ([1], [1, 7]),
    ([1] * 20, [1, 3, 20, 21, 4096]),
    ([0, 5, 0, 0, 1, 0, 9, 0], [1, 2, 5, 6, 100]),
    ([64, 64, 64], [32, 64, 100, 128, 192, 1 << 20]),
    ([100, 300, 0, 64, 37], [1, 7, 64, 100, 501, 4096]),
    ([1023, 1, 1025, 240, 0, 17], [16, 240, 1000 + 1, 4096]),
    ([(1 << 19) + 7, 3, (1 << 19) - 3, 0], [4096, 256 << 10, 4 << 20]),
]
LAYOUTS_PIECES = [(sizes, piece) for sizes, pieces in LAYOUTS for piece in pieces]


@pytest.mark.parametrize(("sizes", "piece"), LAYOUTS_PIECES)
def test_layer_digests_are_python_xxhash_and_the_bytes_land_exact(
    reader: str, data_file: tuple[int, bytes], sizes: list[int], piece: int
) -> None:
    _, data = data_file
    data = data[: sum(sizes)]
    dest = bytearray(b"\xaa" * (len(data) + 1))
    got = fast_io.copy_hash_layers_into(data, memoryview(dest)[: len(data)], sizes, piece)
    assert got == _layers_want(data, sizes)
    assert dest[: len(data)] == data and dest[len(data)] == 0xAA
    # The same whole digest as the single-digest copy.
    assert got[0] == fast_io.copy_hash_into(data, memoryview(bytearray(len(data))), piece)
    # A spread fetch's read of the same layers from the file, on one thread or its layers
    # split over several (l3.threads_per_unit): the same layer digests and bytes.
    fd, _ = data_file
    for threads in (1, 2, 3, 8):
        read = bytearray(b"\xaa" * (len(data) + 1))
        layers = fast_io.pread_hash_layers_into(
            fd, OFFSET, memoryview(read)[: len(data)], sizes, piece, LATER, threads
        )
        assert layers == got[1], threads
        assert read[: len(data)] == data and read[len(data)] == 0xAA, threads


def test_a_layered_read_fails_as_the_whole_read_does(
    reader: str, data_file: tuple[int, bytes]
) -> None:
    """A file that ends early, a passed deadline and impossible arguments: the errors of
    ``pread_hash_into``, and layer sizes checked as the layered copy checks them."""
    fd, data = data_file
    have = len(data) - 100
    dest = bytearray(len(data))
    with pytest.raises(fast_io.EndOfFile) as ended:
        fast_io.pread_hash_layers_into(fd, OFFSET + 100, memoryview(dest), [len(data)], 4096, LATER)
    assert ended.value.args[0] == have
    assert dest[:have] == data[100:]
    untouched = bytearray(b"\xaa" * 10_000)
    with pytest.raises(fast_io.DeadlinePassed) as late:
        fast_io.pread_hash_layers_into(
            fd, OFFSET, memoryview(untouched), [10_000], 4096, time.monotonic() - 0.001
        )
    assert late.value.args[0] == 0 and untouched == b"\xaa" * 10_000
    ten = memoryview(bytearray(10))
    with pytest.raises(ValueError, match="piece_bytes must be > 0"):
        fast_io.pread_hash_layers_into(fd, 0, ten, [10], 0, LATER)
    with pytest.raises(ValueError, match="file_offset >= 0"):
        fast_io.pread_hash_layers_into(fd, -1, ten, [10], 64, LATER)
    with pytest.raises(ValueError, match="layer_sizes add up to 9 bytes, dest has 10"):
        fast_io.pread_hash_layers_into(fd, 0, ten, [4, 5], 64, LATER)
    with pytest.raises(ValueError, match=r"layer_sizes\[1\] is negative"):
        fast_io.pread_hash_layers_into(fd, 0, ten, [4, -1, 7], 64, LATER)
    with pytest.raises(OSError):
        fast_io.pread_hash_layers_into(-1, 0, ten, [10], 64, LATER)
    for threads in (0, fast_io.MAX_READ_THREADS + 1):
        with pytest.raises(ValueError, match="threads must be in 1.."):
            fast_io.pread_hash_layers_into(fd, 0, ten, [10], 64, LATER, threads)


def test_a_layered_read_on_threads_fails_where_the_earliest_group_stopped(
    data_file: tuple[int, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers split over threads (the native loop's): a file that ends early names the
    end of filled bytes of the earliest group that failed (the last group here: earlier
    groups filled theirs), a bad descriptor fails every group, and a passed deadline
    writes nothing."""
    if not fast_io.AVAILABLE:
        pytest.skip(fast_io.reader())
    monkeypatch.setattr(fast_io, "NATIVE", True)
    fd, data = data_file
    quarter = len(data) // 4
    sizes = [quarter, quarter, quarter, len(data) - 3 * quarter]
    dest = bytearray(len(data))
    with pytest.raises(fast_io.EndOfFile) as ended:
        fast_io.pread_hash_layers_into(fd, OFFSET + 100, memoryview(dest), sizes, 4096, LATER, 4)
    assert ended.value.args[0] == len(data) - 100
    assert dest[: len(data) - 100] == data[100:]
    with pytest.raises(OSError):
        fast_io.pread_hash_layers_into(-1, 0, memoryview(dest), sizes, 4096, LATER, 4)
    untouched = bytearray(b"\xaa" * len(data))
    with pytest.raises(fast_io.DeadlinePassed) as late:
        fast_io.pread_hash_layers_into(
            fd, OFFSET, memoryview(untouched), sizes, 4096, time.monotonic() - 0.001, 4
        )
    assert late.value.args[0] == 0 and untouched == b"\xaa" * len(data)


def test_layer_copy_takes_any_buffers_of_bytes(reader: str, data_file: tuple[int, bytes]) -> None:
    """A host slot's view of another format, layer sizes as any ints in any iterable."""
    _, data = data_file
    dest = memoryview(bytearray(4096)).cast("I")
    sizes = (1000, 0, 3000, 96)
    got = fast_io.copy_hash_layers_into(memoryview(data[:4096]).cast("Q"), dest, iter(sizes), 333)
    assert got == _layers_want(data[:4096], list(sizes))
    assert dest.tobytes() == data[:4096]


@pytest.mark.parametrize(
    ("src", "dest", "sizes", "piece", "match"),
    [
        (10, 10, [10], 0, r"piece_bytes must be > 0, not 0"),
        (10, 10, [10], -5, r"piece_bytes must be > 0, not -5"),
        (11, 10, [10], 4, r"src has 11 bytes, dest 10"),
        (10, 10, [4, -1, 7], 4, r"layer_sizes\[1\] is negative"),
        (10, 10, [-(1 << 70), 10], 4, r"layer_sizes\[0\] is negative"),
        (10, 10, [4, 7], 4, r"layer_sizes add up to more than dest's 10 bytes \(at layer 1\)"),
        (10, 10, [1 << 70], 4, r"layer_sizes add up to more than dest's 10 bytes \(at layer 0\)"),
        (10, 10, [4, 5], 4, r"layer_sizes add up to 9 bytes, dest has 10"),
        (10, 10, [], 4, r"layer_sizes add up to 0 bytes, dest has 10"),
    ],
)
def test_impossible_layer_copies_are_refused_naming_why(
    reader: str, src: int, dest: int, sizes: list[int], piece: int, match: str
) -> None:
    """The same ValueError from both loops, before anything is copied."""
    out = bytearray(b"\xaa" * dest)
    with pytest.raises(ValueError, match=match):
        fast_io.copy_hash_layers_into(b"x" * src, memoryview(out), sizes, piece)
    assert out == b"\xaa" * dest
    if not match.startswith("layer_sizes"):  # the single-digest copy checks alike
        with pytest.raises(ValueError, match=match):
            fast_io.copy_hash_into(b"x" * src, memoryview(out), piece)


def test_layer_sizes_must_be_ints(reader: str) -> None:
    dest = memoryview(bytearray(10))
    with pytest.raises(TypeError):
        fast_io.copy_hash_layers_into(b"x" * 10, dest, [10.0], 4)
    with pytest.raises(TypeError):
        fast_io.copy_hash_layers_into(b"x" * 10, dest, 10, 4)


def test_object_file_turns_them_into_storage_errors(
    reader: str, data_file: tuple[int, bytes]
) -> None:
    """A short file is corrupt and a passed deadline a timeout, with the object's own
    byte positions (what ``L3Store.read_file`` reports)."""
    fd, data = data_file
    size = len(data)
    file = ObjectFile(fd, OFFSET, size + 50, LATER)  # the metadata says 50 bytes more
    dest = bytearray(size + 50)
    assert file.readinto_hashed(0, memoryview(dest)[:size], 4096) == xxhash.xxh3_128(data).digest()
    with pytest.raises(CorruptObject, match=f"file ended at object byte {size} of {size + 50}"):
        file.readinto_hashed(0, memoryview(dest), 4096)
    with pytest.raises(CorruptObject, match=f"file ended at object byte {size} of {size + 50}"):
        file.readinto(8, memoryview(dest)[: size + 42])
    with pytest.raises(ValueError):
        file.readinto_hashed(51, memoryview(dest)[:size], 4096)  # past the object's end
    late = ObjectFile(fd, OFFSET, size, time.monotonic() - 0.001)
    with pytest.raises(DeadlineExceeded, match="at object byte 7"):
        late.readinto_hashed(7, memoryview(dest)[:100], 4096)
    # A stop flag set (a fetch given up): every read stops, as ReadStopped.
    stopped = ObjectFile(fd, OFFSET, size, LATER)
    stopped.stop = bytearray(b"\x01")
    with pytest.raises(ReadStopped, match="at object byte 9"):
        stopped.readinto_hashed(9, memoryview(dest)[:100], 4096)
    with pytest.raises(ReadStopped, match="at object byte 9"):
        stopped.readinto_layers_hashed(9, memoryview(dest)[:100], [50, 50], 4096)
    with pytest.raises(ReadStopped, match="at object byte 9"):
        stopped.readinto(9, memoryview(dest)[:100])


def _counted_during(call: Callable[[], object]) -> float:
    """The share of ``call``'s time in which another Python thread went on counting (at
    its pace while this thread sleeps). A call that holds the GIL shuts it out except for
    a switch interval or so."""
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    try:
        before, started = counted[0], time.perf_counter()
        time.sleep(0.05)
        rate = (counted[0] - before) / (time.perf_counter() - started)
        before, started = counted[0], time.perf_counter()
        call()
        took = time.perf_counter() - started
        during = counted[0] - before
    finally:
        stop.set()
        thread.join()
    return during / (rate * took)


def test_the_native_loop_runs_without_the_gil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another Python thread keeps counting while one native call reads (or copies) 64 MiB;
    a call that held the GIL would stop it for the whole call."""
    if not fast_io.AVAILABLE:
        pytest.skip(fast_io.reader())
    monkeypatch.setattr(fast_io, "NATIVE", True)
    data = os.urandom(64 << 20)
    path = tmp_path / "big"
    path.write_bytes(data)
    dest = bytearray(len(data))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # a GIL-holding call lets the counter in briefly only
    fd = os.open(path, os.O_RDONLY)
    try:
        share = _counted_during(
            lambda: fast_io.pread_hash_into(fd, 0, memoryview(dest), 256 << 10, LATER)
        )
        assert share > 0.1, share
        share = _counted_during(lambda: fast_io.copy_hash_into(data, memoryview(dest), 256 << 10))
        assert share > 0.1, share
        layers = [len(data) // 36] * 35 + [len(data) - 35 * (len(data) // 36)]
        share = _counted_during(
            lambda: fast_io.copy_hash_layers_into(data, memoryview(dest), layers, 256 << 10)
        )
        assert share > 0.1, share
        # The measure tells them apart: a copy that holds the GIL is shut out.
        held = _counted_during(lambda: dest.__setitem__(slice(None), data))
        assert held < 0.1, held
    finally:
        sys.setswitchinterval(switch)
        os.close(fd)


# ---- batch file probes of storage lookups ------------------------------------------------------
def _probe_paths(tmp_path: Path) -> list[str | bytes | Path]:
    (tmp_path / "unit").write_bytes(b"u" * 5000)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "dir").mkdir()
    return [
        str(tmp_path / "unit"),
        os.fsencode(tmp_path / "unit"),  # bytes paths, as LMCache's may be
        tmp_path / "missing",
        tmp_path / "dir",
        tmp_path / "no-such-dir" / "unit",
        tmp_path / "empty",
    ]


def test_files_exist_answers_as_os_path_exists(reader: str, tmp_path: Path) -> None:
    paths = _probe_paths(tmp_path)
    assert fast_io.files_exist(paths, LATER) == [True, True, False, True, False, True]
    assert fast_io.files_exist(paths, LATER) == [os.path.exists(p) for p in paths]
    assert fast_io.files_exist([], LATER) == []


def test_files_exist_stops_at_a_passed_deadline(reader: str, tmp_path: Path) -> None:
    with pytest.raises(fast_io.DeadlinePassed) as raised:
        fast_io.files_exist(_probe_paths(tmp_path), time.monotonic() - 0.001)
    assert raised.value.args == (0,)


def test_files_resident_answers_as_file_resident(reader: str, tmp_path: Path) -> None:
    """Read: resident; missing: not (a fetch of it would fail); empty or a directory: cannot
    tell (no mapping). The same answers as l3_residency.file_resident, file by file."""
    from vllm_draft_offload.l3_residency import file_resident

    paths = _probe_paths(tmp_path)
    Path(paths[0]).read_bytes()
    answers = fast_io.files_resident(paths)
    assert answers[:3] == [True, True, False] and answers[4:] == [False, None]
    assert answers == [file_resident(os.fsdecode(p)) for p in paths]


def test_files_resident_sees_an_evicted_file(reader: str, tmp_path: Path) -> None:
    from test_l3_residency import _on_real_filesystem, _skip_unless_evicted

    from vllm_draft_offload.bench.speed.disk_baseline import evict_from_page_cache

    _on_real_filesystem(tmp_path)
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    for path in (warm, cold):
        path.write_bytes(os.urandom(1 << 20))
    warm.read_bytes()
    evict_from_page_cache(cold)
    _skip_unless_evicted(cold)
    assert fast_io.files_resident([warm, cold, warm]) == [True, False, True]


@pytest.mark.parametrize("probe", ["files_exist", "files_resident"])
def test_probes_refuse_what_is_no_path(reader: str, probe: str) -> None:
    call = getattr(fast_io, probe)
    args = (LATER,) if probe == "files_exist" else ()
    with pytest.raises(TypeError):
        call([3], *args)
    with pytest.raises(TypeError):
        call([None], *args)


def test_every_native_call_gives_up_the_gil_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once per call, however many files, pieces or layers it covers: the Python loop
    gives the GIL up and takes it back per file (or piece), and beside vLLM's busy engine
    thread each take can wait out a switch interval (a 64-key lookup took 6.7 ms that
    way against 1.6 ms natively on the 2-core box). The extension counts its releases
    (``gil_releases``), so no timing decides this: a call that released the GIL per
    file, piece or layer fails it."""
    if not fast_io.AVAILABLE:
        pytest.skip(fast_io.reader())
    from vllm_draft_offload import _fastread

    monkeypatch.setattr(fast_io, "NATIVE", True)
    paths = [tmp_path / f"u{i}" for i in range(64)]
    for path in paths:
        path.write_bytes(b"x" * 8192)
    data = os.urandom(4 << 20)  # 64 pieces of 64 KiB, 4 layers
    (tmp_path / "big").write_bytes(data)
    dest = bytearray(len(data))
    piece = 64 << 10
    fd = os.open(tmp_path / "big", os.O_RDONLY)
    calls: dict[str, Callable[[], object]] = {
        "files_exist": lambda: fast_io.files_exist(paths, LATER),
        "files_resident": lambda: fast_io.files_resident(paths),
        "pread_hash_into": lambda: fast_io.pread_hash_into(fd, 0, memoryview(dest), piece, LATER),
        "copy_hash_into": lambda: fast_io.copy_hash_into(data, memoryview(dest), piece),
        "copy_hash_layers_into": lambda: fast_io.copy_hash_layers_into(
            data, memoryview(dest), [len(data) // 4] * 4, piece
        ),
        "pread_hash_layers_into": lambda: fast_io.pread_hash_layers_into(
            fd, 0, memoryview(dest), [len(data) // 4] * 4, piece, LATER
        ),
        "pread_hash_layers_into on 4 threads": lambda: fast_io.pread_hash_layers_into(
            fd, 0, memoryview(dest), [len(data) // 4] * 4, piece, LATER, 4
        ),
    }
    try:
        for name, call in calls.items():
            before = _fastread.gil_releases()
            call()
            assert _fastread.gil_releases() - before == 1, name
    finally:
        os.close(fd)
