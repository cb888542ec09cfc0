"""decode-overhead's configurations: each engine's ``kv_transfer_config`` by name
(what each one measures: the list in decode_overhead.py's docstring)."""

from __future__ import annotations

from typing import Any

from vllm_draft_offload.bench.kv_configs import native_offloading_config

CONFIGS = (
    "none",
    "idle",
    "store",
    "null",
    "native",
    "store_dma",
    "store_kernel",
    "store_thread",
    "store_decode_dma",
    "store_decode_kernel",
    "store_staged",
    "store_staged1",
    "store_unstaged",
)
# `store` with its copies forced onto one path (copy_path memcpy or kernel), so one run
# shows side by side what each path's stores cost decode (session 15, H100, 8B shape:
# `store` under copy_path auto, which sends copies up to 256 KiB to the page kernel,
# decoded at 0.89 x none where native's DMA stores cost nothing measurable).
FORCED_COPY_PATH = {"store_dma": "memcpy", "store_kernel": "kernel"}
# `store` with more settings of its own: store_thread issues the store copies on a thread
# of their own (store_issuer.py): whether DMA stores then stop costing the batches'
# prefill (H200, 64 requests: 1.10 x in session 29, 1.13 x in session 28, with the copy
# call on the engine's thread).
# store_decode_dma sends a decode-only step's stores to DMA and keeps the others on
# copy_path's route: pooled 64-request runs (sessions 25-29) had the kernel cost decode
# (0.947) and DMA the prefill phase (1.13 x), each nothing in the other phase. It is the
# default where pages are at least 48 KiB; store_decode_kernel turns it off, so a run
# shows the two side by side at any shape. Both turn staging off, which would otherwise
# take every batch they route (on CUDA by default since session 32).
EXTRA_SETTINGS: dict[str, dict[str, Any]] = {
    "store_thread": {"store_thread": True},
    "store_decode_dma": {"decode_stores_dma": True, "store_staging_units": 0},
    "store_decode_kernel": {"decode_stores_dma": False, "store_staging_units": 0},
    # every store through a GPU buffer of 8 units (8B shape: 302 MB), whatever the
    # default would size: gathered there by the pair kernel, then one DMA a unit
    # (staged_stores.py)
    "store_staged": {"store_staging_units": 8},
    # a one-unit buffer: each unit gathered, then moved, nothing overlapped (a larger
    # buffer's halves overlap a wave's gather with the previous wave's DMAs)
    "store_staged1": {"store_staging_units": 1},
    # the default before session 32: no staging (decode steps' stores by DMA where pages
    # are at least 48 KiB, the rest on copy_path's route)
    "store_unstaged": {"store_staging_units": 0},
}
# Engines that store, whose paired off batches opt out of stores (decode_batches.arm_params):
# `store` and its variants.
STORING = ("store", *FORCED_COPY_PATH, *EXTRA_SETTINGS)


def connector_config(
    config: str,
    cpu_gib: float,
    chunk: int,
    max_request_tokens: int = 0,
    copy_path: str | None = None,
) -> dict[str, Any] | None:
    """The engine's ``kv_transfer_config``; ``idle`` stores no request of up to
    ``max_request_tokens`` tokens; ``copy_path`` None leaves the connector's default."""
    if config == "none":
        return None
    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    if config == "null":
        from vllm_draft_offload.bench.speed import null_connector

        return null_connector.transfer_config()
    if config == "native":
        return native_offloading_config(int(cpu_gib * 2**30))
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": int(cpu_gib * 2**30),
        "chunk_size": chunk,
        "store_decode": True,
    }
    if config == "idle":
        extra["min_store_tokens"] = max_request_tokens + 1
    extra.update(EXTRA_SETTINGS.get(config, {}))
    copy_path = FORCED_COPY_PATH.get(config, copy_path)
    if copy_path is not None:
        extra["copy_path"] = copy_path
    return {
        "kv_connector": "DraftOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
