"""Child processes of the benchmarks. Each engine runs in a process group of its own
(``start_new_session=True``), and nothing of that group may outlive its run: vLLM's
EngineCore and worker processes left behind keep their GPU memory, and the next engine
on the machine then fails to start ("Free memory on device ... is less than desired GPU
memory utilization", seen after six pressure engines on an H100)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from typing import IO, Any

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


def run_in_group(
    cmd: list[str],
    env: dict[str, str],
    stdout: IO[Any] | int,
    stderr: IO[Any] | int,
    timeout_s: float | None,
    leave_grace_s: float = LEAVE_GRACE_S,
) -> tuple[int | None, bool]:
    """Run ``cmd`` in a process group of its own, its output to ``stdout``/``stderr``
    (files, or ``subprocess.STDOUT``). On timeout (None as the return code) or Ctrl-C
    the whole group is killed; in every case what is left of it is reaped afterwards
    (`reap_group`; True: something had to be killed). Files, not pipes: a process the
    child left behind (an EngineCore) keeps a pipe open, and reading it to the end would
    wait for that process too."""
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        returncode: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()
        returncode = None
    except BaseException:
        kill_group(proc.pid)
        proc.wait()
        raise
    return returncode, reap_group(proc.pid, leave_grace_s)


def run_child(
    cmd: list[str], env: dict[str, str], timeout_s: float | None
) -> subprocess.CompletedProcess[str]:
    """Run one engine's child process (`run_in_group`) and capture its output. Past
    ``timeout_s`` the result has return code 124 and a ``timeout after ...`` line ahead
    of its stderr: a hung engine costs the benchmark that engine, not the run (session
    17: a restart that never finished kept restore-speed, and its one JSON at the end,
    waiting until the lease ran out)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        returncode, _ = run_in_group(cmd, env, out, err, timeout_s)
        note = "" if returncode is not None else f"timeout after {timeout_s}s\n"
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            cmd, 124 if returncode is None else returncode, out.read(), note + err.read()
        )
