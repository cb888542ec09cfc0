"""Which engine moves a batch of copy descriptors: DMA or a gather/scatter kernel.

Two ways move pages between GPU KV blocks and the page-locked host pool:

* ``memcpy``: one batched DMA call (vLLM's ``swap_blocks_batch``, i.e.
  cuMemcpyBatchAsync) on the copy engines. Each descriptor has a fixed cost, so
  it reaches the link's bandwidth only when descriptors are large: at the
  Llama-8B shape adjacent pages merge into runs of hundreds of KiB (0.98 x pinned
  memcpy), but small pages that do not merge ran at 0.06 x (8 KiB pages).
* ``kernel``: vLLM's Triton gather/scatter kernel
  (``vllm.v1.kv_offload.cpu.swap_blocks_triton``), 12 SMs copying 8-byte words
  straight between device memory and the host pool. The pool is registered with
  vLLM's ``host_register`` (``cudaHostRegister`` with default flags), which on a
  system with unified virtual addressing maps it for the device at the same
  address: the same precondition vLLM's own CPU offloading relies on when it
  runs this kernel. The kernel only dereferences pointers, so it serves stores
  (device to host) exactly as loads.

``auto`` follows vLLM's thresholds, tuned on an H100 for CPU->GPU batches: the
kernel beats DMA for descriptors under ``THRESHOLD_BYTES`` (28 KiB) once there are
at least ``MIN_N`` (16) of them to amortise its launch. vLLM keeps GPU->CPU on DMA
(its stores are off the critical path, and DMA leaves the SMs to compute); here
stores are held to the same bandwidth goal as loads, and a descriptor's fixed DMA
cost does not depend on direction, so stores use the same table. The decision is
per descriptor, after merging adjacent pages: small runs go to the kernel, large
ones to DMA, both on the same stream.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_draft_offload.config import CopyPath
from vllm_draft_offload.metric_defs import Direction
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    run_descriptors_on_host,
    run_descriptors_on_stream,
)

logger = logging.getLogger(__name__)

# The kernel moves 8-byte words: a descriptor whose size or either address is not
# a multiple of this always goes to DMA.
WORD_BYTES = 8
# Largest chunk one kernel iteration moves per program (vLLM's choice).
MAX_KERNEL_CHUNK_BYTES = 8192


@dataclass(frozen=True)
class AutoRule:
    """``auto``: descriptors smaller than ``max_bytes`` go to the kernel, when there
    are at least ``min_count`` of them in the batch."""

    max_bytes: int
    min_count: int


@functools.cache
def auto_rules() -> dict[Direction, AutoRule]:
    """The ``auto`` table, per direction, from vLLM's tuned constants."""
    from vllm.v1.kv_offload.cpu.swap_blocks_triton import MIN_N, THRESHOLD_BYTES

    rule = AutoRule(max_bytes=THRESHOLD_BYTES, min_count=MIN_N)
    return {"load": rule, "store": rule}


@dataclass(frozen=True)
class CopyPlan:
    """One batch split between the two engines; together they cover it exactly."""

    kernel: Descriptors
    memcpy: Descriptors


def plan_copies(desc: Descriptors, direction: Direction, path: CopyPath) -> CopyPlan:
    """Split a batch (merged into runs first) between the kernel and DMA.

    ``path`` is the effective path: ``kernel`` sends every word-aligned descriptor
    to the kernel, ``memcpy`` none, ``auto`` those ``auto_rules()`` picks.
    """
    desc = desc.coalesced()
    if path == "memcpy" or not len(desc.sizes):
        return CopyPlan(desc.select(np.zeros(len(desc.sizes), dtype=bool)), desc)
    pick = (
        (desc.sizes % WORD_BYTES == 0)
        & (desc.src % WORD_BYTES == 0)
        & (desc.dst % WORD_BYTES == 0)
        & (desc.sizes > 0)
    )
    if path == "auto":
        rule = auto_rules()[direction]
        pick &= desc.sizes < rule.max_bytes
        if int(pick.sum()) < rule.min_count:
            pick[:] = False
    elif path != "kernel":
        raise ValueError(f"unknown copy path {path!r}")
    return CopyPlan(desc.select(pick), desc.select(~pick))


def kernel_chunk_bytes(page_bytes: Iterable[int]) -> int:
    """Bytes one kernel program moves per iteration: the next power of two of the
    largest page, at most 8 KiB (vLLM's rule). Fixed per worker, so the kernel is
    compiled once, at start."""
    largest = max(page_bytes, default=WORD_BYTES)
    chunk = 1 << max(0, (int(largest) - 1).bit_length())
    return max(WORD_BYTES, min(chunk, MAX_KERNEL_CHUNK_BYTES))


