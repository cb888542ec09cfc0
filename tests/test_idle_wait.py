"""Idle steps while a request waits on storage (`l3.idle_wait_ms`).

vLLM's engine loop spins through steps with nothing scheduled while a request waits on a
storage fetch, and every step takes the GIL from the read threads. A worker with fetches
in flight waits for the next one to land instead (at most idle_wait_ms), so such a wait
costs a few steps, not one per millisecond. Real Scheduler and connector halves, real
fs:// backend, reads slowed by a throttle (tests/l3_throttle.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kv_sim import SimEngine, prompt
from l3_throttle import throttle
from test_l3_tier import CHUNK, fill_l3, l3_engine

from vllm_draft_offload.config import ConfigError, parse_config

READ_S = 0.3  # per unit read


def _restart_and_count_steps(
    model_dirs: tuple[Path, Path], url: str, tokens: list[int], idle_wait_ms: float
) -> tuple[SimEngine, int, float]:
    """A restarted engine serves `tokens` from storage; (engine, steps until the request
    was scheduled, seconds that took)."""
    eng = l3_engine(
        model_dirs,
        url,
        extra_config={
            "l3": {
                "enabled": True,
                "timeout_s": 10.0,
                "hit_policy": "always",
                "io_threads": 2,
                "idle_wait_ms": idle_wait_ms,
            }
        },
    )
    throttle(eng.worker.worker.l3.store, get=READ_S)
    eng.add_request("r", tokens, max_tokens=2)
    steps, started = 0, time.monotonic()
    while "r" not in eng.external_hits:
        eng.step()
        steps += 1
        assert time.monotonic() - started < 20, "the request was never scheduled"
    return eng, steps, time.monotonic() - started


def test_idle_steps_wait_for_the_next_landing(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    url = f"fs://{tmp_path / 'l3'}"
    tokens = prompt(41, 3 * CHUNK + 5)
    first = fill_l3(model_dirs, url, tokens, max_tokens=2)

    wait_s = 0.04
    eng, steps, seconds = _restart_and_count_steps(model_dirs, url, tokens, wait_s * 1000)
    # 3 units on 2 read threads: two rounds of READ_S.
    assert seconds >= 2 * READ_S
    assert eng.external_hits["r"] == 3 * CHUNK
    assert eng.mismatched_positions("r") == []
    eng.run_until_done()
    assert eng.outputs["r"] == first.outputs["fresh"]
    eng.worker.shutdown()
    # Each idle step ended at a landing (3) or after wait_s; a few more steps ran
    # during the lookup (no fetch in flight yet, nothing to wait for).
    bound = seconds / wait_s + 3 + 10
    assert steps <= bound, f"{steps} steps in {seconds:.2f} s"

    # Without the wait the loop spins: the bound above is what tells the two apart.
    spin, spin_steps, spin_seconds = _restart_and_count_steps(model_dirs, url, tokens, 0)
    assert spin.external_hits["r"] == 3 * CHUNK
    spin.worker.shutdown()
    assert spin_steps > bound, f"{spin_steps} steps in {spin_seconds:.2f} s without the wait"


@pytest.mark.parametrize("bad", [-1, 101, float("nan"), "soon"])
def test_a_bad_idle_wait_names_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match="idle_wait_ms"):
        parse_config({"l3": {"enabled": True, "idle_wait_ms": bad}})
