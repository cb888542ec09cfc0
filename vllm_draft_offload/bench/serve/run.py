"""``vllm bench serve`` against ``vllm serve``, without and with DraftOffloadConnector.

For a fixture family (``vllm-draft-offload fixtures``), each run starts ``vllm serve``
of the target and its drafter, with a GPU KV cache fixed smaller than the workload's
shared prefixes (so a prefix leaves the GPU before it comes back), waits for
``/health``, scrapes ``/metrics`` every second into ``OUT/RUN/metrics.prom``, runs
``vllm bench serve --dataset-name prefix_repetition`` and stops the server. Run
``none`` has no KV connector; ``ours_cpu`` adds
``--kv-transfer-config {"kv_connector":"DraftOffloadConnector",...}`` with a CPU tier
that holds every prefix.

Writes ``OUT/serve_bench.json`` (both runs: TTFT, TPOT, throughput, GPU and external
prefix-cache hits, spec-decode acceptance, the connector's hit/byte/acceptance
counters; commands, GPU and versions) and ``OUT/serve_bench.md`` (the comparison
table), and per run ``server.log``, ``bench.log``, ``bench.json`` (the client's own
result, per request) and ``metrics.prom`` (input of ``dashboard-render``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import add_eager_or_compile, command_parser
from vllm_draft_offload.bench.procs import reap_group
from vllm_draft_offload.bench.serve.plan import (
    CPU_WORKLOAD,
    GPU_WORKLOAD,
    RUNS,
    ServePlan,
    Workload,
    fixture_spec_method,
)

EXAMPLES = """examples:
  vllm-draft-offload serve-bench --fixtures /root/fx --out $OUT/serve
  vllm-draft-offload serve-bench --fixtures /root/fx --out $OUT/serve --draft small-draft \\
      --prefix-len 8192 --num-prefixes 16 --gpu-kv-tokens 65536
  vllm-draft-offload serve-bench --fixtures /tmp/fx --out /tmp/serve --dry-run-cpu
  vllm-draft-offload serve-bench --fixtures /root/fx --out /tmp/serve --print-commands
  vllm-draft-offload serve-bench --fixtures /root/fx --out $OUT/serve --report-only
