"""Benchmark KV offload under speculative decoding: ours vs vLLM native vs LMCache.

One run compares, on the same token-id prompts, the configurations
``none`` (no prefix cache), ``gpu_prefix``, ``native`` (OffloadingConnector),
``lmcache`` (LMCacheConnectorV1), ``ours_cpu`` and ``ours_disk``
(DraftOffloadConnector with the LMCache fs:// tier), each x every drafter, each
engine in its own subprocess (a crash is a result), and writes
``OUT/bench.json`` (every raw number), ``OUT/summary.{json,md}`` and PNG plots.
See docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench import PACKAGE_PARENT
from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.procs import LEAVE_GRACE_S, run_in_group
from vllm_draft_offload.bench.progress import progress
from vllm_draft_offload.bench.workloads.report import write_report
from vllm_draft_offload.bench.workloads.specs import (
    CONFIGS,
    GIB,
    WORKLOADS,
    Drafter,
    Sizes,
    build_workload,
    digest,
    dry_run_sizes,
    engine_env,
    engine_kwargs,
    parse_drafters,
    with_overrides,
)

EXAMPLES = """examples:
  # GPU (one H100), fixtures from `vllm-draft-offload fixtures --preset gpu`
  vllm-draft-offload bench --fixtures /root/fixtures --out /root/bench --enforce-eager
  # CPU dry run with the tiny fixtures
  vllm-draft-offload bench --fixtures /tmp/fx --dry-run-cpu --out /tmp/bench
  # rebuild summary and plots from a recorded run
  vllm-draft-offload bench --report-only /root/bench/bench.json --out /tmp/rep
