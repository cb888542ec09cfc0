"""Unit codec: a bit-exact round trip, and each reject cause set off by a real planted defect."""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable

import pytest

from vllm_draft_offload.unit_codec import (
    FORMAT_VERSION,
    PAYLOAD_ALIGN,
    PREFIX_SIZE,
    REJECT_CAUSES,
    LayerSpec,
    UnitHeader,
    UnitIdentity,
    UnitRejected,
    encode_unit,
    encode_unit_into,
    header_digest,
    layer_view,
    make_header,
    pack_unit,
    read_header,
    unit_frame,
    verify_layer,
)
from vllm_draft_offload.unit_verify import ExpectedUnit, decode_unit

KEY = "3f" * 16
FP = "llama-3-8b|tp1|bf16|blk16|kv8x128"
DRAFTER = "eagle3-llama-3-8b@abc123"
SUCC = (42017,)
TARGET_BYTES = 2 * 16 * 8 * 128 * 2  # [K/V, tokens, kv_heads, head_dim] bf16
DRAFT_BYTES = 2 * 16 * 4 * 64 * 2  # the drafter has another geometry


def _layers(
    rng: random.Random, n_target: int = 4, n_draft: int = 2
) -> list[tuple[str, bool, bytes]]:
    out = [
        (f"model.layers.{i}.self_attn", False, rng.randbytes(TARGET_BYTES)) for i in range(n_target)
    ]
    out += [
        (f"draft.layers.{i}.self_attn", True, rng.randbytes(DRAFT_BYTES)) for i in range(n_draft)
    ]
    return out


def _expected(layers: list[tuple[str, bool, bytes]], **over: object) -> ExpectedUnit:
    fields: dict[str, object] = {
        "key": KEY,
        "geometry_fingerprint": FP,
        "drafter_id": DRAFTER,
        "layers": tuple(LayerSpec(n, d, len(b)) for n, d, b in layers),
        "successor_tokens": SUCC,
        "num_tokens": 16,
    }
    fields.update(over)
    return ExpectedUnit(**fields)  # type: ignore[arg-type]


def _pack(layers: list[tuple[str, bool, bytes]], **over: object) -> tuple[UnitHeader, bytes]:
    fields: dict[str, object] = {
        "key": KEY,
        "geometry_fingerprint": FP,
        "drafter_id": DRAFTER,
        "num_tokens": 16,
        "successor_tokens": SUCC,
    }
    fields.update(over)
    return pack_unit(UnitIdentity(**fields), layers)  # type: ignore[arg-type]


@pytest.fixture
def unit() -> tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes]:
    layers = _layers(random.Random(7))
    header, blob = _pack(layers)
    return layers, header, blob


def _header_span(blob: bytes) -> tuple[int, int]:
    (hlen,) = struct.unpack_from("<I", blob, 12)
    return PREFIX_SIZE, PREFIX_SIZE + hlen


def test_round_trip_is_bit_exact(
    unit: tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes],
) -> None:
    layers, header, blob = unit
    got_header, payload = decode_unit(blob, _expected(layers))
    assert got_header == header
    assert bytes(payload) == b"".join(b for _, _, b in layers)
    for entry, (name, is_draft, data) in zip(got_header.layers, layers, strict=True):
        assert (entry.name, entry.is_draft, entry.nbytes) == (name, is_draft, len(data))
        assert bytes(layer_view(payload, entry)) == data
        assert verify_layer(payload, entry)
    # The payload starts aligned, so callers can view it as bf16/fp8 without a copy.
    assert (len(blob) - payload.nbytes) % PAYLOAD_ALIGN == 0
    # Decoding also accepts a memoryview (what a zero-copy reader hands us).
    assert bytes(decode_unit(memoryview(blob), _expected(layers))[1]) == bytes(payload)


