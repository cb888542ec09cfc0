"""Soak: the connector with a CPU tier and a storage tier under load while storage fails.

One engine (`DraftOffloadConnector`, CPU tier + LMCache ``fs://`` or ``redis://`` tier)
serves ``--streams`` closed-loop streams of a load mix (shared system prompts,
multi-turn chat, document QA larger than the GPU cache, divergent successors) for
``--minutes``, while a thread of this process injects storage faults (outage, disk
full, corrupted objects). Then a no-connector engine runs the same load for
``--baseline-seconds`` (TTFT and pace baseline) and then replays a sample of ours'
finished requests twice (reference, and in reverse order as the numerics control).
Every engine is a subprocess: a crash is a result.

Separating the connector's cost from the engines' order (stress/phases.py):

* ``--idle-seconds S``: ours' requests of its first S seconds ask the connector to
  neither store nor load (its hooks still run every step); faults start after S. The
  report gives output tokens/s, ms per output token, ms per spec step and per engine
  step, preemptions and stored chunks for the idle and the active phase (by request
  end, ``--phase-margin`` seconds skipped after each start and after the switch) next
  to the baseline's.
* ``--baseline-first``: the no-connector engine runs its load before ours; the replay
  then runs on a third (no-connector) engine after ours.

Writes ``OUT/soak.json``, ``OUT/soak.md`` and ``OUT/soak.png``; see docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import add_eager_or_compile, command_parser
from vllm_draft_offload.bench.stress.engine import dtype_bytes, kv_bytes_per_token
from vllm_draft_offload.bench.stress.faults import (
    FAULTS,
    FaultInjector,
    FsBackend,
    RedisBackend,
    RedisProcess,
    schedule,
    small_tmpfs,
)
from vllm_draft_offload.bench.stress.flips import NEAR_TIE_NATS, add_near_tie_option
from vllm_draft_offload.bench.stress.jobs import (
    EngineShape,
    build_kwargs,
    cpu_tier_bytes,
    run_header,
    run_job,
    worker_env,
)
from vllm_draft_offload.bench.stress.load import SoakLoad
from vllm_draft_offload.bench.stress.phases import DEFAULT_MARGIN_S, TRANSFERS, active_schedule
from vllm_draft_offload.bench.stress.report_markdown import soak_markdown
from vllm_draft_offload.bench.stress.soak_plot import soak_plot
from vllm_draft_offload.bench.stress.soak_summary import soak_summary
from vllm_draft_offload.bench.workloads.run import read_model_limits
from vllm_draft_offload.bench.workloads.specs import parse_drafters

DRY_LOAD = SoakLoad(
    streams=8,
    system_prompts=2,
    system_len=96,
    chat_turns=3,
    user_len=16,
    docs=4,
    doc_len=256,
    question_len=12,
    div_prefix=64,
    div_cont=12,
    answer=8,
    chunk_size=32,
)

EXAMPLES = """examples:
  vllm-draft-offload soak --fixtures /root/fx --out /root/soak --minutes 10
  vllm-draft-offload soak --fixtures /root/fx --out /root/soak-redis --minutes 10 --backend redis
  vllm-draft-offload soak --fixtures /root/fx --out /root/soak-order --no-faults --baseline-first \
    --baseline-seconds 90 --seconds 210 --idle-seconds 90 --replay-n 8
  vllm-draft-offload soak --fixtures /tmp/fx --out /tmp/soak --dry-run-cpu --seconds 20
  vllm-draft-offload soak --report-only /root/soak/soak.json --out /tmp/rep
