"""Page-cache residency of stored objects (l3_residency.py): on real files, and as the
scheduler's lookup reports it for a fetch's first round through LMCache's fs:// files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_l3_prefetch import _prefetch, _put_unit, _stored_prompt

from vllm_draft_offload.bench.speed.disk_baseline import evict_from_page_cache
from vllm_draft_offload.l3_decisions import L3Decision
from vllm_draft_offload.l3_residency import (
    Presence,
    Residency,
    file_resident,
    first_round_residency,
    residency_of,
)


def _skip_unless_evicted(path: Path) -> None:
    if file_resident(path):
        pytest.skip(
            f"the kernel kept {path.name} cached after fsync + POSIX_FADV_DONTNEED "
            "(a filesystem that ignores the advice): cannot show a cold file here"
        )


def _on_real_filesystem(tmp_path: Path) -> None:
    """tmpfs pages are the file itself: never evictable, always resident."""
    with open("/proc/mounts") as mounts:
        best = ("", "")
        for line in mounts:
            _, mount_point, fs_type, *_ = line.split()
            inside = str(tmp_path).startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) > len(best[0]):
                best = (mount_point, fs_type)
    if best[1] in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {best[1]}: its pages cannot be evicted")


def test_a_read_file_is_resident_and_an_evicted_one_is_not(tmp_path: Path) -> None:
    _on_real_filesystem(tmp_path)
    path = tmp_path / "unit.bin"
    path.write_bytes(os.urandom(3 << 20))
    assert path.read_bytes()  # read: every page cached
    assert file_resident(path) is True
    evict_from_page_cache(path)
    _skip_unless_evicted(path)
    assert file_resident(path) is False
    # One page read back (not the whole file): still not resident.
    with open(path, "rb") as f:
        f.seek(1 << 20)
        f.read(4096)
    assert file_resident(path) is False
    path.read_bytes()
    assert file_resident(path) is True


def test_a_missing_file_is_not_resident_and_an_empty_one_is_unknown(tmp_path: Path) -> None:
    assert file_resident(tmp_path / "gone") is False
    (tmp_path / "empty").write_bytes(b"")
    assert file_resident(tmp_path / "empty") is None


def test_residency_is_known_only_when_every_file_answered() -> None:
    assert residency_of([True, True]) == Residency(2, 2)
    assert residency_of([True, False]) == Residency(2, 1)
    assert not Residency(2, 1).all_resident and Residency(2, 2).all_resident
    assert residency_of([True, None]) is None
    assert residency_of([]) is None


def test_the_first_round_is_the_leading_hits_one_per_read_thread_every_rank() -> None:
    asked: list[list[str]] = []

    def answer(names: list[str]) -> list[bool | None]:
        asked.append(names)
        return [name != "b1" for name in names]

    def ranks(key: bytes) -> list[str]:
        return [f"{key.decode()}{rank}" for rank in range(2)]

    keys = [b"a", b"b", b"c", b"d"]
    assert first_round_residency(answer, keys, [True] * 4, 2, ranks) == Residency(4, 3)
    assert asked[-1] == ["a0", "a1", "b0", "b1"]
    assert first_round_residency(answer, keys, [True, False, True, True], 3, ranks) == (
        Residency(2, 2)
    )
    assert first_round_residency(answer, keys, [False] * 4, 2, ranks) is None

    def broken(names: list[str]) -> list[bool | None]:
        raise RuntimeError("a probe bug")

    # A failed probe is unknown residency, never a failed lookup.
    assert first_round_residency(broken, keys, [True] * 4, 2, ranks) is None


def test_the_lookup_reports_its_first_rounds_residency(tmp_path: Path) -> None:
    """Units written through LMCache's FSConnector, two TP ranks, three read threads: the
    lookup asks about every rank's object of the first three hits (six files), cached
    after their writes and cold once evicted; a miss ends the round early."""
    _on_real_filesystem(tmp_path)
    prefetch = _prefetch(f"fs://{tmp_path / 'l3'}", world_size=2, io_threads=3)
    lookup = prefetch.lookup
    keys = _stored_prompt(prefetch, 1, 5)  # rank 0's objects
    store = lookup.store
    assert store is not None
    for key in keys:
        _put_unit(store, key, 1, ())
    files = [p for p in (tmp_path / "l3").rglob("*") if p.is_file()]
    assert len(files) == 10
    for path in files:
        path.read_bytes()  # whatever writeback did: cached now
    present = lookup.lookup(keys).result(5)
    assert present == [True] * 5 and isinstance(present, Presence)
    assert present.first_round == Residency(6, 6)

    for path in files:
        evict_from_page_cache(path)
    _skip_unless_evicted(files[0])
    present = lookup.lookup(keys).result(5)
    assert present.first_round == Residency(6, 0)
    # Only the leading hits are read first: two here.
    missing = [keys[0], keys[1], b"\x09" * 32, keys[3]]
    assert lookup.lookup(missing).result(5).first_round == Residency(4, 0)
    # No hit, no round to ask about.
    assert lookup.lookup([b"\x09" * 32]).result(5).first_round is None
    lookup.close()


def test_the_decision_line_says_how_much_of_the_first_round_was_resident() -> None:
    decision = L3Decision("r", "cost", 0, 0, 64, 0.5559, "fit")
    assert "; resident ?;" in decision.line()
    assert decision.first_round_resident is None
    decision.first_round = Residency(8, 8)
    assert "; resident 8/8;" in decision.line()
    assert decision.first_round_resident is True
    decision.first_round = Residency(8, 7)
    assert "; resident 7/8;" in decision.line() and decision.first_round_resident is False
