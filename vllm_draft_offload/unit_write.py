"""Writing one unit from its host-pool slot into a storage buffer, in one pass over memory.

A write used to copy the slot into LMCache's staging buffer (a torch copy), then hash
every layer, then hash the whole payload: three passes over 37.7 MB at the 8B shape, the
two hashes reading it back from DRAM. Write-behind runs beside the fetches a request
waits on and beside prefills (session 10, H100: a restart's fetches landed 7 units in
73 ms while the previous prompt's write-behind was likely still draining, against 64
units in 0.21 s with nothing to write), so what a write costs the memory bus and the GIL
is paid by the requests in flight.

Here the payload is copied piece by piece, and each piece is hashed right after it
landed, while it is still in the CPU cache: the payload's digest and the digests of the
layers it overlaps (``fast_io.copy_hash_layers_into``). With the native loop (the
default where the C extension was built) the whole copy runs in C in one release of the
GIL, in pieces of ``NATIVE_PIECE_BYTES``; with the Python one (``fast_io.NATIVE`` off)
numpy copies and python-xxhash hashes each piece of ``PIECE_BYTES``, giving up the GIL
and taking it back for every call. Both give the same digests, so the unit's bytes are
exactly what ``unit_codec.encode_unit_into`` makes of the same payload either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_draft_offload import fast_io
from vllm_draft_offload.fast_io import NATIVE_PIECE_BYTES, PIECE_BYTES
from vllm_draft_offload.unit_codec import (
    LayerSpec,
    UnitFrame,
    UnitHeader,
    UnitIdentity,
    header_with_digests,
    write_header_into,
)


def copy_unit_into(
    out: memoryview,
    frame: UnitFrame,
    source: memoryview,
    identity: UnitIdentity,
    layers: Sequence[LayerSpec],
    *,
    on_copied: Callable[[], None] | None = None,
    piece_bytes: int = PIECE_BYTES,
    native_piece_bytes: int = NATIVE_PIECE_BYTES,
) -> UnitHeader:
    """Copy the payload ``source`` to ``out[frame.header_nbytes:]``, hashing each piece
    as it lands (``native_piece_bytes`` at a time with the native loop, ``piece_bytes``
    with the Python one), then write the header in front; returns the header.
    ``on_copied`` runs once every byte of ``source`` was copied (the slot may be reused
    from then on)."""
    out = out.cast("B") if out.format != "B" else out
    source = source.cast("B") if source.format != "B" else source
    if out.nbytes != frame.nbytes:
        raise ValueError(f"buffer has {out.nbytes} bytes, the unit needs {frame.nbytes}")
    if source.nbytes != frame.payload_nbytes:
        raise ValueError(f"source has {source.nbytes} bytes, the payload {frame.payload_nbytes}")
    if sum(spec.nbytes for spec in layers) != frame.payload_nbytes:
        raise ValueError(f"layers do not cover the payload's {frame.payload_nbytes} bytes")
    whole, layer_digests = fast_io.copy_hash_layers_into(
        source,
        out[frame.header_nbytes :],
        [spec.nbytes for spec in layers],
        native_piece_bytes if fast_io.NATIVE else piece_bytes,
    )
    if on_copied is not None:
        on_copied()
    digests = [digest.hex() for digest in layer_digests]
    header = header_with_digests(identity, layers, digests, whole.hex())
    write_header_into(out, frame, header)
    return header