"""
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
STOP_GRACE_S = 30.0  # vllm serve drains and exits on SIGINT; past this, the group is killed


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser("serve-bench", __doc__, EXAMPLES)
    ap.add_argument("--fixtures", required=True, type=Path, help="`fixtures --out` directory")
    ap.add_argument("--out", required=True, type=Path, help="results directory")
    add_eager_or_compile(ap)
    ap.add_argument(
        "--draft", default="eagle3", help="drafter fixture dir (default eagle3); 'none': no spec"
    )
    ap.add_argument("--spec-method", help="default: the drafter's fixture_meta.json")
    ap.add_argument("--num-spec", type=int, default=3, help="speculative tokens (default 3)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"subset of {','.join(RUNS)}")
    ap.add_argument("--dry-run-cpu", action="store_true", help="vLLM on the CPU, small sizes")
    w = ap.add_argument_group("workload (defaults: a ~3 min GPU run; smaller with --dry-run-cpu)")
    w.add_argument("--prefix-len", type=int, help=f"default {GPU_WORKLOAD.prefix_len}")
    w.add_argument("--suffix-len", type=int, help=f"default {GPU_WORKLOAD.suffix_len}")
    w.add_argument("--num-prefixes", type=int, help=f"default {GPU_WORKLOAD.num_prefixes}")
    w.add_argument("--output-len", type=int, help=f"default {GPU_WORKLOAD.output_len}")
    w.add_argument("--num-prompts", type=int, help=f"default {GPU_WORKLOAD.num_prompts}")
    w.add_argument("--max-concurrency", type=int, help=f"default {GPU_WORKLOAD.max_concurrency}")
    w.add_argument("--request-rate", type=float, default=math.inf, help="default inf")
    s = ap.add_argument_group("server")
    s.add_argument(
        "--gpu-kv-tokens",
        type=int,
        help="GPU KV cache in tokens, below the prefixes' total (default: a quarter of "
        "it, or the concurrent requests' tokens + 25%%, whichever is more)",
    )
    s.add_argument("--block-size", type=int, help="default 16 (32 with --dry-run-cpu)")
    s.add_argument("--chunk-size", type=int, help="connector chunk_size (default 256; CPU 64)")
    s.add_argument("--cpu-gib", type=float, help="connector CPU tier (default 4; CPU 0.25)")
    s.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=1 << 30,
        help="passed to vllm serve only to skip its memory profiling (default 1 GiB)",
    )
    s.add_argument("--port", type=int, default=0, help="default: a free port per run")
    s.add_argument("--startup-timeout", type=float, default=600.0)
    s.add_argument("--bench-timeout", type=float, default=900.0)
    s.add_argument("--scrape-interval", type=float, default=1.0, help="seconds (default 1)")
    m = ap.add_argument_group("modes").add_mutually_exclusive_group()
    m.add_argument("--print-commands", action="store_true", help="print the plan, run nothing")
    m.add_argument("--report-only", action="store_true", help="rebuild the report from OUT")
    return ap


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_plan(args: argparse.Namespace) -> ServePlan:
    """The plan the options describe (defaults by GPU or --dry-run-cpu); ValueError
    naming the option when the run could not measure offloading."""
    cpu = args.dry_run_cpu
    base = CPU_WORKLOAD if cpu else GPU_WORKLOAD
    given = {
        f: getattr(args, f)
        for f in (
            "prefix_len", "suffix_len", "num_prefixes", "output_len", "num_prompts",
            "max_concurrency",
        )
        if getattr(args, f) is not None
    }  # fmt: skip
    workload: Workload = replace(base, request_rate=args.request_rate, **given)
    block = args.block_size or (32 if cpu else 16)  # CPU attention wants multiples of 32
    kv_tokens = args.gpu_kv_tokens
    if kv_tokens is None:
        # a quarter of the prefixes, but room for the concurrent requests (+25%)
        room = math.ceil(workload.max_concurrency * workload.request_tokens * 1.25 / block)
        kv_tokens = max(workload.working_set_tokens // 4 // block, room) * block
    draft = None if args.draft == "none" else args.draft
    spec_method = args.spec_method
    if draft is not None:
        if not (args.fixtures / draft / "config.json").exists():
            raise ValueError(f"--draft={draft}: no {args.fixtures / draft / 'config.json'}")
        spec_method = spec_method or fixture_spec_method(args.fixtures / draft)
    if not (args.fixtures / "target" / "tokenizer.json").exists():
        raise ValueError(
            f"--fixtures={args.fixtures}: no target/tokenizer.json (build the fixtures with "
            "`vllm-draft-offload fixtures`)"
        )
    plan = ServePlan(
        fixtures=args.fixtures,
        draft=draft,
        spec_method=spec_method,
        num_spec=args.num_spec if draft else 0,
        workload=workload,
        block_size=block,
        gpu_kv_tokens=kv_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        chunk_size=args.chunk_size or (64 if cpu else 256),
        cpu_bytes=int((args.cpu_gib or (0.25 if cpu else 4.0)) * 2**30),
        port=args.port,
        enforce_eager=not args.compile,
    )
    plan.check()
    return plan


def child_env(dry_run_cpu: bool) -> dict[str, str]:
    from vllm_draft_offload.bench.accept.check import child_env as engine_env

    env = engine_env()
    if dry_run_cpu:
        env.update(CPU_ENV)
    return env


# ------------------------------------------------------------------------ running


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Seconds until ``url`` answered 200; RuntimeError if the server exits or times out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> float:
    """SIGINT (vLLM's clean shutdown), then the whole process group (engine core,
    workers) by SIGTERM and SIGKILL if it lingers. Seconds it took."""
    started = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    # vLLM's engine-core process leaves with its parent: give it a moment, then take
    # whatever of the group is left (it would hold the GPU's memory for the next run)
    reap_group(proc.pid)
    return time.monotonic() - started


def probe_prompt(plan: ServePlan) -> str:
    """One prompt of the workload's shape, built as ``vllm bench serve`` builds its own
    (vLLM's prefix_repetition sampler and the fixture's tokenizer), from another seed so
    that its prefix is none of the workload's."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer

    w = plan.workload
    (request,) = PrefixRepetitionRandomDataset(random_seed=plan.seed + 1).sample(
        get_tokenizer(str(plan.target)), num_requests=1, prefix_len=w.prefix_len,
        suffix_len=w.suffix_len, num_prefixes=1, output_len=w.output_len,
    )  # fmt: skip
    return str(request.prompt)


def probe_request(plan: ServePlan, prompt: str, timeout_s: float) -> float:
    """Send one request as the bench client does (``/v1/completions``, streamed, greedy,
    ``ignore_eos``) before the benchmark. The client reports a refused request only by
    its HTTP reason ("Bad Request", 256 times in session 8 on an H100); this raises
    with the server's own error text instead. Seconds it took."""
    payload = {
        "model": str(plan.target), "prompt": prompt, "max_tokens": plan.workload.output_len,
        "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    req = urllib.request.Request(
        f"{plan.base_url}/v1/completions", data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace").strip()
        raise RuntimeError(
            f"the server refused a request of the workload's shape: HTTP {e.code} "
            f"{e.reason}: {body[:2000]}"
        ) from e
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"a request of the workload's shape got no answer: {e}") from e
    return time.monotonic() - started


