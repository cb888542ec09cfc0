"""Where a warm ``fs://`` fetch spends its time, through the worker's own path, next to a
plain threaded read of the same files.

    vllm-draft-offload l3-stages --dir /tmp/l3-stages [--unit-mb 36] [--units 16] \\
        [--threads 8] [--reps 3] [--engine-loop-ms 0,1] [--writes 0,16] \\
        [--reader native,python] [--piece-kib 1024,4096] [--native-piece-kib 256,1024] \\
        [--switch-interval-ms 5,0.5] [--out stages.json]

Writes ``--units`` units (a Llama-3-8B-like layout: 32 target + 4 draft layers, ``--unit-mb``
each; 36 MiB is one 256-token chunk) with the worker's own write path (``WorkerL3``), reads
them once so their files are in the page cache, then for every scenario reports:

* ``fetch_GBps``: ``WorkerL3.fetch_unit`` of every unit into its own host slot on the
  worker's read pool (``--threads`` = ``l3.io_threads``), until every result is in;
* ``raw_GBps``: the same files, each unit's bytes read with one ``preadv`` straight into
  the same slots, on a pool of as many threads (no checks, no checksum);
* ``fetch_vs_raw``; and ``stages_ms_per_unit``, from one more fetch pass with the fetch
  path's workers timed: ``read_and_checksum`` (``ObjectFile.readinto_hashed``: the payload,
  or with a unit spread over threads each layer, read into the slot, so there is no
  separate copy to the slot on fs://, and hashed piece by piece), of which, with the
  Python reader, ``read`` (``fast_io.pread_into``, each piece's read) and ``checksum``
  (the rest: the hash calls; the native reader does both in one call without the GIL,
  so they are null there), ``other`` (open, header, checks, waiting for the GIL) and
  ``total`` (``FetchResult.seconds``), each summed over units and divided by their
  number; plus ``hashed_reads_per_unit`` (read calls per unit: the native reader gives up
  the GIL and takes it back once per call) and, Python reader only, ``pieces_per_unit``
  (reads per unit: each one releases and retakes the GIL, and so does each hash call).

Scenarios are every combination of ``--switch-interval-ms``, ``--reader`` with its piece
sizes, ``--engine-loop-ms`` and ``--writes``:

* ``switch_interval_ms``: Python's GIL switch interval during the scenario
  (``sys.setswitchinterval``; default the connector's ``l3.switch_interval_ms``, which
  ``WorkerL3`` applies). A fetch thread takes the GIL back after every read and
  checksum call, and each take can wait out an interval of the engine loop's Python.

* ``reader``: ``native`` (``fast_io``'s C loop, the product's default when it was built)
  or ``python`` (its fallback, what ``VLLM_DRAFT_OFFLOAD_NATIVE_IO=0`` runs); default
  the one the process would use. The scenario's writes (``writes`` W > 0) copy and hash
  with the same loop, each in its own pieces (``unit_write``), as they would in the
  product. The report's ``native_available`` says whether the
  extension could be imported at all.
* ``piece_kib``: the bytes a fetch reads and hashes at a time, by the row's reader:
  ``--piece-kib`` for the Python reader (``WorkerL3.fetch_piece_bytes``; default the
  product's ``unit_fetch.PIECE_BYTES``), ``--native-piece-kib`` for the native one
  (``WorkerL3.fetch_native_piece_bytes``; default ``unit_fetch.NATIVE_PIECE_BYTES``).

* ``engine_loop_ms`` B > 0: while reads run, one more thread does what vLLM's engine
  loop does while a request waits on a KV connector: B ms of Python (an empty step),
  then ``time.sleep(0.001)`` (vLLM's ``EngineCore`` yields that long after a step that
  ran no model), over and over. Fetch threads need the GIL after every read and every
  checksum call; a plain read needs it once per unit.
* ``writes`` W > 0: W other units are queued for writing (``WorkerL3.write_units``, the
  write-behind a fresh prompt leaves) right before the fetches start, as in
  ``restore-speed``'s warm restart, where each restored prompt follows a fresh one.
  Their files are removed after each pass. Each such scenario runs twice: writes as
  they run with no request waiting (``writes_held: false``), and held
  (``WorkerL3.hold_writes``: none start for ``WRITES_HELD_MAX_S``, then one at a time),
  as they are while a request waits on storage.

GB/s figures are the best of ``--reps`` passes. The directory should be on the disk
(or tmpfs) whose page cache a restarted engine would read from.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcache.v1.storage_backend.connector.fs_connector import FSConnector

from vllm_draft_offload import fast_io
from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.provenance import provenance
from vllm_draft_offload.config import L3Config
from vllm_draft_offload.geometry import GroupLayout, LayerSlot, UnitLayout
from vllm_draft_offload.l3_backends import inner_connector, make_key
from vllm_draft_offload.l3_fs_reads import ObjectFile
from vllm_draft_offload.l3_objects import object_key
from vllm_draft_offload.l3_worker import WorkerL3
from vllm_draft_offload.metadata import L3WriteOrder
from vllm_draft_offload.transfers import HostPool

TARGET_LAYERS = 32
DRAFT_LAYERS = 4
BLOCKS_PER_CHUNK = 16  # 256 tokens in blocks of 16
DRAFTER_ID = "l3-stages"


def make_layout(unit_mb: float) -> UnitLayout:
    """A Llama-3-8B-like unit: 32 target + 4 draft layers of equal size."""
    layers = TARGET_LAYERS + DRAFT_LAYERS
    page = max(1, int(unit_mb * 2**20) // layers // BLOCKS_PER_CHUNK)
    nbytes = page * BLOCKS_PER_CHUNK
    names = [f"model.layers.{i}.self_attn.attn" for i in range(TARGET_LAYERS)] + [
        f"draft_model.model.layers.{i}.self_attn.attn" for i in range(DRAFT_LAYERS)
    ]
    slots = tuple(
        LayerSlot(name, 0, page, i * nbytes, nbytes, i >= TARGET_LAYERS)
        for i, name in enumerate(names)
    )
    group = GroupLayout(0, 16, BLOCKS_PER_CHUNK, False, tuple(names))
    return UnitLayout(256, (group,), slots, nbytes * layers, "NHD")


def chunk_key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Timers:
    """Seconds and calls of the fetch path's read-and-checksum calls and, within them, of
    the Python reader's reads, summed over threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = {"read_and_checksum": 0.0, "read": 0.0}
        self.calls = {"read_and_checksum": 0, "read": 0}

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent = time.perf_counter() - start
                with self._lock:
                    self.seconds[stage] += spent
                    self.calls[stage] += 1

        return timed


