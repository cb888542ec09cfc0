"""`spy-report`: engine-core processes, waits, step parts, the connector's share and
the other threads, on small raw py-spy files written here."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from vllm_draft_offload.bench.stress.spy_report import engine_report, is_wait, main, tally

ROOT = 'process 1:""'
OURS_CMD = "python3 -m worker /jobs/ours.job.json"
# A `;` in a command line must not split the process frame.
BASE_CMD = 'sh -c "cd /x; python3 -m worker /jobs/baseline.job.json"'
OURS = f'{ROOT};process 10:"{OURS_CMD}";process 11:"{OURS_CMD}"'
# An engine core that renamed itself (setproctitle): its job file is in its parent's.
BASE = f'{ROOT};process 20:"{BASE_CMD}";process 21:"VLLM::EngineCore"'
OTHER_PROC = f'{ROOT};process 30:"python3 -c "import x; x.run()""'

LOOP = "main (w.py:1);EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:1629)"
STEP = f"{LOOP};EngineCoreProc._process_engine_step (vllm/v1/engine/core.py:1683)"
WAIT_INPUT = (
    f"{LOOP};EngineCoreProc._process_input_queue (vllm/v1/engine/core.py:1650)"
    ";Queue.get (queue.py:171);Condition.wait (threading.py:355)"
)
SCHEDULE = f"{STEP};Scheduler.schedule (vllm/v1/core/sched/scheduler.py:123)"
BUILD_META = (
    f"{SCHEDULE};DraftOffloadConnector.build_connector_meta (vllm_draft_offload/connector.py:10)"
    ";DraftOffloadScheduler.build_connector_meta (vllm_draft_offload/scheduler.py:20)"
    ";plan_stores (vllm_draft_offload/plan.py:5);Plan.add (vllm_draft_offload/plan.py:9)"
    ";Unit.key (vllm_draft_offload/units.py:1)"
)
UPDATE = f"{STEP};Scheduler.update_from_output (vllm/v1/core/sched/scheduler.py:900)"
STATS = (
    f"{UPDATE};DraftOffloadConnector.get_kv_connector_stats (vllm_draft_offload/connector.py:30)"
    ";DraftOffloadScheduler.on_step_output (vllm_draft_offload/scheduler.py:40)"
)
EXECUTE = (
    f"{STEP};UniProcExecutor.execute_model (vllm/v1/executor/uniproc_executor.py:1);fwd (m.py:3)"
)
# A frame of the toolkit (bench/) is not the connector's.
SAMPLE = (
    f"{STEP};UniProcExecutor.sample_tokens (vllm/v1/executor/uniproc_executor.py:137)"
    ";hook (vllm_draft_offload/bench/stress/worker.py:5)"
)
OTHER_WAIT = f"{STEP};Condition.wait (threading.py:355)"  # a wait, not for input: busy
POOL = "_bootstrap (threading.py:1);_worker (concurrent/futures/thread.py:89)"

LINES = [
    # ours: MainThread
    f"{OURS};thread (11): MainThread;main (w.py:1);LLM.__init__ (vllm/entrypoints/llm.py:1) 7",
    f"{OURS};thread (11): MainThread;{WAIT_INPUT} 20",
    f"{OURS};thread (11): MainThread;{SCHEDULE} 10",
    f"{OURS};thread (11): MainThread;{BUILD_META} 6",
    f"{OURS};thread (11): MainThread;{UPDATE} 5",
    f"{OURS};thread (11): MainThread;{STATS} 3",
    f"{OURS};thread (11): MainThread;{EXECUTE} 40",
    f"{OURS};thread (11): MainThread;{SAMPLE} 15",
    f"{OURS};thread (11): MainThread;{OTHER_WAIT} 4",
    # ours: other threads
    f"{OURS};thread (12): draft-offload-l3-write_0;{POOL} 30",
    f"{OURS};thread (12): draft-offload-l3-write_0;{POOL};_WorkItem.run (t.py:58)"
    ";copy_into (vllm_draft_offload/fast_io.py:170) 10",
    f"{OURS};thread (13): draft-offload-l3-write_1;{POOL} 5",
    f"{OURS};thread (14): l3-fs-loop;BaseEventLoop._run_once (asyncio/base_events.py:1)"
    ";EpollSelector.select (selectors.py:468) 20",
    f"{OURS};thread (15): Thread-2 (process_input_sockets);run (t.py:1)"
    ";Poller.poll (zmq/sugar/poll.py:106) 8",
    f"{OURS};thread (15): Thread-2 (process_input_sockets);run (t.py:1)"
    ";sha256 (vllm/utils/hashing.py:41) 2",
    f"{OURS};thread (16);{POOL} 3",
    f"{OURS};thread (17) 1",  # no Python frame: not a wait
    f"{OURS};thread (18): asyncio_0;{POOL} 4",
    f"{OURS};thread (19): asyncio_0;{POOL};_WorkItem.run (t.py:58) 1",  # same name, other id
    f"{OURS};thread (24): tqdm_monitor;run (t.py:1);Event.wait (threading.py:629)"
    ";Condition.wait (threading.py:359) 6",
    # baseline
    f"{BASE};thread (21): MainThread;{WAIT_INPUT} 50",
    f"{BASE};thread (21): MainThread;{EXECUTE} 30",
    f"{BASE};thread (21): MainThread;{SAMPLE} 20",
    f"{BASE};thread (22): signal-callback;run (t.py:1);Condition.wait (threading.py:355) 9",
    # not engine cores: the soak's parent process (a busy loop off its MainThread)...
    f'{ROOT};process 10:"{OURS_CMD}";thread (10): MainThread;main (w.py:1)'
    ";Popen._wait (subprocess.py:1) 100",
    f'{ROOT};process 10:"{OURS_CMD}";thread (23): fake;{LOOP} 5',
    # ... and one whose command line holds `;` and quotes
    f"{OTHER_PROC};thread (30): MainThread;<module> (x.py:1) 2",
    "",
]


def write_raw(tmp_path: Path, name: str = "spy.raw") -> Path:
    path = tmp_path / name
    text = "\n".join(LINES)
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_engines_main_thread_and_step_parts(tmp_path: Path) -> None:
    processes = tally(write_raw(tmp_path), depth=4)
    assert set(processes) == {10, 11, 21, 30}
    assert processes[30].cmdline == 'python3 -c "import x; x.run()"'
    assert [pid for pid, p in processes.items() if p.loop_samples] == [11, 21]
    ours, base = engine_report(processes[11], top=15), engine_report(processes[21], top=15)
    # No job file in the command line: named by its PID.
    assert (ours["name"], base["name"], processes[30].name) == ("ours", "baseline", "30")
    assert ours["main_thread"] == {
        "samples": 110,
        "busy_loop_samples": 103,
        "waiting_samples": 20,
        "busy_samples": 83,
        "waiting_pct": 19.42,
        "busy_pct": 80.58,
    }
    assert ours["step_parts"] == {
        "Scheduler.schedule": {"samples": 16, "pct_of_busy": 19.28},
        "Scheduler.update_from_output": {"samples": 8, "pct_of_busy": 9.64},
        "execute_model": {"samples": 40, "pct_of_busy": 48.19},
        "sample_tokens": {"samples": 15, "pct_of_busy": 18.07},
        "other": {"samples": 4, "pct_of_busy": 4.82},
    }
    assert base["main_thread"]["busy_samples"] == 50 and base["main_thread"]["waiting_pct"] == 50.0
    assert base["step_parts"]["execute_model"] == {"samples": 30, "pct_of_busy": 60.0}
    assert base["connector"] == {
        "samples": 0,
        "pct_of_busy": 0.0,
        "by_outer_frame": [],
        "by_chain": [],
    }


@pytest.mark.parametrize("depth", [4, 2])
def test_connector_share_by_outer_frame_and_chain(tmp_path: Path, depth: int) -> None:
    connector = engine_report(tally(write_raw(tmp_path), depth)[11], top=15)["connector"]
    assert (connector["samples"], connector["pct_of_busy"]) == (9, 10.84)
    assert [tuple(r.values()) for r in connector["by_outer_frame"]] == [
        ("DraftOffloadConnector.build_connector_meta", 6, 7.23),
        ("DraftOffloadConnector.get_kv_connector_stats", 3, 3.61),
    ]
    meta = "DraftOffloadConnector.build_connector_meta > DraftOffloadScheduler.build_connector_meta"
    meta_chain = meta + " > plan_stores > Plan.add" if depth == 4 else meta  # Unit.key: 5th
    stats = "DraftOffloadConnector.get_kv_connector_stats > DraftOffloadScheduler.on_step_output"
    assert [tuple(r.values()) for r in connector["by_chain"]] == [
        (meta_chain, 6, 7.23),
        (stats, 3, 3.61),
    ]
    top1 = engine_report(tally(write_raw(tmp_path), depth)[11], top=1)["connector"]
    assert len(top1["by_outer_frame"]) == len(top1["by_chain"]) == 1


def test_other_threads_busy_share(tmp_path: Path) -> None:
    threads = engine_report(tally(write_raw(tmp_path), 4)[11], top=15)["other_threads"]
    assert [(t["name"], t["samples"], t["busy_samples"], t["busy_pct"]) for t in threads] == [
        ("draft-offload-l3-write_0", 40, 10, 25.0),
        ("Thread-2 (process_input_sockets)", 10, 2, 20.0),
        ("asyncio_0", 5, 1, 20.0),
        ("(unnamed)", 4, 1, 25.0),
        ("l3-fs-loop", 20, 0, 0.0),
        ("tqdm_monitor", 6, 0, 0.0),
        ("draft-offload-l3-write_1", 5, 0, 0.0),
    ]


def test_wait_leaves() -> None:
    waits = ["Condition.wait (threading.py:355)", "EpollSelector.select (selectors.py:468)"]
    waits += ["Poller.poll (zmq/sugar/poll.py:106)", "_worker (concurrent/futures/thread.py:89)"]
    assert all(is_wait(leaf) for leaf in waits)
    busy = ["sha256 (vllm/utils/hashing.py:41)", "BaseEventLoop._run_once (asyncio/x.py:1)"]
    assert not any(is_wait(leaf) for leaf in [*busy, None])


def test_gzip_input_reads_the_same(tmp_path: Path) -> None:
    assert tally(write_raw(tmp_path, "spy.raw.gz"), 4) == tally(write_raw(tmp_path), 4)


def test_main_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, out = write_raw(tmp_path, "spy.raw.gz"), tmp_path / "report" / "spy.json"
    assert main([str(raw), "--out", str(out), "--top", "3"]) == 0
    report = json.loads(out.read_text())
    assert report["input"] == str(raw) and (report["depth"], report["top"]) == (4, 3)
    assert [(e["pid"], e["name"]) for e in report["engines"]] == [(11, "ours"), (21, "baseline")]
    ours = report["engines"][0]
    assert ours["main_thread"]["busy_samples"] == 83
    assert ours["connector"]["samples"] == 9 and len(ours["other_threads"]) == 7
    text = capsys.readouterr().out
    assert text == out.with_suffix(".md").read_text()
    assert "## ours (pid 11)" in text and "## baseline (pid 21)" in text
    assert "| execute_model | 40 | 48.2 |" in text
    assert "4 more threads, all of them in the JSON." in text

    assert main([str(raw), "--process", "21", "--out", str(out)]) == 0
    assert [e["pid"] for e in json.loads(out.read_text())["engines"]] == [21]
    assert main([str(raw), "--process", "10"]) == 1  # not an engine core
    assert "no engine-core process" in capsys.readouterr().err