def test_encode_unit_and_make_header_agree_with_pack_unit(
    unit: tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes],
) -> None:
    layers, header, blob = unit
    payload = b"".join(b for _, _, b in layers)
    h2 = make_header(
        UnitIdentity(
            key=KEY,
            geometry_fingerprint=FP,
            drafter_id=DRAFTER,
            num_tokens=16,
            successor_tokens=list(SUCC),
        ),
        [(n, d, len(b)) for n, d, b in layers],
        payload,
    )
    assert h2 == header
    assert encode_unit(h2, payload, verify=True) == blob


@pytest.mark.parametrize("successors", [(), SUCC, (1, 22, 333, 4444)])
def test_in_place_encode_gives_the_same_blob(
    unit: tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes], successors: tuple[int, ...]
) -> None:
    layers, _, _ = unit
    specs = [LayerSpec(n, d, len(b)) for n, d, b in layers]
    identity = UnitIdentity(KEY, FP, DRAFTER, 16, successors)
    frame = unit_frame(identity, specs)
    out = bytearray(b"\xee" * frame.nbytes)
    out[frame.header_nbytes :] = b"".join(b for _, _, b in layers)
    header = encode_unit_into(memoryview(out), frame, identity, specs)
    _, blob = _pack(layers, successor_tokens=successors)
    assert bytes(out) == blob
    assert decode_unit(bytes(out), _expected(layers, successor_tokens=successors))[0] == header
    with pytest.raises(ValueError, match="needs"):
        encode_unit_into(memoryview(out)[:-1], frame, identity, specs)


def test_empty_successor_list_round_trips() -> None:
    layers = _layers(random.Random(1), 2, 1)
    _, blob = _pack(layers, successor_tokens=[])
    header, _ = decode_unit(blob, _expected(layers, successor_tokens=()))
    assert header.successor_tokens == ()
    # A caller that does not care about successors accepts any.
    decode_unit(blob, _expected(layers, successor_tokens=None))


def _flip(blob: bytes, pos: int) -> bytes:
    b = bytearray(blob)
    b[pos] ^= 0x01
    return bytes(b)


def _first_draft_layer_pos(header: UnitHeader, blob: bytes) -> int:
    draft = next(e for e in header.layers if e.is_draft)
    payload_start = len(blob) - header.payload_nbytes
    return payload_start + draft.offset + draft.nbytes // 2


Defect = Callable[[list[tuple[str, bool, bytes]], UnitHeader, bytes], tuple[bytes, ExpectedUnit]]

