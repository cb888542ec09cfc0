"""Property tests of the L3 prefetch against the CPU-tier index, under random
sequences of stores, pins, unpins, removals, evictions (by reserving), request
arrivals, polls, aborts and fetches that finish or fail.

After every step: no slot is held twice, no pinned slot is free, the budget
holds, and while a request waits on storage its matched CPU prefix is still in
the tier. The storage is a real fs:// LMCache backend holding every chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId
from vllm_draft_offload.hit_logic import PrefixMatch, StoredUnitView, match_prefix
from vllm_draft_offload.l3_lookup import SchedulerL3
from vllm_draft_offload.l3_objects import object_key
from vllm_draft_offload.l3_prefetch import RANK_MISMATCH, L3Prefetch
from vllm_draft_offload.metrics import DraftOffloadStats
from vllm_draft_offload.unit_codec import LayerSpec, UnitIdentity, encode_unit, make_header

CHUNK = 4
CHUNKS = 6
SLOTS = 5
EXAMPLES = itertools.count()
OTHER_KEYS = [bytes([100 + c]) * 16 for c in range(6)]
TOKENS = list(range(10, 10 + CHUNKS * CHUNK + 1))
REQUESTS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def lookup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerL3]:
    url = f"fs://{tmp_path_factory.mktemp('props') / 'l3'}"
    config = L3Config(
        enabled=True,
        lmcache={"remote_url": url, "extra_config": {"draft_offload.l3_namespace": "props"}},
    )
    scheduler_l3 = SchedulerL3(config)
    assert scheduler_l3.store is not None
    yield scheduler_l3
    scheduler_l3.close()


def put_prompt(scheduler_l3: SchedulerL3) -> list[bytes]:
    """Every chunk of a prompt in storage, under keys no earlier example used (a
    refused unit's objects get deleted)."""
    example = next(EXAMPLES)
    keys = [example.to_bytes(8, "big") + bytes([c]) * 8 for c in range(CHUNKS)]
    payload = np.zeros(16, dtype=np.uint8)
    for key in keys:
        header = make_header(
            UnitIdentity(
                key=key.hex(),
                geometry_fingerprint="g",
                drafter_id="d",
                num_tokens=CHUNK,
                successor_tokens=(),
            ),
            (LayerSpec("l", False, 16),),
            payload,
        )
        assert scheduler_l3.store is not None
        scheduler_l3.store.put(object_key(key, 0), encode_unit(header, payload))
    return keys


class PrefetchMachine(RuleBasedStateMachine):
    lookup_l3: SchedulerL3

    def __init__(self) -> None:
        super().__init__()
        self.index = CpuTierIndex(SLOTS)
        ids = itertools.count(1)
        config = L3Config(enabled=True, hit_policy="always")
        self.lookup_l3.reset()
        self.keys = put_prompt(self.lookup_l3)
        self.prefetch = L3Prefetch(
            self.lookup_l3, self.index, CHUNK, config, DraftOffloadStats(), lambda: next(ids), 64
        )
        # Pins this machine holds itself, as loads and store snapshots would.
        self.load_pins: list[UnitId] = []
        # request -> CPU units of its match when it last had to wait
        self.waiting_on: dict[str, list[UnitId]] = {}
        self.jobs: list[int] = []

    # ---------------------------------------------------------------- helpers

    def _view(self, chunk_key: bytes, wanted: tuple[int, ...]):
        entry = self.index.get((chunk_key, ()))
        if entry is not None and entry.ready:
            return StoredUnitView(entry.unit_id, ()), None
        return None, None

    def _match(self) -> PrefixMatch:
        return match_prefix(self.keys, TOKENS, 0, CHUNK, 0, self._view, 1)

    def _drive(self, req_id: str) -> None:
        for _ in range(2):
            match = self._match()
            waits = self.prefetch.must_wait(req_id, match, self.keys, len(TOKENS), 0)
            state = self.prefetch.waits.states.get(req_id)
            if waits and state is not None and state.lookup is not None:
                state.lookup.result(10)  # deterministic: let the lookup answer, then ask again
        if waits:
            self.waiting_on[req_id] = [view.handle for _, view in match.chunks]
            self.jobs = list(self.prefetch.fetches.units)
        else:
            self.waiting_on.pop(req_id, None)
            self.prefetch.forget(req_id)  # admitted: the scheduler takes over

    # ------------------------------------------------------------------ rules

    @rule(chunk=st.integers(0, CHUNKS - 1))
    def store_prompt_chunk(self, chunk: int) -> None:
        unit: UnitId = (self.keys[chunk], ())
        if self.index.get(unit) is None and self.index.reserve(unit) is not None:
            self.index.commit(unit)

    @rule(i=st.integers(0, len(OTHER_KEYS) - 1))
    def store_other(self, i: int) -> None:
        unit: UnitId = (OTHER_KEYS[i], ())
        if self.index.get(unit) is None and self.index.reserve(unit) is not None:
            self.index.commit(unit)

    @rule(data=st.data())
    def pin_some(self, data: st.DataObject) -> None:
        units = [u for u in self.index._entries if self.index._entries[u].ready]
        if units:
            unit = data.draw(st.sampled_from(units))
            self.index.pin(unit)
            self.load_pins.append(unit)

    @rule(data=st.data())
    def unpin_some(self, data: st.DataObject) -> None:
        if self.load_pins:
            unit = self.load_pins.pop(data.draw(st.integers(0, len(self.load_pins) - 1)))
            self.index.unpin(unit)

    @rule(data=st.data())
    def remove_unpinned(self, data: st.DataObject) -> None:
        units = [u for u, e in self.index._entries.items() if e.ready and e.pins == 0]
        if units:
            self.index.remove(data.draw(st.sampled_from(units)))

    @rule(req=st.sampled_from(REQUESTS))
    def poll(self, req: str) -> None:
        self._drive(req)

    @rule(req=st.sampled_from(REQUESTS))
    def abort(self, req: str) -> None:
        self.waiting_on.pop(req, None)
        self.prefetch.forget(req)

    @rule(data=st.data(), outcome=st.sampled_from(["ok", "missing", RANK_MISMATCH]))
    def finish_fetch(self, data: st.DataObject, outcome: str) -> None:
        self.prefetch.take_fetch_jobs()
        pending = list(self.prefetch.fetches.units)
        if not pending:
            return
        job = data.draw(st.sampled_from(pending))
        if outcome == "ok":
            self.prefetch.fetch_finished(job, [], None)
        else:
            self.prefetch.fetch_finished(
                job, None, outcome if outcome != "missing" else "object_missing"
            )

    # ------------------------------------------------------------- invariants

    @invariant()
    def slots_consistent(self) -> None:
        entries = list(self.index._entries.values())
        slots = [e.slot for e in entries]
        assert len(slots) == len(set(slots)), "a slot is held by two entries"
        free = set(self.index._free_slots)
        assert not free & set(slots), "a held slot is also free"
        assert not any(e.slot in free for e in entries if e.pins), "a pinned slot is free"
        assert len(slots) + len(free) == SLOTS, "budget"

    @invariant()
    def any_waiting_is_some_request_waiting(self) -> None:
        # What the scheduler tells the workers with every step (they hold writes).
        assert self.prefetch.any_waiting() == any(self.prefetch.waiting(r) for r in REQUESTS)

    @invariant()
    def waiting_requests_keep_their_head(self) -> None:
        for req_id, units in self.waiting_on.items():
            if self.prefetch.waiting(req_id):
                for unit in units:
                    assert self.index.get(unit) is not None, f"{req_id} lost its matched {unit}"

    def teardown(self) -> None:
        for req in REQUESTS:
            self.prefetch.forget(req)
        for unit in self.load_pins:
            self.index.unpin(unit)
        # Every pin the prefetch took was given back.
        for pending_job in list(self.prefetch.fetches.units):
            self.prefetch.fetch_finished(pending_job, None, "object_missing")
        assert all(e.pins == 0 for e in self.index._entries.values())


def test_prefetch_state_machine(lookup: SchedulerL3) -> None:
    PrefetchMachine.lookup_l3 = lookup
    runner = PrefetchMachine.TestCase
    runner.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
    runner().runTest()
