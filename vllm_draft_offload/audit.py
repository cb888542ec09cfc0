"""Sampled recompute audit: compare stored units with a fresh recompute of their prefix.

The checksum audit (`audit: true`) proves a unit's bytes did not change between
store and load; it cannot tell that the bytes were right in the first place (a
wrong page paired with a block, draft KV of another successor, a drafter that
wrote late). This audit can. For a sampled fraction of requests the scheduler
reports no hit, so vLLM recomputes the prefix, and keeps the stored units the
lookup found pinned. When the store path reaches such a chunk (its KV and
successors are complete, exactly when it would be stored), it sends a compare
job instead: the worker copies the chunk's GPU blocks aside, after the drafter's
forward, and compares each layer with the host slot within a dtype tolerance. A
unit that differs is dropped from the CPU tier, so later requests recompute it.

Only chunks whose stored successors equal the request's tokens are compared: a
unit built with other successors legitimately differs at its last position.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, cast

import torch

from vllm_draft_offload.hit_logic import PrefixMatch, storable_chunk_limit
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata, TransferJob
from vllm_draft_offload.transfers import (
    Descriptors,
    HostPool,
    LayerRegion,
    layer_descriptors,
    run_descriptors_on_host,
    run_descriptors_on_stream,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
    from vllm_draft_offload.geometry import UnitLayout
    from vllm_draft_offload.metrics import DraftOffloadStats

logger = logging.getLogger(__name__)

MISMATCH_CAUSE: Final = "audit_recompute_mismatch"
ERROR_CAUSE: Final = "audit_recompute_error"

# Largest error (see `relative_error`) a recomputed layer may show, by KV dtype.
# A GPU recompute is not bit-exact: another batch shape changes the kernels'
# reduction order, so elements drift by a few units in the last place (ulp),
# more in deeper layers. A real fault (a wrong page, draft KV of other tokens, a
# torn copy) moves elements by about their own magnitude, an error near 1. The
# bounds sit well above a few ulps and well below 1. One ulp relative to an
# element is at most 2**-mantissa_bits: fp32 1.2e-7 (1e-3 is loose; TF32 matmuls
# keep only 10 input mantissa bits, so with TF32 on raise it towards fp16's),
# fp16 9.8e-4 (1e-2 ~ 10 ulps), bf16 7.8e-3 (5e-2 ~ 6 ulps), fp8 e4m3 0.125 and
# e5m2 0.25 (a drift of one quantization step must pass).
DEFAULT_TOLERANCE: Final[dict[torch.dtype, float]] = {
    torch.float64: 1e-3,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
    torch.float8_e4m3fn: 0.15,
    torch.float8_e4m3fnuz: 0.15,
    torch.float8_e5m2: 0.3,
    torch.float8_e5m2fnuz: 0.3,
}


# (host pages, GPU blocks, slot, chunk, block ids, first token, end token): the
# scheduler's pairing of a chunk's host pages with its GPU blocks.
def is_sampled(req_id: str, fraction: float) -> bool:
    """Whether a request is audited: a hash of its id, so reruns audit the same ones."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(req_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


