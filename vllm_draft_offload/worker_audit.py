"""Audit mode on the worker: per-layer checksums of each CPU-tier slot, taken when the
slot was filled (a store completed, or an L3 fetch landed), checked before a load.

Its own module so that the worker's copy code does not carry the audit's bookkeeping;
a load whose slot differs from what was stored is recomputed, never restored.
"""

from __future__ import annotations

import logging

from vllm_draft_offload.geometry import UnitLayout
from vllm_draft_offload.metadata import TransferJob
from vllm_draft_offload.transfers import HostPool
from vllm_draft_offload.unit_codec import checksum

logger = logging.getLogger(__name__)


def job_slots(layout: UnitLayout, job: TransferJob) -> set[int]:
    """The CPU-tier slots (one per chunk) a job reads or writes: of every group, since
    a state group has a page only in the units that hold a state."""
    return {
        page // group.pages_per_unit
        for group, pages in zip(layout.groups, job.host_pages, strict=True)
        for page in pages
    }


class SlotChecksums:
    """Slot -> per-layer checksums of the unit as it was stored."""

    def __init__(self, layout: UnitLayout, pool: HostPool) -> None:
        self.layout = layout
        self.pool = pool
        self._by_slot: dict[int, list[str]] = {}

    def _layer_checksums(self, slot: int) -> list[str]:
        unit = self.pool.unit_view(slot).numpy()
        return [
            checksum(unit[layer.offset : layer.offset + layer.nbytes])
            for layer in self.layout.layers
        ]

    def record_job(self, job: TransferJob) -> None:
        """Take the checksums of every slot a completed store filled."""
        for slot in job_slots(self.layout, job):
            self._by_slot[slot] = self._layer_checksums(slot)

    def put(self, slot: int, layer_checksums: list[str]) -> None:
        """Checksums computed elsewhere (an L3 fetch verified the unit as it landed)."""
        self._by_slot[slot] = layer_checksums

    def passes(self, job: TransferJob) -> bool:
        """Compare every layer of every slot with the checksums taken at store time."""
        for slot in job_slots(self.layout, job):
            expected = self._by_slot.get(slot)
            actual = self._layer_checksums(slot)
            if expected is None:
                logger.warning("audit: slot %d has no store-time checksums", slot)
                return False
            bad = [
                layer.name
                for layer, want, got in zip(self.layout.layers, expected, actual, strict=True)
                if want != got
            ]
            if bad:
                logger.warning(
                    "audit: load job %d (request %s) slot %d differs from what was stored "
                    "in layer(s) %s; recomputing",
                    job.job_id,
                    job.req_id,
                    slot,
                    ", ".join(bad),
                )
                return False
        return True
