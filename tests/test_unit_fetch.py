"""fetch_unit_into: a stored unit lands in its destination bit-exact, on fs:// (read straight
from the object's file, by one thread or spread over several) and on Redis (LMCache's
buffer, copied). Every defect the codec knows is refused with the codec's cause on every
path, including damage in a piece that was already copied into the destination, and
damaged fs:// files are storage errors, not hits. Every test runs with both of fast_io's
readers, the native loop and its Python fallback. Real backends throughout: an fs
directory and redis-server.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis_fixture import RedisServer, redis_server_binary
from test_unit_codec import DEFECTS, _expected, _layers, _pack

from vllm_draft_offload import fast_io
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_fs_reads import HEAD_BYTES, ObjectFile
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.run_pool import RunPool
from vllm_draft_offload.unit_codec import UnitRejected, checksum, read_header
from vllm_draft_offload.unit_fetch import (
    NATIVE_PIECE_BYTES,
    PIECE_BYTES,
    fetch_unit_into,
    layer_runs,
)
from vllm_draft_offload.unit_verify import ExpectedUnit, check_layer, check_payload

KEY = "3f" * 16
# Pieces these tests read in (the product's are larger: the logic is the same, and a
# unit of several pieces stays small).
PIECE = 1 << 20

pytestmark = pytest.mark.usefixtures("reader")


def _open(url: str, timeout_s: float = 2.0) -> L3Store:
    extra = {"draft_offload.l3_retry_interval_s": 0.2, "draft_offload.l3_staging_mb": 64}
    return L3Store.from_dict({"remote_url": url, "extra_config": extra}, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def fs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fetch") / "l3"


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, fs_dir: Path) -> Iterator[dict[str, L3Store]]:
    out = {"fs": _open(f"fs://{fs_dir}")}
    server = None
    if redis_server_binary() is not None:
        server = RedisServer(tmp_path_factory.mktemp("redis")).start()
        out["redis"] = _open(server.url)
    try:
        yield out
    finally:
        for store in out.values():
            store.close()
        if server is not None:
            server.close()


@pytest.fixture(params=["fs", "redis"])
def store(request: pytest.FixtureRequest, stores: dict[str, L3Store]) -> L3Store:
    if request.param not in stores:
        pytest.skip("redis-server not installed")
    return stores[request.param]


@pytest.fixture(scope="module")
def pool() -> Iterator[RunPool]:
    runs = RunPool(3, "spread-test")
    yield runs
    runs.shutdown()


@pytest.fixture(params=["one_thread", "spread", "threads_per_unit"])
def split(request: pytest.FixtureRequest, pool: RunPool) -> dict[str, Any]:
    """fs:// units read by the calling thread alone, their layers spread over a pool, or
    split over threads inside one read call (l3.threads_per_unit: natively, else read on
    the calling thread); Redis ignores it: its object arrives whole. fetch_unit_into's
    arguments for each."""
    if request.param == "spread":
        return {"spread": pool}
    if request.param == "threads_per_unit":
        return {"threads_per_unit": 3}
    return {}


def _big_unit(rng: random.Random) -> tuple[bytes, bytes, ExpectedUnit]:
    """A unit of several pieces of PIECE: 3 target layers of 1 MiB and 2 small draft layers."""
    layers = [(f"t{i}", False, rng.randbytes(1 << 20)) for i in range(3)]
    layers += [(f"d{i}", True, rng.randbytes(96 << 10)) for i in range(2)]
    header, blob = _pack(layers, key=KEY)
    assert header.payload_nbytes > 3 * PIECE
    expected = _expected(layers)
    return blob, b"".join(b for _, _, b in layers), expected


def _name(rng: random.Random) -> str:
    return rng.randbytes(16).hex()


@pytest.mark.parametrize(
    ("piece", "native_piece"),
    [(PIECE, NATIVE_PIECE_BYTES), (PIECE_BYTES, PIECE_BYTES), (4096 + 64, 4096 + 64)],
)
def test_fetch_lands_the_payload_bit_exact(
    store: L3Store, piece: int, native_piece: int, split: dict[str, Any]
) -> None:
    """In pieces of PIECE, the product's, and an odd size (a short last piece)."""
    rng = random.Random(1)
    blob, payload, expected = _big_unit(rng)
    name = _name(rng)
    store.put(name, blob)
    dest = bytearray(b"\xaa" * len(payload))
    header = fetch_unit_into(
        store, name, expected, memoryview(dest), piece, native_piece_bytes=native_piece, **split
    )
    assert header == read_header(blob)[0]
    assert dest == payload
    assert fetch_unit_into(store, _name(rng), expected, memoryview(dest)) is None
    assert store.staging_in_use() == 0


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_planted_defect_is_refused_with_the_codec_cause(
    store: L3Store, defect: str, split: dict[str, Any]
) -> None:
    layers = _layers(random.Random(7))
    header, blob = _pack(layers)
    cause, plant = DEFECTS[defect]
    bad_blob, expected = plant(layers, header, blob)
    name = _name(random.Random(defect))
    store.put(name, bad_blob)
    dest = memoryview(bytearray(sum(s.nbytes for s in expected.layers)))
    with pytest.raises(UnitRejected) as exc:
        # 1 KiB runs: every layer of these small units is a run of its own when spread
        fetch_unit_into(store, name, expected, dest, 1024, **split)
    assert exc.value.cause == cause, exc.value


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.integers(1, 4096))
def test_a_digest_is_the_payload_checksum_whatever_the_pieces(
    data: st.DataObject, size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Any piece size reads or copies an intact payload to its checksum, and the checks
    refuse a changed byte, a missing byte or an extra byte with the codec's causes."""
    layers = [("t", False, random.Random(size).randbytes(size)), ("d", True, b"\x01")]
    header, blob = _pack(layers)
    payload = blob[len(blob) - header.payload_nbytes :]
    piece = data.draw(st.integers(1, len(payload) + 1))
    path = tmp_path_factory.mktemp("pieces") / "blob"
    path.write_bytes(blob)
    dest = bytearray(len(payload))
    fd = os.open(path, os.O_RDONLY)
    try:
        read = fast_io.pread_hash_into(fd, len(blob) - len(payload), memoryview(dest), piece, 1e18)
    finally:
        os.close(fd)
    copied = fast_io.copy_hash_into(payload, memoryview(bytearray(len(payload))), piece)
    assert dest == payload and read == copied
    assert read.hex() == checksum(payload) == header.payload_checksum
    check_payload(header, len(payload), read)
    first = header.layers[0]
    check_layer(first, first.nbytes, bytes.fromhex(checksum(payload[: first.nbytes])))

    at = data.draw(st.integers(0, len(payload) - 1))
    damaged = bytearray(payload)
    damaged[at] ^= 1 << data.draw(st.integers(0, 7))
    for fed, cause in (
        (bytes(damaged), "checksum_mismatch"),
        (payload[:-1], "truncated"),
        (payload + b"\0", "corrupt_header"),
    ):
        with pytest.raises(UnitRejected) as exc:
            check_payload(header, len(fed), bytes.fromhex(checksum(fed)))
        assert exc.value.cause == cause
    layer = bytearray(payload[: first.nbytes])
    layer[at % first.nbytes] ^= 0x01
    for nbytes, digest in ((first.nbytes, checksum(layer)), (0, checksum(b""))):
        with pytest.raises(UnitRejected) as exc:
            check_layer(first, nbytes, bytes.fromhex(digest))
        assert exc.value.cause == "checksum_mismatch"


@pytest.mark.parametrize("where", ["first_byte", "middle_piece", "last_byte"])
def test_byte_flipped_in_a_copied_piece_is_refused(
    store: L3Store, where: str, split: dict[str, Any]
) -> None:
    """The damaged piece has already landed when its hash is checked: still refused. The
    first byte also lies in what fs:// read with the header (the head), so this is the
    payload read into the destination that is checked, not the head."""
    rng = random.Random(2)
    blob, payload, expected = _big_unit(rng)
    offset = {"first_byte": 0, "middle_piece": 2 * PIECE + PIECE // 2}.get(where, len(payload) - 1)
    bad = bytearray(blob)
    bad[len(blob) - len(payload) + offset] ^= 0x10
    name = _name(rng)
    store.put(name, bytes(bad))
    with pytest.raises(UnitRejected) as exc:
        fetch_unit_into(store, name, expected, memoryview(bytearray(len(payload))), PIECE, **split)
    assert exc.value.cause == "checksum_mismatch"


def test_header_longer_than_the_head_read_is_read_whole(store: L3Store) -> None:
    """fs:// reads the header with LMCache's metadata in one read of HEAD_BYTES; a header
    longer than that (hundreds of layers with long names) costs one more read, and
    damage past the head is still refused."""
    rng = random.Random(5)
    name_tail = "x" * 200
    layers = [(f"layer.{i}.{name_tail}", i % 9 == 8, rng.randbytes(64)) for i in range(400)]
    header, blob = _pack(layers, key=KEY)
    assert len(blob) - header.payload_nbytes > HEAD_BYTES
    expected = _expected(layers)
    name = _name(rng)
    store.put(name, blob)
    dest = bytearray(header.payload_nbytes)
    assert fetch_unit_into(store, name, expected, memoryview(dest)) == header
    assert dest == b"".join(b for _, _, b in layers)

    bad = bytearray(blob)
    at = blob.index(f"layer.399.{name_tail}".encode())
    assert at > HEAD_BYTES
    bad[at] ^= 0x01  # inside the header, past the head: the header digest fails
    store.put(name + "0", bytes(bad))
    with pytest.raises(UnitRejected) as exc:
        fetch_unit_into(store, name + "0", expected, memoryview(dest))
    assert exc.value.cause == "corrupt_header"


def _fs_file(stores: dict[str, L3Store], fs_dir: Path, blob: bytes, name: str) -> Path:
    stores["fs"].put(name, blob)
    (path,) = fs_dir.glob(f"*@1{name}@*.data")  # LMCache's name: <ns>@1@0@1<hex>@uint8
    return path


@pytest.mark.parametrize("damage", ["cut_in_payload", "cut_in_header", "cut_in_metadata", "grown"])
def test_fs_file_damaged_on_disk_is_a_corrupt_object(
    stores: dict[str, L3Store], fs_dir: Path, damage: str, split: dict[str, Any]
) -> None:
    """The file disagrees with LMCache's own length prefix: a storage error, as a failed
    FSConnector.get of an existing key is, and the tier stays up."""
    rng = random.Random(damage)
    blob, payload, expected = _big_unit(rng)
    name = _name(rng)
    path = _fs_file(stores, fs_dir, blob, name)
    if damage == "grown":
        with path.open("ab") as f:
            f.write(b"\0")
    else:
        cut = {"cut_in_metadata": 10, "cut_in_header": 100}.get(damage, path.stat().st_size // 2)
        os.truncate(path, cut)
    with pytest.raises(L3Error) as exc:
        fetch_unit_into(
            stores["fs"], name, expected, memoryview(bytearray(len(payload))), PIECE, **split
        )
    assert exc.value.kind == "corrupt"
    assert stores["fs"].healthy()


def test_fs_file_cut_while_being_read_is_a_corrupt_object(
    stores: dict[str, L3Store], fs_dir: Path
) -> None:
    rng = random.Random(3)
    blob, _, _ = _big_unit(rng)
    name = _name(rng)
    path = _fs_file(stores, fs_dir, blob, name)

    def cut_then_read(file) -> None:  # type: ignore[no-untyped-def]
        os.truncate(path, path.stat().st_size - PIECE)
        file.readinto(0, memoryview(bytearray(file.nbytes)))

    with pytest.raises(L3Error) as exc:
        stores["fs"].read_file(name, cut_then_read)
    assert exc.value.kind == "corrupt"


def test_fs_read_past_its_deadline_stops_and_trips_the_breaker(tmp_path: Path) -> None:
    """No piece is read once the timeout has passed, so nothing lands in the caller's
    buffer after the call returned; a timeout marks the backend down like any other."""
    with _open(f"fs://{tmp_path / 'l3'}", timeout_s=0.3) as store:
        rng = random.Random(4)
        blob, payload, expected = _big_unit(rng)
        name = _name(rng)
        store.put(name, blob)
        dest = bytearray(len(payload))

        def slow(file) -> None:  # type: ignore[no-untyped-def]
            time.sleep(0.4)
            file.readinto(0, memoryview(dest)[:PIECE])

        with pytest.raises(L3Error) as exc:
            store.read_file(name, slow)
        assert exc.value.kind == "timeout"
        assert dest == bytes(len(payload))
        assert not store.healthy()
        time.sleep(0.25)  # the retry interval: the next call probes and recovers
        assert fetch_unit_into(store, name, expected, memoryview(dest)) is not None
        assert dest == payload and store.healthy()


def test_spread_runs_are_whole_layers_that_tile_the_payload() -> None:
    blob, _, _ = _big_unit(random.Random(8))
    header = read_header(blob)[0]  # 3 layers of 1 MiB, then 2 of 96 KiB
    names = [[layer.name for layer in run] for run in layer_runs(header, PIECE)]
    assert names == [["t0"], ["t1"], ["t2"], ["d0", "d1"]]
    names = [[layer.name for layer in run] for run in layer_runs(header, 2 * PIECE)]
    assert names == [["t0", "t1"], ["t2", "d0", "d1"]]
    # A layer table with a gap (or an overlap) leaves bytes unchecked: refused.
    moved = dataclasses.replace(header.layers[1], offset=header.layers[1].offset + 1)
    bad = dataclasses.replace(header, layers=(header.layers[0], moved, *header.layers[2:]))
    with pytest.raises(UnitRejected) as exc:
        layer_runs(bad, PIECE)
    assert exc.value.cause == "corrupt_header"


def test_a_spread_fetch_reads_on_several_threads_and_stops_them_on_damage(
    stores: dict[str, L3Store], pool: RunPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs really run on the pool's threads, one read call per run of layers; a run
    that finds damage stops the others, and none reads on after the fetch returned."""
    store = stores["fs"]
    rng = random.Random(9)
    blob, payload, expected = _big_unit(rng)
    span = len(blob) - len(payload)
    reads: list[str] = []
    real = ObjectFile.readinto_layers_hashed

    def recording(
        file: ObjectFile, pos: int, buf: memoryview, sizes: list[int], piece: int, threads: int
    ) -> list[bytes]:
        reads.append(threading.current_thread().name)
        if pos != span:
            time.sleep(0.05)  # every run but the first: slow enough that the runs overlap
        return real(file, pos, buf, sizes, piece, threads)

    monkeypatch.setattr(ObjectFile, "readinto_layers_hashed", recording)
    name = _name(rng)
    store.put(name, blob)
    dest = bytearray(len(payload))
    assert fetch_unit_into(store, name, expected, memoryview(dest), PIECE, pool) is not None
    assert dest == payload
    # every byte read on the pool's threads, by more than one (the caller only waits)
    assert all(r.startswith("spread-test") for r in reads), reads
    assert len(set(reads)) > 1, reads
    assert len(reads) == 4  # one call per run: [t0], [t1], [t2], [d0, d1]

    bad = bytearray(blob)
    bad[span + 5] ^= 0x01  # in t0, the first run: found while the others sleep
    store.put(name + "0", bytes(bad))
    reads.clear()
    with pytest.raises(UnitRejected) as exc:
        fetch_unit_into(store, name + "0", expected, memoryview(dest), PIECE, pool)
    assert exc.value.cause == "checksum_mismatch"
    after = len(reads)
    time.sleep(0.2)
    assert len(reads) == after  # nothing read into dest after the call returned
    # 4 runs on 3 threads: the last run (d0, d1) never started its read
    assert after < 4, reads


def test_threads_per_unit_reads_a_unit_in_one_call_split_over_its_threads(
    stores: dict[str, L3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    """l3.threads_per_unit: one read call a unit, its layers (tiling the payload) split
    over that many threads inside it, every layer checked against its digest."""
    store = stores["fs"]
    rng = random.Random(11)
    blob, payload, expected = _big_unit(rng)
    calls: list[tuple[list[int], int]] = []
    real = ObjectFile.readinto_layers_hashed

    def recording(
        file: ObjectFile, pos: int, buf: memoryview, sizes: list[int], piece: int, threads: int = 1
    ) -> list[bytes]:
        calls.append((sizes, threads))
        return real(file, pos, buf, sizes, piece, threads)

    monkeypatch.setattr(ObjectFile, "readinto_layers_hashed", recording)
    name = _name(rng)
    store.put(name, blob)
    dest = bytearray(len(payload))
    assert fetch_unit_into(store, name, expected, memoryview(dest), threads_per_unit=4)
    assert dest == payload
    assert calls == [([1 << 20] * 3 + [96 << 10] * 2, 4)]
    bad = bytearray(blob)
    bad[-5] ^= 0x01  # in the last draft layer
    store.put(name + "0", bytes(bad))
    with pytest.raises(UnitRejected) as exc:
        fetch_unit_into(store, name + "0", expected, memoryview(dest), threads_per_unit=4)
    assert exc.value.cause == "checksum_mismatch"
