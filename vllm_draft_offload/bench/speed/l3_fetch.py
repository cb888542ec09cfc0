"""How fast units come back from the LMCache storage tier, next to the raw disk.

    vllm-draft-offload l3-speed --url fs:///tmp/l3-speed [--unit-mb 36] [--units 16] \\
        [--threads 1,2,4,8] [--modes cold,warm] [--drop-caches] [--out result.json]

Writes ``--units`` real target+draft units (the codec's format, ``--unit-mb`` each:
36 MiB is one 256-token chunk of a Llama-3-8B shape plus a 4-layer drafter), then
reads them back the way a restore does (``unit_fetch.fetch_unit_into``, the worker's
own path: read straight into a host slot, verifying each piece as it lands) from 1..N
threads, and reports GB/s per thread count. This is the CPU side of an L3 hit; GPU
time is not involved.

For fs://, each pass runs twice side by side: the worker's default path, one unit per
thread, read by that thread alone (``fetch_GBps``), and ``l3.spread_reads``' path,
where N threads take a unit each and spread its layers over another N
(``fetch_GBps_spread``), and ``l3.threads_per_unit``'s (``--threads-per-unit``, default 4),
where N / 4 threads take a unit each and split its layers over 4 threads inside one
native read call (``fetch_GBps_split``). Each also reports when the first unit landed
(``first_unit_s``, ``first_unit_s_spread``), which is what a request's wait allowance
has to cover before anything it waits for has arrived.

* ``warm``: the units' files are in the page cache (a first pass puts them there).
* ``cold`` (fs:// only): before every pass the units' files are evicted from the page
  cache (``posix_fadvise(DONTNEED)``, or ``drop_caches`` with ``--drop-caches`` as root).

For fs://, the same run measures the directory's raw bandwidth with ``disk_baseline``
(an O_DIRECT write with fsync; O_DIRECT, cold buffered and warm buffered reads, on the
same thread counts, each the best of ``--reps`` passes like the fetch figures) and
reports each fetch figure as a fraction of the raw read of the same kind: cold fetch /
raw cold buffered read, warm fetch / raw warm read (``dd``-style, into one reused
buffer that stays in the CPU cache), and ``warm_into_memory``: warm fetch / raw warm
read into buffers as large as the data, which is the least a fetch must do (its
bytes have to land in host memory).
"""

from __future__ import annotations

import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from vllm_draft_offload import fast_io
from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.speed.disk_baseline import evict, measure
from vllm_draft_offload.l3_store import L3Store
from vllm_draft_offload.run_pool import RunPool
from vllm_draft_offload.unit_codec import LayerSpec, UnitIdentity, encode_unit, make_header
from vllm_draft_offload.unit_fetch import PIECE_BYTES, fetch_unit_into
from vllm_draft_offload.unit_verify import ExpectedUnit

NUM_LAYERS = 36  # 32 target + 4 draft


def write_units(store: L3Store, units: int, unit_bytes: int) -> ExpectedUnit:
    per_layer = unit_bytes // NUM_LAYERS
    layers = tuple(LayerSpec(f"layer{i}", i >= 32, per_layer) for i in range(NUM_LAYERS))
    payload = np.random.default_rng(0).integers(0, 255, per_layer * NUM_LAYERS, dtype=np.uint8)
    key = "ab" * 16
    header = make_header(
        UnitIdentity(
            key=key,
            geometry_fingerprint="l3-fetch-speed",
            drafter_id="l3-fetch-speed",
            num_tokens=256,
            successor_tokens=(),
        ),
        layers,
        payload,
    )
    blob = encode_unit(header, payload)
    for i in range(units):
        store.put(f"{i:032x}", blob)
    return ExpectedUnit(
        key=key,
        geometry_fingerprint="l3-fetch-speed",
        drafter_id="l3-fetch-speed",
        layers=layers,
        num_tokens=256,
    )