@contextmanager
def timed_stages(timers: Timers) -> Iterator[None]:
    """Time ``ObjectFile.readinto_hashed`` (the fetch path's read and checksum) and
    ``fast_io.pread_into`` (the Python reader's reads within it) for the duration of the
    block."""
    hashed, read = ObjectFile.readinto_hashed, fast_io.pread_into
    ObjectFile.readinto_hashed = timers.wrap("read_and_checksum", hashed)  # type: ignore[method-assign]
    fast_io.pread_into = timers.wrap("read", read)
    try:
        yield
    finally:
        ObjectFile.readinto_hashed = hashed  # type: ignore[method-assign]
        fast_io.pread_into = read


@contextmanager
def engine_loop(burst_ms: float) -> Iterator[None]:
    """A thread that runs ``burst_ms`` of Python, then sleeps 1 ms, until the block ends."""
    if burst_ms <= 0:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            until = time.perf_counter() + burst_ms / 1000
            state: dict[str, int] = {}
            while time.perf_counter() < until:
                state["steps"] = state.get("steps", 0) + 1
            time.sleep(0.001)

    thread = threading.Thread(target=loop, name="engine-loop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Bench:
    def __init__(self, directory: Path, unit_mb: float, units: int, threads: int) -> None:
        self.directory = directory
        self.layout = make_layout(unit_mb)
        self.units = units
        self.config = L3Config(
            enabled=True,
            io_threads=threads,
            timeout_s=600.0,
            lmcache={
                "chunk_size": 256,
                "remote_url": f"fs://{directory}",
                "remote_serde": "naive",
                "extra_config": {"save_chunk_meta": True},
            },
        )
        self.pool: HostPool | None = None
        self.l3: WorkerL3 | None = None
        self.raw_pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-read")
        self._next_id = 0
        self._write_key = 1 << 40  # keys of the background writes, unlike the units'

    def open(self, max_writes: int) -> WorkerL3:
        """The host pool (a slot per unit and per background write) and the worker's L3."""
        self.pool = HostPool(self.units + max_writes, self.layout.unit_bytes, pin=False)
        self.pool.buffer.fill_(1)  # touched, as a page-locked pool's pages are
        self.l3 = WorkerL3(self.config, self.layout, self.pool, DRAFTER_ID, rank=0)
        if self.l3.store is None:
            raise SystemExit(f"cannot open fs://{self.directory}")
        return self.l3

    def _ids(self) -> int:
        self._next_id += 1
        return self._next_id

    def write(self, keys: list[int], slots: list[int]) -> None:
        """Queue the writes of units ``keys`` from ``slots`` (returns at once)."""
        assert self.l3 is not None
        orders = [
            L3WriteOrder(self._ids(), slot, chunk_key(key), (1,), chunk)
            for chunk, (key, slot) in enumerate(zip(keys, slots, strict=True))
        ]
        self.l3.write_units(orders)

    def settle_writes(self) -> None:
        assert self.l3 is not None
        if not self.l3.flush(600):
            raise RuntimeError("writes did not finish")
        while not self.l3.write_reports.empty():
            self.l3.write_reports.get()
        while not self.l3.events.empty():
            self.l3.events.get()

    def files(self) -> list[Path]:
        """The units' files, by the connector's own path rule."""
        assert self.l3 is not None and self.l3.store is not None
        store = self.l3.store
        fs = inner_connector(store._acquire("get", None, time.monotonic() + 10))  # noqa: SLF001
        if not isinstance(fs, FSConnector):
            raise SystemExit(f"{type(fs).__name__} is not an fs:// connector")
        namespace = store.settings.namespace
        return [
            fs._get_file_path(make_key(namespace, object_key(chunk_key(i), 0)))  # noqa: SLF001
            for i in range(self.units)
        ]

    def fetch_all(self) -> list[float]:
        """Fetch every unit into its slot; each unit's ``FetchResult.seconds``."""
        assert self.l3 is not None
        for i in range(self.units):
            self.l3.fetch_unit(self._ids(), i, chunk_key(i))
        seconds = []
        for _ in range(self.units):
            result = self.l3.fetches_done.get(timeout=600)
            if result.successors is None:
                raise RuntimeError(f"fetch of slot {result.slot} failed: {result.cause}")
            seconds.append(result.seconds)
        return seconds

    def raw_all(self, files: list[Path]) -> None:
        """Each unit's last ``unit_bytes`` (its payload) read into its slot with one preadv."""
        assert self.pool is not None
        pool = self.pool
        nbytes = self.layout.unit_bytes

        def read(i: int) -> None:
            fd = os.open(files[i], os.O_RDONLY)
            try:
                dest = memoryview(pool.unit_view(i).numpy())
                at = os.fstat(fd).st_size - nbytes
                done = 0
                while done < nbytes:
                    n = os.preadv(fd, [dest[done:]], at + done)
                    if n <= 0:
                        raise RuntimeError(f"{files[i]} ended early")
                    done += n
            finally:
                os.close(fd)

        list(self.raw_pool.map(read, range(self.units)))

    @contextmanager
    def background(self, burst_ms: float, writes: int, held: bool) -> Iterator[None]:
        """The emulated engine loop, and ``writes`` unit writes queued (held to one at a
        time, as while a request waits on storage, when ``held``), for one pass."""
        assert self.l3 is not None
        keys = list(range(self._write_key, self._write_key + writes))
        self._write_key += writes
        try:
            with engine_loop(burst_ms):
                if held:
                    self.l3.hold_writes(True)
                if writes:
                    self.write(keys, list(range(self.units, self.units + writes)))
                yield
        finally:
            if held:
                self.l3.hold_writes(False)
            self.settle_writes()
            self._remove_written(keys)

    def scenario(
        self,
        reader: str,
        piece_kib: int | None,
        burst_ms: float,
        writes: int,
        held: bool,
        reps: int,
        files: list[Path],
    ) -> dict[str, Any]:
        assert self.l3 is not None
        native = reader == "native"
        fast_io.NATIVE = native
        attr = "fetch_native_piece_bytes" if native else "fetch_piece_bytes"
        if piece_kib is not None:
            setattr(self.l3, attr, piece_kib << 10)
        piece_bytes = getattr(self.l3, attr)
        best = {"fetch": float("inf"), "raw": float("inf")}
        for _ in range(reps):
            for kind in ("fetch", "raw"):
                with self.background(burst_ms, writes, held):
                    start = time.perf_counter()
                    self.raw_all(files) if kind == "raw" else self.fetch_all()
                    best[kind] = min(best[kind], time.perf_counter() - start)
        timers = Timers()
        with timed_stages(timers), self.background(burst_ms, writes, held):
            per_unit = self.fetch_all()
        n = self.units
        both = 1e3 * timers.seconds["read_and_checksum"] / n
        read = None if native else 1e3 * timers.seconds["read"] / n
        total = 1e3 * sum(per_unit) / n
        stages = {
            "read_and_checksum": both,
            "read": read,
            "checksum": None if read is None else both - read,
            "other": total - both,
            "total": total,
        }
        nbytes = n * self.layout.unit_bytes
        fetch_gbps, raw_gbps = nbytes / best["fetch"] / 1e9, nbytes / best["raw"] / 1e9
        return {
            "reader": reader,
            "piece_kib": piece_bytes >> 10,
            "engine_loop_ms": burst_ms,
            "writes": writes,
            "writes_held": held,
            "fetch_GBps": fetch_gbps,
            "raw_GBps": raw_gbps,
            "fetch_vs_raw": fetch_gbps / raw_gbps,
            "stages_ms_per_unit": stages,
            "hashed_reads_per_unit": timers.calls["read_and_checksum"] / n,
            "pieces_per_unit": None if native else timers.calls["read"] / n,
        }

    def _remove_written(self, keys: list[int]) -> None:
        assert self.l3 is not None and self.l3.store is not None
        for key in keys:
            self.l3.store.remove(object_key(chunk_key(key), 0))

    def close(self) -> None:
        if self.l3 is not None:
            self.l3.close(flush_timeout_s=60)
        self.raw_pool.shutdown()


def _line(row: dict[str, Any]) -> str:
    s = row["stages_ms_per_unit"]
    split = (
        f"read {s['read']:.2f} checksum {s['checksum']:.2f}"
        if s["read"] is not None
        else f"read+checksum {s['read_and_checksum']:.2f}"
    )
    calls = row["pieces_per_unit"] or row["hashed_reads_per_unit"]
    return (
        f"switch_ms={row.get('switch_interval_ms', 5):g} reader={row['reader']} "
        f"piece_kib={row['piece_kib']} engine_loop_ms={row['engine_loop_ms']:g} "
        f"writes={row['writes']}{' held' if row['writes_held'] else ''}: "
        f"fetch {row['fetch_GBps']:.2f} GB/s, "
        f"raw {row['raw_GBps']:.2f} GB/s, fetch/raw {row['fetch_vs_raw']:.2f}; "
        f"ms per unit: {split} other {s['other']:.2f} total {s['total']:.2f}; "
        f"{calls:.0f} reads/unit"
    )


EXAMPLES = """examples:
  vllm-draft-offload l3-stages --dir /root/l3-stages --threads 8 --units 32 \\
      --engine-loop-ms 0,1 --writes 0,32 --piece-kib 1024,4096 --out $OUT/l3_stages.json
  vllm-draft-offload l3-stages --dir /root/l3-stages --threads 16 --units 32 \\
      --reader native,python --native-piece-kib 128,256,1024 --out $OUT/l3_stages.json
  vllm-draft-offload l3-stages --dir /dev/shm/l3 --unit-mb 4 --units 8 --threads 2
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = command_parser("l3-stages", __doc__, EXAMPLES)
    ap.add_argument("--dir", required=True, type=Path, help="fs:// directory for the units")
    ap.add_argument("--unit-mb", type=float, default=36.0)
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--threads", type=int, default=8, help="l3.io_threads, and raw readers")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine-loop-ms", default="0,1", help="Python ms per emulated empty step")
    ap.add_argument("--writes", default="0", help="unit writes queued before each pass")
    ap.add_argument(
        "--reader",
        default="",
        help="fetch readers to measure: native, python or both (default: the one in use)",
    )
    ap.add_argument(
        "--piece-kib", default="", help="Python reader's piece sizes (default: the product's)"
    )
    ap.add_argument(
        "--native-piece-kib",
        default="",
        help="native reader's piece sizes (default: the product's)",
    )
    ap.add_argument(
        "--switch-interval-ms",
        default="",
        help="Python's GIL switch intervals to run each scenario at, e.g. 5,0.5 "
        "(default: the connector's l3.switch_interval_ms)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    bursts = [float(b) for b in args.engine_loop_ms.split(",")]
    writes = [int(w) for w in args.writes.split(",")]
    readers = [r.strip() for r in args.reader.split(",") if r.strip()] or [
        "native" if fast_io.NATIVE else "python"
    ]
    unknown = set(readers) - {"native", "python"}
    if unknown:
        raise SystemExit(f"unknown --reader {sorted(unknown)}: native or python")
    if "native" in readers and not fast_io.AVAILABLE:
        raise SystemExit(f"--reader native: the extension is missing ({fast_io.reader()})")
    pieces: dict[str, list[int | None]] = {
        "python": [int(p) for p in args.piece_kib.split(",") if p] or [None],
        "native": [int(p) for p in args.native_piece_kib.split(",") if p] or [None],
    }
    use = fast_io.NATIVE
    intervals = [float(i) for i in args.switch_interval_ms.split(",") if i] or [None]
    python_default = sys.getswitchinterval()
    bench = Bench(args.dir, args.unit_mb, args.units, args.threads)
    scenarios = []
    try:
        l3 = bench.open(max(writes))
        bench.write(list(range(args.units)), list(range(args.units)))
        bench.settle_writes()
        files = bench.files()
        missing = [f for f in files if not f.exists()]
        if missing:
            raise SystemExit(f"{len(missing)} unit files missing after the writes")
        bench.fetch_all()  # into the page cache
        configured = sys.getswitchinterval()  # after the tier lowered it
        cases = [(r, p) for r in readers for p in pieces[r]]
        for interval, (reader, piece_kib), burst, w in itertools.product(
            intervals, cases, bursts, writes
        ):
            sys.setswitchinterval(configured if interval is None else interval / 1000)
            # Held: as while a request waits on storage (where the connector has
            # hold_writes); not held: as before it did.
            for held in (False, True) if w and hasattr(l3, "hold_writes") else (False,):
                row = bench.scenario(reader, piece_kib, burst, w, held, args.reps, files)
                row["switch_interval_ms"] = sys.getswitchinterval() * 1000
                scenarios.append(row)
                print(_line(row), flush=True)
    finally:
        bench.close()
        sys.setswitchinterval(python_default)
        fast_io.NATIVE = use
    report: dict[str, Any] = {
        **provenance(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "directory": str(args.dir),
        "unit_bytes": bench.layout.unit_bytes,
        "units": args.units,
        "threads": args.threads,
        "reps": args.reps,
        # the C extension could be imported (rows name the reader they ran; provenance's
        # fetch_reader, the one the product would use)
        "native_available": fast_io.AVAILABLE,
        "scenarios": scenarios,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
