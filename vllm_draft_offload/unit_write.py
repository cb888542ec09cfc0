"""Writing one unit from its host-pool slot into a storage buffer, in one pass over memory.

A write used to copy the slot into LMCache's staging buffer (a torch copy), then hash
every layer, then hash the whole payload: three passes over 37.7 MB at the 8B shape, the
two hashes reading it back from DRAM. Write-behind runs beside the fetches a request
waits on and beside prefills (session 10, H100: a restart's fetches landed 7 units in
73 ms while the previous prompt's write-behind was likely still draining, against 64
units in 0.21 s with nothing to write), so what a write costs the memory bus and the GIL
is paid by the requests in flight.

Here the payload is copied piece by piece (numpy, without the GIL), and each piece is
hashed right after it landed, while it is still in the CPU cache: the payload's digest
and the digests of the layers it overlaps. The unit's bytes are exactly what
``unit_codec.encode_unit_into`` makes of the same payload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from vllm_draft_offload.unit_codec import (
    LayerSpec,
    UnitFrame,
    UnitHeader,
    UnitIdentity,
    header_with_digests,
    payload_hasher,
    write_header_into,
)

# Small enough that a piece is still in the last-level cache when it is hashed (twice:
# the payload's digest and its layers'), as for fetches by the Python reader
# (unit_fetch.PIECE_BYTES).
PIECE_BYTES: Final = 4 << 20


def copy_unit_into(
    out: memoryview,
    frame: UnitFrame,
    source: memoryview,
    identity: UnitIdentity,
    layers: Sequence[LayerSpec],
    *,
    on_copied: Callable[[], None] | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> UnitHeader:
    """Copy the payload ``source`` to ``out[frame.header_nbytes:]``, hashing each piece
    as it lands, then write the header in front; returns the header. ``on_copied`` runs
    once every byte of ``source`` was copied (the slot may be reused from then on)."""
    out = out.cast("B") if out.format != "B" else out
    source = source.cast("B") if source.format != "B" else source
    if out.nbytes != frame.nbytes:
        raise ValueError(f"buffer has {out.nbytes} bytes, the unit needs {frame.nbytes}")
    if source.nbytes != frame.payload_nbytes:
        raise ValueError(f"source has {source.nbytes} bytes, the payload {frame.payload_nbytes}")
    if sum(spec.nbytes for spec in layers) != frame.payload_nbytes:
        raise ValueError(f"layers do not cover the payload's {frame.payload_nbytes} bytes")
    payload = out[frame.header_nbytes :]
    src = np.frombuffer(source, dtype=np.uint8)
    dst = np.frombuffer(payload, dtype=np.uint8)
    whole = payload_hasher()
    layer_hashers = [payload_hasher() for _ in layers]
    layer_ends = np.cumsum([spec.nbytes for spec in layers]).tolist()
    layer = 0  # the first layer not yet wholly hashed
    for start in range(0, payload.nbytes, piece_bytes):
        end = min(start + piece_bytes, payload.nbytes)
        dst[start:end] = src[start:end]  # numpy copies without the GIL
        whole.update(payload[start:end])
        while layer < len(layers):
            layer_start = layer_ends[layer] - layers[layer].nbytes
            piece_end = min(end, layer_ends[layer])
            layer_hashers[layer].update(payload[max(start, layer_start) : piece_end])
            if layer_ends[layer] > end:
                break
            layer += 1
    if on_copied is not None:
        on_copied()
    digests = [h.hexdigest() for h in layer_hashers]
    header = header_with_digests(identity, layers, digests, whole.hexdigest())
    write_header_into(out, frame, header)
    return header
