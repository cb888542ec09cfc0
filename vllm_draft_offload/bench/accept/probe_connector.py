"""KV probe connector for the fixtures' KV-sensitivity check (imports no connector code).

Loaded by vLLM through ``kv_connector_module_path``::

    kv_transfer_config = {
        "kv_connector": "KVProbeConnector",
        "kv_connector_module_path": "vllm_draft_offload.bench.accept.probe_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"corrupt_draft": False, "report_path": "probe.json"},
    }

It never loads or stores anything.  For requests that opted in (sampling params
``extra_args={"kv_probe_corrupt_draft": True}``, or every request with
``corrupt_draft: true``) it overwrites, before the drafter's first forward, the KV
of the blocks the request got from the prefix cache in the layers it corrupts:

* ``corrupt_layers: "draft"`` (default): the *draft layers*.  Target layers are
  never touched, so greedy outputs must stay identical while the acceptance
  length drops if the drafter really reads that KV.
* ``corrupt_layers: "target_window"``: the *target's sliding-window layers* (those
  whose KV-cache group is a ``SlidingWindowSpec``), i.e. the in-window KV a restore
  of a hybrid model must bring back.  Outputs (or acceptance) must change: the run
  shows that a restore that left the window out would be caught.

Scheduler side: ``build_connector_meta`` lists, per KV-cache group, the first
``num_computed_tokens // block_size`` blocks of each opted-in new request (less
vLLM's null block, which a sliding-window group gets for the positions that left
the window).  Worker side: ``register_kv_caches`` finds the draft layers through
``static_forward_context[name].is_draft_layer`` (set by vLLM's proposer when it
loads the drafter); ``start_load_kv`` (which vLLM calls after the target forward
and before the drafter runs, on both model runners) zeroes (or noises) those
blocks in each corrupted layer.

vLLM 0.33 lays the KV-cache groups of a hybrid model over one allocation, each from
byte 0: layer *i* of one group has the same tensor (pointer, strides) as layer *i* of
every other group.  The groups own disjoint block ids (one block pool), so writing a
group's blocks through its layer's tensor touches none of the other groups' KV: such
cross-group aliases are corruptible.  Only a layer sharing its tensor with a layer
of the *same* group (a KV-sharing layer) cannot be corrupted alone, and is skipped.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import SlidingWindowSpec, group_kernel_blocks

from vllm_draft_offload.bench.speed.null_connector import NullConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CORRUPT_ARG = "kv_probe_corrupt_draft"  # SamplingParams.extra_args key
# which layers a probe corrupts (kv_connector_extra_config "corrupt_layers")
CORRUPT_DRAFT, CORRUPT_TARGET_WINDOW = "draft", "target_window"
NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block): never corrupted
CONNECTOR_NAME = "KVProbeConnector"
MODULE_NAME = "vllm_draft_offload.bench.accept.probe_connector"


@dataclass
class ProbeMetadata(KVConnectorMetadata):
    # kv-cache group index -> block ids whose draft-layer KV is to be corrupted
    corrupt_blocks: dict[int, list[int]] = field(default_factory=dict)
    # (request id, prefix-cache tokens) of the requests those blocks belong to
    requests: list[tuple[str, int]] = field(default_factory=list)


def wants_corruption(req: NewRequestData, corrupt_all: bool) -> bool:
    if corrupt_all:
        return True
    params = req.sampling_params
    return bool(params is not None and (params.extra_args or {}).get(CORRUPT_ARG))


def cached_blocks(req: NewRequestData, block_sizes: list[int]) -> dict[int, list[int]]:
    """Per group, the blocks fully covered by the request's prefix-cache hit, less the
    null block (a sliding-window group's positions that left the window)."""
    blocks = {
        g: [b for b in ids[: req.num_computed_tokens // block_sizes[g]] if b != NULL_BLOCK]
        for g, ids in enumerate(req.block_ids)
        if req.num_computed_tokens >= block_sizes[g]
    }
    return {g: ids for g, ids in blocks.items() if ids}


def shared_in_group(
    kv_caches: dict[str, torch.Tensor], layer_group: dict[str, int], name: str, others: set[str]
) -> str | None:
    """A layer of `others` whose KV tensor is `name`'s (same pointer and strides) in the
    same KV-cache group, or in none: writing `name`'s blocks would write its KV too.
    The same tensor in another group is vLLM's cross-group aliasing (disjoint blocks)."""
    tensor = kv_caches[name]
    group = layer_group.get(name)
    for other in sorted(others):
        t = kv_caches[other]
        if (t.data_ptr(), t.stride()) != (tensor.data_ptr(), tensor.stride()):
            continue
        if group is None or layer_group.get(other) in (None, group):
            return other
    return None


class KVProbeConnector(NullConnector, SupportsHMA):
    """Corrupts draft (or the target's sliding-window) KV before the forward; every other
    hook does nothing (NullConnector)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.corrupt_all = bool(extra.get("corrupt_draft", False))
        self.mode = str(extra.get("corrupt_mode", "zero"))
        if self.mode not in ("zero", "noise"):
            raise ValueError(f"corrupt_mode must be zero|noise, got {self.mode!r}")
        self.corrupt_layers = str(extra.get("corrupt_layers", CORRUPT_DRAFT))
        if self.corrupt_layers not in (CORRUPT_DRAFT, CORRUPT_TARGET_WINDOW):
            raise ValueError(
                f"corrupt_layers must be {CORRUPT_DRAFT}|{CORRUPT_TARGET_WINDOW}, "
                f"got {self.corrupt_layers!r}"
            )
        self.report_path: str | None = extra.get("report_path")
        self._vllm_config = vllm_config
        groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
        self.block_sizes = [g.kv_cache_spec.block_size for g in groups] or [
            vllm_config.cache_config.block_size
        ]
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config else 0
        self.layer_group = {n: i for i, g in enumerate(groups) for n in g.layer_names}
        self.window_groups = {
            i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        }
        # worker state
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.draft_layers: list[str] = []
        self.target_window_layers: list[str] = []
        self.corrupt_targets: list[str] = []  # the layers start_load_kv corrupts
        self.skipped_layers: dict[str, str] = {}
        self.corrupted: dict[str, int] = defaultdict(int)
        self.corrupted_requests: list[tuple[str, int]] = []

    # ------------------------------------------------------------- scheduler side
    # (no hit to match, nothing to allocate for: NullConnector's hooks)
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ProbeMetadata:
        meta = ProbeMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            if not wants_corruption(req, self.corrupt_all):
                continue
            blocks = cached_blocks(req, self.block_sizes)
            if not blocks:
                continue
            for g, ids in blocks.items():
                meta.corrupt_blocks.setdefault(g, []).extend(ids)
            meta.requests.append((req.req_id, req.num_computed_tokens))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        ctx = self._vllm_config.compilation_config.static_forward_context
        # in kv_caches' order
        draft = [n for n in kv_caches if getattr(ctx.get(n), "is_draft_layer", False)]
        target = [n for n in kv_caches if n not in draft]
        window = [n for n in target if self.layer_group.get(n) in self.window_groups]
        self.target_window_layers = window
        if self.corrupt_layers == CORRUPT_DRAFT:
            candidates, others = draft, set(target)
        else:
            candidates, others = window, set(draft)
        for name in candidates:
            tensor = kv_caches[name]
            shared = shared_in_group(kv_caches, self.layer_group, name, others)
            # a layer sharing the other side's KV tensor cannot be corrupted alone
            if shared is not None:
                self.skipped_layers[name] = f"shares storage with {shared} in its group"
            elif self.num_blocks and tensor.shape[0] % self.num_blocks:
                self.skipped_layers[name] = (
                    f"dim0 {tensor.shape[0]} not a multiple of {self.num_blocks}"
                )
            else:
                self.corrupt_targets.append(name)
        self.draft_layers = [n for n in draft if n not in self.skipped_layers]
        self._write_report()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProbeMetadata)
        if not meta.corrupt_blocks:
            return
        for name in self.corrupt_targets:
            ids = meta.corrupt_blocks.get(self.layer_group.get(name, 0))
            if ids:
                self._corrupt(name, ids)
        self.corrupted_requests.extend(meta.requests)
        self._write_report()

    def _corrupt(self, name: str, block_ids: list[int]) -> None:
        cache = self.kv_caches[name]
        view = group_kernel_blocks(cache, self.num_blocks) if self.num_blocks else cache
        idx = torch.tensor(sorted(set(block_ids)), device=cache.device, dtype=torch.long)
        if self.mode == "zero":
            view[idx] = 0
        else:  # noise with the scale of the real content, so the drafter can't ignore it
            sel = view[idx].float()
            view[idx] = (torch.randn_like(sel) * sel.std().clamp_min(1e-3)).to(cache.dtype)
        self.corrupted[name] += int(idx.numel())

    def report(self) -> dict[str, Any]:
        ctx = self._vllm_config.compilation_config.static_forward_context
        return {
            "mode": self.mode,
            "corrupt_layers": self.corrupt_layers,
            "num_blocks": self.num_blocks,
            "layers": {
                n: {
                    "draft": bool(getattr(ctx.get(n), "is_draft_layer", False)),
                    "shape": list(t.shape),
                    "group": self.layer_group.get(n, 0),
                }
                for n, t in self.kv_caches.items()
            },
            "draft_layers": self.draft_layers,
            "target_window_layers": self.target_window_layers,
            "corrupt_targets": self.corrupt_targets,
            "skipped_layers": self.skipped_layers,
            "corrupted_blocks": dict(self.corrupted),
            "corrupted_requests": self.corrupted_requests,
        }

    def _write_report(self) -> None:
        if not self.report_path:
            return
        tmp = f"{self.report_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.report(), f, indent=1)
        os.replace(tmp, self.report_path)


def probe_transfer_config(
    corrupt_all: bool = False,
    report_path: str | None = None,
    mode: str = "zero",
    layers: str = CORRUPT_DRAFT,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that loads this connector (by its module path)."""
    extra: dict[str, Any] = {"corrupt_draft": corrupt_all, "corrupt_mode": mode}
    if layers != CORRUPT_DRAFT:
        extra["corrupt_layers"] = layers
    if report_path:
        extra["report_path"] = report_path
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_NAME,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
