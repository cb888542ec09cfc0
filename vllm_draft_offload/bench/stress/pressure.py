"""Pressure run: the connector when the GPU cache and the CPU tier both evict.

Per drafter, three engines run the same request list (same order, same number of
concurrent streams, greedy) one after another, each in its own subprocess:

* ``reference``: no connector, no prefix cache (every token computed);
* ``control``: no connector, GPU prefix cache on, same GPU KV capacity: its outputs
  differ from the reference only by numerics (cached vs computed, batch shapes);
* ``ours``: `DraftOffloadConnector` with a CPU tier of ``--cpu-fraction`` x the working
  set and (``--l3 fs``) an LMCache fs:// storage tier behind it.

The working set is ``--ws-factor`` x the GPU KV capacity (``num_gpu_blocks_override``).
Writes ``OUT/pressure.json`` and ``OUT/pressure.md``; see docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import add_eager_or_compile, command_parser
from vllm_draft_offload.bench.progress import progress
from vllm_draft_offload.bench.stress.engine import dtype_bytes, kv_bytes_per_token
from vllm_draft_offload.bench.stress.flips import NEAR_TIE_NATS, add_near_tie_option
from vllm_draft_offload.bench.stress.jobs import (
    EngineShape,
    build_kwargs,
    cpu_tier_bytes,
    run_header,
    run_job,
    worker_env,
)
from vllm_draft_offload.bench.stress.load import plan_pressure
from vllm_draft_offload.bench.stress.pressure_summary import pressure_summary
from vllm_draft_offload.bench.stress.report_markdown import pressure_markdown
from vllm_draft_offload.bench.workloads.run import read_model_limits
from vllm_draft_offload.bench.workloads.specs import parse_drafters

ROLES: dict[str, str] = {"reference": "none", "control": "gpu_prefix", "ours": "ours_cpu"}
EXAMPLES = """examples:
  vllm-draft-offload pressure --fixtures /root/fx --out /root/pressure
  vllm-draft-offload pressure --fixtures /root/fx --out /root/pressure-bi --batch-invariant
  vllm-draft-offload pressure --fixtures /tmp/fx --out /tmp/p --dry-run-cpu --drafters self-draft
  vllm-draft-offload pressure --report-only /root/pressure/pressure.json --out /tmp/rep
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = command_parser("pressure", __doc__, EXAMPLES)
    ap.add_argument("--fixtures", help="fixture dir from `vllm-draft-offload fixtures`")
    ap.add_argument("--model", help="target model dir (default FIXTURES/target)")
    ap.add_argument("--drafters", default="eagle3,small-draft", help="fixture names or M:PATH")
    ap.add_argument("--out", type=Path, default=Path("pressure-out"))
    ap.add_argument("--report-only", type=Path, metavar="JSON")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny sizes, CPU engine args")
    ap.add_argument("--streams", type=int, help="concurrent streams (64; dry run 8)")
    ap.add_argument("--rounds", type=int, help="passes over the prefixes (3; dry run 2)")
    ap.add_argument("--prefix-len", type=int, help="shared prefix tokens (1024; dry run 64)")
    ap.add_argument("--suffix-len", type=int, help="per-request tokens after it (64; 16)")
    ap.add_argument("--answer", type=int, help="output tokens (32; 8)")
    ap.add_argument("--ws-factor", type=float, default=3.2, help="working set / GPU KV capacity")
    ap.add_argument("--gpu-factor", type=float, default=1.1, help="GPU KV / running streams")
    ap.add_argument("--cpu-fraction", type=float, default=0.5, help="CPU tier / working set")
    ap.add_argument("--l3", choices=("fs", "none"), default="fs", help="storage tier of ours")
    ap.add_argument("--l3-dir", type=Path, default=Path("/tmp/pressure-l3"))
    ap.add_argument(
        "--l3-hit-policy",
        choices=("cost", "always"),
        help="l3.hit_policy of ours (default: the connector's, cost). With a small "
        "--cpu-fraction, `always` makes storage serve what the CPU tier dropped even "
        "where recompute is faster: the run then checks storage restores under pressure",
    )
    ap.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1")
    add_near_tie_option(ap)
    ap.add_argument("--dtype", help="engine dtype (auto; dry run float32)")
    add_eager_or_compile(ap)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--engine-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _pick(value: Any, gpu: Any, cpu: Any, dry: bool) -> Any:
    return value if value is not None else (cpu if dry else gpu)


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
    chunk, block = (32, 32) if dry else (256, 16)
    dtype = _pick(args.dtype, "auto", "float32", dry)
    plan = plan_pressure(
        streams=_pick(args.streams, 64, 8, dry),
        prefix_len=_pick(args.prefix_len, 1024, 64, dry),
        suffix_len=_pick(args.suffix_len, 64, 16, dry),
        answer=_pick(args.answer, 32, 8, dry),
        rounds=_pick(args.rounds, 3, 2, dry),
        block_size=block,
        ws_factor=args.ws_factor,
        gpu_factor=args.gpu_factor,
        seed=args.seed,
    )
    if plan.prefix_len % chunk:
        raise SystemExit(f"--prefix-len {plan.prefix_len} must be a multiple of the chunk {chunk}")
    vocab, _ = read_model_limits(model)
    req_len = plan.prefix_len + plan.suffix_len + plan.answer + args.num_spec_tokens + 1
    max_model_len = math.ceil(req_len / block) * block
    data: dict[str, Any] = {
        **run_header("pressure", "vllm-draft-offload pressure", argv, dry, args.batch_invariant),
        "model": model,
        "plan": plan.to_dict(),
        "chunk_size": chunk,
        "l3": args.l3,
        "l3_hit_policy": args.l3_hit_policy or "cost",
        "cpu_fraction": args.cpu_fraction,
        "near_tie_nats": NEAR_TIE_NATS if args.near_tie_nats is None else args.near_tie_nats,
        "runs": [],
    }
    env = worker_env(dry, args.batch_invariant)
    t0 = time.time()
    for drafter in progress(parse_drafters(args.drafters, args.fixtures), "pressure", "drafter"):
        elem = dtype_bytes(dtype, model)
        bpt = kv_bytes_per_token(model, elem) + kv_bytes_per_token(drafter.path, elem)
        cpu_bytes = cpu_tier_bytes(args.cpu_fraction, plan.working_set_tokens, bpt, chunk)
        shape = EngineShape(
            model=model,
            drafter=drafter,
            block_size=block,
            chunk_size=chunk,
            num_spec_tokens=args.num_spec_tokens,
            dtype=dtype,
            enforce_eager=dry or not args.compile,
            gpu_memory_utilization=0.3 if dry else 0.5,
            max_num_seqs=plan.streams,
            max_num_batched_tokens=max(512, max_model_len) if dry else None,
            max_model_len=max_model_len,
            gpu_blocks=plan.gpu_tokens // block + 1,  # vLLM holds one null block back
            seed=args.seed,
        )
        for role, config in ROLES.items():
            l3_dir = args.l3_dir / f"{out.name}-{drafter.method}-{Path(drafter.path).name}"
            kw_config, l3_url = config, None
            if role == "ours" and args.l3 == "fs":
                shutil.rmtree(l3_dir, ignore_errors=True)
                l3_dir.mkdir(parents=True)
                kw_config, l3_url = "ours_disk", f"fs://{l3_dir}"
            job = {
                "mode": "pressure",
                "dry_run": dry,
                "plan": plan.to_dict(),
                "vocab": vocab,
                "engine_kwargs": build_kwargs(
                    kw_config,
                    shape,
                    cpu_bytes=cpu_bytes,
                    l3_url=l3_url,
                    staging_mb=64,
                    l3_hit_policy=args.l3_hit_policy,
                ),
            }
            name = f"{role}--{drafter.method}-{Path(drafter.path).name}"
            try:
                rec = run_job(job, name, out, env, args.engine_timeout)
            finally:
                if l3_url:
                    shutil.rmtree(l3_dir, ignore_errors=True)
            rec.update(
                role=role,
                drafter={**drafter.__dict__, "label": drafter.label},
                engine_kwargs=job["engine_kwargs"],
                kv_bytes_per_token_estimate=bpt,
                cpu_bytes=cpu_bytes if role == "ours" else None,
            )
            data["runs"].append(rec)
            (out / "pressure.json").write_text(json.dumps(data))
    data["total_wall_s"] = time.time() - t0
    return _write(data, out)


def _write(data: dict[str, Any], out: Path) -> int:
    data["summary"] = pressure_summary(data)
    (out / "pressure.json").write_text(json.dumps(data))
    (out / "pressure.md").write_text(pressure_markdown(data))
    for row in data["summary"]["rows"]:
        print(f"[pressure] {row['drafter']}: {row['verdict']} ({', '.join(row['failed']) or 'ok'})")
    print(f"[pressure] wrote {out}/pressure.json, pressure.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
