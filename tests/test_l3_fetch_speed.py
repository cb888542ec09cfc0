"""The L3 fetch benchmark runs end to end on a tiny configuration (no timing asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import l3_fetch_speed  # noqa: E402


def test_fetch_speed_script_reports_every_thread_count(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    report = l3_fetch_speed.main(
        ["--url", f"fs://{tmp_path / 'l3'}", "--unit-mb", "0.5", "--units", "3",
         "--threads", "1,2", "--reps", "1", "--out", str(out)]
    )  # fmt: skip
    assert set(report["read_GBps_by_threads"]) == {"1", "2"}
    assert all(v > 0 for v in report["read_GBps_by_threads"].values())
    assert json.loads(out.read_text())["units"] == 3