def read_all(
    store: L3Store,
    units: int,
    expected: ExpectedUnit,
    threads: int,
    spread: bool = False,
    threads_per_unit: int = 1,
) -> tuple[float, float]:
    """Seconds to fetch, verify and copy every unit into its own host slot, and until
    the first one had landed. `spread`: each unit's layers over another `threads`
    threads, as the worker reads fs:// units with l3.spread_reads; `threads_per_unit`:
    `threads` // it units at a time, each split over that many threads in one read call
    (l3.threads_per_unit)."""
    slot_bytes = sum(layer.nbytes for layer in expected.layers)
    slots = np.ones((units, slot_bytes), dtype=np.uint8)  # touched, like the host pool
    landed = [float("inf")] * units

    spread_pool = RunPool(threads, "l3-speed-spread") if spread else None
    with ThreadPoolExecutor(max(1, threads // threads_per_unit)) as pool:

        def fetch(i: int) -> None:
            # The worker's own fetch path (WorkerL3._fetch): read, verify, into the slot.
            dest = memoryview(slots[i])
            name = f"{i:032x}"
            if (
                fetch_unit_into(
                    store,
                    name,
                    expected,
                    dest,
                    PIECE_BYTES,
                    spread_pool,
                    threads_per_unit=threads_per_unit,
                )
                is None
            ):
                raise RuntimeError(f"unit {i} missing")
            landed[i] = time.perf_counter()

        start = time.perf_counter()
        list(pool.map(fetch, range(units)))
        end = time.perf_counter()
    if spread_pool is not None:
        spread_pool.shutdown()
    return end - start, min(landed) - start


def _fmt(by_threads: dict[str, float]) -> str:
    return " ".join(f"{t}:{v:.2f}" for t, v in by_threads.items()) or "-"


def fs_directory(url: str) -> Path | None:
    parts = urlsplit(url)
    return Path(parts.path) if parts.scheme == "fs" else None


EXAMPLES = """examples:
  vllm-draft-offload l3-speed --url fs:///root/l3-fetch --threads 1,2,4,8 --units 32 \\
      --drop-caches --out $OUT/l3_fetch_speed.json
  vllm-draft-offload l3-speed --url redis://127.0.0.1:6379 --modes warm --out /tmp/redis.json
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = command_parser("l3-speed", __doc__, EXAMPLES)
    ap.add_argument("--url", required=True, help="LMCache remote_url, e.g. fs:///tmp/l3-speed")
    ap.add_argument("--unit-mb", type=float, default=36.0)
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="cold,warm", help="of cold (fs:// only), warm")
    ap.add_argument(
        "--drop-caches",
        action="store_true",
        help="cold passes drop the whole host's page cache (root) instead of the units' files",
    )
    ap.add_argument(
        "--threads-per-unit",
        type=int,
        default=4,
        help="fs://: also read with each unit split over this many threads (l3.threads_per_unit;"
        " 1: not)",
    )
    ap.add_argument("--no-raw", action="store_true", help="skip the raw disk baseline")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    unit_bytes = int(args.unit_mb * 2**20) // NUM_LAYERS * NUM_LAYERS
    threads = [int(t) for t in args.threads.split(",")]
    modes = args.modes.split(",")
    directory = fs_directory(args.url)
    if "cold" in modes and directory is None:
        raise SystemExit("--modes cold needs an fs:// url: nothing else has a page cache to empty")
    staging_mb = max(64, int(2 * args.unit_mb * max(threads)))
    store = L3Store.from_dict(
        {
            "chunk_size": 256,
            "remote_url": args.url,
            "remote_serde": "naive",
            "extra_config": {"save_chunk_meta": True, "draft_offload.l3_staging_mb": staging_mb},
        },
        timeout_s=600,
    )
    # path (its report keys' suffix) -> (spread?, threads a unit); then path -> mode ->
    # threads -> GB/s, and seconds until the first unit landed. Only fs:// units can be
    # spread or split: other backends' arrive whole.
    paths = {"": (False, 1)}
    if directory is not None:
        paths["_spread"] = (True, 1)
        if args.threads_per_unit > 1:
            paths["_split"] = (False, args.threads_per_unit)
    fetch: dict[str, dict[str, dict[str, float]]] = {p: {m: {} for m in modes} for p in paths}
    first: dict[str, dict[str, dict[str, float]]] = {p: {m: {} for m in modes} for p in paths}
    cold_method = None
    try:
        expected = write_units(store, args.units, unit_bytes)
        files = sorted(directory.glob("*.data")) if directory is not None else []
        for n in threads:
            for mode in modes:
                for path, (spread, per_unit) in paths.items():
                    best = (float("inf"), float("inf"))
                    for _ in range(args.reps):
                        if mode == "cold":
                            cold_method = evict(files, args.drop_caches)
                        else:
                            read_all(store, args.units, expected, n)  # into the page cache
                        best = min(best, read_all(store, args.units, expected, n, spread, per_unit))
                    fetch[path][mode][str(n)] = args.units * unit_bytes / best[0] / 1e9
                    first[path][mode][str(n)] = best[1]
                    print(
                        f"threads={n} {mode}{path}: {fetch[path][mode][str(n)]:.2f} GB/s, "
                        f"first unit in {best[1] * 1000:.1f} ms",
                        flush=True,
                    )
    finally:
        store.close()
    report: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "url": args.url,
        "unit_bytes": unit_bytes,
        "units": args.units,
        "fetch_reader": fast_io.reader(),  # native or Python read-and-hash loop
        "threads_per_unit": args.threads_per_unit if "_split" in paths else None,
        **{f"fetch_GBps{path}": fetch[path] for path in paths},
        **{f"first_unit_s{path}": first[path] for path in paths},
        "cold_method": cold_method,
    }
    if directory is not None and not args.no_raw:
        # Same directory, same amount of data, same thread counts.
        raw = measure(
            directory,
            args.units * unit_bytes,
            threads,
            args.drop_caches,
            reps=args.reps,
            into_memory="warm" in modes,
        )
        report["raw"] = raw
        kinds = {  # ratio name: (fetch mode, raw field)
            "cold": ("cold", "read_cold_GBps"),
            "warm": ("warm", "read_warm_GBps"),
            "warm_into_memory": ("warm", "read_warm_into_memory_GBps"),
        }
        report["fetch_vs_raw"] = {
            kind: {t: gbps / raw[field][t] for t, gbps in fetch[""][mode].items()}
            for kind, (mode, field) in kinds.items()
            if mode in modes
        }
        print(
            f"raw: write {raw['write_GBps']:.2f} GB/s (O_DIRECT={raw['write_direct']}), "
            f"read direct {_fmt(raw['read_direct_GBps'])}, cold {_fmt(raw['read_cold_GBps'])}, "
            f"warm {_fmt(raw['read_warm_GBps'])}, "
            f"warm into memory {_fmt(raw.get('read_warm_into_memory_GBps', {}))}",
            flush=True,
        )
        for kind, ratios in report["fetch_vs_raw"].items():
            print(f"fetch/raw {kind}: {_fmt(ratios)}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
