"""Fetching one stored unit into its destination (a host-pool slot), verified on the way.

The payload lands in the destination in pieces, and each piece is hashed right after it
landed, while it is still in the CPU cache: verifying then costs a cache-speed hash
instead of another pass over memory, and nothing is copied twice. One call reads (or
copies) and hashes the whole payload, or one layer (``fast_io``; its digest is then
checked against the header, ``unit_verify``), with one of two readers:

* native (``fast_io.NATIVE``: the C extension was built and not switched off), the
  default: the whole loop runs without the GIL, so a unit takes it once (once per run of
  layers when spread), and its pieces (``NATIVE_PIECE_BYTES``) can be as small as a core's L2
  holds. With 4 MiB pieces on 8-16 threads a piece had left the cache before it was
  hashed: the fetch moved each byte through memory three times where a raw read moves
  it twice, and an H100 host fetched at 0.58-0.65 × the raw read (0.47-0.50 beside a
  busy engine thread).
* Python (the fallback): each read and each hash call gives up the GIL and takes it
  back; while vLLM's engine thread steps (it does, every millisecond or so, while a
  request waits on storage) taking it back can wait out the engine's Python, and read
  threads queue for it behind each other. So its pieces (``piece_bytes``, by default
  ``PIECE_BYTES``) are as large as the last-level cache comfortably holds for several
  threads at once, not the size of a core's L2: 1 MiB pieces took the GIL about 80 times
  per 36 MiB unit, 4 MiB pieces (with the header read along with LMCache's metadata) 23
  times (``vllm-draft-offload l3-stages --reader python --piece-kib 1024,4096`` runs
  both).

* fs://: each piece is read from the object's file straight into the destination
  (``L3Store.read_file``, ``ObjectFile.readinto_hashed``): no staging buffer, no event
  loop.
* Other backends (Redis, lm://, Mooncake) hand over their own buffer (``get_into``);
  it is copied into the destination piece by piece, each piece hashed there
  (``fast_io.copy_hash_into``).

A unit that fails any check raises ``UnitRejected``; the destination then holds a
partial copy that must not be used (the caller drops the slot).

Spread over threads (``spread``, fs:// only): one unit's layers are read and verified by
several threads at once, in runs of whole layers of about ``piece_bytes`` (whichever
reader runs), one read call per run (``fast_io.pread_hash_layers_into``: the run's bytes
hashed per layer as they land, so the GIL is taken once per run, not once per layer),
each layer checked against its own digest in the header (a run not yet started is
skipped once another has failed), the earliest unit's runs first (run_pool.py), while
the caller waits. The layers tile the payload (checked
first), so every byte is verified, as by the payload digest. The aim is a unit landing
in about 1 / threads of the time one thread takes (not yet measured on a GPU host): with
one unit per thread, the first of a fetch's units landed only after a whole unit's read
(21 ms at 37.7 MB on an H100 host), as long as a request's whole wait allowance, and no
unit of a probe round landed in it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from vllm_draft_offload import fast_io
from vllm_draft_offload.fast_io import NATIVE_PIECE_BYTES, PIECE_BYTES
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_fs_reads import ObjectFile
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.run_pool import RunPool
from vllm_draft_offload.unit_codec import (
    PREFIX_SIZE,
    LayerEntry,
    UnitHeader,
    UnitRejected,
    header_span,
    parse_framed,
    read_header,
)
from vllm_draft_offload.unit_verify import (
    ExpectedUnit,
    check_expected,
    check_layer,
    check_payload,
)


def fetch_unit_into(
    store: L3Store,
    name: str,
    expected: ExpectedUnit,
    dest: memoryview,
    piece_bytes: int = PIECE_BYTES,
    spread: RunPool | None = None,
    native_piece_bytes: int = NATIVE_PIECE_BYTES,
    threads_per_unit: int = 1,
    stop: bytearray | None = None,
) -> UnitHeader | None:
    """Read object ``name`` into ``dest`` (exactly the payload's size) and verify it,
    ``native_piece_bytes`` (native reader) or ``piece_bytes`` (Python reader) at a time;
    fs:// objects of more than one run of layers (``piece_bytes`` each) with the help of
    ``spread``'s threads (never the caller's own pool: the caller waits for them), or,
    with ``threads_per_unit`` > 1, their layers split over that many threads inside one
    native call (``fast_io.pread_hash_layers_into``; the Python reader reads them on the
    calling thread), each layer checked against its own digest.

    Returns the unit's header, or None when the object is absent. Raises
    ``UnitRejected`` for a unit that must not be used and ``L3Error`` for a storage
    failure, within the store's timeout; ``ReadStopped`` once ``stop[0]`` is set (from
    another thread) between two pieces of an fs:// read (other backends' objects arrive
    whole, then are copied).
    """
    dest = dest.cast("B") if dest.format != "B" else dest
    piece = native_piece_bytes if fast_io.NATIVE else piece_bytes
    if store.reads_files:

        def consume(file: ObjectFile) -> UnitHeader:
            file.stop = stop
            return _read_file_into(
                file, expected, dest, piece_bytes, piece, spread, threads_per_unit
            )

        try:
            return store.read_file(name, consume)
        except L3Error as exc:
            if exc.kind != "unsupported":  # an fs plugin whose connector has no files
                raise
    return store.get_into(name, lambda blob: _copy_blob_into(blob, expected, dest, piece))


def _read_file_into(
    file: ObjectFile,
    expected: ExpectedUnit,
    dest: memoryview,
    run_bytes: int,
    piece: int,
    spread: RunPool | None = None,
    threads_per_unit: int = 1,
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
    if spread is not None:
        runs = layer_runs(header, run_bytes)
        if len(runs) > 1:
            _read_runs(file, span, dest, runs, piece, spread)
            return header
    if threads_per_unit > 1:
        _read_checked_layers(file, span, dest, tiled_layers(header), piece, threads_per_unit)
        return header
    check_payload(header, dest.nbytes, file.readinto_hashed(span, dest, piece))
    return header


def tiled_layers(header: UnitHeader) -> list[LayerEntry]:
    """The header's layers in payload order. Raises ``corrupt_header`` unless they tile
    the payload, back to back from byte 0 to its end (else checking every layer's digest
    would leave bytes unchecked)."""
    layers = sorted(header.layers, key=lambda entry: entry.offset)
    end = 0
    for layer in layers:
        if layer.offset != end or layer.nbytes < 0:
            raise UnitRejected(
                "corrupt_header", f"layer {layer.name!r} at {layer.offset}, not {end}"
            )
        end += layer.nbytes
    if end != header.payload_nbytes:
        raise UnitRejected("corrupt_header", f"layers cover {end} of {header.payload_nbytes} bytes")
    return layers


def layer_runs(header: UnitHeader, run_bytes: int) -> list[list[LayerEntry]]:
    """The header's layers in payload order, in runs of whole layers of at least
    ``run_bytes`` (the last may be shorter). Raises ``corrupt_header`` unless the layers
    tile the payload (``tiled_layers``)."""
    runs: list[list[LayerEntry]] = [[]]
    run_size = 0
    for layer in tiled_layers(header):
        if run_size >= run_bytes:
            runs.append([])
            run_size = 0
        runs[-1].append(layer)
        run_size += layer.nbytes
    return runs


def _read_runs(
    file: ObjectFile,
    span: int,
    dest: memoryview,
    runs: list[list[LayerEntry]],
    piece: int,
    spread: RunPool,
) -> None:
    """Every run on ``spread``'s threads, in this unit's ticket order, while this thread
    waits: readers of later units must not take threads (cores, the GIL) from an earlier
    unit. Returns (or raises the first failure) only once none of them reads or writes
    any more."""
    stop = threading.Event()
    futures: list[Future[None]] = []
    inline: list[list[LayerEntry]] = []
    ticket = spread.ticket()
    for run in runs:
        try:
            futures.append(spread.submit(ticket, _read_layers, file, span, dest, run, piece, stop))
        except RuntimeError:  # the pool is shut down: read it here
            inline.append(run)
    failure: BaseException | None = None
    for run in inline:
        try:
            _read_layers(file, span, dest, run, piece, stop)
        except BaseException as exc:
            failure = failure or exc
            stop.set()
    for future in futures:
        try:
            future.result()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def _read_layers(
    file: ObjectFile,
    span: int,
    dest: memoryview,
    layers: list[LayerEntry],
    piece: int,
    stop: threading.Event,
) -> None:
    """``_read_checked_layers`` of one run, on a spread thread: a run not yet started once
    another has failed is skipped, and a failure stops the runs not yet started."""
    if stop.is_set():
        return  # another run failed: the unit is refused anyway
    try:
        _read_checked_layers(file, span, dest, layers, piece)
    except BaseException:
        stop.set()
        raise


def _read_checked_layers(
    file: ObjectFile,
    span: int,
    dest: memoryview,
    layers: list[LayerEntry],
    piece: int,
    threads: int = 1,
) -> None:
    """Read back-to-back ``layers`` into their place in ``dest`` in one call (split over
    ``threads`` threads), each layer checked against its digest."""
    start, end = layers[0].offset, layers[-1].offset + layers[-1].nbytes
    sizes = [layer.nbytes for layer in layers]
    digests = file.readinto_layers_hashed(span + start, dest[start:end], sizes, piece, threads)
    for layer, digest in zip(layers, digests, strict=True):
        check_layer(layer, layer.nbytes, digest)


def _copy_blob_into(
    blob: memoryview, expected: ExpectedUnit, dest: memoryview, piece: int
) -> UnitHeader:
    header, payload = read_header(blob)
    check_expected(header, expected)
    _check_destination(header, dest)
    check_payload(header, dest.nbytes, fast_io.copy_hash_into(payload, dest, piece))
    return header


def _check_destination(header: UnitHeader, dest: memoryview) -> None:
    if dest.nbytes != header.payload_nbytes:
        # check_expected has matched the layer table, so this is the caller's mistake.
        raise ValueError(f"destination has {dest.nbytes} bytes, the unit {header.payload_nbytes}")
