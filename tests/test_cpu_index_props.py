"""Property tests of CpuTierIndex: random sequences of what the scheduler does to it
(reserve, commit, failed store, pin, unpin, remove, touch, rekey, reset, eviction
through reserve on a full tier), checked against a model after every step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vllm_draft_offload.cpu_index import CpuTierIndex, UnitId

UNITS: list[UnitId] = [(key, succ) for key in (b"a", b"b", b"c") for succ in ((), (1,), (2,))]
unit_ids = st.sampled_from(UNITS)


class IndexMachine(RuleBasedStateMachine):
    """The model: which unit holds which slot, who still uses it, what is visible."""

    @initialize(num_slots=st.integers(min_value=1, max_value=4))
    def start(self, num_slots: int) -> None:
        self.index = CpuTierIndex(num_slots)
        self.slot_of: dict[UnitId, int] = {}  # visible units
        self.ready: set[UnitId] = set()
        self.writing: set[UnitId] = set()  # stores/fetches not reported yet
        self.pins: dict[UnitId, int] = {}
        self.doomed: dict[UnitId, int] = {}  # dropped, slot still in use

    # ----------------------------------------------------------- helpers

    def _in_use(self, unit: UnitId) -> bool:
        return self.pins.get(unit, 0) > 0 or unit in self.writing

    def _drop(self, unit: UnitId) -> None:
        slot = self.slot_of.pop(unit)
        self.ready.discard(unit)
        if self._in_use(unit):
            self.doomed[unit] = slot

    def _settle(self, unit: UnitId) -> None:
        if unit in self.doomed and not self._in_use(unit):
            del self.doomed[unit]

    # ------------------------------------------------------------- rules

    @rule(unit=unit_ids)
    def reserve(self, unit: UnitId) -> None:
        if unit in self.slot_of:
            with pytest.raises(KeyError):
                self.index.reserve(unit)
            return
        before = set(self.slot_of)
        entry = self.index.reserve(unit)
        gone = before - {e.unit_id for e in self.index}
        # Eviction takes at most one unit, and only one no transfer uses.
        assert len(gone) <= 1
        for victim in gone:
            assert victim in self.ready and not self._in_use(victim), "evicted a unit in use"
            self._drop(victim)
        if entry is None:
            # Busy: every slot is in use, or a dropped copy of this id is.
            assert unit in self.doomed or all(
                self._in_use(u) or u not in self.ready for u in self.slot_of
            )
            return
        assert not entry.ready and entry.pins == 0
        self.slot_of[unit] = entry.slot
        self.writing.add(unit)

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        unit = data.draw(st.sampled_from(sorted(self.writing)))
        self.index.commit(unit)
        self.writing.discard(unit)
        if unit in self.slot_of:
            self.ready.add(unit)
        self._settle(unit)

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def store_fails(self, data: st.DataObject) -> None:
        unit = data.draw(st.sampled_from(sorted(self.writing)))
        self.index.remove(unit)
        self.writing.discard(unit)
        if unit in self.slot_of:
            self._drop(unit)
        self._settle(unit)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        unit = data.draw(st.sampled_from(sorted(self.ready)))
        self.index.pin(unit)
        self.pins[unit] = self.pins.get(unit, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        unit = data.draw(st.sampled_from(sorted(u for u, n in self.pins.items() if n)))
        self.index.unpin(unit)
        self.pins[unit] -= 1
        self._settle(unit)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """A failed load or the recompute audit condemns a ready unit."""
        unit = data.draw(st.sampled_from(sorted(self.ready)))
        self.index.remove(unit)
        self._drop(unit)

    @rule(unit=unit_ids)
    def touch(self, unit: UnitId) -> None:
        self.index.touch(unit)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), new=unit_ids)
    def rekey(self, data: st.DataObject, new: UnitId) -> None:
        """An L3 fetch learns its unit's successors, then commits it."""
        old = data.draw(st.sampled_from(sorted(self.writing)))
        if new in self.slot_of:
            with pytest.raises(KeyError):
                self.index.rekey(old, new)
            return
        if old == new:
            return
        moved = self.index.rekey(old, new)
        assert moved == (old in self.slot_of and new not in self.doomed)
        self.writing.discard(old)
        if moved:
            self.slot_of[new] = self.slot_of.pop(old)
            self.pins[new] = self.pins.pop(old, 0)
            self.writing.add(new)
        else:
            if old in self.slot_of:
                self._drop(old)
            self._settle(old)

    @rule()
    def reset(self) -> None:
        dropped = self.index.clear_unpinned()
        assert dropped == len(self.ready)
        for unit in list(self.slot_of):
            self._drop(unit)

    # -------------------------------------------------------- invariants

    @invariant()
    def matches_the_model(self) -> None:
        visible = {e.unit_id: e for e in self.index}
        assert set(visible) == set(self.slot_of)
        for unit, entry in visible.items():
            assert entry.slot == self.slot_of[unit]
            assert entry.ready == (unit in self.ready)
            assert entry.pins == self.pins.get(unit, 0)
            assert self.index.get(unit) is entry
        for unit in self.doomed:
            assert self.index.get(unit) is None
        assert self.index.num_doomed == len(self.doomed)

    @invariant()
    def slots_are_held_once_and_never_free_while_used(self) -> None:
        held = list(self.slot_of.values()) + list(self.doomed.values())
        assert len(held) == len(set(held)), "a slot is held by two units"
        free = set(self.index._free_slots)
        assert len(free) == len(self.index._free_slots)
        assert not free & set(held), "a slot in use is free"
        in_use = {u for u in (*self.slot_of, *self.doomed) if self._in_use(u)}
        for unit in in_use:
            assert (self.slot_of.get(unit, self.doomed.get(unit))) not in free
        # The budget: every slot is free or held, never both, never more.
        assert len(free) + len(held) == self.index.num_slots
        assert self.index.num_used_slots == len(held)

    @invariant()
    def variants_match_the_entries(self) -> None:
        keys = {unit[0] for unit in self.slot_of}
        for key in (b"a", b"b", b"c"):
            expected = {u for u in self.ready if u[0] == key}
            assert {e.unit_id for e in self.index.ready_variants(key)} == expected
        assert set(self.index._variants) == keys
        for key, units in self.index._variants.items():
            assert units and len(units) == len(set(units))
            assert set(units) == {u for u in self.slot_of if u[0] == key}


IndexMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCpuTierIndex = IndexMachine.TestCase