def run_one(
    plan: ServePlan, run: str, out: Path, args: argparse.Namespace, probe: str
) -> dict[str, Any]:
    """One server + one bench client, after the request `probe`; the timings (and
    error) of the run."""
    from vllm_draft_offload.bench.serve.scrape import Scraper

    out.mkdir(parents=True, exist_ok=True)
    plan = replace(plan, port=plan.port or free_port())
    server_cmd = plan.server_argv(sys.executable, run)
    bench_cmd = plan.bench_argv(sys.executable, out, run)
    (out / "commands.json").write_text(
        json.dumps({"server": server_cmd, "bench": bench_cmd}, indent=1)
    )
    env = child_env(args.dry_run_cpu)
    info: dict[str, Any] = {"port": plan.port}
    with (out / "server.log").open("wb") as log:
        server = subprocess.Popen(
            server_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        scraper = None
        try:
            info["startup_s"] = wait_healthy(
                f"{plan.base_url}/health", server, args.startup_timeout
            )
            # before the first scrape: the counters' increase leaves the probe out
            info["probe_s"] = probe_request(plan, probe, args.bench_timeout)
            scraper = Scraper(
                f"{plan.base_url}/metrics", out / "metrics.prom", args.scrape_interval
            )
            scraper.start()
            started = time.monotonic()
            with (out / "bench.log").open("wb") as bench_log:
                bench = subprocess.run(
                    bench_cmd, env=env, stdout=bench_log, stderr=subprocess.STDOUT,
                    timeout=args.bench_timeout, check=False,
                )  # fmt: skip
            info["bench_s"] = time.monotonic() - started
            if bench.returncode != 0:
                raise RuntimeError(f"vllm bench serve exited with {bench.returncode}")
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            info["error"] = f"{e} (see {out}/server.log, bench.log)"
        finally:
            if scraper is not None:
                scraper.stop()
                info["scrapes"], info["scrape_errors"] = scraper.scrapes, len(scraper.errors)
            info["stop_s"] = stop_server(server)
            info["server_returncode"] = server.returncode
    return info


def summarize(out: Path, runs: list[str], infos: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every run's summary from its files in ``OUT/RUN`` (also for --report-only)."""
    from vllm_draft_offload.bench.serve.report import load_bench_result, same_outputs, summarize_run
    from vllm_draft_offload.bench.serve.scrape import read_scrapes

    results: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, Any]] = {}
    for run in runs:
        d, info = out / run, infos.get(run, {})
        if "error" in info or not (d / "bench.json").exists():
            results[run] = {**info, "error": info.get("error", f"no {d / 'bench.json'}")}
            continue
        raw[run] = load_bench_result(d / "bench.json")
        log = (d / "server.log").read_text(errors="replace") if (d / "server.log").exists() else ""
        results[run] = {**info, **summarize_run(raw[run], read_scrapes(d / "metrics.prom"), log)}
    same = same_outputs(raw["none"], raw["ours_cpu"]) if len(raw) == 2 else None
    return {"runs": results, "same_outputs": same}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or set(runs) - set(RUNS):
        ap.error(f"--runs={args.runs}: pick from {','.join(RUNS)}")
    plan = None
    if not args.report_only:  # the report reads what the run recorded, plan.json too
        try:
            plan = make_plan(args)
        except ValueError as e:
            ap.error(str(e))
    if args.print_commands:
        assert plan is not None
        out = args.out
        print(json.dumps({
            "plan": plan.to_dict(),
            "runs": {
                run: {
                    "server": plan.server_argv(sys.executable, run),
                    "bench": plan.bench_argv(sys.executable, out / run, run),
                }
                for run in runs
            },
        }, indent=1))  # fmt: skip
        return 0

    from vllm_draft_offload.bench.accept.check import collect_env
    from vllm_draft_offload.bench.progress import progress
    from vllm_draft_offload.bench.serve.report import markdown

    args.out.mkdir(parents=True, exist_ok=True)
    files = {name: args.out / f"{name}.json" for name in ("runs_info", "env", "plan")}
    if args.report_only:
        missing = [str(p) for p in files.values() if not p.exists()]
        if missing:
            ap.error(f"--report-only: {', '.join(missing)} missing (run serve-bench first)")
        infos, env, setup = (json.loads(p.read_text()) for p in files.values())
    else:
        assert plan is not None
        setup = plan.to_dict()
        files["plan"].write_text(json.dumps(setup, indent=1))
        infos = {}
        probe = probe_prompt(plan)  # the same request for every run
        for run in progress(runs, "serve-bench", unit="server"):
            infos[run] = run_one(plan, run, args.out / run, args, probe)
            print(f"[serve-bench] {run}: {json.dumps(infos[run])}", flush=True)
            files["runs_info"].write_text(json.dumps(infos, indent=1))
        # only now: collect_env initialises CUDA in this process, the servers are gone
        env = collect_env().model_dump()
        files["env"].write_text(json.dumps(env, indent=1))
    result = {"env": env, "setup": setup, **summarize(args.out, list(infos), infos)}
    (args.out / "serve_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (args.out / "serve_bench.md").write_text(table)
    print(table)
    ok = all("error" not in r and not r["bench"].get("failed") for r in result["runs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