DEFECTS: dict[str, tuple[str, Defect]] = {
    "cut_in_payload": ("truncated", lambda L, h, b: (b[:-1], _expected(L))),
    "cut_in_prefix": ("truncated", lambda L, h, b: (b[: PREFIX_SIZE - 5], _expected(L))),
    "cut_in_header": ("truncated", lambda L, h, b: (b[: _header_span(b)[1] - 3], _expected(L))),
    "header_byte_flipped": (
        "corrupt_header",
        lambda L, h, b: (_flip(b, b.index(b'"num_tokens"') + 2), _expected(L)),
    ),
    "trailing_garbage": ("corrupt_header", lambda L, h, b: (b + b"\0", _expected(L))),
    "bad_magic": ("bad_magic_or_version", lambda L, h, b: (_flip(b, 0), _expected(L))),
    "future_version": (
        "bad_magic_or_version",
        lambda L, h, b: (b[:8] + struct.pack("<H", FORMAT_VERSION + 1) + b[10:], _expected(L)),
    ),
    # Format 1 (blake3 checksums) is refused, so its objects are recomputed, never misread.
    "format_1_object": (
        "bad_magic_or_version",
        lambda L, h, b: (b[:8] + struct.pack("<H", 1) + b[10:], _expected(L)),
    ),
    "draft_layer_byte_flipped": (
        "checksum_mismatch",
        lambda L, h, b: (_flip(b, _first_draft_layer_pos(h, b)), _expected(L)),
    ),
    "other_key": ("key_mismatch", lambda L, h, b: (b, _expected(L, key="3f" * 15 + "40"))),
    "other_fingerprint": (
        "geometry_mismatch",
        lambda L, h, b: (b, _expected(L, geometry_fingerprint=FP.replace("bf16", "fp8"))),
    ),
    "other_token_count": ("geometry_mismatch", lambda L, h, b: (b, _expected(L, num_tokens=32))),
    "other_drafter": (
        "drafter_mismatch",
        lambda L, h, b: (b, _expected(L, drafter_id="eagle3-llama-3-8b@def456")),
    ),
    "wrong_successor": (
        "successor_mismatch",
        lambda L, h, b: (b, _expected(L, successor_tokens=(7,))),
    ),
    "successor_missing_from_unit": (
        "successor_mismatch",
        lambda L, h, b: (_pack(L, successor_tokens=[])[1], _expected(L)),
    ),
    "draft_part_missing": (
        "draft_part_missing",
        lambda L, h, b: (_pack([x for x in L if not x[1]])[1], _expected(L)),
    ),
    "target_part_missing": (
        "draft_part_missing",
        lambda L, h, b: (_pack([x for x in L if x[1]])[1], _expected(L)),
    ),
    "layer_order_swapped": (
        "layer_table_mismatch",
        lambda L, h, b: (_pack([L[1], L[0], *L[2:]])[1], _expected(L)),
    ),
    "one_draft_layer_fewer": (
        "layer_table_mismatch",
        lambda L, h, b: (_pack(L[:-1])[1], _expected(L)),
    ),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_planted_defect_is_rejected_with_its_cause(
    defect: str, unit: tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes]
) -> None:
    layers, header, blob = unit
    cause, plant = DEFECTS[defect]
    bad_blob, expected = plant(layers, header, blob)
    with pytest.raises(UnitRejected) as exc:
        decode_unit(bad_blob, expected)
    assert exc.value.cause == cause, exc.value


def test_every_reject_cause_has_a_planted_defect() -> None:
    assert {cause for cause, _ in DEFECTS.values()} == set(REJECT_CAUSES)


def test_verify_layer_pinpoints_the_damaged_draft_layer(
    unit: tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes],
) -> None:
    _, header, blob = unit
    damaged = _flip(blob, _first_draft_layer_pos(header, blob))
    # read_header checks framing only, as audit mode would, then checks each layer.
    h, payload = read_header(damaged)
    bad = [e.name for e in h.layers if not verify_layer(payload, e)]
    assert bad == [next(e.name for e in h.layers if e.is_draft)]


def test_header_with_overlapping_layers_is_corrupt(
    unit: tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes],
) -> None:
    """A writer bug (overlapping offsets) is refused even when the header digest is valid."""
    layers, header, blob = unit
    start, end = _header_span(blob)
    doc = json.loads(blob[start:end])
    doc["layers"][1][2] = 0  # layer 1 now overlaps layer 0
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * ((end - start) - len(raw))
    prefix = blob[:16] + header_digest(raw)
    with pytest.raises(UnitRejected) as exc:
        decode_unit(prefix + raw + blob[end:], _expected(layers))
    assert exc.value.cause == "corrupt_header"


def test_encode_rejects_inconsistent_input(
    unit: tuple[list[tuple[str, bool, bytes]], UnitHeader, bytes],
) -> None:
    layers, header, _ = unit
    payload = b"".join(b for _, _, b in layers)
    with pytest.raises(ValueError, match="payload has"):
        encode_unit(header, payload[:-1])
    tampered = bytearray(payload)
    tampered[-1] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        encode_unit(header, bytes(tampered), verify=True)
    with pytest.raises(ValueError, match="cover"):
        make_header(
            UnitIdentity(key=KEY, geometry_fingerprint=FP, drafter_id=DRAFTER, num_tokens=16),
            [(n, d, len(b)) for n, d, b in layers[:-1]],
            payload,
        )


def test_unknown_cause_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        UnitRejected("bit_rot")  # type: ignore[arg-type]
