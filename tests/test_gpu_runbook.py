"""The GPU runbook's lease script (scripts/gpu/lease.sh) on this machine: it parses,
lists its phases, and refuses every phase on a machine that is not set up, at once
(a machine that went back is replaced by a bare one; waiting there only burns the
lease)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LEASE = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "lease.sh"
BASH = shutil.which("bash")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    assert BASH is not None
    return subprocess.run([BASH, str(LEASE), *args], capture_output=True, text=True, timeout=30)


def test_lease_script_parses_and_lists_its_phases() -> None:
    assert subprocess.run([BASH, "-n", str(LEASE)]).returncode == 0
    usage = _run()
    assert usage.returncode == 2
    phases = ("fixtures", "fx", "accept", "l3", "hybrid-speed", "soak", "soak-order", "chain")
    for phase in (*phases, "await"):
        assert f"#   {phase}" in usage.stdout, phase
    assert "#   reap" in usage.stdout


def test_reap_runs_anywhere_and_chain_reaps_after_every_phase() -> None:
    """`reap` (kill GPU processes a phase left behind) needs no set-up and no GPU; a
    chain runs it after each phase, before the phase's done mark."""
    assert _run("reap").returncode == 0
    text = LEASE.read_text()
    assert "bash $SELF reap >> $L/$p.log" in text
    assert text.index("bash $SELF reap >> $L/$p.log") < text.index("echo $p-done >> $L/$p.log")


@pytest.mark.skipif(Path("/root/proj/bin/vllm-draft-offload").exists(), reason="set up here")
@pytest.mark.parametrize("phase", [["l3"], ["chain", "fx", "soak"], ["await", "soak", "600"]])
def test_every_phase_stops_at_once_on_a_machine_not_set_up(phase: list[str]) -> None:
    result = _run(*phase)
    assert result.returncode == 3
    assert "not set up" in result.stderr
