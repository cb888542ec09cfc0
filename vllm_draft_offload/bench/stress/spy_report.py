"""Where the engine-core threads' time goes, from a py-spy raw profile.

Reads what ``py-spy record --subprocesses --threads --idle --format raw`` wrote (plain
or gzip): one collapsed stack a line, ``process PID:"CMDLINE";...;thread (TID): NAME;
FRAME;...;FRAME COUNT``. An engine-core process is one whose MainThread runs
``EngineCoreProc.run_busy_loop``; it is named after the ``*.job.json`` in its command
line (the soak's ``baseline``, ``ours``, ``replay``), else by its PID. For each one:
the busy loop's samples waiting for input vs busy, the busy ones split into vLLM's step
parts, the connector's share of them (frames of ``vllm_draft_offload/`` outside
``bench/``), and how busy the process's other threads are.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllm_draft_offload.bench.markdown import table as markdown_table
from vllm_draft_offload.bench.options import PROG, command_parser

EXAMPLES = f"""examples:
  {PROG} spy-report spy.raw.gz --out /tmp/spy_report.json
  {PROG} spy-report spy.raw --process 2277 --depth 6 --top 30
"""

BUSY_LOOP = "EngineCoreProc.run_busy_loop"
INPUT_QUEUE = "EngineCoreProc._process_input_queue"
# vLLM's step parts: the function that marks each, and its label (outermost one wins).
STEP_PART_OF: dict[str, str] = {
    "Scheduler.schedule": "Scheduler.schedule",
    "Scheduler.update_from_output": "Scheduler.update_from_output",
    "UniProcExecutor.execute_model": "execute_model",
    "UniProcExecutor.sample_tokens": "sample_tokens",
}
OTHER_PART = "other"
# Leaf functions at which a thread is taken to be blocked rather than working. A
# heuristic: py-spy's raw format does not mark idle samples, and without --native a
# blocking C call (lock acquire, SimpleQueue.get, time.sleep, recv) is no frame of its
# own, so the leaf is the Python function that made it. Hence ThreadPoolExecutor's
# `_worker` (idle in SimpleQueue.get between tasks) and vLLM's usage reporter (a
# `time.sleep(600)` loop). A dotted name matches that function; a bare one matches
# any function or method of that name (`select` covers EpollSelector.select).
WAIT_LEAVES: frozenset[str] = frozenset(
    ("Condition.wait", "Event.wait", "Thread._wait_for_tstate_lock", "Popen._wait")
    + ("Queue.get", "_queue.SimpleQueue.get", "_worker", "UsageMessage._report_continuous_usage")
    + ("select", "poll", "epoll", "recv", "recv_into", "recvfrom", "recv_multipart")
    + ("time.sleep", "sleep")
)
# A sampled process's own frame: its command line may hold `;`, so it ends only where
# the next process frame or the thread frame starts.
PROCESS_FRAME = re.compile(r'process (\d+):"(.*?)";(?=process \d+:"|thread \()')
THREAD_FRAME = re.compile(r"thread \((\w+)\)(?:: (.*))?$")
JOB_FILE = re.compile(r'([^/\s"]+)\.job\.json')
CONNECTOR_DIR, EXCLUDED_DIR = "vllm_draft_offload/", "bench/"


@dataclass
class ThreadTally:
    samples: int = 0
    busy_samples: int = 0  # whose leaf is not a wait (WAIT_LEAVES)


@dataclass
class ProcessTally:
    pid: int
    cmdline: str
    main_samples: int = 0
    loop_samples: int = 0  # MainThread inside run_busy_loop
    waiting_samples: int = 0  # ... of those, blocked on the input queue
    step_parts: Counter[str] = field(default_factory=Counter)
    connector_by_outer: Counter[str] = field(default_factory=Counter)
    connector_by_chain: Counter[str] = field(default_factory=Counter)
    other_threads: dict[str, ThreadTally] = field(default_factory=dict)

    @property
    def busy_samples(self) -> int:
        return self.loop_samples - self.waiting_samples

    @property
    def name(self) -> str:
        job = JOB_FILE.search(self.cmdline)
        return job.group(1) if job else str(self.pid)


def function_name(frame: str) -> str:
    return frame.partition(" (")[0]


def is_connector_frame(frame: str) -> bool:
    source = frame.partition(" (")[2].rpartition(":")[0]
    # The last occurrence: an absolute path of an editable install may name the
    # checkout's directory `vllm_draft_offload/` too.
    at = source.rfind(CONNECTOR_DIR)
    return at >= 0 and not source.startswith(EXCLUDED_DIR, at + len(CONNECTOR_DIR))


def is_wait(leaf: str | None) -> bool:
    if leaf is None:
        return False
    name = function_name(leaf)
    return name in WAIT_LEAVES or name.rpartition(".")[2] in WAIT_LEAVES


def open_text(path: Path) -> TextIO:
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    if gzipped:  # by content, not by name: a renamed .gz still reads
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


def samples(path: Path) -> Iterator[tuple[int, str, str, list[str], int]]:
    """(pid, command lines of its process chain, thread name, Python frames outermost
    first, count) per line.

    A file without process frames (no --subprocesses) is one process, PID 0."""
    with open_text(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            # The command lines from the root process down: an engine core renames itself
            # (setproctitle: "VLLM::EngineCore"), so its job file is in its parent's.
            pid, chain, at = 0, [], 0
            while process := PROCESS_FRAME.match(stack, at):
                pid, at = int(process.group(1)), process.end()
                chain.append(process.group(2))
            cmdline = " > ".join(c for c in chain if c)
            thread_frame, *frames = stack[at:].split(";")
            thread = THREAD_FRAME.match(thread_frame)
            if thread is None:
                continue
            yield pid, cmdline, thread.group(2) or "(unnamed)", frames, int(count)


def tally(path: Path, depth: int) -> dict[int, ProcessTally]:
    processes: dict[int, ProcessTally] = {}
    for pid, cmdline, thread, frames, count in samples(path):
        process = processes.setdefault(pid, ProcessTally(pid, cmdline))
        if thread != "MainThread":
            other = process.other_threads.setdefault(thread, ThreadTally())
            other.samples += count
            other.busy_samples += 0 if is_wait(frames[-1] if frames else None) else count
            continue
        process.main_samples += count
        names = [function_name(frame) for frame in frames]
        if BUSY_LOOP not in names:
            continue  # start-up, shutdown, or not an engine core
        process.loop_samples += count
        if names[-1] == "Condition.wait" and INPUT_QUEUE in names:
            process.waiting_samples += count
            continue
        part = next((STEP_PART_OF[name] for name in names if name in STEP_PART_OF), OTHER_PART)
        process.step_parts[part] += count
        connector = [
            name for name, frame in zip(names, frames, strict=True) if is_connector_frame(frame)
        ]
        if connector:
            process.connector_by_outer[connector[0]] += count
            process.connector_by_chain[" > ".join(connector[:depth])] += count
    return processes


def pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


def of_busy(samples: int, busy: int) -> dict[str, Any]:
    return {"samples": samples, "pct_of_busy": pct(samples, busy)}


def ranking(counts: Counter[str], busy: int, top: int) -> list[dict[str, Any]]:
    return [{"frames": key, **of_busy(n, busy)} for key, n in counts.most_common(top)]


def engine_report(process: ProcessTally, top: int) -> dict[str, Any]:
    busy, loop = process.busy_samples, process.loop_samples
    # Threads that work first; the busy count is the useful one, waits fill the rest.
    threads = sorted(
        process.other_threads.items(), key=lambda kv: (-kv[1].busy_samples, -kv[1].samples)
    )
    return {
        "pid": process.pid,
        "name": process.name,
        "cmdline": process.cmdline,
        "main_thread": {
            "samples": process.main_samples,
            "busy_loop_samples": loop,
            "waiting_samples": process.waiting_samples,
            "busy_samples": busy,
            "waiting_pct": pct(process.waiting_samples, loop),
            "busy_pct": pct(busy, loop),
        },
        "step_parts": {
            label: of_busy(process.step_parts[label], busy)
            for label in [*STEP_PART_OF.values(), OTHER_PART]
        },
        "connector": {
            **of_busy(process.connector_by_outer.total(), busy),
            "by_outer_frame": ranking(process.connector_by_outer, busy, top),
            "by_chain": ranking(process.connector_by_chain, busy, top),
        },
        "other_threads": [
            {"name": name, **asdict(t), "busy_pct": pct(t.busy_samples, t.samples)}
            for name, t in threads
        ],
    }


def table(header: str, rows: list[list[str]]) -> list[str]:
    """A table (its header's columns split at ` | `), then a blank line."""
    return [*markdown_table(header.split(" | "), rows), ""]


def row(label: str, share: dict[str, Any], digits: int = 1) -> list[str]:
    return [label, f"{share['samples']:,}", f"{share['pct_of_busy']:.{digits}f}"]


def markdown(report: dict[str, Any]) -> str:
    top = report["top"]
    out = [f"# py-spy profile: {Path(report['input']).name}", ""]
    for engine in report["engines"]:
        main, conn, threads = engine["main_thread"], engine["connector"], engine["other_threads"]
        out += [
            f"## {engine['name']} (pid {engine['pid']})",
            "",
            f"MainThread: {main['samples']:,} samples, {main['busy_loop_samples']:,} in "
            f"run_busy_loop: waiting for input {main['waiting_samples']:,} "
            f"({main['waiting_pct']:.1f}%), busy {main['busy_samples']:,} "
            f"({main['busy_pct']:.1f}%).",
            "",
        ]
        parts = [row(label, share) for label, share in engine["step_parts"].items()]
        out += table("step part | samples | % of busy", parts)
        out += [
            f"Connector (`vllm_draft_offload/`, not `bench/`): {conn['samples']:,} samples, "
            f"{conn['pct_of_busy']:.1f}% of busy.",
            "",
        ]
        for key, title in [
            ("by_outer_frame", "outermost connector frame"),
            ("by_chain", f"connector chain (first {report['depth']} frames)"),
        ]:
            if conn[key]:  # small shares: two decimals
                rows = [row(f"`{r['frames']}`", r, digits=2) for r in conn[key]]
                out += table(f"{title} | samples | % of busy", rows)
        rows = [
            [t["name"], f"{t['samples']:,}", f"{t['busy_samples']:,}", f"{t['busy_pct']:.1f}"]
            for t in threads[:top]
        ]
        out += table("other thread | samples | not waiting | % not waiting", rows)
        if len(threads) > top:
            out += [f"{len(threads) - top} more threads, all of them in the JSON.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = command_parser("spy-report", __doc__, EXAMPLES)
    ap.add_argument("raw", type=Path, help="py-spy --format raw output (plain or .gz)")
    out_help = "write the JSON here (the Markdown next to it, as .md)"
    ap.add_argument("--out", type=Path, metavar="PATH.json", help=out_help)
    only = "only this engine-core process (repeatable)"
    ap.add_argument("--process", type=int, action="append", metavar="PID", help=only)
    ap.add_argument("--depth", type=int, default=4, help="connector frames per chain (default 4)")
    ap.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    args = ap.parse_args(argv)
    processes = tally(args.raw, args.depth)
    chosen = set(args.process or processes)
    engines = [p for pid, p in sorted(processes.items()) if p.loop_samples and pid in chosen]
    missing = sorted(chosen - {p.pid for p in engines}) if args.process else []
    if missing:
        print(f"no engine-core process with PID {missing} in {args.raw}", file=sys.stderr)
    if not engines:
        print(f"no engine-core process (MainThread in {BUSY_LOOP}) in {args.raw}", file=sys.stderr)
        return 1
    report = {
        "input": str(args.raw),
        "depth": args.depth,
        "top": args.top,
        "wait_leaves": sorted(WAIT_LEAVES),
        "engines": [engine_report(p, args.top) for p in engines],
    }
    text = markdown(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
