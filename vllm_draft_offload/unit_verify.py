"""Does a stored unit match what the reader expects, and is its payload intact?

The identity checks (key, geometry, drafter, successor tokens, layer table) need only the
header, so a unit from another deployment costs nothing to reject; the payload checksum
comes last. ``check_payload`` and ``check_layer`` judge a digest the reader took while the
bytes landed in their destination (``unit_fetch``, through ``fast_io``: each piece hashed
right after it landed, instead of the whole payload in a second pass over memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_draft_offload.unit_codec import (
    Buffer,
    LayerEntry,
    LayerSpec,
    UnitHeader,
    UnitRejected,
    checksum,
    read_header,
)


@dataclass(frozen=True, slots=True)
class ExpectedUnit:
    """What the reader needs. ``successor_tokens=None`` means that the caller does not care.

    ``num_tokens=None`` skips the token-count check; the geometry fingerprint usually
    covers it already.
    """

    key: str
    geometry_fingerprint: str
    drafter_id: str
    layers: tuple[LayerSpec, ...]
    successor_tokens: tuple[int, ...] | None = None
    num_tokens: int | None = None
    table: tuple[tuple[str, bool, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "layers",
            tuple(s if isinstance(s, LayerSpec) else LayerSpec(*s) for s in self.layers),
        )
        # The layer table as plain tuples: compared with a header's in one C-level
        # comparison (a fetch checks it on a read thread, holding the GIL).
        object.__setattr__(
            self, "table", tuple((s.name, s.is_draft, s.nbytes) for s in self.layers)
        )
        if self.successor_tokens is not None:
            object.__setattr__(self, "successor_tokens", tuple(self.successor_tokens))


def check_expected(header: UnitHeader, expected: ExpectedUnit) -> None:
    """Everything but the payload hash: a unit from another deployment costs nothing to reject."""
    if header.key != expected.key:
        raise UnitRejected("key_mismatch", f"stored {header.key!r}, wanted {expected.key!r}")
    if header.geometry_fingerprint != expected.geometry_fingerprint:
        raise UnitRejected(
            "geometry_mismatch",
            f"stored {header.geometry_fingerprint!r}, wanted {expected.geometry_fingerprint!r}",
        )
    if expected.num_tokens is not None and header.num_tokens != expected.num_tokens:
        raise UnitRejected(
            "geometry_mismatch", f"stored {header.num_tokens} tokens, wanted {expected.num_tokens}"
        )
    if header.drafter_id != expected.drafter_id:
        raise UnitRejected(
            "drafter_mismatch", f"stored {header.drafter_id!r}, wanted {expected.drafter_id!r}"
        )
    # The draft KV of the last position depends on the next token (EAGLE/MTP), so the
    # successor must match exactly. A prefix match could accept draft KV built from another
    # continuation.
    if (
        expected.successor_tokens is not None
        and header.successor_tokens != expected.successor_tokens
    ):
        raise UnitRejected(
            "successor_mismatch",
            f"stored {list(header.successor_tokens)}, wanted {list(expected.successor_tokens)}",
        )
    stored = tuple((e.name, e.is_draft, e.nbytes) for e in header.layers)
    wanted_bytes = sum(nbytes for _, _, nbytes in expected.table)
    if stored == expected.table and header.payload_nbytes == wanted_bytes:
        return  # the usual case, in one comparison; the checks below say what differs
    # The part checks run before the full table comparison: "the drafter half is absent"
    # is a different operational problem from "the layer list changed".
    for part, is_draft in (("draft", True), ("target", False)):
        wants = any(s.is_draft is is_draft and s.nbytes > 0 for s in expected.layers)
        has = any(e.is_draft is is_draft and e.nbytes > 0 for e in header.layers)
        if wants and not has:
            raise UnitRejected("draft_part_missing", f"{part} layers absent from stored unit")
    if header.layer_specs() != expected.layers:
        raise UnitRejected(
            "layer_table_mismatch", _table_diff(header.layer_specs(), expected.layers)
        )
    if header.payload_nbytes != wanted_bytes:  # gaps between the layers
        raise UnitRejected(
            "layer_table_mismatch", f"payload {header.payload_nbytes} bytes, wanted {wanted_bytes}"
        )


def check_payload(header: UnitHeader, nbytes: int, digest: bytes) -> None:
    """Raise ``UnitRejected`` unless ``nbytes`` are exactly the payload's and ``digest``
    (XXH3-128, fast_io's) is its checksum."""
    if nbytes != header.payload_nbytes:
        # More bytes than the header names is damage to the framing, as in read_header.
        cause = "truncated" if nbytes < header.payload_nbytes else "corrupt_header"
        raise UnitRejected(cause, f"checked {nbytes} of {header.payload_nbytes} bytes")
    if digest.hex() != header.payload_checksum:
        raise UnitRejected("checksum_mismatch", "payload checksum mismatch")


def check_layer(layer: LayerEntry, nbytes: int, digest: bytes) -> None:
    """One layer's ``check_payload`` (a unit whose layers are read by several threads:
    unit_fetch): ``checksum_mismatch`` unless exactly the layer was hashed and matches."""
    if nbytes != layer.nbytes or digest.hex() != layer.checksum:
        raise UnitRejected("checksum_mismatch", f"layer {layer.name!r} checksum mismatch")


def decode_unit(blob: Buffer, expected: ExpectedUnit) -> tuple[UnitHeader, memoryview]:
    """Validate ``blob`` against ``expected``. Returns the header and a zero-copy payload view.

    The cheap identity checks run before the payload hash, so a unit from another
    deployment costs nothing to reject.
    """
    header, payload = read_header(blob)
    check_expected(header, expected)
    if checksum(payload) != header.payload_checksum:
        raise UnitRejected("checksum_mismatch", "payload checksum mismatch")
    return header, payload


def _table_diff(stored: tuple[LayerSpec, ...], wanted: tuple[LayerSpec, ...]) -> str:
    if len(stored) != len(wanted):
        return f"stored {len(stored)} layers, wanted {len(wanted)}"
    for i, (s, w) in enumerate(zip(stored, wanted, strict=True)):
        if s != w:
            return f"layer {i}: stored {s}, wanted {w}"
    return "tables differ"
