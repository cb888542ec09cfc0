"""`kv_connector_extra_config` schema for DraftOffloadConnector.

Validated with pydantic at engine start, in every process that builds the
connector, so a typo or an impossible value stops the engine with a message
that names the field instead of silently running without offload.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# Keys LMCache reads itself; they are passed through to the L3 tier untouched.
LMCACHE_KEY_PREFIX = "lmcache."
# How pages move between GPU blocks and the CPU tier (copy_paths.py).
CopyPath = Literal["auto", "memcpy", "kernel"]


class ConfigError(ValueError):
    """A `kv_connector_extra_config` value is unknown, mistyped or impossible."""


class L3Config(BaseModel):
    """The LMCache storage tier behind the CPU tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    # LMCache's own settings (remote_url, local_disk, ...): an LMCACHE_CONFIG_FILE
    # path, or `lmcache.*` keys collected from the extra config.
    config_file: str | None = None
    lmcache: dict[str, Any] = Field(default_factory=dict)
    # Bytes of units queued for an L3 write whose bytes are not yet in LMCache's
    # staging buffer. They stay pinned in the CPU tier meanwhile, so this is a share
    # of the CPU budget, never extra memory; past it a prompt's deepest queued
    # chunks are dropped (counted). None: half of cpu_bytes_to_use.
    max_pending_write_bytes: int | None = Field(default=None, gt=0)
    # Threads per worker for storage reads (with spread_reads, as many again). None:
    # sized from the host (three quarters of the cores, 2 to 16).
    io_threads: int = Field(default_factory=lambda: default_io_threads(), ge=1, le=64)
    # Writes in flight per worker; None: half the host's cores (2 to 16), at most
    # io_threads. Either way at most what half of LMCache's staging pool holds.
    write_threads: int | None = Field(default=None, ge=1, le=64)
    timeout_s: float = Field(default=5.0, gt=0)
    # fs:// only: read the bytes of the units in flight on another io_threads threads,
    # earliest unit first, each unit's layers on several at once (unit_fetch.py), so a
    # fetch's units land one after another from its start. Off until a GPU host shows
    # it pays: on an H200 host (session 29) it landed the first unit in half the time
    # outside an engine, but fetched slower inside one and took no more restart hits.
    spread_reads: bool = False
    # fs:// only: each unit's layers read by this many threads at once, inside one
    # native call without the GIL (fast_io.pread_hash_layers_into); a fetch then reads
    # io_threads // threads_per_unit units at a time (units_in_flight), as many threads in
    # all, each unit landing in about 1 / threads_per_unit of one thread's time, so a
    # fetch's first units land early. A whole unit read by one thread takes about a
    # request's 5 % allowance at the 8B shape, which is why waits bet past it (session 29).
    # 1: one thread a unit. On an H200 (session 30) 4 landed first units about twice as
    # early in the engine, but its bets, sized from that smaller estimate, gave up two of
    # three warm hits behind storage writes: 1 until a second run decides.
    threads_per_unit: int = Field(default=1, ge=1, le=16)
    # cost: fetch the part of a storage hit that loads faster than it recomputes
    # (l3_cost.py); always: fetch every hit; never: no storage reads (writes go on).
    hit_policy: Literal["cost", "always", "never"] = "cost"
    # Under `cost`, a request waits on storage for its allowance: 5 % of the estimated
    # recompute of the chunks it looks up, plus the recompute the landed ones save
    # (the bound: a hit costs at most recompute + 5 %). True: also past it, while the
    # lookup answers within two round trips or the fetch keeps its measured pace and
    # beats recomputing the rest; a storage whose first units land late is then still
    # used, at the cost of that bound (session 9: partial hits at 1.16-1.29 x). False:
    # a request stops at the last scheduler step before its allowance ends.
    wait_past_allowance: bool = True
    # Admit a request whose storage fetch is under way (and on pace) before its units
    # have landed, as an asynchronous load that copies each unit to the GPU as soon as
    # it lands (restore_overlap.py): the fetch and the host-to-GPU restore overlap
    # instead of running one after the other. False: a storage hit is admitted once
    # its units sit in the CPU tier, then restored like any CPU hit. Off under `audit`.
    # Off by default until it is measured on a GPU (session 17's only GPU run used a
    # build before a fix of a restore that waited forever).
    overlap_restore: bool = False
    # At shutdown, how long a worker waits for queued writes to land; the rest are
    # counted as l3_write_lost_shutdown.
    flush_timeout_s: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    # Log every storage lookup's decision at INFO instead of DEBUG (l3_decisions.py).
    log_decisions: bool = False
    # Python's GIL switch interval in the worker process, in ms, while the tier is on
    # (lowered, never raised; None: left as it is). A read thread takes the GIL back
    # after every read and checksum call; with the engine's thread running Python it
    # waits up to the interval (Python's default: 5 ms) each time (l3-stages
    # --switch-interval-ms measures it).
    switch_interval_ms: float | None = Field(default=0.5, gt=0, le=100, allow_inf_nan=False)

    @field_validator("io_threads", mode="before")
    @classmethod
    def _auto_io_threads(cls, value: Any) -> Any:
        return default_io_threads() if value is None else value

    @model_validator(mode="after")
    def _one_way_to_split_reads(self) -> L3Config:
        if self.spread_reads and self.threads_per_unit > 1:
            raise ValueError(
                "l3.spread_reads and l3.threads_per_unit > 1 both split a unit's reads "
                "over threads: set one of them"
            )
        return self

    @property
    def units_in_flight(self) -> int:
        """Units a worker reads at once: `io_threads` threads, `threads_per_unit` a unit."""
        return max(1, self.io_threads // self.threads_per_unit)

    @property
    def writes_in_flight(self) -> int:
        """Write threads per worker: `write_threads`, or by default half the host's
        cores and no more than the read threads."""
        return self.write_threads or min(self.io_threads, default_write_threads())


def _share_of_cores(numerator: int, denominator: int) -> int:
    return min(16, max(2, (os.cpu_count() or 4) * numerator // denominator))


def default_io_threads() -> int:
    """Read threads: three quarters of the host's cores, 2 to 16. A fetch's read
    thread is busy on its CPU 90-95 % of the time (reading and hashing), and a request
    waits on it: on a 16-core H200 host (session 27) 12 read threads beside 8 write
    threads fetched at 25-30 GB/s against 19-23 on 8, and took every restart hit at
    0.33-0.36 x recompute quiet and 0.52-0.57 x behind writes (8: 0.38-0.41 x, and one
    hit behind writes given up). 12 threads for writes too had been slower behind
    writes on an H100 host (session 25), hence default_write_threads."""
    return _share_of_cores(3, 4)


def default_write_threads() -> int:
    """Write threads: half the host's cores, 2 to 16. Write-behind has no request
    waiting on it; more threads than that only take cores and the GIL from fetches
    and the engine (l3_write_behind holds new writes while a request waits)."""
    return _share_of_cores(1, 2)


class DraftOffloadConfig(BaseModel):
    """Settings read from `kv_transfer_config.kv_connector_extra_config`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Pinned host memory for the CPU tier, per worker. Alias matches vLLM's
    # native OffloadingConnector so configs can be swapped.
    cpu_bytes: int = Field(gt=0, alias="cpu_bytes_to_use")
    # Tokens per stored unit; a multiple of every KV-cache group's block size.
    chunk_size: int = Field(default=256, gt=0)
    # Tokens after a chunk whose identity its EAGLE draft KV depends on.
    # None: derived from the speculative config (1 for EAGLE/EAGLE3/MTP,
    # num_speculative_tokens for multi-module MTP, 0 otherwise).
    successor_tokens: int | None = Field(default=None, ge=0, le=64)
    # Tokens a restored request computes itself at least. None: 2 with a
    # drafter (vLLM 0.33's proposers waste the first draft of a request whose
    # first step computes a single token), else 1.
    min_compute_tokens: int | None = Field(default=None, ge=1, le=1024)
    # Also offload KV produced while decoding (multi-turn chat reuses it).
    store_decode: bool = True
    # Skip offloading prompts shorter than this many tokens.
    min_store_tokens: int = Field(default=0, ge=0)
    # Audit mode: verify per-layer checksums of every restored unit.
    audit: bool = False
    # Sampled audit: this fraction of requests (picked by a hash of the request id,
    # so a rerun audits the same ones) recompute a prefix they could have loaded,
    # and the recomputed KV is compared with the stored units (audit.py).
    audit_recompute_fraction: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    # Largest relative error a recomputed layer may show; None: chosen by the
    # layer's KV dtype (audit.DEFAULT_TOLERANCE).
    audit_tolerance: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    # memcpy: batched DMA; kernel: vLLM's Triton gather/scatter kernel; auto: per
    # batch, by the size and number of its runs of pages (copy_paths.py).
    copy_path: CopyPath = "auto"
    # Issue each step's store copies on a thread of their own instead of in
    # wait_for_save on the engine's thread (store_issuer.py): a DMA batch queued behind
    # the step's forward can block its call until the GPU has worked through it (H200,
    # session 29: 1.6 s once a 64-request batch, its prefill 1.10 x as long). Off: on an
    # H200 (session 30) it ended that block, but DMA-stored batches still took 1.11 x as
    # long before decoding, and with stores on the kernel it changed nothing measured.
    store_thread: bool = False
    # Stores issued in a step that computes no prompt token (decode only) go by DMA
    # (copy engines), the rest as copy_path says. H200/H100 at 64 requests, 8B shape:
    # on the pair kernel stores cost decode about 5 % (0.947, 53 pairs) and the prefill
    # phase nothing (1.005); on DMA decode nothing (1.033, 36 pairs) but the prefill
    # phase 1.10-1.13 x. By phase (H200, session 31, 12 pairs beside 12 on the kernel):
    # decode 1.006 against 0.966, the prefill phase 1.035 against 1.031 (one run). None
    # (default): on under copy_path auto when every layer's page is at least
    # copy_rules.DECODE_STORE_DMA_MIN_PAGE_BYTES (48 KiB; measured at 64 KiB), else off;
    # a forced copy_path is kept.
    decode_stores_dma: bool | None = None
    # Stores through a GPU buffer of this many units (0: off): the pair kernel gathers
    # each unit's pages into it at device speed, then one DMA a unit moves it to the
    # host, so no copy holds SMs through the PCIe transfer and the driver gets a copy a
    # unit, not a page (staged_stores.py). For every store batch it can take (the kernel
    # can move every layer, units stored whole), whatever copy_path and
    # decode_stores_dma say. GPU memory beyond vLLM's KV cache: units x a unit's bytes.
    # None (default): on CUDA under copy_path auto where the kernel moves every layer,
    # up to 8 units and 512 MiB, at most a quarter of the GPU memory free when the KV
    # cache is registered (staged_stores.staging_units). H200, 8B shape, 64 requests
    # (session 32): decode 1.026 x, the prefill phase 1.002 x, the longest decode step
    # 75-79 ms against 73-75 without storing (other paths: up to 216 ms).
    store_staging_units: int | None = Field(default=None, ge=0, le=1024)
    l3: L3Config = Field(default_factory=L3Config)
    # Mixed into every key: bumping it makes everything stored under another
    # generation unreachable (storage is shared and survives resets and restarts).
    cache_generation: int = Field(default=0, ge=0)

    def check_budget(self, unit_bytes: int) -> None:
        """The budget must hold one unit, which only the engine's KV geometry tells."""
        if self.cpu_bytes < unit_bytes:
            raise ConfigError(
                f"kv_connector_extra_config.cpu_bytes_to_use={self.cpu_bytes} is smaller "
                f"than one chunk of target+draft KV ({unit_bytes} bytes for chunk_size="
                f"{self.chunk_size}); raise it or lower chunk_size"
            )
        pending = self.l3.max_pending_write_bytes
        if self.l3.enabled and pending is not None and pending < unit_bytes:
            raise ConfigError(
                "kv_connector_extra_config.l3.max_pending_write_bytes="
                f"{pending} is smaller than one chunk of target+draft "
                f"KV ({unit_bytes} bytes): no unit could ever be written to L3"
            )

    @property
    def pending_write_bytes(self) -> int:
        """Resolved `l3.max_pending_write_bytes` (None: half the CPU tier)."""
        pending = self.l3.max_pending_write_bytes
        return pending if pending is not None else self.cpu_bytes // 2


def parse_config(extra_config: dict[str, Any] | None) -> DraftOffloadConfig:
    """Build the config from vLLM's extra-config dict, naming bad fields."""
    raw = dict(extra_config or {})
    lmcache_keys = {
        key[len(LMCACHE_KEY_PREFIX) :]: raw.pop(key)
        for key in list(raw)
        if key.startswith(LMCACHE_KEY_PREFIX)
    }
    if lmcache_keys:
        l3 = dict(raw.get("l3") or {})
        l3.setdefault("enabled", True)
        l3["lmcache"] = {**l3.get("lmcache", {}), **lmcache_keys}
        raw["l3"] = l3
    try:
        return DraftOffloadConfig.model_validate(raw)
    except ValidationError as exc:
        problems = field_problems(exc, "kv_connector_extra_config", root="<root>")
        raise ConfigError("invalid DraftOffloadConnector config: " + "; ".join(problems)) from None


def field_problems(exc: ValidationError, prefix: str, root: str = "") -> list[str]:
    """One ``prefix.field.path: message`` per error of ``exc``, so a message names the
    field as the user wrote it; ``root`` stands for the path of an error about the
    whole input (empty: ``prefix: message``)."""
    problems = []
    for err in exc.errors():
        path = ".".join(str(part) for part in err["loc"]) or root
        problems.append(f"{prefix}.{path}: {err['msg']}" if path else f"{prefix}: {err['msg']}")
    return problems
