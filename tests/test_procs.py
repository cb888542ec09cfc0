"""Engine subprocesses leave nothing behind: vLLM's EngineCore, started by the engine
driver, kept about 1.3 GB of GPU memory each after six `pressure` engines had exited
(session 8, H100), and the next `vllm serve` then failed to start."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from vllm_draft_offload.bench.procs import reap_group, run_child
from vllm_draft_offload.bench.workloads.run import run_subprocess

# a driver that starts a long-lived child (as LLM() starts EngineCore), prints its pid,
# and exits without stopping it
LEAVES_A_CHILD = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print('child', child.pid, flush=True)\n"
)


def _running(pid: int) -> bool:
    """Alive and not a zombie (PID 1 of a container need not reap orphans)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _child_pid(log: Path) -> int:
    return int(next(ln for ln in log.read_text().splitlines() if ln.startswith("child")).split()[1])


def test_a_run_that_exits_normally_leaves_no_process_behind(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    rc, _ = run_subprocess(
        [sys.executable, "-c", LEAVES_A_CHILD], dict(os.environ), log, timeout=60,
        leave_grace_s=0.5,
    )  # fmt: skip
    assert rc == 0
    child = _child_pid(log)
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), "the driver's child outlived the run"
    assert "killed engine processes left behind" in log.read_text()


def test_a_group_that_leaves_in_time_is_not_killed(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    rc, _ = run_subprocess(
        [sys.executable, "-c", "print('child 0')"], dict(os.environ), log, timeout=60,
        leave_grace_s=0.5,
    )  # fmt: skip
    assert rc == 0 and "killed" not in log.read_text()
    assert reap_group(2**22 + 12345, grace_s=0.0) is False  # no such group


def test_run_child_kills_a_hung_engine_group_and_reports_the_timeout() -> None:
    """restore-speed and decode-overhead run each engine through run_child: an engine
    that never finishes (session 17: a restart hung until the lease ran out) is killed
    with everything it started, and the run goes on with a timeout entry."""
    hangs = LEAVES_A_CHILD + "import time\ntime.sleep(300)\n"
    start = time.monotonic()
    proc = run_child([sys.executable, "-c", hangs], dict(os.environ), timeout_s=3)
    assert time.monotonic() - start < 30
    assert proc.returncode == 124 and proc.stderr.startswith("timeout after 3")
    assert _gone(_printed_child(proc.stdout))


def test_run_child_returns_what_a_finished_engine_wrote() -> None:
    proc = run_child(
        [sys.executable, "-c", LEAVES_A_CHILD + "import sys\nsys.exit(3)\n"],
        dict(os.environ),
        timeout_s=60,
    )
    assert proc.returncode == 3 and "child" in proc.stdout
    assert _gone(_printed_child(proc.stdout))  # reaped with its group after the grace


def _printed_child(stdout: str) -> int:
    return int(next(ln for ln in stdout.splitlines() if ln.startswith("child")).split()[1])


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """A SIGKILLed process takes a moment to leave."""
    deadline = time.monotonic() + wait_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pid)