"""
# The engine side, run as ``python -m`` in a subprocess per engine (tests swap it).
WORKER: list[str] = ["-m", "vllm_draft_offload.bench.workloads.worker"]
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in _csv(s))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = command_parser("bench", __doc__, EXAMPLES)
    ap.add_argument(
        "--out", type=Path, help="output directory (default bench-out, or the JSON's dir)"
    )
    ap.add_argument("--report-only", type=Path, metavar="JSON", help="only rebuild summary/plots")
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="tiny sizes and CPU engine args (float32, block 32, eager, chunk 32)",
    )
    ap.add_argument(
        "--fixtures", help="fixture dir from `vllm-draft-offload fixtures` (target + drafters)"
    )
    ap.add_argument("--model", help="target model dir (default FIXTURES/target)")
    ap.add_argument(
        "--drafters",
        default="eagle3",
        help="METHOD:PATH,... or fixture names (eagle3,eagle,small-draft,self-draft)",
    )
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}"
    )
    ap.add_argument(
        "--prompt-lengths", type=_ints, help="TTFT-curve prefix lengths, e.g. 1024,4096,16384"
    )
    ap.add_argument(
        "--no-ttft-curve", action="store_true", help="skip the TTFT vs prefix length curve"
    )
    ap.add_argument(
        "--ttft-all-drafters",
        action="store_true",
        help="TTFT curve for every drafter (default: the first one only)",
    )
    ap.add_argument("--ttft-reps", type=int)
    ap.add_argument("--doc-lengths", type=_ints, help="doc QA document lengths (tokens)")
    ap.add_argument("--doc-questions", type=int)
    ap.add_argument("--chat-system", type=int)
    ap.add_argument("--chat-convs", type=int)
    ap.add_argument("--chat-turns", type=int)
    ap.add_argument("--div-prefix", type=int, help="divergent shared prefix (multiple of chunk)")
    ap.add_argument("--div-requests", type=int)
    ap.add_argument("--nohit-prompts", type=int)
    ap.add_argument("--nohit-answer", type=int, help="output tokens per no-hit request")
    ap.add_argument("--num-spec-tokens", type=int)
    ap.add_argument("--chunk-size", type=int, help="ours + LMCache chunk (tokens)")
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--dtype")
    ap.add_argument("--enforce-eager", action="store_true", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument(
        "--gpu-cache-factor",
        type=float,
        help="GPU KV capacity as a multiple of the longest request (default 1.25)",
    )
    ap.add_argument("--cpu-gib", type=float, help="CPU tier of native/ours (GiB)")
    ap.add_argument("--disk-mode", choices=("fresh-engine", "small-cpu"))
    ap.add_argument(
        "--l3-dir", default="/tmp/bench-l3", help="ours_disk fs:// root (a subdir per run)"
    )
    ap.add_argument("--l3-settle-s", type=float, default=3.0, help="wait for L3 writes after fill")
    ap.add_argument("--memcpy-gib", type=float, default=1.0)
    ap.add_argument("--engine-timeout", type=float, default=900.0, help="per engine subprocess (s)")
    ap.add_argument("--seed", type=int)
    return ap.parse_args(argv)


def resolve_sizes(args: argparse.Namespace) -> Sizes:
    base = dry_run_sizes() if args.dry_run_cpu else Sizes()
    sizes = with_overrides(
        base,
        ttft_lengths=args.prompt_lengths,
        ttft_reps=args.ttft_reps,
        doc_lengths=args.doc_lengths,
        doc_questions=args.doc_questions,
        chat_system=args.chat_system,
        chat_convs=args.chat_convs,
        chat_turns=args.chat_turns,
        div_prefix=args.div_prefix,
        div_requests=args.div_requests,
        nohit_prompts=args.nohit_prompts,
        nohit_answer=args.nohit_answer,
        num_spec_tokens=args.num_spec_tokens,
        chunk_size=args.chunk_size,
        block_size=args.block_size,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        gpu_cache_factor=args.gpu_cache_factor,
        cpu_bytes=int(args.cpu_gib * GIB) if args.cpu_gib else None,
        lmcache_cpu_gb=args.cpu_gib,
        disk_mode=args.disk_mode,
        seed=args.seed,
    )
    if args.no_ttft_curve:
        sizes = with_overrides(sizes, ttft_lengths=())
    sizes.validate()
    return sizes


def versions() -> dict[str, str | None]:
    """Package versions without importing them (the parent must not initialise CUDA)."""
    out: dict[str, str | None] = {}
    for pkg in ("vllm", "torch", "lmcache", "vllm-draft-offload", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def child_env(dry_run: bool, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    if dry_run:
        for k, v in CPU_ENV.items():
            env.setdefault(k, v)
    env.update(extra)
    # the package under test must be importable from the worker even uninstalled
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    return env


def run_subprocess(
    cmd: list[str],
    env: dict[str, str],
    log: Path,
    timeout: float,
    leave_grace_s: float = LEAVE_GRACE_S,
) -> tuple[int, float]:
    """Run ``cmd`` in its own process group. On timeout (or Ctrl-C) kill the whole group;
    after a normal exit, reap what of it is left (``procs.reap_group``), so vLLM's
    EngineCore/worker children never outlive the run holding GPU memory."""
    t0 = time.perf_counter()
    with log.open("ab") as fh:
        rc, left_behind = run_in_group(cmd, env, fh, subprocess.STDOUT, timeout, leave_grace_s)
        if left_behind:
            fh.write(b"\n[run] killed engine processes left behind by the run\n")
    return (-9 if rc is None else rc), time.perf_counter() - t0


def measure_memcpy(out: Path, gib: float, dry_run: bool, timeout: float) -> dict[str, Any]:
    """Pinned H2D bandwidth, measured in a subprocess before any engine: the parent never
    touches CUDA, so vLLM's workers keep their default start method."""
    if dry_run:
        return {"gbps": None, "device": "cpu", "reason": "skipped in --dry-run-cpu"}
    path = out / "memcpy.json"
    rc, _ = run_subprocess(
        [sys.executable, *WORKER, "memcpy", str(path), "--gib", str(gib)],
        child_env(False, {}),
        out / "logs" / "memcpy.log",
        timeout,
    )
    if rc != 0 or not path.exists():
        return {
            "gbps": None,
            "device": None,
            "reason": f"memcpy probe failed (rc={rc}), see logs/memcpy.log",
        }
    return json.loads(path.read_text())


_ERROR_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception): [^\n]*)")
_GENERIC = ("Engine core initialization failed", "Worker proc", "subprocess exit code")


