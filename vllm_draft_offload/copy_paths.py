"""Which engine moves a batch of copy descriptors: DMA or the gather/scatter kernel.

Two ways move pages between GPU KV blocks and the page-locked host pool:

* ``memcpy``: one batched DMA call (vLLM's ``swap_blocks_batch``, i.e.
  cuMemcpyBatchAsync) on the copy engines. Each descriptor has a fixed cost, so
  it reaches the link's bandwidth only when descriptors are large: at the
  Llama-8B shape adjacent pages merge into runs of hundreds of KiB (0.98 x pinned
  memcpy), but small pages that do not merge ran at 0.06 x (8 KiB pages).
* ``kernel``: this package's Triton gather/scatter kernel (``page_kernel.py``):
  many pages of every layer per launch, 16-byte accesses straight between device
  memory and the host pool. The pool is registered with vLLM's ``host_register``
  (``cudaHostRegister`` with default flags), which on a system with unified virtual
  addressing maps it for the device at the same address: the precondition vLLM's
  own CPU offloading relies on when it runs its kernel. The kernel only
  dereferences pointers, so it serves stores (device to host) exactly as loads.

``auto`` follows a measured table (``copy_rules.py``: per GPU and direction, the
largest copy the kernel moves faster than DMA, from ``vllm-draft-offload
copy-speed``): copies up to that size go to the kernel once a group of copies planned
together (``pipeline_groups``) has enough of them to pay for a launch, the rest to DMA,
both on the same stream. The decision is per descriptor, after merging adjacent pages.

Loads of one step go as few launches for every layer (``run_layers``): layers are
planned and enqueued in groups of copies (``FIRST_PIECE_DESCRIPTORS``, then twice as
many each time up to ``PIECE_DESCRIPTORS``), so the GPU copies one group while the host
plans the next; in each group the kernel's share of its
layers first, then each layer's DMA share, and after a layer's last group its event,
so a layer whose pages all move by DMA is still waited for alone.

The connector's CPU-tier loads and stores reach this engine through
``copy_routes.PairCopier``, which moves whole layers by the pair kernel where it can
(no per-descriptor planning) and hands the other layers here as descriptors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_draft_offload import copy_rules
from vllm_draft_offload.config import CopyPath
from vllm_draft_offload.copy_rules import DMA_ONLY, AutoRule, auto_rules, rule_source
from vllm_draft_offload.metric_defs import Direction
from vllm_draft_offload.page_kernel import (
    BLOCK_BYTES,
    DEFAULT_PROGRAMS,
    NUM_WARPS,
    PageKernel,
    kernel_can_move,
    tile_bytes,
    triton_missing,
)
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    run_descriptors_on_host,
    run_descriptors_on_stream,
)

logger = logging.getLogger(__name__)

# torch caches page-locked blocks by power-of-two size; allocating one
# (cudaHostAlloc) can stall the device, so the tile tables' sizes up to this many
# bytes (2**18 tiles) are allocated at start and cached for the copies.
TABLE_CACHE_BYTES = 1 << 22
# Descriptors planned and enqueued at a time (pipeline_groups): the first group's, then
# doubling up to the most.
FIRST_PIECE_DESCRIPTORS = 512
PIECE_DESCRIPTORS = 8192


@dataclass(frozen=True)
class CopyPlan:
    """One batch split between the two engines; together they cover it exactly."""

    kernel: Descriptors
    memcpy: Descriptors


def plan_layers(
    descs: Sequence[Descriptors],
    direction: Direction,
    path: CopyPath,
    tile: int | None,
    rules: Mapping[Direction, AutoRule],
) -> list[CopyPlan]:
    """Split each layer's batch (merged into runs first) between the kernel and DMA.

    ``path`` is the effective path: ``kernel`` sends every descriptor the kernel can
    move (whole ``tile``s, 16-byte aligned ends) to it, ``memcpy`` none, ``auto``
    those of at most the rule's size, when the layers together have at least the
    rule's count of them (they share one launch).
    """
    merged = [desc.coalesced() for desc in descs]
    if path not in ("auto", "kernel", "memcpy"):
        raise ValueError(f"unknown copy path {path!r}")
    picks = [np.zeros(len(desc.sizes), dtype=bool) for desc in merged]
    if path != "memcpy" and tile is not None:
        picks = [kernel_can_move(desc, tile) for desc in merged]
        if path == "auto":
            rule = rules[direction]
            picks = [
                pick & (desc.sizes <= rule.max_bytes)
                for pick, desc in zip(picks, merged, strict=True)
            ]
            if sum(int(pick.sum()) for pick in picks) < rule.min_count:
                picks = [np.zeros_like(pick) for pick in picks]
    return [CopyPlan(d.select(p), d.select(~p)) for d, p in zip(merged, picks, strict=True)]


def plan_copies(
    desc: Descriptors,
    direction: Direction,
    path: CopyPath,
    tile: int | None,
    rules: Mapping[Direction, AutoRule],
) -> CopyPlan:
    """``plan_layers`` of a single batch."""
    return plan_layers([desc], direction, path, tile, rules)[0]


def kernel_unavailable(pinned: bool) -> str | None:
    """Why the kernel cannot run on this GPU host, or None."""
    if not pinned:
        return "the host pool is not page-locked, so the GPU cannot address it"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        # ROCm host mappings and XPU lack what the kernel needs (vLLM's own check).
        return f"the platform is {current_platform.device_name}, not CUDA"
    if triton_missing():
        return "Triton is not available"
    return None


def _read_rules(gpu: str | None) -> tuple[dict[Direction, AutoRule], str]:
    """``auto``'s table for this GPU and where it comes from. A table that cannot be
    read must not stop the engine: then ``auto`` sends everything to DMA (logged)."""
    try:
        return auto_rules(gpu), rule_source(gpu)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning(
            "DraftOffloadConnector: copy_path=auto's table %s cannot be read (%r): auto uses "
            "memcpy only",
            copy_rules.RULES_FILE,
            exc,
        )
        return dict(DMA_ONLY), "unreadable table: DMA only"


class CopyEngine:
    """A worker's copies, each batch split by ``plan_layers``.

    On CPU tensors (CI) every batch runs now: the DMA share as memmove, the
    kernel's share through the kernel's CPU interface (its host fallback, or Triton's
    interpreter under TRITON_INTERPRET=1), so the split and the tile tables the GPU
    would run are exercised too.
    """

    def __init__(
        self,
        setting: CopyPath,
        pool: HostPool,
        page_bytes: Iterable[int],
        on_device: bool,
        programs: int = DEFAULT_PROGRAMS,
        rules: Mapping[Direction, AutoRule] | None = None,
        kernel_block_bytes: int = BLOCK_BYTES,
        kernel_warps: int = NUM_WARPS,
    ) -> None:
        self.setting = setting
        self.on_device = on_device
        self.piece_descriptors = PIECE_DESCRIPTORS
        self.first_piece_descriptors = FIRST_PIECE_DESCRIPTORS
        self.tile = tile_bytes(page_bytes)
        gpu = torch.cuda.get_device_name() if on_device and torch.cuda.is_available() else None
        self.rules, source = (dict(rules), "given") if rules is not None else _read_rules(gpu)
        self.kernel = (
            PageKernel(self.tile, programs, kernel_block_bytes, kernel_warps)
            if self.tile is not None
            else None
        )
        # The path batches actually take: the setting, unless the kernel cannot run.
        self.path: CopyPath = setting
        if setting != "memcpy":
            reason = self._kernel_unavailable(pool)
            if reason is not None:
                log = logger.warning if setting == "kernel" else logger.info
                log("DraftOffloadConnector: copy_path=%s uses memcpy only: %s", setting, reason)
                self.path, self.kernel = "memcpy", None
            elif setting == "auto" and on_device:
                logger.info(
                    "DraftOffloadConnector: copy_path=auto, kernel up to %d B loads and %d B "
                    "stores, tile %d B, %d programs (table: %s)",
                    self.rules["load"].max_bytes,
                    self.rules["store"].max_bytes,
                    self.tile,
                    programs,
                    source,
                )

    def _kernel_unavailable(self, pool: HostPool) -> str | None:
        if self.tile is None:
            return "the page sizes share no power of two of 16 bytes or more"
        if not self.on_device:
            return None  # the kernel's CPU interface always runs
        return kernel_unavailable(pool.pinned) or self._warm_up(pool)

    def _warm_up(self, pool: HostPool) -> str | None:
        """Compile the kernel now, not on the first hit (a compile takes about a
        second): one tile from the pool into a scratch tensor. Also caches the
        page-locked blocks of the tile tables' sizes."""
        assert self.kernel is not None and self.tile is not None
        try:
            scratch = torch.empty(self.tile, dtype=torch.uint8, device="cuda")
            stream = torch.cuda.Stream()
            one = np.array([self.tile], dtype=np.int64)
            desc = Descriptors(np.array([pool.base]), np.array([scratch.data_ptr()]), one)
            keepalive = self.kernel.copy(desc, stream)
            stream.synchronize()
            del keepalive
            cached = [
                torch.empty(1 << k, dtype=torch.uint8, pin_memory=True)
                for k in range(4, TABLE_CACHE_BYTES.bit_length())
            ]
            del cached
        except Exception as exc:  # a broken Triton install must not stop serving
            return f"the kernel failed to build or run ({exc!r})"
        return None

    def path_for(self, batch_path: CopyPath | None) -> CopyPath:
        """The path a batch takes: its own (``decode_stores_dma``'s memcpy) or, without
        one, the engine's; the engine's memcpy whenever the kernel cannot run here."""
        return self.path if batch_path is None or self.kernel is None else batch_path

    def run(
        self,
        desc: Descriptors,
        direction: Direction,
        stream: torch.cuda.Stream | None,
        path: CopyPath | None = None,
    ) -> list[torch.Tensor]:
        """Copy a batch: enqueued on ``stream`` (GPU), or done now (``None``: CPU), by
        ``path`` if given, else the engine's. Returns the tensors to keep alive until the
        stream passes this point."""
        return self._run([desc], direction, stream, mark=False, path=path)[0]

    def run_layers(
        self, descs: Sequence[Descriptors], direction: Direction, stream: torch.cuda.Stream | None
    ) -> tuple[list[torch.Tensor], list[torch.cuda.Event | None]]:
        """Copy one batch per layer, in the groups of ``pipeline_groups``: per group the
        kernel's share of its layers in one launch, then each layer's DMA share. Returns
        the tensors to keep alive and, per layer, an event recorded once its bytes are
        in place (None on CPU: already done)."""
        return self._run(list(descs), direction, stream, mark=True)

    def _run(
        self,
        descs: list[Descriptors],
        direction: Direction,
        stream: torch.cuda.Stream | None,
        mark: bool,
        path: CopyPath | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.cuda.Event | None]]:
        """Plan and enqueue ``descs`` group by group (``pipeline_groups``), so the GPU
        copies one group while the host plans the next; per layer, an event after its
        last group (when ``mark``)."""
        keepalive: list[torch.Tensor] = []
        events: list[torch.cuda.Event | None] = [None] * len(descs)
        path = self.path_for(path)
        for group in pipeline_groups(descs, self.piece_descriptors, self.first_piece_descriptors):
            plans = plan_layers(
                [piece for _, piece, _ in group], direction, path, self.tile, self.rules
            )
            kernel_share = Descriptors.concat([plan.kernel for plan in plans])
            if len(kernel_share.sizes):
                assert self.kernel is not None
                keepalive += self.kernel.copy(kernel_share, stream)
            for (layer, _, last), plan in zip(group, plans, strict=True):
                if len(plan.memcpy.sizes):
                    if stream is None:
                        run_descriptors_on_host(plan.memcpy)
                    else:
                        keepalive += run_descriptors_on_stream(plan.memcpy, stream)
                if last and mark and stream is not None:
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(stream)
                    events[layer] = event
        return keepalive, events


