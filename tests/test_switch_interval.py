"""`l3.switch_interval_ms`: the storage tier lowers Python's GIL switch interval in the
worker (read threads take the GIL back after every read and checksum call), never
raises it, and refuses a bad value naming the field."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_l3_tier import l3_engine

from vllm_draft_offload.config import parse_config
from vllm_draft_offload.l3_tier import lower_switch_interval


@pytest.fixture
def python_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("python_interval")
def test_lowered_never_raised() -> None:
    lower_switch_interval(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    lower_switch_interval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


@pytest.mark.usefixtures("python_interval")
def test_a_worker_with_the_storage_tier_applies_it(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    eng = l3_engine(model_dirs, f"fs://{tmp_path / 'l3'}")
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0005)  # the default, 0.5 ms
    finally:
        eng.worker.shutdown()


@pytest.mark.parametrize("bad", [0, -1, 1000, "fast"])
def test_a_bad_value_names_the_field(bad: object) -> None:
    with pytest.raises((ValidationError, ValueError), match="switch_interval_ms"):
        parse_config(
            {"cpu_bytes_to_use": 1 << 24, "l3": {"enabled": True, "switch_interval_ms": bad}}
        )


@pytest.mark.usefixtures("python_interval")
def test_null_leaves_python_alone(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    l3 = {"enabled": True, "switch_interval_ms": None}
    eng = l3_engine(model_dirs, f"fs://{tmp_path / 'l3'}", extra_config={"l3": l3})
    try:
        assert eng.worker.worker.l3 is not None  # the tier is on
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        eng.worker.shutdown()
