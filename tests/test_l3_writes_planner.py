"""Property tests of the L3 write planner alone (pure Python, real CpuTierIndex).

Random sequences of store plans, worker reports from two TP ranks (in any order,
some failing), cancels honoured or lost to a race, and full-tier relief. After every
step: pins match the writes that still hold them, the queue bound holds, no live
write sits behind a chunk known to be missing, and once every rank has answered,
nothing is pinned or pending and every unit is accounted for exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_draft_offload.cpu_index import CpuTierIndex
from vllm_draft_offload.l3_writes import L3WritePlanner, PlannedUnit
from vllm_draft_offload.metadata import DraftOffloadWorkerMetadata, L3WriteOrder
from vllm_draft_offload.metrics import DraftOffloadStats

RANKS = 2
MAX_PENDING = 5


def key(prompt: int, chunk: int) -> bytes:
    # Prompts 0 and 1 share their first two chunks (a common system prompt).
    owner = 0 if prompt < 2 and chunk < 2 else prompt
    return bytes([owner, chunk]) * 16


@dataclass
class Sim:
    index: CpuTierIndex = field(default_factory=lambda: CpuTierIndex(24))
    stats: DraftOffloadStats = field(default_factory=DraftOffloadStats)
    planner: L3WritePlanner = field(init=False)
    ids: int = 0
    # order id -> (order, ranks that still owe "released", ranks that owe an outcome)
    orders: dict[int, tuple[L3WriteOrder, set[int], set[int]]] = field(default_factory=dict)
    next_chunk: dict[int, int] = field(default_factory=dict)
    planned_units: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        def new_id() -> int:
            self.ids += 1
            return self.ids

        self.planner = L3WritePlanner(self.index, 1, MAX_PENDING, RANKS, self.stats, new_id)

    def plan(self, prompt: int, count: int) -> None:
        units = []
        start = self.next_chunk.get(prompt, 0)
        for chunk in range(start, start + count):
            unit_id = (key(prompt, chunk), ())
            if self.index.get(unit_id) is not None:
                continue  # in the CPU tier already (a shared prefix): no store
            entry = self.index.reserve(unit_id)
            if entry is None:
                self.planner.relieve()
                break
            self.index.commit(unit_id)
            units.append(
                PlannedUnit(unit_id, entry.slot, chunk, key(prompt, chunk - 1) if chunk else None)
            )
        self.next_chunk[prompt] = start + count
        self.skipped += sum(
            1
            for u in units
            if u.unit_id[0] in self.planner.written or self.planner._by_key.get(u.unit_id[0])
        )
        self.planned_units += len(units)
        for order in self.planner.plan(units):
            self.orders[order.write_id] = (order, set(range(RANKS)), set(range(RANKS)))

    def cancels(self, honoured: list[bool]) -> None:
        for i, write_id in enumerate(self.planner.take_cancels()):
            if write_id not in self.orders:
                continue
            _, owe_release, owe_outcome = self.orders[write_id]
            for rank in range(RANKS):
                # A rank that has not staged the unit skips it; one that has, writes it.
                if rank in owe_release and honoured[(i + rank) % len(honoured)]:
                    self.report(write_id, rank, ok=False)

    def report(self, write_id: int, rank: int, ok: bool) -> None:
        entry = self.orders.get(write_id)
        if entry is None:
            return
        _, owe_release, owe_outcome = entry
        if rank not in owe_outcome:
            return
        meta = DraftOffloadWorkerMetadata()
        if rank in owe_release:
            owe_release.discard(rank)
            meta.l3_writes_released[write_id] = 1
        owe_outcome.discard(rank)
        (meta.l3_writes_ok if ok else meta.l3_writes_failed)[write_id] = 1
        if not owe_outcome:
            del self.orders[write_id]
        self.planner.on_output(meta)

    def check(self) -> None:
        planner = self.planner
        assert len(planner._pending) <= MAX_PENDING
        assert not any(k in planner.absent for k in planner.written._keys)
        for unit_id, entry in self.index._entries.items():
            holders = sum(1 for w in planner._writes.values() if w.unit_id == unit_id and w.pinned)
            assert entry.pins == holders
        for write in planner._writes.values():
            if not write.cancelled and write.pred_key is not None:
                assert write.pred_key not in planner.absent


ops = st.lists(
    st.one_of(
        st.tuples(st.just("plan"), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("report"), st.integers(0, 40), st.integers(0, RANKS - 1), st.booleans()),
        st.tuples(st.just("cancels"), st.lists(st.booleans(), min_size=1, max_size=3)),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(ops)
def test_planner_invariants(steps: list[tuple]) -> None:
    sim = Sim()
    for step in steps:
        if step[0] == "plan":
            sim.plan(step[1], step[2])
        elif step[0] == "report":
            if sim.orders:  # the i-th open order, so reports land on live writes
                open_ids = sorted(sim.orders)
                sim.report(open_ids[step[1] % len(open_ids)], step[2], step[3])
        else:
            sim.cancels(step[1])
        sim.check()
    # Every rank answers everything still open (cancels first, as a worker would).
    sim.cancels([True])
    for write_id in list(sim.orders):
        for rank in range(RANKS):
            sim.report(write_id, rank, ok=True)
    sim.check()
    assert not sim.planner.has_work()
    assert all(entry.pins == 0 for entry in sim.index._entries.values())
    fallbacks = sim.stats.data.get("fallbacks", {})
    lost = fallbacks.get("l3_write_dropped", 0) + fallbacks.get("store_failed", 0)
    # Each unit handed to the planner ends written, skipped (already written or
    # queued) or counted as lost, once.
    assert len(sim.planner.written) + lost + sim.skipped == sim.planned_units


def test_unit_dropped_while_its_write_is_queued_gets_its_slot_back() -> None:
    """A unit dropped while its L3 write still pins it (a failed load of it, the recompute
    audit, a cache reset) keeps its slot only until that write lets go of it."""
    for drop in ("remove", "discard"):
        sim = Sim()
        sim.plan(prompt=5, count=2)
        (write_id, _), *_ = sorted(sim.orders.items())
        order = sim.orders[write_id][0]
        unit_id = (order.chunk_key, order.successors)
        getattr(sim.index, drop)(unit_id)
        assert sim.index.num_doomed == 1  # hidden at once, slot still held
        for rank in range(RANKS):
            sim.report(write_id, rank, ok=True)
        assert sim.index.num_doomed == 0, drop
        assert order.slot in sim.index._free_slots