def pipeline_groups(
    descs: Sequence[Descriptors], piece: int, first: int = FIRST_PIECE_DESCRIPTORS
) -> list[list[tuple[int, Descriptors, bool]]]:
    """The layers' batches as groups of (layer, descriptors, the layer's last piece?),
    in order. The first group holds ``first`` descriptors, each next one twice as many
    up to ``piece``; layers are cut where a group fills. Planning a batch costs the host
    about 60 ns a descriptor (an H100 host, session 16: 4 ms for 65,536 pages of 4 KiB,
    while the kernel moved them in 5.4 ms). Planned and enqueued a group at a time, the
    GPU copies a group while the host plans the next, so only the first group's
    planning is not hidden: it is kept small, and the rest grow because planning runs
    about ten times faster than the copies it plans."""
    groups: list[list[tuple[int, Descriptors, bool]]] = [[]]
    held, target = 0, max(1, min(first, piece))
    for layer, desc in enumerate(descs):
        count, start = len(desc.sizes), 0
        while True:
            take = min(count - start, target - held)
            part = desc if take == count else desc.slice(start, start + take)
            start += take
            held += take
            groups[-1].append((layer, part, start >= count))
            if held >= target:
                groups.append([])
                held, target = 0, min(2 * target, piece)
            if start >= count:
                break
    return [group for group in groups if group]