def error_lines(log: Path, limit: int = 5) -> list[str]:
    """Distinct specific error lines of an engine's log, first first.

    vLLM re-raises worker failures as "Engine core initialization failed. See root
    cause above", so the recorded exception alone would not say what broke; and a
    connector can log errors yet keep serving (without hits), which a run that ends
    "ok" should still show.
    """
    found: list[str] = []
    for line in tail(log, 2_000_000).splitlines():
        m = _ERROR_LINE.search(line)
        if m and not any(g in line for g in _GENERIC):
            msg = m.group(1).strip()[:500]
            if msg not in found:
                found.append(msg)
                if len(found) >= limit:
                    break
    return found


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_engine_job(
    job: dict[str, Any], name: str, out: Path, env: dict[str, str], timeout: float
) -> dict[str, Any]:
    jobs = out / "jobs"
    job_path = jobs / f"{name}.job.json"
    job["out"] = str(jobs / f"{name}.result.json")
    job_path.write_text(json.dumps(job, indent=1))
    log = out / "logs" / f"{name}.log"
    print(f"[bench] {name}: starting ({job['stage']})", flush=True)
    rc, wall = run_subprocess([sys.executable, *WORKER, "run", str(job_path)], env, log, timeout)
    res_path = Path(job["out"])
    rec: dict[str, Any] = (
        json.loads(res_path.read_text())
        if res_path.exists()
        else {
            "config": job["config"],
            "drafter": job["drafter"],
            "stage": job["stage"],
            "status": "running",
            "workloads": {},
            "ttft_curve": {},
        }
    )
    if rc != 0 and rec.get("status") in ("running", "ok"):
        # died without writing its own error: segfault, OOM kill, timeout, abort()
        rec["status"] = "timeout" if rc == -9 else "crashed"
        rec["error"] = f"subprocess exit code {rc}"
    rec["rc"] = rc
    rec["wall_s"] = wall
    rec["log"] = str(log.relative_to(out))
    rec["log_errors"] = error_lines(log)
    if rec.get("status") != "ok":
        rec["log_tail"] = tail(log)
    print(f"[bench] {name}: {rec['status']} in {wall:.0f}s", flush=True)
    return rec


def merge_stages(fill: dict[str, Any], restore: dict[str, Any]) -> dict[str, Any]:
    """ours_disk in fresh-engine mode: one record from the fill and restore engines."""
    rec = dict(restore)
    rec["stage"] = "fill+restore"
    rec["fill_engine"] = {
        k: fill.get(k) for k in ("status", "error", "engine", "wall_s", "rc", "log")
    }
    rec["workloads"] = restore.get("workloads") or fill.get("workloads", {})
    rec["ttft_curve"] = restore.get("ttft_curve") or fill.get("ttft_curve", {})
    totals = dict(fill.get("totals", {}))
    for k, v in restore.get("totals", {}).items():
        totals[k] = totals.get(k, 0.0) + v
    rec["totals"] = totals
    if fill.get("status") != "ok":
        rec["status"], rec["error"] = fill.get("status"), f"fill engine: {fill.get('error')}"
    rec["wall_s"] = (fill.get("wall_s") or 0) + (restore.get("wall_s") or 0)
    return rec


def l3_usage(path: Path) -> dict[str, int]:
    files = list(path.rglob("*.data")) if path.exists() else []
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def run_config(
    config: str,
    drafter: Drafter,
    args: argparse.Namespace,
    sizes: Sizes,
    model: str,
    vocab: int,
    workloads: list[str],
    ttft: bool,
    out: Path,
) -> dict[str, Any]:
    name = f"{config}--{drafter.method}-{Path(drafter.path).name}"
    l3_dir = (
        Path(args.l3_dir) / f"{out.name}-{name}-{os.getpid()}" if config == "ours_disk" else None
    )
    if l3_dir is not None:
        shutil.rmtree(l3_dir, ignore_errors=True)
        l3_dir.mkdir(parents=True)
    try:
        kwargs = engine_kwargs(config, model, drafter, sizes, f"fs://{l3_dir}" if l3_dir else None)
    except ValueError as exc:
        return {"config": config, "drafter": drafter.__dict__, "status": "error", "error": str(exc)}
    env = child_env(args.dry_run_cpu, engine_env(config, sizes))
    job = {
        "config": config,
        "drafter": {**drafter.__dict__, "label": drafter.label},
        "sizes": sizes.to_dict(),
        "vocab": vocab,
        "engine_kwargs": kwargs,
        "env": engine_env(config, sizes),
        "workloads": workloads,
        "ttft": ttft,
        "stage": "all",
        "settle_s": args.l3_settle_s,
    }
    try:
        if config == "ours_disk" and sizes.disk_mode == "fresh-engine":
            # Fill in one engine, restore in a fresh one: its CPU tier is empty, so every
            # hit must come from the L3 (fs://) tier.
            fill = run_engine_job(
                {**job, "stage": "fill"}, name + ".fill", out, env, args.engine_timeout
            )
            after_fill = l3_usage(l3_dir) if l3_dir else {}
            restore = run_engine_job(
                {
                    **job,
                    "stage": "restore",
                    "prior": str(out / "jobs" / f"{name}.fill.result.json"),
                },
                name + ".restore",
                out,
                env,
                args.engine_timeout,
            )
            rec = merge_stages(fill, restore)
            rec["l3_after_fill"] = after_fill
        else:
            rec = run_engine_job(job, name, out, env, args.engine_timeout)
        if l3_dir is not None:
            rec["l3_after_run"] = l3_usage(l3_dir)
    finally:
        if l3_dir is not None:
            shutil.rmtree(l3_dir, ignore_errors=True)
    rec["drafter"] = {**drafter.__dict__, "label": drafter.label}
    return rec


