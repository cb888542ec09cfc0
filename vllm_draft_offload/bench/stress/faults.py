"""Storage faults for the soak, injected on a schedule from a thread of the parent.

Three faults, on either backend:

* ``outage``: the backend goes away and comes back. fs: the directory is renamed away
  and a plain file put in its place (every read and write fails, even as root, where
  ``chmod 000`` would not), then restored. redis: the server process is stopped and
  restarted on the same port (without persistence: it comes back empty).
* ``disk_full``: fs: a ballast file fills the filesystem of the directory (only one we
  mounted ourselves, a size-limited tmpfs, or one with little free space), then is
  deleted. redis: ``maxmemory`` is lowered to what is in use (``noeviction``), so
  writes fail with OOM, then lifted.
* ``corrupt``: bytes in the middle of stored objects are flipped (fs: ``*.data``
  files; redis: values of ``*kv_bytes`` keys).

Every injection is an event ``{t, fault, hold_s, ok, detail}``; a fault that cannot be
injected here is recorded with ``ok: false`` and the reason, never silently skipped.
Servers bind 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Protocol

# corrupt last in each cycle: after a Redis outage the server is empty until new writes
FAULTS: tuple[str, ...] = ("outage", "disk_full", "corrupt")
MAX_BALLAST = 8 << 30  # never fill a filesystem with more free space than this


class Backend(Protocol):
    def go_away(self) -> str: ...
    def come_back(self) -> str: ...
    def fill(self) -> str: ...
    def release(self) -> str: ...
    def corrupt(self, n: int) -> int: ...


class FsBackend:
    def __init__(self, root: Path, may_fill: bool) -> None:
        self.root, self.may_fill = root, may_fill
        self.away = root.with_name(root.name + ".away")
        self.ballast = root.parent / (root.name + ".ballast")

    def go_away(self) -> str:
        os.rename(self.root, self.away)
        self.root.write_bytes(b"")  # ENOTDIR for every path below it
        return f"renamed {self.root} away"

    def come_back(self) -> str:
        if self.away.exists():
            with contextlib.suppress(FileNotFoundError):
                self.root.unlink()
            os.rename(self.away, self.root)
        return "restored"

    def fill(self) -> str:
        free = shutil.disk_usage(self.root).free
        if not self.may_fill and free > MAX_BALLAST:
            raise RuntimeError(f"{free >> 20} MiB free and not our tmpfs: not filling it")
        written = 0
        with contextlib.suppress(OSError), self.ballast.open("wb") as fh:  # ENOSPC ends it
            block = b"\0" * (1 << 20)
            while written < free + (1 << 20):
                fh.write(block)
                written += len(block)
        return f"ballast {written >> 20} MiB, {shutil.disk_usage(self.root).free >> 10} KiB left"

    def release(self) -> str:
        self.ballast.unlink(missing_ok=True)
        return "ballast deleted"

    def corrupt(self, n: int) -> int:
        files = sorted(self.root.rglob("*.data")) if self.root.is_dir() else []
        hit = 0
        for f in random.Random(len(files)).sample(files, min(n, len(files))):
            with contextlib.suppress(OSError), f.open("r+b") as fh:
                size = fh.seek(0, 2)
                fh.seek(size // 2)
                chunk = fh.read(16)
                fh.seek(size // 2)
                fh.write(bytes(b ^ 0xFF for b in chunk))
                hit += 1
        return hit


class RedisProcess:
    """A loopback redis-server that can be stopped and started again on its port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.binary, self.workdir = binary, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir)]
        args += ["--logfile", str(self.workdir / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(f"redis-server not listening on {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


class RedisBackend:
    def __init__(self, server: RedisProcess) -> None:
        self.server = server

    def go_away(self) -> str:
        self.server.stop()
        return "redis-server stopped"

    def come_back(self) -> str:
        if self.server.proc is None:
            self.server.start()
        return "redis-server restarted (empty)"

    def fill(self) -> str:
        c = self.server.client()
        used = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", str(used + 1024))
        return f"maxmemory {used + 1024} bytes (noeviction)"

    def release(self) -> str:
        if self.server.proc is not None:
            self.server.client().config_set("maxmemory", "0")
        return "maxmemory lifted"

    def corrupt(self, n: int) -> int:
        c = self.server.client()
        keys = sorted(k for k in c.scan_iter(match="*kv_bytes", count=1000))
        hit = 0
        for k in random.Random(len(keys)).sample(keys, min(n, len(keys))):
            size = int(c.strlen(k))
            if size:
                chunk = c.getrange(k, size // 2, size // 2 + 15)
                c.setrange(k, size // 2, bytes(b ^ 0xFF for b in chunk))
                hit += 1
        return hit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def schedule(
    seconds: float, faults: tuple[str, ...] = FAULTS, period: float | None = None
) -> list[tuple[float, str, float]]:
    """(start, fault, hold) over the run: `faults` in turn, by default one every tenth of it."""
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown or not faults:
        raise ValueError(f"faults: {unknown or 'none'} not among {', '.join(FAULTS)}")
    if period is None:
        period = seconds / 10 if seconds >= 60 else seconds / 6
    if period <= 0:
        raise ValueError(f"fault_period: {period} s, must be > 0")
    out, t, i = [], period / 2, 0
    while t + period / 2 < seconds:
        out.append((t, faults[i % len(faults)], period / 2))
        t, i = t + period, i + 1
    return out


class FaultInjector(threading.Thread):
    """Runs `schedule` against ``backend``; `stop` ends it and restores the backend."""

    def __init__(self, backend: Backend, plan: list[tuple[float, str, float]], corrupt_n: int = 8):
        super().__init__(name="soak-faults", daemon=True)
        self.backend, self.plan, self.corrupt_n = backend, plan, corrupt_n
        self.events: list[dict[str, Any]] = []
        self._stop_evt = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        self._t0 = time.monotonic()
        for start, fault, hold in self.plan:
            if self._stop_evt.wait(max(0.0, start - (time.monotonic() - self._t0))):
                return
            self._inject(fault, hold)

    def _inject(self, fault: str, hold: float) -> None:
        ev: dict[str, Any] = {
            "t": round(time.monotonic() - self._t0, 3),
            "fault": fault,
            "hold_s": hold,
        }
        try:
            if fault == "corrupt":
                # nothing stored yet (start, or a Redis that came back empty): wait for
                # objects during the hold instead of recording a no-op
                deadline = time.monotonic() + hold
                n = self.backend.corrupt(self.corrupt_n)
                while n == 0 and not self._stop_evt.wait(0.2) and time.monotonic() < deadline:
                    n = self.backend.corrupt(self.corrupt_n)
                ev["ok"], ev["detail"] = n > 0, f"{n} objects corrupted"
            else:
                on, off = (
                    (self.backend.go_away, self.backend.come_back)
                    if fault == "outage"
                    else (self.backend.fill, self.backend.release)
                )
                ev["detail"] = on()
                ev["ok"] = True
                self._stop_evt.wait(hold)
                ev["detail"] += "; " + off()
        except Exception as exc:  # noqa: BLE001 - a fault we cannot inject is a recorded event
            ev["ok"], ev["detail"] = False, f"{type(exc).__name__}: {exc}"
            self._restore()
        self.events.append(ev)

    def _restore(self) -> None:
        for undo in (self.backend.come_back, self.backend.release):
            with contextlib.suppress(Exception):
                undo()

    def stop(self) -> list[dict[str, Any]]:
        self._stop_evt.set()
        self.join(60)
        self._restore()
        return self.events


@contextlib.contextmanager
def small_tmpfs(path: Path, size_mb: int) -> Any:
    """Mount a tmpfs of ``size_mb`` at ``path`` (root only); yields whether it mounted."""
    path.mkdir(parents=True, exist_ok=True)
    ok = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
