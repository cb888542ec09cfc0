"""Child processes of the benchmarks. Each engine runs in a process group of its own
(``start_new_session=True``), and nothing of that group may outlive its run: vLLM's
EngineCore and worker processes left behind keep their GPU memory, and the next engine
on the machine then fails to start ("Free memory on device ... is less than desired GPU
memory utilization", seen after six pressure engines on an H100)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

# how long a finished run's engine processes get to leave on their own
LEAVE_GRACE_S = 10.0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def reap_group(pgid: int, grace_s: float = LEAVE_GRACE_S) -> bool:
    """Give the group ``grace_s`` to leave, then SIGKILL what is left. True if something
    had to be killed (a leak worth a line in the run's log)."""
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not group_alive(pgid):
        return False
    kill_group(pgid)
    return True