def comparable_dtype(tensor_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype | None:
    """The element type of a layer's bytes, or None where elements have no tolerance.

    vLLM allocates fp8 caches as uint8 tensors; other byte formats (int8/int4 with
    per-token scales, NVFP4, turboquant) pack scales beside the values, so their
    bytes cannot be compared element by element and the layer is not audited.
    """
    if tensor_dtype in DEFAULT_TOLERANCE:
        return tensor_dtype
    if tensor_dtype == torch.uint8 and kv_cache_dtype in ("fp8", "fp8_e4m3"):
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()
    if tensor_dtype == torch.uint8 and kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    return None


def tolerance_for(dtype: torch.dtype, override: float | None) -> float:
    return override if override is not None else DEFAULT_TOLERANCE[dtype]


def relative_error(stored: torch.Tensor, fresh: torch.Tensor) -> float:
    """Largest error of `stored` against `fresh`, each element relative to its size.

    An element's error is |stored - fresh| over the larger of the two magnitudes,
    floored at the RMS of the fresh layer: a layer's maximum alone would hide a
    wrong ordinary value behind an outlier channel, while near-zero elements
    would otherwise turn rounding noise into large relative errors. Elements
    equal bit for bit (NaN in both included) agree; a non-finite difference is inf.
    """
    a = stored.to(torch.float64).flatten()
    b = fresh.to(torch.float64).flatten()
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return 0.0
    finite = b[b.isfinite()]
    rms = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
    a, b = a[~same], b[~same]
    diff = (a - b).abs()
    if not bool(diff.isfinite().all()):
        return float("inf")
    # Nonzero: two finite elements that differ are not both zero.
    scale = torch.maximum(a.abs(), b.abs()).clamp(min=rms)
    return float((diff / scale).max())


# ------------------------------------------------------------------ scheduler


@dataclass
class _CompareRecord:
    req_id: str
    unit_id: UnitId
    reports: int = 0
    failed: bool = False
    cause: str | None = None
    layers: dict[str, set[str]] = field(default_factory=dict)


class RecomputeAudit:
    """Scheduler side: picks audited requests, plans compare jobs, acts on results."""

    def __init__(
        self,
        fraction: float,
        index: CpuTierIndex,
        layout: UnitLayout,
        num_successors: int,
        world_size: int,
        stats: DraftOffloadStats,
        next_job_id: Callable[[], int],
    ) -> None:
        self.fraction = fraction
        self.index = index
        self.layout = layout
        self.num_successors = num_successors
        self.world_size = world_size
        self.stats = stats
        self._next_job_id = next_job_id
        # Request -> chunk index -> pinned unit still to compare.
        self._targets: dict[str, dict[int, UnitId]] = {}
        self._jobs: dict[int, _CompareRecord] = {}

    def divert(self, req_id: str, match: PrefixMatch) -> bool:
        """Whether to report no hit for this lookup, so that vLLM recomputes the prefix.

        vLLM may ask again for a request it could not schedule: the previous
        answer's pins are released first.
        """
        if self.fraction <= 0.0:
            return False
        self.release(req_id)
        if not is_sampled(req_id, self.fraction):
            return False
        chunk_size = self.layout.chunk_size
        # Chunks the match covers whole: one it ends inside may be a variant built
        # with other successors, whose last draft position legitimately differs.
        targets = {
            chunk: cast("UnitId", unit.handle)
            for chunk, unit in match.chunks
            if (chunk + 1) * chunk_size <= match.end_token
        }
        if not targets:
            return False
        for unit_id in targets.values():
            self.index.pin(unit_id)
        self._targets[req_id] = targets
        return True

    def pending(self, req_id: str) -> bool:
        """Whether the request has audited chunks still to compare."""
        return req_id in self._targets

    def plan(
        self,
        request: Request,
        computed_after_step: int,
        block_ids: tuple[list[int], ...],
    ) -> list[TransferJob]:
        """Compare jobs for audited chunks whose KV this step completes."""
        targets = self._targets.get(request.request_id)
        if not targets:
            return []
        chunk_size = self.layout.chunk_size
        # The store rule: KV computed by the end of this step, successors known.
        limit = storable_chunk_limit(
            len(request.all_token_ids),
            computed_after_step,
            request.num_prompt_tokens,
            chunk_size,
            self.num_successors,
            store_decode=True,
        )
        jobs = []
        for chunk in sorted(c for c in targets if c < limit):
            unit_id = targets.pop(chunk)
            entry = self.index.get(unit_id)
            if entry is None or not entry.ready:
                # Dropped meanwhile (a failed load elsewhere, a reset): nothing to audit,
                # but its slot stays in use until this pin goes.
                self.index.unpin(unit_id)
                continue
            host_pages: list[list[int]] = [[] for _ in self.layout.groups]
            gpu_blocks: list[list[int]] = [[] for _ in self.layout.groups]
            # Sliding-window pages vLLM has already freed are compared no more.
            self.layout.add_unit_pages(
                host_pages, gpu_blocks, entry.slot, chunk, block_ids, skip_freed=True
            )
            # One job per unit, so a result names the unit it condemns.
            job = TransferJob(
                self._next_job_id(), request.request_id, "compare", host_pages, gpu_blocks
            )
            self._jobs[job.job_id] = _CompareRecord(request.request_id, unit_id)
            jobs.append(job)
        if not targets:
            del self._targets[request.request_id]
        return jobs

    def release(self, req_id: str) -> None:
        """Unpin what a finished or preempted request had not compared yet."""
        for unit_id in self._targets.pop(req_id, {}).values():
            self.index.unpin(unit_id)

    def on_output(self, meta: DraftOffloadWorkerMetadata) -> None:
        if not self._jobs:
            return
        for counts, failed in ((meta.failed_jobs, True), (meta.completed_jobs, False)):
            for job_id, count in counts.items():
                record = self._jobs.get(job_id)
                if record is None:
                    continue
                record.reports += count
                record.failed |= failed
                record.cause = record.cause or meta.failure_causes.get(job_id)
                for part, names in meta.audit_mismatch_layers.get(job_id, {}).items():
                    record.layers.setdefault(part, set()).update(names)
                if record.reports >= self.world_size:
                    del self._jobs[job_id]
                    self._finish(record)

    def _finish(self, record: _CompareRecord) -> None:
        self.index.unpin(record.unit_id)
        key = record.unit_id[0].hex()
        if not record.failed:
            self.stats.record_audit_recompute("ok")
        elif record.cause == MISMATCH_CAUSE:
            self.stats.record_audit_recompute("mismatch")
            self.stats.record_fallback(MISMATCH_CAUSE)
            logger.warning(
                "audit: stored unit %s (request %s) differs from its recomputed prefix in "
                "draft layer(s) [%s] and target layer(s) [%s]; dropped, later requests "
                "recompute it",
                key,
                record.req_id,
                ", ".join(sorted(record.layers.get("draft", ()))),
                ", ".join(sorted(record.layers.get("target", ()))),
            )
            self.index.remove(record.unit_id)
        else:
            # The comparison did not run: no evidence against the unit, keep it.
            self.stats.record_audit_recompute("error")
            logger.warning(
                "audit: could not compare stored unit %s (request %s): %s",
                key,
                record.req_id,
                record.cause or "unknown",
            )


# --------------------------------------------------------------------- worker


class RecomputeComparer:
    """Worker side: copies a compare job's GPU blocks aside and compares them."""

    def __init__(
        self,
        layout: UnitLayout,
        regions: list[LayerRegion],
        pool: HostPool,
        kv_caches: dict[str, torch.Tensor],
        kv_cache_dtype: str,
        tolerance: float | None,
        pin: bool,
    ) -> None:
        self.layout = layout
        self.regions = regions
        self.pool = pool
        self.tolerance = tolerance
        self._pin = pin
        self.dtypes = {
            slot.name: comparable_dtype(kv_caches[slot.name].dtype, kv_cache_dtype)
            for slot in layout.layers
        }
        self._scratch: HostPool | None = None
        self._warned_skips = False

    def run(
        self,
        jobs: list[TransferJob],
        meta: DraftOffloadWorkerMetadata,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Compare every job now; results go into `meta` for the scheduler."""
        self._warn_skipped_layers()
        for job in jobs:
            try:
                mismatched = self._compare(job, stream)
            except (ValueError, RuntimeError) as exc:
                logger.warning(
                    "audit: compare job %d (request %s) failed: %s", job.job_id, job.req_id, exc
                )
                meta.failed_jobs[job.job_id] = 1
                meta.failure_causes[job.job_id] = ERROR_CAUSE
                continue
            if any(mismatched.values()):
                meta.failed_jobs[job.job_id] = 1
                meta.failure_causes[job.job_id] = MISMATCH_CAUSE
                meta.audit_mismatch_layers[job.job_id] = mismatched
            else:
                meta.completed_jobs[job.job_id] = 1

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def _warn_skipped_layers(self) -> None:
        skipped = sorted(name for name, dtype in self.dtypes.items() if dtype is None)
        if skipped and not self._warned_skips:
            self._warned_skips = True
            logger.warning(
                "audit: KV layers %s use a packed or scaled format without an element-wise "
                "tolerance; the recompute audit skips them",
                ", ".join(skipped),
            )

    def _compare(self, job: TransferJob, stream: torch.cuda.Stream | None) -> dict[str, list[str]]:
        """Layers of the job's slots that differ from the GPU blocks, by part."""
        if self._scratch is None:
            self._scratch = HostPool(1, self.layout.unit_bytes, pin=self._pin)
        groups = self.layout.groups
        slots = sorted(
            {
                page // group.pages_per_unit
                for group, pages in zip(groups, job.host_pages, strict=True)
                for page in pages
            }
        )
        mismatched: dict[str, list[str]] = {"draft": [], "target": []}
        for slot in slots:
            if not 0 <= slot < self.pool.num_slots:
                raise ValueError(f"host slot {slot} out of range")
            # This slot's pages, placed at the same pages of the scratch unit.
            pages: list[list[int]] = []
            blocks: list[list[int]] = []
            for group, host_pages, gpu_blocks in zip(
                groups, job.host_pages, job.gpu_blocks, strict=True
            ):
                pairs = [
                    (page % group.pages_per_unit, block)
                    for page, block in zip(host_pages, gpu_blocks, strict=True)
                    if page // group.pages_per_unit == slot
                ]
                pages.append([page for page, _ in pairs])
                blocks.append([block for _, block in pairs])
            self._copy_aside(pages, blocks, stream)
            for region in self.regions:
                bad = self._layer_error(region, slot, pages[region.group_index])
                if bad is not None:
                    layer = region.slot
                    mismatched["draft" if layer.is_draft else "target"].append(layer.name)
                    logger.warning(
                        "audit: compare job %d (request %s) slot %d: %s layer %s differs "
                        "from its recompute (error %.3g > %.3g)",
                        job.job_id,
                        job.req_id,
                        slot,
                        "draft" if layer.is_draft else "target",
                        layer.name,
                        *bad,
                    )
        return mismatched

    def _copy_aside(
        self, pages: list[list[int]], blocks: list[list[int]], stream: torch.cuda.Stream | None
    ) -> None:
        assert self._scratch is not None
        desc = Descriptors.concat(
            [
                layer_descriptors(
                    region,
                    self._scratch,
                    pages[region.group_index],
                    blocks[region.group_index],
                    to_host=True,
                )
                for region in self.regions
            ]
        )
        if stream is None:
            run_descriptors_on_host(desc)
            return
        if not desc.num_bytes:
            return
        # The drafter's writes to these blocks are on the compute stream.
        stream.wait_stream(torch.cuda.current_stream())
        keepalive = run_descriptors_on_stream(desc, stream)
        # A sampled audit may stall its step: the comparison needs the bytes now.
        stream.synchronize()
        del keepalive

    def _layer_error(
        self, region: LayerRegion, slot: int, pages: list[int]
    ) -> tuple[float, float] | None:
        """(error, tolerance) of one layer if it exceeds the tolerance, else None."""
        assert self._scratch is not None
        layer = region.slot
        dtype = self.dtypes[layer.name]
        if dtype is None or not pages:
            return None
        stored_unit = self.pool.unit_view(slot)
        fresh_unit = self._scratch.unit_view(0)
        spans = [
            (layer.offset + page * layer.page_bytes, layer.offset + (page + 1) * layer.page_bytes)
            for page in pages
        ]
        stored = torch.cat([stored_unit[lo:hi] for lo, hi in spans]).view(dtype)
        fresh = torch.cat([fresh_unit[lo:hi] for lo, hi in spans]).view(dtype)
        error = relative_error(stored, fresh)
        tolerance = tolerance_for(dtype, self.tolerance)
        return (error, tolerance) if error > tolerance else None
