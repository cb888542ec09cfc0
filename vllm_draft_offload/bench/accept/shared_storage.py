"""Two vLLM engines, two processes, one GPU, one L3 directory: B hits what A wrote.

Engine A (writer) serves the fixture prompts (`docs/fixtures.md`, shared-prefix groups),
fresh, and lands their units in the `fs://` directory. Then engine B starts in its own
process with an empty CPU tier and sends the same prompts: their prefixes come from what
A wrote. Meanwhile A keeps serving new prompts, so both engines write to the directory
while B reads. Each engine gets a fixed `kv_cache_memory_bytes`: two engines cannot share
`gpu_memory_utilization` on one GPU.

`OUT/shared_storage.json` has, per prompt, B's tokens hit and its acceptance length
restored from L3 against A's fresh one, whether B's greedy output equals A's, the L3
lookup hits B's connector counted, how many prompts A wrote while B ran, and the GPU
and versions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import command_parser

EXAMPLES = """examples:
  vllm-draft-offload shared-storage --fixtures /root/fx --out $OUT/shared --enforce-eager
  vllm-draft-offload shared-storage --fixtures /root/fx --out $OUT/shared \\
      --spec-method draft_model --draft small-draft --prompt-tokens 4096 --kv-cache-gib 8
"""
# Both engines run this module again, as ``python -m``, with --role.
MODULE = "vllm_draft_offload.bench.accept.shared_storage"


def engine_kwargs(args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    fixtures = Path(args.fixtures)
    return {
        "model": str(fixtures / "target"),
        "dtype": "auto",
        "seed": 0,
        "max_model_len": max_len,
        "enable_prefix_caching": True,
        "enforce_eager": args.enforce_eager,
        "disable_log_stats": False,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
        # vLLM 0.33 still checks free memory against gpu_memory_utilization at start
        # (0.92 by default), which the other engine on the GPU makes fail.
        "gpu_memory_utilization": 0.4,
        "speculative_config": {
            "method": args.spec_method,
            "model": str(fixtures / args.draft),
            "num_speculative_tokens": args.num_spec,
        },
        "per_request_spec_decode_metrics": "summary",
        "kv_transfer_config": {
            "kv_connector": "DraftOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": int(args.cpu_gib * 2**30),
                "l3": {"enabled": True},
                "lmcache.remote_url": f"fs://{args.l3_dir}",
                "lmcache.extra_config": {"save_chunk_meta": True},
            },
        },
    }


def run_engine(args: argparse.Namespace) -> None:
    """Child: engine A (`--role writer`) or B (`--role reader`)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_draft_offload.bench.accept.engine import load_corpus, request_result
    from vllm_draft_offload.bench.fixtures.data import build_prompts
    from vllm_draft_offload.bench.workloads.summary import sum_prefix
    from vllm_draft_offload.bench.workloads.worker import snapshot_metrics

    work = Path(args.work)
    model = str(Path(args.fixtures) / "target")
    prompts = build_prompts(
        load_corpus(model),
        seed=0,
        num_prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
    )
    llm = LLM(**engine_kwargs(args, args.prompt_tokens + args.max_tokens + 64))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def serve(token_lists: list[list[int]]) -> list[dict[str, Any]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_lists], params)
        return [
            request_result(i, out, token_lists[i], prompts.group_of[i]).model_dump()
            for i, out in enumerate(outs)
        ]

    if args.role == "writer":
        results = serve(prompts.base)
        from vllm_draft_offload.bench.speed.l3_dir import wait_for_l3_files

        wait_for_l3_files(Path(args.l3_dir))
        (work / "a_ready.json").write_text(json.dumps({"requests": results}))
        # Keep writing new prompts until the reader is done.
        written, started = [], time.time()
        filler = 0
        while not (work / "stop").exists() and time.time() - started < args.limit_s:
            filler += 1
            other = build_prompts(
                load_corpus(model),
                seed=1000 + filler,
                num_prompts=1,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
            )
            llm.generate([TokensPrompt(prompt_token_ids=other.base[0])], params, use_tqdm=False)
            written.append(time.time())
        (work / "a_done.json").write_text(json.dumps({"filler_done_at": written}))
        return

    before = snapshot_metrics()
    started = time.time()
    results = serve(prompts.base)  # the same prompts A served: prefixes from A's units
    after = snapshot_metrics()
    counters = {
        "lookup_hit_chunks_l3": sum_prefix(
            after, "vllm:draft_offload_lookup_hit_chunks_total", tier="l3"
        )
        - sum_prefix(before, "vllm:draft_offload_lookup_hit_chunks_total", tier="l3"),
        "refusals": {k: v for k, v in after.items() if "draft_offload_refusals" in k},
        "fallbacks": {k: v for k, v in after.items() if "draft_offload_fallbacks" in k},
    }
    (work / "b_done.json").write_text(
        json.dumps({"requests": results, "counters": counters, "window": [started, time.time()]})
    )


