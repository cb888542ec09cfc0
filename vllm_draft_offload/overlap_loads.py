"""Worker side of overlapped restores: copy each unit of a storage hit to the GPU as
soon as its fetch lands in its host slot (restore_overlap.py has the scheduler side).

An overlapped load arrives while some of its units are still being fetched on this
worker's read threads. Its request waits in vLLM's WAITING_FOR_REMOTE_KVS, so no
forward reads its blocks and no copy has to be waited for layer by layer: each step
(`start_load_kv`, `get_transfer_results`) the units whose fetch has landed since are
copied, on the load stream, after the device work the request's new blocks had when
the load arrived. The load is reported finished once every unit it still needs is
copied and those copies are complete.

A unit whose fetch failed, was skipped, or landed with other successor tokens than the
hit relies on, and every unit of an abandoned load that has not landed, is not
copied: its GPU blocks are reported as load errors (vLLM then recomputes from the
first of them; with several KV-cache groups, where block ids do not name a request,
the request's load fails whole: `failed_recving`). Units after the first such one are
not waited for, as vLLM recomputes them anyway. Copies already issued into those
blocks are still waited for before the load is reported, so the recompute never
races a copy. Each TP rank decides on its own units; vLLM takes the union of the
ranks' error blocks, so every rank recomputes from the earliest failure of any.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vllm_draft_offload.metadata import TransferJob
from vllm_draft_offload.transfers import PairBatch, UnitCopies

logger = logging.getLogger(__name__)

# Unit states: its fetch has not landed here yet; copied (its copy is issued); not
# copied and reported as load errors (failed, or past a failure).
WAITING, ISSUED, NOT_LOADED = "waiting", "issued", "not_loaded"


def remembered_fetches(num_slots: int) -> int:
    """Fetch outcomes a worker keeps for loads not yet arrived: at most one fetch per
    CPU-tier slot is in flight on any rank, so twice that, and some, is never short."""
    return 2 * num_slots + 64


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class OverlapLoad:
    job: TransferJob
    # Device work the copies must follow: the last writers of the request's new blocks.
    after: torch.Event | None
    states: list[str] = field(default_factory=list)
    events: list[_Event] = field(default_factory=list)
    keepalive: list[torch.Tensor] = field(default_factory=list)
    abandoned: bool = False

    def __post_init__(self) -> None:
        self.states = [WAITING] * len(self.job.overlap_units)


class OverlapLoads:
    def __init__(self, per_request_failures: bool, remembered_fetches: int) -> None:
        # Several KV-cache groups: block ids do not name a request (vLLM refuses
        # per-block errors then), so a failure fails the request's load whole.
        self.per_request_failures = per_request_failures
        self._loads: dict[int, OverlapLoad] = {}
        # Fetch job -> header successors (None: failed) of fetches landed here. A fetch
        # may land before the load that waits for it arrives (the scheduler plans the
        # load when it admits the request, and learns of a landing only once every
        # rank has reported it), so outcomes are kept for at least as many fetches as
        # can be in flight on any rank: one per CPU-tier slot.
        self._outcomes: OrderedDict[int, tuple[int, ...] | None] = OrderedDict()
        self._remembered = remembered_fetches

    def __bool__(self) -> bool:
        return bool(self._loads)

    def add(self, job: TransferJob, after: torch.Event | None) -> None:
        self._loads[job.job_id] = OverlapLoad(job, after)

    def landed(self, fetch_job: int, successors: tuple[int, ...] | None) -> None:
        """A fetch finished on this worker (successors None: failed or skipped)."""
        self._outcomes[fetch_job] = successors
        while len(self._outcomes) > self._remembered:
            self._outcomes.popitem(last=False)

    def abandon(self, load_jobs: list[int]) -> None:
        """The scheduler stopped waiting on these loads' fetches."""
        for job_id in load_jobs:
            if (load := self._loads.get(job_id)) is not None:
                load.abandoned = True

    def copies_due(
        self, copies: UnitCopies
    ) -> list[tuple[OverlapLoad, list[tuple[int, PairBatch]]]]:
        """Per load, the units to copy now (their fetch landed, or they need none) with
        their checked (host page, GPU block) pairs; settles failed ones. The caller
        issues them and calls `issued`."""
        due = []
        for load in self._loads.values():
            planned = []
            for index in range(len(load.states)):
                if not self._settle(load, index):
                    continue
                unit = load.job.overlap_units[index]
                try:
                    pairs = copies.pairs(unit.host_pages, unit.gpu_blocks)
                except ValueError as exc:
                    logger.warning(
                        "DraftOffloadConnector: load job %d unit %d refused: %s",
                        load.job.job_id,
                        index,
                        exc,
                    )
                    load.states[index] = NOT_LOADED  # reported like a failed fetch
                    continue
                planned.append((index, pairs))
            if planned:
                due.append((load, planned))
        return due

    def _settle(self, load: OverlapLoad, index: int) -> bool:
        """Decide a waiting unit: True when it is to be copied now."""
        if load.states[index] != WAITING:
            return False
        if NOT_LOADED in load.states[:index]:
            load.states[index] = NOT_LOADED  # vLLM recomputes from the earlier failure
            return False
        unit = load.job.overlap_units[index]
        if unit.fetch_job is None:
            return True
        if unit.fetch_job not in self._outcomes:
            if load.abandoned:
                load.states[index] = NOT_LOADED
            return False
        successors = self._outcomes[unit.fetch_job]
        wanted = unit.successors
        if successors is None or tuple(successors[: len(wanted)]) != wanted:
            # Failed, skipped, or another variant of the chunk: its draft KV was built
            # from other tokens than this request's.
            load.states[index] = NOT_LOADED
            return False
        return True

    def issued(
        self,
        load: OverlapLoad,
        units: list[int],
        event: _Event | None,
        keepalive: list[torch.Tensor],
    ) -> None:
        """Copies of `units` were issued; `event` (None: done already) follows them."""
        for index in units:
            load.states[index] = ISSUED
        if event is not None:
            load.events.append(event)
        load.keepalive += keepalive

    def poll(self) -> tuple[list[int], set[str], set[str], set[int]]:
        """(completed load jobs, finished_recving, failed_recving, error blocks) of the
        loads whose every needed unit is copied, copies complete."""
        jobs: list[int] = []
        finished: set[str] = set()
        failed: set[str] = set()
        error_blocks: set[int] = set()
        for job_id, load in list(self._loads.items()):
            for index in range(len(load.states)):
                self._settle(load, index)  # failures past which nothing is waited for
            if WAITING in load.states or not all(event.query() for event in load.events):
                continue
            del self._loads[job_id]
            jobs.append(job_id)
            finished.add(load.job.req_id)
            lost = _unloaded_blocks(load)
            if not lost:
                continue
            if self.per_request_failures:
                failed.add(load.job.req_id)
            else:
                error_blocks |= lost
        return jobs, finished, failed, error_blocks

    def synchronize(self) -> None:
        for load in self._loads.values():
            for event in load.events:
                event.synchronize()


def _unloaded_blocks(load: OverlapLoad) -> set[int]:
    """GPU blocks vLLM counts as loaded that hold no restored KV: the plan's (units
    evicted before it) and those of every unit not copied."""
    blocks = set(load.job.error_blocks)
    for unit, state in zip(load.job.overlap_units, load.states, strict=True):
        if state == NOT_LOADED:
            blocks.update(block for group in unit.gpu_blocks for block in group)
    return blocks