"""


def _switch_interval_ms(text: str) -> float | str:
    """``--l3-switch-interval-ms``: a number of ms, or ``none`` (Python's own interval)."""
    if text.strip().lower() == "none":
        return "none"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of ms nor none") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = command_parser("soak", __doc__, EXAMPLES)
    ap.add_argument("--fixtures", help="fixture dir from `vllm-draft-offload fixtures`")
    ap.add_argument("--model", help="target model dir (default FIXTURES/target)")
    ap.add_argument("--drafter", default="eagle3", help="fixture name or METHOD:PATH")
    ap.add_argument("--out", type=Path, default=Path("soak-out"))
    ap.add_argument("--report-only", type=Path, metavar="JSON")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny load, CPU engine args")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, help="overrides --minutes")
    ap.add_argument("--backend", choices=("fs", "redis"), default="fs")
    ap.add_argument("--l3-dir", type=Path, help="fs root (default: a tmpfs under OUT if root)")
    ap.add_argument("--tmpfs-mb", type=int, help="size of that tmpfs (4096; dry run 64)")
    ap.add_argument("--streams", type=int, help="concurrent streams (64; dry run 8)")
    ap.add_argument("--baseline-seconds", type=float, help="no-connector TTFT run (120; dry: 1/2)")
    ap.add_argument("--replay-n", type=int, help="finished requests replayed (64; dry run 8)")
    ap.add_argument("--max-requests", type=int, help="bound on requests per engine")
    ap.add_argument("--no-faults", action="store_true")
    add_near_tie_option(ap)
    ap.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="fault order, repeated over the run (default %(default)s)",
    )
    ap.add_argument(
        "--fault-period", type=float, help="seconds between faults (run / 10; run / 6 under 60 s)"
    )
    ap.add_argument(
        "--idle-seconds",
        type=float,
        default=0.0,
        help="ours' requests of its first S seconds neither store nor load (the connector "
        "idle); faults come after it",
    )
    ap.add_argument(
        "--idle-off",
        default=",".join(TRANSFERS),
        help="what the idle phase's requests turn off, of store,load (default %(default)s; "
        "load alone: the idle phase stores and never restores)",
    )
    ap.add_argument(
        "--l3-switch-interval-ms",
        type=_switch_interval_ms,
        help="the connector's l3.switch_interval_ms (a number, or none: Python's 5 ms "
        "stays); default the connector's",
    )
    ap.add_argument(
        "--ours-connector",
        choices=("draft_offload", "null"),
        default="draft_offload",
        help="null: the connector engine runs a connector whose every hook returns at once "
        "(vLLM's connector plumbing alone), to tell its cost from ours; it stores and "
        "restores nothing, so its hit and acceptance figures are empty",
    )
    ap.add_argument(
        "--baseline-first",
        action="store_true",
        help="run the no-connector baseline before ours (the replay then on its own engine)",
    )
    ap.add_argument(
        "--phase-margin",
        type=float,
        default=DEFAULT_MARGIN_S,
        help="seconds skipped after each engine's start and the idle/active switch in the "
        "phase figures (at most a quarter of a phase; default %(default)s)",
    )
    ap.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1")
    ap.add_argument("--dtype")
    add_eager_or_compile(ap)
    ap.add_argument("--engine-timeout", type=float, default=1200.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:  # bad fault flags fail here, with the flag's name, not minutes into the run
        schedule(60.0, tuple(args.faults.split(",")), args.fault_period)
    except ValueError as exc:
        field, _, reason = str(exc).partition(":")
        ap.error(f"--{field.replace('_', '-')}:{reason}")
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    args.idle_off = tuple(args.idle_off.split(","))
    if not args.idle_off or not set(args.idle_off) <= set(TRANSFERS):
        ap.error(f"--idle-off: {','.join(args.idle_off)}, give one or both of store,load")
    if not 0 <= args.idle_seconds < seconds:
        ap.error(f"--idle-seconds: {args.idle_seconds}, must be in [0, {seconds}) (the run)")
    if args.baseline_first and args.baseline_seconds is not None and args.baseline_seconds <= 0:
        ap.error("--baseline-first: needs a baseline (--baseline-seconds > 0)")
    if args.phase_margin < 0:
        ap.error(f"--phase-margin: {args.phase_margin}, must be >= 0")
    return args


@contextlib.contextmanager
def storage(args: argparse.Namespace, out: Path, dry: bool) -> Iterator[tuple[str, Any, bool]]:
    """(l3 url, fault backend, disk-full possible) for the run; cleaned up after it."""
    if args.backend == "redis":
        server = RedisProcess(out / "redis")
        server.start()
        try:
            yield server.url, RedisBackend(server), True
        finally:
            server.stop()
        return
    if args.l3_dir is not None:
        root = args.l3_dir.resolve()
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        yield f"fs://{root}", FsBackend(root, may_fill=False), False
        return
    size = args.tmpfs_mb or (64 if dry else 4096)
    with small_tmpfs(out / "l3mnt", size) as mounted:
        root = out / "l3mnt" / "l3"  # a subdirectory: a mount point cannot be renamed away
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        try:
            yield f"fs://{root}", FsBackend(root, may_fill=mounted), mounted
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _start_when_ready(ready: Path, injector: FaultInjector, timeout: float) -> threading.Thread:
    def wait() -> None:
        deadline = time.monotonic() + timeout
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if ready.exists():
            injector.start()

    t = threading.Thread(target=wait, name="soak-faults-wait", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        data = json.loads(args.report_only.read_text())
        if args.near_tie_nats is not None:
            data["near_tie_nats"] = args.near_tie_nats
        return _write(data, out)
    model = args.model or (str(Path(args.fixtures) / "target") if args.fixtures else None)
    if model is None:
        raise SystemExit("give --model or --fixtures")
    dry = args.dry_run_cpu
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    load = DRY_LOAD if dry else SoakLoad()
    load = SoakLoad.from_dict({**load.to_dict(), "seed": args.seed})
    if args.streams:
        load = SoakLoad.from_dict({**load.to_dict(), "streams": args.streams})
    load.validate()
    drafter = parse_drafters(args.drafter, args.fixtures)[0]
    chunk, block = load.chunk_size, 32 if dry else 16
    dtype = args.dtype or ("float32" if dry else "auto")
    elem = dtype_bytes(dtype, model)
    bpt = kv_bytes_per_token(model, elem) + kv_bytes_per_token(drafter.path, elem)
    longest = math.ceil(load.longest_request() / block) * block
    shared = load.system_prompts * load.system_len + load.docs * load.doc_len + load.div_prefix
    # the documents do not fit in the GPU cache (half of them do), the longest request does
    gpu_tokens = max(load.docs * load.doc_len // 2, math.ceil(1.25 * longest))
    cpu_bytes = cpu_tier_bytes(0.5, shared, bpt, chunk)  # so the storage tier serves too
    shape = EngineShape(
        model=model,
        drafter=drafter,
        block_size=block,
        chunk_size=chunk,
        num_spec_tokens=3,
        dtype=dtype,
        enforce_eager=dry or not args.compile,
        gpu_memory_utilization=0.3 if dry else 0.5,
        max_num_seqs=load.streams,
        max_num_batched_tokens=max(512, longest) if dry else None,
        max_model_len=longest,
        gpu_blocks=math.ceil(gpu_tokens / block) + 1,
        seed=args.seed,
    )
    vocab, _ = read_model_limits(model)
    max_requests = args.max_requests or int(200 * seconds + 1000)
    base_s = (
        args.baseline_seconds
        if args.baseline_seconds is not None
        else (seconds / 2 if dry else 120.0)
    )
    env = worker_env(dry, args.batch_invariant)
    idle_s = args.idle_seconds
    order = ["baseline", "ours", "replay"] if args.baseline_first else ["ours", "baseline"]
    data: dict[str, Any] = {
        **run_header("soak", "vllm-draft-offload soak", argv, dry, args.batch_invariant),
        "backend": args.backend,
        "seconds": seconds,
        "idle_seconds": idle_s,
        "idle_off": list(args.idle_off),
        "phase_margin_s": args.phase_margin,
        "baseline_first": args.baseline_first,
        "ours_connector": args.ours_connector,
        "l3_switch_interval_ms": args.l3_switch_interval_ms,
        "engine_order": order if base_s > 0 else ["ours", "replay"],
        "near_tie_nats": NEAR_TIE_NATS if args.near_tie_nats is None else args.near_tie_nats,
        "load": load.to_dict(),
        "drafter": {**drafter.__dict__, "label": drafter.label},
        "chunk_size": chunk,
        "gpu_tokens": gpu_tokens,
        "cpu_bytes": cpu_bytes,
        "kv_bytes_per_token_estimate": bpt,
        "runs": {},
        "faults": [],
    }
    common = {"dry_run": dry, "vocab": vocab, "load": load.to_dict(), "max_requests": max_requests}

    def no_connector(mode: str, secs: float, replay: list[dict[str, Any]]) -> dict[str, Any]:
        # GPU prefix cache on; memory sampled as in ours (no connector there: RSS only)
        job = {**common, "mode": mode, "seconds": secs, "replay": replay, "state": False}
        job.update(ready=str(out / "jobs" / "baseline.ready"))
        job["engine_kwargs"] = build_kwargs("gpu_prefix", shape)
        return job

    t0 = time.time()
    if args.baseline_first and base_s > 0:
        # the baseline's load alone, before ours: the replay needs ours' requests
        rec = run_job(no_connector("soak", base_s, []), "baseline", out, env, args.engine_timeout)
        data["runs"]["baseline"] = {**rec, "seconds": base_s}
        (out / "soak.json").write_text(json.dumps(data))
    with storage(args, out, dry) as (url, backend, can_fill):
        data["l3_url"], data["disk_full_possible"] = url, can_fill
        ready = out / "jobs" / "ours.ready"
        ready.unlink(missing_ok=True)
        # faults only while the connector works (after the idle phase)
        faults = tuple(args.faults.split(","))
        plan = [] if args.no_faults else active_schedule(seconds, idle_s, faults, args.fault_period)
        injector = FaultInjector(backend, plan)
        waiter = _start_when_ready(ready, injector, args.engine_timeout)
        job = {
            **common,
            "mode": "soak",
            "seconds": seconds,
            "idle_s": idle_s,
            "idle_off": list(args.idle_off),
            "ready": str(ready),
            "replay_n": args.replay_n or (8 if dry else 64),
            "replay_every": 3 if dry else 25,
            "engine_kwargs": build_kwargs(
                "ours_disk",
                shape,
                cpu_bytes=cpu_bytes,
                l3_url=url,
                staging_mb=64 if dry else 512,
                l3_switch_interval_ms=args.l3_switch_interval_ms,
            ),
        }
        if args.ours_connector == "null":
            from vllm_draft_offload.bench.speed import null_connector

            job["engine_kwargs"]["kv_transfer_config"] = null_connector.transfer_config()
        data["runs"]["ours"] = run_job(job, "ours", out, env, args.engine_timeout)
        waiter.join(1)
        data["faults"] = injector.stop() if injector.is_alive() or injector.events else []
    (out / "soak.json").write_text(json.dumps(data))
    sample = data["runs"]["ours"].get("replay_sample") or []
    if args.baseline_first and base_s > 0:
        rec = run_job(no_connector("replay", 0.0, sample), "replay", out, env, args.engine_timeout)
        engine = "a no-connector engine of its own, after ours (--baseline-first)"
    else:
        # One no-connector engine: the baseline's load for base_s, then the replay of
        # ours' sample (reference + reversed control).
        mode = "soak" if base_s > 0 else "replay"
        rec = run_job(no_connector(mode, base_s, sample), "baseline", out, env, args.engine_timeout)
        if base_s > 0:
            data["runs"]["baseline"] = {**rec, "seconds": base_s}
        engine = "baseline (no connector, GPU prefix cache reset before the replay)"
    data["runs"]["replay"] = {
        "status": rec.get("status") if "reference" in rec else "not run",
        "reference": rec.pop("reference", None),
        "reference_margins": rec.pop("reference_margins", None),
        "control": rec.pop("control", None),
        "engine": engine,
        "started_at": rec.get("started_at"),
    }
    data["total_wall_s"] = time.time() - t0
    return _write(data, out)


def _write(data: dict[str, Any], out: Path) -> int:
    ours = data["runs"].get("ours", {})
    data["device"] = (ours.get("engine") or {}).get("device")
    data["summary"] = soak_summary(data)
    (out / "soak.json").write_text(json.dumps(data))
    (out / "soak.md").write_text(soak_markdown(data))
    soak_plot(data, out / "soak.png")
    s = data["summary"]
    print(f"[soak] {s['verdict']}: {'; '.join(s['failed']) or 'ok'}; faults {s['faults_injected']}")
    print(f"[soak] wrote {out}/soak.json, soak.md, soak.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
