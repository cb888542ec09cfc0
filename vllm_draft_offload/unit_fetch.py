"""Fetching one stored unit into its destination (a host-pool slot), verified on the way.

The payload lands in the destination in pieces of ``PIECE_BYTES``, and each piece is
hashed right after it landed, while it is still in the CPU cache (the last level, at
least): verifying then costs a cache-speed hash instead of another pass over memory, and
nothing is copied twice.

A fetch runs on a worker thread in the engine's process. Each read and each hash call
gives up the GIL and takes it back; while vLLM's engine thread steps (it does, every
millisecond or so, while a request waits on storage) taking it back can wait out the
engine's Python, and read threads queue for it behind each other. So pieces are as large
as the last-level cache comfortably holds for several threads at once, not the size of
a core's L2: 1 MiB pieces took the GIL about 80 times per 36 MiB unit, 4 MiB pieces
(with the header read along with LMCache's metadata) 23 times
(``vllm-draft-offload l3-stages --piece-kib 1024,4096`` runs both).

* fs://: each piece is read from the object's file straight into the destination
  (``L3Store.read_file``): no staging buffer, no event loop.
* Other backends (Redis, lm://, Mooncake) hand over their own buffer (``get_into``);
  it is copied into the destination piece by piece, each piece verified there.

A unit that fails any check raises ``UnitRejected``; the destination then holds a
partial copy that must not be used (the caller drops the slot).
"""

from __future__ import annotations

from typing import Final

import numpy as np

from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_fs_reads import ObjectFile
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.unit_codec import (
    PREFIX_SIZE,
    UnitHeader,
    UnitRejected,
    header_span,
    parse_framed,
    read_header,
)
from vllm_draft_offload.unit_verify import ExpectedUnit, PayloadCheck, check_expected

# Small enough to stay in the last-level cache between landing and hashing (several
# threads' pieces at once), large enough that a unit takes the GIL a few dozen times.
PIECE_BYTES: Final = 4 << 20


def fetch_unit_into(
    store: L3Store,
    name: str,
    expected: ExpectedUnit,
    dest: memoryview,
    piece_bytes: int = PIECE_BYTES,
) -> UnitHeader | None:
    """Read object ``name`` into ``dest`` (exactly the payload's size) and verify it,
    ``piece_bytes`` at a time.

    Returns the unit's header, or None when the object is absent. Raises
    ``UnitRejected`` for a unit that must not be used and ``L3Error`` for a storage
    failure, within the store's timeout.
    """
    dest = dest.cast("B") if dest.format != "B" else dest
    if store.reads_files:
        try:
            return store.read_file(
                name, lambda file: _read_file_into(file, expected, dest, piece_bytes)
            )
        except L3Error as exc:
            if exc.kind != "unsupported":  # an fs plugin whose connector has no files
                raise
    return store.get_into(name, lambda blob: _copy_blob_into(blob, expected, dest, piece_bytes))


def _read_file_into(
    file: ObjectFile, expected: ExpectedUnit, dest: memoryview, piece_bytes: int
) -> UnitHeader:
    if file.nbytes < PREFIX_SIZE:
        raise UnitRejected("truncated", f"{file.nbytes} bytes, prefix needs {PREFIX_SIZE}")
    prefix = file.read(0, PREFIX_SIZE)
    span = header_span(prefix)
    if span > file.nbytes:
        raise UnitRejected("truncated", f"header needs {span} bytes, have {file.nbytes}")
    header = parse_framed(prefix + file.read(PREFIX_SIZE, span - PREFIX_SIZE), file.nbytes)
    check_expected(header, expected)
    _check_destination(header, dest)
    check = PayloadCheck(header)
    for start in range(0, dest.nbytes, piece_bytes):
        piece = dest[start : start + piece_bytes]
        file.readinto(span + start, piece)
        check.update(piece)
    check.finish()
    return header


def _copy_blob_into(
    blob: memoryview, expected: ExpectedUnit, dest: memoryview, piece_bytes: int
) -> UnitHeader:
    header, payload = read_header(blob)
    check_expected(header, expected)
    _check_destination(header, dest)
    # numpy copies without the GIL; the hash runs on the destination's fresh copy.
    src = np.frombuffer(payload, dtype=np.uint8)
    out = np.frombuffer(dest, dtype=np.uint8)
    check = PayloadCheck(header)
    for start in range(0, dest.nbytes, piece_bytes):
        end = min(start + piece_bytes, dest.nbytes)
        out[start:end] = src[start:end]
        check.update(dest[start:end])
    check.finish()
    return header


def _check_destination(header: UnitHeader, dest: memoryview) -> None:
    if dest.nbytes != header.payload_nbytes:
        # check_expected has matched the layer table, so this is the caller's mistake.
        raise ValueError(f"destination has {dest.nbytes} bytes, the unit {header.payload_nbytes}")
