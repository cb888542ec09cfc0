"""The one-pass unit writer (unit_write.py) makes exactly the blob the codec makes of the
same payload, whatever the piece size against the layer boundaries, with the native copy
loop and with the Python one (so a unit is byte for byte the same whichever wrote it)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_draft_offload import fast_io, unit_write
from vllm_draft_offload.unit_codec import (
    LayerSpec,
    UnitIdentity,
    UnitRejected,
    pack_unit,
    unit_frame,
    verify_layer,
)
from vllm_draft_offload.unit_verify import ExpectedUnit, decode_unit
from vllm_draft_offload.unit_write import copy_unit_into

KEY = "ab" * 16
FIELDS = {"key": KEY, "geometry_fingerprint": "fp", "drafter_id": "d", "num_tokens": 16}
IDENTITY = UnitIdentity(**FIELDS)  # type: ignore[arg-type]


def _write(sizes: list[int], piece_bytes: int, seed: int = 0) -> tuple[bytes, bytes, list]:
    """(copy_unit_into's blob, pack_unit's blob, the layers)."""
    rng = random.Random(seed)
    layers = [(f"l{i}", i % 3 == 2, rng.randbytes(n)) for i, n in enumerate(sizes)]
    specs = [LayerSpec(name, draft, len(data)) for name, draft, data in layers]
    succ = (7, 8)
    identity = replace(IDENTITY, successor_tokens=succ)
    frame = unit_frame(identity, specs)
    out = bytearray(b"\xee" * frame.nbytes)
    source = bytearray(b"".join(data for _, _, data in layers))
    copied = []
    header = copy_unit_into(
        memoryview(out), frame, memoryview(source), identity, specs,
        on_copied=lambda: copied.append(bytes(out[frame.header_nbytes :]) == bytes(source)),
        piece_bytes=piece_bytes, native_piece_bytes=piece_bytes,
    )  # fmt: skip
    assert copied == [True]  # called once, with every byte copied
    _, blob = pack_unit(identity, layers)
    expected = ExpectedUnit(layers=tuple(specs), successor_tokens=succ, **FIELDS)
    assert decode_unit(bytes(out), expected)[0] == header
    return bytes(out), blob, layers


@pytest.mark.parametrize("piece_bytes", [1, 5, 64, 100, 1000, 1 << 20])
def test_one_pass_write_gives_the_codecs_blob(reader: str, piece_bytes: int) -> None:
    # Pieces inside a layer, across several, ending on a boundary and past the end.
    ours, codec, _ = _write([100, 300, 0, 64, 37], piece_bytes)
    assert ours == codec


# The reader fixture only picks the loop: it holds for every example.
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    piece_bytes=st.integers(1, 700),
    seed=st.integers(0, 2**16),
)
def test_one_pass_write_matches_for_any_layers_and_pieces(
    reader: str, sizes: list[int], piece_bytes: int, seed: int
) -> None:
    ours, codec, _ = _write(sizes, piece_bytes, seed)
    assert ours == codec


def test_damage_to_what_was_written_is_refused(reader: str) -> None:
    """The digests are those of the bytes written: a flipped byte in layer 1 is refused
    as a checksum mismatch, and the header's digest of that layer no longer matches."""
    ours, _, layers = _write([100, 300, 64], 128)
    damaged = bytearray(ours)
    damaged[len(ours) - 64 - 10] ^= 1  # inside layer 1
    specs = tuple(LayerSpec(name, draft, len(data)) for name, draft, data in layers)
    expected = ExpectedUnit(layers=specs, successor_tokens=(7, 8), **FIELDS)
    header, payload = decode_unit(ours, expected)
    assert [verify_layer(payload, entry) for entry in header.layers] == [True] * 3
    with pytest.raises(UnitRejected, match="checksum"):
        decode_unit(bytes(damaged), expected)
    damaged_payload = memoryview(damaged)[len(ours) - payload.nbytes :]
    assert [verify_layer(damaged_payload, entry) for entry in header.layers] == [True, False, True]


def test_sizes_that_disagree_are_refused() -> None:
    specs = [LayerSpec("a", False, 10)]
    frame = unit_frame(IDENTITY, specs)
    out = memoryview(bytearray(frame.nbytes))
    with pytest.raises(ValueError, match="source"):
        copy_unit_into(out, frame, memoryview(bytearray(9)), IDENTITY, specs)
    with pytest.raises(ValueError, match="needs"):
        copy_unit_into(out[:-1], frame, memoryview(bytearray(10)), IDENTITY, specs)


def test_both_loops_store_the_same_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the default pieces (256 KiB native, 4 MiB Python), a unit of 36 layers that
    straddle them, some empty, comes out byte for byte the same from either loop, and
    decodes and verifies with the codec."""
    if not fast_io.AVAILABLE:
        pytest.skip(fast_io.reader())
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 3 << 17, (1 << 18) + 1, (1 << 20) - 5]) for _ in range(36)]
    layers = [(f"l{i}", i >= 32, rng.randbytes(n)) for i, n in enumerate(sizes)]
    specs = [LayerSpec(name, draft, len(data)) for name, draft, data in layers]
    identity = replace(IDENTITY, successor_tokens=(7, 8))
    frame = unit_frame(identity, specs)
    source = memoryview(bytearray(b"".join(data for _, _, data in layers)))
    blobs = {}
    for native in (True, False):
        monkeypatch.setattr(fast_io, "NATIVE", native)
        out = bytearray(b"\xee" * frame.nbytes)
        copy_unit_into(memoryview(out), frame, source, identity, specs)
        blobs[native] = bytes(out)
    assert blobs[True] == blobs[False] == pack_unit(identity, layers)[1]
    expected = ExpectedUnit(layers=tuple(specs), successor_tokens=(7, 8), **FIELDS)
    header, payload = decode_unit(blobs[True], expected)
    assert all(verify_layer(payload, entry) for entry in header.layers)


def test_each_loop_copies_in_its_own_pieces(reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native loop copies in ``NATIVE_PIECE_BYTES``, small enough for a core's L2 (as
    fetches do); the Python loop in ``PIECE_BYTES``, to take the GIL few times."""
    pieces = []
    real = fast_io.copy_hash_layers_into

    def recorded(src, dest, layer_sizes, piece_bytes):  # type: ignore[no-untyped-def]
        pieces.append(piece_bytes)
        return real(src, dest, layer_sizes, piece_bytes)

    monkeypatch.setattr(fast_io, "copy_hash_layers_into", recorded)
    specs = [LayerSpec("a", False, 10)]
    frame = unit_frame(IDENTITY, specs)
    out = memoryview(bytearray(frame.nbytes))
    copy_unit_into(out, frame, memoryview(bytearray(10)), IDENTITY, specs)
    want = unit_write.NATIVE_PIECE_BYTES if reader == "native" else unit_write.PIECE_BYTES
    assert pieces == [want]