def read_model_limits(model: str) -> tuple[int, int | None]:
    """(vocab size, max positions) of the target, from its config.json."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "vocab_size" not in cfg else cfg
    pos = cfg.get("max_position_embeddings")
    return int(cfg["vocab_size"]), int(pos) if pos else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        data = json.loads(args.report_only.read_text())
        out = args.out or args.report_only.parent
        summary = write_report(data, out)
        _print_goals(summary)
        return 0
    out: Path = (args.out or Path("bench-out")).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    model = args.model or (str(Path(args.fixtures) / "target") if args.fixtures else None)
    if model is None:
        raise SystemExit("give --model or --fixtures")
    drafters = parse_drafters(args.drafters, args.fixtures)
    configs, workloads = _csv(args.configs), _csv(args.workloads)
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    sizes = resolve_sizes(args)
    vocab, max_pos = read_model_limits(model)
    if max_pos is not None and sizes.max_model_len() > max_pos:
        # every engine would fail the same way: say it once, before starting any
        raise SystemExit(
            f"the longest request needs max_model_len={sizes.max_model_len()} > the model's "
            f"{max_pos} positions; lower --doc-lengths / --prompt-lengths"
        )
    t0 = time.time()
    memcpy = measure_memcpy(out, args.memcpy_gib, args.dry_run_cpu, args.engine_timeout)
    data: dict[str, Any] = {
        "schema": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv if argv is None else ["vllm-draft-offload", "bench", *argv],
        "dry_run": args.dry_run_cpu,
        "device": {
            "name": "cpu" if args.dry_run_cpu else (memcpy.get("device") or "unknown"),
            "memcpy": memcpy,
        },
        "versions": versions(),
        "model": model,
        "vocab": vocab,
        "drafters": [{**d.__dict__, "label": d.label} for d in drafters],
        "configs": configs,
        "workloads": workloads,
        "sizes": sizes.to_dict(),
        "derived": {
            "max_model_len": sizes.max_model_len(),
            "num_gpu_blocks_override": sizes.num_gpu_blocks(),
            "gpu_cache_tokens": (sizes.num_gpu_blocks() - 1) * sizes.block_size,
        },
        "workload_params": {},
        "runs": [],
    }
    for w in workloads:
        wl = build_workload(w, sizes, vocab)
        data["workload_params"][w] = {
            **wl.params,
            "fill_digest": digest(wl.fill),
            "n_fill": len(wl.fill),
        }
    runs = [(config, i, drafter) for config in configs for i, drafter in enumerate(drafters)]
    for config, i, drafter in progress(runs, "bench"):
        ttft = bool(sizes.ttft_lengths) and (i == 0 or args.ttft_all_drafters)
        rec = run_config(config, drafter, args, sizes, model, vocab, workloads, ttft, out)
        data["runs"].append(rec)
        # rewritten after every engine: an interrupted run still has a usable JSON
        (out / "bench.json").write_text(json.dumps(data, indent=1))
    data["total_wall_s"] = time.time() - t0
    (out / "bench.json").write_text(json.dumps(data, indent=1))
    summary = write_report(data, out)
    _print_goals(summary)
    print(f"[bench] wrote {out}/bench.json, summary.md, *.png in {data['total_wall_s']:.0f}s")
    return 0


def _print_goals(summary: dict[str, Any]) -> None:
    for g in summary["goals"]:
        who = f" [{g['drafter']}]" if g.get("drafter") else ""
        print(f"[goal] {g['goal']}{who}: {g['message']}")
    for c in summary["checks"]:
        print(f"[warn] {c}")


if __name__ == "__main__":
    sys.exit(main())
