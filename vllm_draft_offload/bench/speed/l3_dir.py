"""What an L3 `fs://` directory holds, read from its files: whole units, the prefill
calibration, the sustained write rate, and when writes have settled."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def unit_files(directory: Path) -> list[Path]:
    """Whole units in an fs:// directory (temp files of writes in flight end in .tmp;
    the engines' prefill calibration is not a unit)."""
    from vllm_draft_offload.l3_calibration import is_calibration_file

    return sorted(p for p in directory.glob("*.data") if not is_calibration_file(p.name))


def calibration_samples(directory: Path) -> list[list[float]]:
    """The prefill calibration's (tokens, attention, seconds) samples found in an
    fs:// directory (the JSON document inside LMCache's file), [] without one."""
    from vllm_draft_offload.l3_calibration import is_calibration_file

    for path in sorted(directory.glob("*.data")):
        if not is_calibration_file(path.name):
            continue
        blob = path.read_bytes()
        start = blob.find(b'{"version"')
        try:
            return json.loads(blob[start : blob.rindex(b"}") + 1])["samples"]
        except (ValueError, KeyError):
            return []
    return []


def write_throughput(files: list[Path]) -> dict[str, Any]:
    """Sustained L3 write rate from the files themselves: the bytes of every file but the
    first, over the time from the first file's last write to the last one's."""
    if len(files) < 2:
        return {"files": len(files), "GBps": None}
    stats = sorted((f.stat() for f in files), key=lambda st: st.st_mtime_ns)
    span_s = (stats[-1].st_mtime_ns - stats[0].st_mtime_ns) / 1e9
    nbytes = sum(st.st_size for st in stats[1:])
    return {
        "files": len(files),
        "bytes": nbytes + stats[0].st_size,
        "first_to_last_s": span_s,
        "GBps": nbytes / span_s / 1e9 if span_s > 0 else None,
    }


def wait_for_l3_files(directory: Path, settle_s: float = 3.0, limit_s: float = 300.0) -> int:
    """Wait until the L3 directory stops growing: the write-behind queue has drained."""
    deadline = time.monotonic() + limit_s
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = len(unit_files(directory))
        if count != last:
            last, stable_since = count, time.monotonic()
        elif count > 0 and time.monotonic() - stable_since >= settle_s:
            break
        time.sleep(0.5)
    return last