def _acceptance(requests: list[dict[str, Any]]) -> float | None:
    drafts = sum(r["num_drafts"] or 0 for r in requests)
    accepted = sum(r["num_accepted"] or 0 for r in requests)
    return 1 + accepted / drafts if drafts else None


def summarize(
    a: list[dict[str, Any]], b: dict[str, Any], filler_done_at: list[float]
) -> dict[str, Any]:
    """Per prompt: B's hit tokens and acceptance restored from A's units vs A's fresh."""
    from vllm_draft_offload.bench.accept.compare import ratio

    per_prompt = [
        {
            "prompt_tokens": fresh["prompt_len"],
            "b_hit_tokens": restored["num_cached_tokens"],
            "acceptance_fresh_a": fresh["acceptance_length"],
            "acceptance_restored_b": restored["acceptance_length"],
            "acceptance_ratio": ratio(restored["acceptance_length"], fresh["acceptance_length"]),
            "same_output": fresh["output_token_ids"] == restored["output_token_ids"],
        }
        for fresh, restored in zip(a, b["requests"], strict=True)
    ]
    start, end = b["window"]
    return {
        "per_prompt": per_prompt,
        "summary": {
            "b_hit_tokens_total": sum(p["b_hit_tokens"] or 0 for p in per_prompt),
            "prompt_tokens_total": sum(p["prompt_tokens"] for p in per_prompt),
            "acceptance_restored_over_fresh": ratio(_acceptance(b["requests"]), _acceptance(a)),
            "outputs_equal": sum(p["same_output"] for p in per_prompt),
            "b_l3_lookup_hit_chunks": b["counters"]["lookup_hit_chunks_l3"],
            "a_prompts_written_while_b_ran": sum(start <= t <= end for t in filler_done_at),
        },
        "b_counters": b["counters"],
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = command_parser("shared-storage", __doc__, EXAMPLES)
    ap.add_argument(
        "--fixtures", required=True, help="fixture dir from `vllm-draft-offload fixtures`"
    )
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--spec-method", default="eagle3")
    ap.add_argument("--draft", default="eagle3", help="fixture dir of the drafter")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-cache-gib", type=float, default=8.0, help="per engine")
    ap.add_argument("--cpu-gib", type=float, default=8.0, help="CPU tier per engine")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--l3-dir", help="shared fs:// directory (default: OUT/l3)")
    ap.add_argument("--limit-s", type=float, default=900.0)
    ap.add_argument("--role", choices=["writer", "reader"], help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        run_engine(args)
        return

    from vllm_draft_offload.bench.accept.check import child_env, collect_env

    out: Path = args.out
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    args.l3_dir = args.l3_dir or str(out / "l3")
    base = [sys.executable, "-m", MODULE, *argv, "--l3-dir", args.l3_dir, "--work", str(work)]
    env = child_env()
    logs = {role: open(out / f"{role}.log", "w") for role in ("writer", "reader")}  # noqa: SIM115
    writer = subprocess.Popen(
        [*base, "--role", "writer"], env=env, stdout=logs["writer"], stderr=subprocess.STDOUT
    )
    deadline = time.time() + args.limit_s
    while not (work / "a_ready.json").exists():
        if writer.poll() is not None or time.time() > deadline:
            raise SystemExit(f"writer failed; see {out / 'writer.log'}")
        time.sleep(1)
    # A is up and keeps writing; B starts now, on the same GPU, with an empty CPU tier.
    reader = subprocess.run(
        [*base, "--role", "reader"], env=env, stdout=logs["reader"], stderr=subprocess.STDOUT,
        timeout=args.limit_s,
    )  # fmt: skip
    (work / "stop").touch()
    writer.wait(timeout=600)
    if reader.returncode != 0 or not (work / "b_done.json").exists():
        raise SystemExit(f"reader failed; see {out / 'reader.log'}")

    report = summarize(
        json.loads((work / "a_ready.json").read_text())["requests"],
        json.loads((work / "b_done.json").read_text()),
        json.loads((work / "a_done.json").read_text())["filler_done_at"],
    )
    report["env"] = collect_env().model_dump()
    report["setup"] = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in ("role", "work")
    }
    (out / "shared_storage.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