def kernel_unavailable(pinned: bool) -> str | None:
    """Why the kernel cannot run here, or None."""
    if not pinned:
        return "the host pool is not page-locked, so the GPU cannot address it"
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cuda():
        # ROCm host mappings and XPU lack what the kernel needs (vLLM's own check).
        return f"the platform is {current_platform.device_name}, not CUDA"
    if not HAS_TRITON:
        return "Triton is not available"
    return None


def kernel_table(desc: Descriptors) -> torch.Tensor:
    """(src, dst, size) rows as one int64 tensor, page-locked on a GPU host so the
    kernel's descriptor uploads are asynchronous (a pageable upload may wait for
    the stream, which waits for the forward)."""
    table = torch.empty(
        (3, len(desc.sizes)), dtype=torch.int64, pin_memory=torch.cuda.is_available()
    )
    table.numpy()[:] = np.stack([desc.src, desc.dst, desc.sizes])
    return table


def launch_kernel(
    desc: Descriptors, stream: torch.cuda.Stream, chunk_bytes: int
) -> list[torch.Tensor]:
    """Enqueue vLLM's gather/scatter kernel on ``stream``; tensors to keep alive."""
    from vllm.v1.kv_offload.cpu.swap_blocks_triton import swap_blocks_batch

    table = kernel_table(desc)
    with torch.cuda.stream(stream):
        # Below vLLM's MIN_N descriptors this runs the DMA batch instead.
        swap_blocks_batch(table[0], table[1], table[2], bytes_per_chunk=chunk_bytes)
    return [table]


class CopyEngine:
    """A worker's copies, each batch run by the path ``plan_copies`` picks.

    On CPU tensors (CI) every batch runs as memmove, whatever the setting.
    """

    def __init__(
        self, setting: CopyPath, pool: HostPool, page_bytes: Iterable[int], on_device: bool
    ) -> None:
        self.setting = setting
        self.on_device = on_device
        self.chunk_bytes = kernel_chunk_bytes(page_bytes)
        # The path batches actually take: the setting, unless the kernel cannot run.
        self.path: CopyPath = setting if on_device else "memcpy"
        if on_device and setting != "memcpy":
            reason = kernel_unavailable(pool.pinned) or self._warm_up(pool)
            if reason is not None:
                log = logger.warning if setting == "kernel" else logger.info
                log("DraftOffloadConnector: copy_path=%s uses memcpy only: %s", setting, reason)
                self.path = "memcpy"

    def _warm_up(self, pool: HostPool) -> str | None:
        """Compile the kernel now, not on the first hit (a compile takes about a
        second). Triton specialises integer arguments on divisibility by 16, so
        both variants of the descriptor count are built, with at least vLLM's
        minimum count (below it vLLM's wrapper runs DMA). Reads the pool, writes a
        scratch tensor."""
        at_least = max(rule.min_count for rule in auto_rules().values())
        multiple = -(-at_least // 16) * 16
        try:
            scratch = torch.empty((multiple + 1) * WORD_BYTES, dtype=torch.uint8, device="cuda")
            stream = torch.cuda.Stream()
            for count in (multiple, multiple + 1):
                offsets = np.arange(count, dtype=np.int64) * WORD_BYTES
                desc = Descriptors(
                    pool.base + offsets,
                    scratch.data_ptr() + offsets,
                    np.full(count, WORD_BYTES, dtype=np.int64),
                )
                launch_kernel(desc, stream, self.chunk_bytes)
            stream.synchronize()
            # torch caches page-locked blocks by power-of-two size; allocating one
            # (cudaHostAlloc) can stall the device, so the descriptor tables' sizes
            # (up to 2**17 copies) are allocated now and cached for the copies.
            cached = [torch.empty(3 << k, dtype=torch.int64, pin_memory=True) for k in range(18)]
            del cached
        except Exception as exc:  # a broken Triton install must not stop serving
            return f"the kernel failed to build or run ({exc!r})"
        return None

    def run(
        self, desc: Descriptors, direction: Direction, stream: torch.cuda.Stream | None
    ) -> list[torch.Tensor]:
        """Copy a batch: enqueued on ``stream`` (GPU), or done now (``None``: CPU).
        Returns the tensors to keep alive until the stream passes this point."""
        if stream is None:
            run_descriptors_on_host(desc)
            return []
        plan = plan_copies(desc, direction, self.path)
        keepalive: list[torch.Tensor] = []
        if len(plan.kernel.sizes):
            keepalive += launch_kernel(plan.kernel, stream, self.chunk_bytes)
        if len(plan.memcpy.sizes):
            keepalive += run_descriptors_on_stream(plan.memcpy, stream)
        return keepalive
