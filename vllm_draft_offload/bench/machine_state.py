"""What the machine did while a timed window ran: CPU time stolen by the hypervisor,
how busy the host's CPUs were, and the GPU's SM clock and the reasons NVML gives for
holding it below its maximum.

Batches of one engine a few seconds apart decoded up to 1.6 x apart on an H100 host
(session 19) with identical work, so a throughput ratio needs to say what the machine
was doing: a batch slowed by stolen CPU time or a clock held down is noise, not the
connector. ``MachineSampler`` samples in a thread every ``period_s`` (NVML through
vLLM's vendored ``pynvml``; ``/proc/stat`` through psutil), summarizes the window, and
names the processes that used the most CPU in it (a slow batch with the host busier:
whose work was it?).
Where NVML or a GPU is missing (CPU runs), the GPU fields are None.
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import threading
import time
from types import TracebackType
from typing import Any

import psutil

# NVML clock event reasons that mean the clock was held down by something other than
# the GPU being idle or the application's own clock setting (nvml.h's
# nvmlClocksEventReason* bits; vLLM's pynvml names the same values).
CLOCK_REASONS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
TOP_PROCESSES = 5  # the processes that used the most CPU in a window, by name
TOP_THREADS = 6  # the threads of the busiest process that used the most CPU in a window


@functools.cache
def _nvml_handle() -> Any | None:  # noqa: ANN401 - an NVML device handle
    """The NVML handle of the GPU this process uses (the first of
    ``CUDA_VISIBLE_DEVICES`` when it names indices), or None without NVML or a GPU.
    Looked up once per process: every sampler (one per batch) shares it."""
    try:
        from vllm.third_party import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        index = int(visible) if visible.isdigit() else 0
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no driver, no GPU, no NVML: CPU fields only
        return None


def reason_names(mask: int) -> list[str]:
    """The names of the clock-limiting reasons set in an NVML reasons bit mask."""
    return [name for bit, name in CLOCK_REASONS.items() if mask & bit]


def cpu_shares(before: Any, after: Any) -> dict[str, float | None]:  # noqa: ANN401
    """Shares of all CPUs' time between two ``psutil.cpu_times()`` readings: stolen by
    the hypervisor, busy (user, system, interrupts), and waiting on I/O."""
    # Linux counts guest time inside user time already: leave it out of the total.
    fields = [name for name in before._fields if not name.startswith("guest")]
    delta = {name: getattr(after, name) - getattr(before, name) for name in fields}
    total = sum(delta.values())
    if total <= 0:
        return {"steal_share": None, "busy_share": None, "iowait_share": None}
    busy = sum(delta.get(name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
    return {
        "steal_share": delta.get("steal", 0.0) / total,
        "busy_share": busy / total,
        "iowait_share": delta.get("iowait", 0.0) / total,
    }


def process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far (user + system), by pid, with its name."""
    seconds = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None:
            seconds[proc.pid] = (proc.info["name"] or "?", times.user + times.system)
    return seconds


def top_processes(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> list[dict[str, Any]]:
    """The ``TOP_PROCESSES`` processes that used the most CPU between two readings (a
    process started meanwhile counts from zero): where the host's busy time went."""
    used = [
        {"pid": pid, "name": name, "cpu_s": total - before.get(pid, (name, 0.0))[1]}
        for pid, (name, total) in after.items()
    ]
    used.sort(key=lambda row: -row["cpu_s"])
    return [row for row in used[:TOP_PROCESSES] if row["cpu_s"] > 0]


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each thread of ``pid`` (user + system), by thread id, with
    the thread's name (``/proc/PID/task/TID/comm``); empty once the process is gone."""
    try:
        threads = psutil.Process(pid).threads()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}
    seconds = {}
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread.id}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            name = "?"
        seconds[thread.id] = (name, thread.user_time + thread.system_time)
    return seconds


def busy_threads(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> list[dict[str, Any]]:
    """The ``TOP_THREADS`` threads that used the most CPU between two readings of one
    process: which of an engine's threads (its loop, the output or input socket's,
    CUDA's) did a slow batch's extra host work."""
    used = [
        {"tid": tid, "name": name, "cpu_s": total - before.get(tid, (name, 0.0))[1]}
        for tid, (name, total) in after.items()
    ]
    used.sort(key=lambda row: -row["cpu_s"])
    return [row for row in used[:TOP_THREADS] if row["cpu_s"] > 0]


# vLLM's GC debugger's line (VLLM_GC_DEBUG=1, vllm/utils/gc_utils.py), one per collection
# and per callback attached (an engine core with its worker in one process attaches two).
GC_LINE = re.compile(r"GC took ([0-9.]+)ms to complete\. .* in GC generation (\d)")


def gc_pauses(log: str) -> dict[str, dict[str, float]]:
    """Per generation, the collections vLLM's GC debugger logged in ``log``: how many,
    their total and their longest milliseconds (an engine whose loop stops for the
    collector leaves its GPU idle meanwhile)."""
    pauses: dict[str, dict[str, float]] = {}
    for match in GC_LINE.finditer(log):
        ms, generation = float(match.group(1)), match.group(2)
        row = pauses.setdefault(generation, {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
        row["count"] += 1
        row["total_ms"] = round(row["total_ms"] + ms, 3)
        row["max_ms"] = max(row["max_ms"], ms)
    return pauses


class MachineSampler:
    """``with MachineSampler() as sampler: ...`` then ``sampler.summary``: the window's
    CPU shares and the GPU's SM clock (min, median, max MHz), median power and
    utilization, every clock-limiting reason seen, and the threads of the processes
    named ``watch`` that used the most CPU (``threads``, by pid)."""

    def __init__(
        self, period_s: float = 0.1, watch: tuple[str, ...] = ("VLLM::EngineCore",)
    ) -> None:
        self.period_s = period_s
        self.watch = watch
        self.summary: dict[str, Any] = {}
        self._handle = _nvml_handle()
        self._stop = threading.Event()
        self._clocks: list[int] = []
        self._power_w: list[float] = []
        self._util: list[int] = []
        self._reasons = 0
        self._thread = threading.Thread(target=self._run, name="machine-sampler", daemon=True)

    def _sample_gpu(self) -> None:
        from vllm.third_party import pynvml

        try:
            self._clocks.append(pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM))
            self._power_w.append(pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1000)
            self._util.append(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            self._reasons |= pynvml.nvmlDeviceGetCurrentClocksEventReasons(self._handle)
        except Exception:  # noqa: BLE001 - a query this driver lacks: keep the others
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._handle is not None:
                self._sample_gpu()
            self._stop.wait(self.period_s)

    def __enter__(self) -> MachineSampler:
        self._start_s = time.perf_counter()
        self._cpu_before = psutil.cpu_times()
        self._procs_before = process_cpu_seconds()
        self._threads_before = {
            pid: thread_cpu_seconds(pid)
            for pid, (name, _) in self._procs_before.items()
            if name in self.watch
        }
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.summary = {
            "seconds": time.perf_counter() - self._start_s,
            "cpus": psutil.cpu_count(),
            **cpu_shares(self._cpu_before, psutil.cpu_times()),
            "top_processes": top_processes(self._procs_before, process_cpu_seconds()),
            "threads": {
                str(pid): busy_threads(before, thread_cpu_seconds(pid))
                for pid, before in self._threads_before.items()
            },
            "sm_clock_mhz": _spread(self._clocks),
            "power_w": statistics.median(self._power_w) if self._power_w else None,
            "gpu_util_pct": statistics.median(self._util) if self._util else None,
            "clock_reasons": reason_names(self._reasons) if self._handle is not None else None,
        }


def _spread(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}
