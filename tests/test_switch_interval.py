"""`l3.switch_interval_ms`: the storage tier lowers Python's GIL switch interval in the
scheduler and the worker only while a request waits on storage, puts the process's own
back as soon as none does, never raises it, and refuses a bad value naming the field."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kv_sim import prompt
from pydantic import ValidationError
from test_l3_tier import CHUNK, l3_engine
from test_l3_writes import serve, settle_writes

from vllm_draft_offload import switch_interval
from vllm_draft_offload.config import parse_config
from vllm_draft_offload.switch_interval import WaitingSwitchInterval

PYTHONS = 0.005


@pytest.fixture
def python_interval(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Python's 5 ms, and no claim of another test's engine still alive in the process."""
    monkeypatch.setattr(switch_interval, "_wanted", {})
    monkeypatch.setattr(switch_interval, "_normal", None)
    before = sys.getswitchinterval()
    sys.setswitchinterval(PYTHONS)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("python_interval")
def test_a_tier_dropped_while_waiting_gives_it_back() -> None:
    tier = WaitingSwitchInterval(0.0005)
    tier.set_waiting(True)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    del tier
    gc.collect()
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)


@pytest.mark.usefixtures("python_interval")
def test_lowered_while_waiting_then_the_process_own_back() -> None:
    tier = WaitingSwitchInterval(0.0005)
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)  # nothing waits yet
    tier.set_waiting(True)
    assert tier.lowered and sys.getswitchinterval() == pytest.approx(0.0005)
    tier.set_waiting(True)  # every step repeats the verdict
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    tier.set_waiting(False)
    assert not tier.lowered and sys.getswitchinterval() == pytest.approx(PYTHONS)


@pytest.mark.usefixtures("python_interval")
def test_never_raised_above_the_process_own() -> None:
    tier = WaitingSwitchInterval(0.02)
    tier.set_waiting(True)
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)
    tier.close()
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)


@pytest.mark.usefixtures("python_interval")
def test_none_leaves_python_alone() -> None:
    tier = WaitingSwitchInterval(None)
    tier.set_waiting(True)
    assert not tier.lowered and sys.getswitchinterval() == pytest.approx(PYTHONS)


@pytest.mark.usefixtures("python_interval")
def test_tiers_in_one_process_share_it() -> None:
    """The lowest wanted applies while any waits; the process's own once none does,
    whichever stops last."""
    a, b = WaitingSwitchInterval(0.002), WaitingSwitchInterval(0.0005)
    a.set_waiting(True)
    assert sys.getswitchinterval() == pytest.approx(0.002)
    b.set_waiting(True)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    b.set_waiting(False)
    assert sys.getswitchinterval() == pytest.approx(0.002)
    b.set_waiting(True)
    a.set_waiting(False)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    b.close()
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)


@pytest.mark.usefixtures("python_interval")
def test_a_worker_lowers_it_only_while_a_request_waits_on_storage(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    hit_tokens = prompt(61, 3 * CHUNK + 2)
    first = l3_engine(model_dirs, url)
    first.add_request("fill", hit_tokens, max_tokens=1)
    serve(first)
    # Serving and writing with the tier on, nothing waiting on storage: left alone.
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)
    settle_writes(first)
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)
    first.worker.shutdown()

    eng = l3_engine(model_dirs, url)  # a restart: the hit is in storage only
    worker_l3 = eng.worker.worker.l3
    assert worker_l3 is not None
    try:
        prefetch = eng.scheduler.connector.scheduler.l3
        assert prefetch is not None
        eng.add_request("hit", hit_tokens, max_tokens=2)
        eng.step()  # its lookup starts; the step's metadata tells the worker
        # The scheduler lowers it as the lookup starts, the workers with the step.
        assert prefetch.switch_interval.lowered and worker_l3.switch_interval.lowered
        assert sys.getswitchinterval() == pytest.approx(0.0005)  # the default, 0.5 ms
        eng.run_prefill("hit")
        assert eng.external_hits["hit"] == 3 * CHUNK  # served from storage
        eng.step()
        assert not worker_l3.switch_interval.lowered  # admitted: nothing waits
        assert not prefetch.switch_interval.lowered
        assert sys.getswitchinterval() == pytest.approx(PYTHONS)
    finally:
        eng.worker.shutdown()
    assert sys.getswitchinterval() == pytest.approx(PYTHONS)


@pytest.mark.parametrize("bad", [0, -1, 1000, "fast"])
def test_a_bad_value_names_the_field(bad: object) -> None:
    with pytest.raises((ValidationError, ValueError), match="switch_interval_ms"):
        parse_config(
            {"cpu_bytes_to_use": 1 << 24, "l3": {"enabled": True, "switch_interval_ms": bad}}
        )


@pytest.mark.usefixtures("python_interval")
def test_null_never_lowers_it(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    hit_tokens = prompt(62, 2 * CHUNK + 2)
    l3 = {"enabled": True, "timeout_s": 2.0, "hit_policy": "always", "switch_interval_ms": None}
    first = l3_engine(model_dirs, url, extra_config={"l3": l3})
    first.add_request("fill", hit_tokens, max_tokens=1)
    serve(first)
    settle_writes(first)
    first.worker.shutdown()
    eng = l3_engine(model_dirs, url, extra_config={"l3": l3})
    try:
        eng.add_request("hit", hit_tokens, max_tokens=2)
        eng.step()
        assert sys.getswitchinterval() == pytest.approx(PYTHONS)
        eng.run_prefill("hit")
        assert eng.external_hits["hit"] == 2 * CHUNK
    finally:
        eng.worker.shutdown()
