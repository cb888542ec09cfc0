"""CPU time of the connector's per-step hooks in a decode-heavy batch, on the CPU.

    vllm-draft-offload hook-cost --out $OUT/hook_cost.json [--profile $OUT/hooks.prof]

Under CUDA graphs and async scheduling a small model's decode step is bound by the
engine's CPU work, so every microsecond the connector's hooks spend per step shows in
decode throughput (``decode-overhead``). This drives vLLM's real ``Scheduler`` and both
halves of ``DraftOffloadConnector`` (worker on CPU tensors of the shape's real geometry)
through the steps of ``decode-overhead``'s batch: ``--batch`` prompts prefilled in one
step, then decode steps of 1 + ``--spec-tokens`` tokens per request, every draft
accepted (``decode-overhead``'s dummy drafter accepts every one). Only the forward is
left out. The same steps run without a connector (``none``), and the report gives the
mean microseconds per decode step of the scheduler (``schedule`` +
``update_from_output``) and of each connector hook, on steps with and without stores,
in CPU time of the engine's thread (other work on the machine does not count).

``--shared-prefixes K --gpu-blocks N`` make it a load with hits instead: the prompts
share K prefixes (all but their last 64 tokens) and the KV cache holds N blocks, so
requests wait, evict each other's prefixes and restore them from the CPU tier (what the
soak's 64 streams do). Every step then counts (``*_all_steps``), prefills and restores
included, with the chunks each step loaded.

The worker's copies run on the CPU here (memmove, ``copy_path=memcpy``): on a GPU they
are enqueued instead, so ``copy_exec`` (the memmove) is reported apart and left out of
the hooks' figures; planning the copies (descriptors, merging) is in them, as on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.speed.hook_engine import OWN_TOKENS, Engine, blocks_per_request
from vllm_draft_offload.bench.speed.hook_report import compare, summarize
from vllm_draft_offload.bench.speed.shapes import SHAPES, has_windows

EXAMPLES = """examples:
  vllm-draft-offload hook-cost --out /tmp/hook_cost.json
  vllm-draft-offload hook-cost --batch 4 --decode-tokens 128 --profile /tmp/hooks.prof \\
      --out /tmp/hook_cost.json
  vllm-draft-offload hook-cost --batch 64 --prompt-tokens 4096 --decode-tokens 32 \\
      --shared-prefixes 8 --gpu-blocks 1200 --cpu-gib 4 --out /tmp/hook_cost_hits.json
"""
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

# What it times: no connector, and ours storing nothing or everything (decode-overhead's
# null and native configurations are other connectors, whose hooks it does not wrap).
CONFIGS = ("none", "idle", "store")


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("hook-cost", __doc__, EXAMPLES)
    parser.add_argument("--out", required=True)
    # Its simulated KV cache is full attention only: shapes with sliding windows are not
    # modelled here (restore-speed and decode-overhead run them in real engines).
    full_attention = sorted(name for name, (target, _) in SHAPES.items() if not has_windows(target))
    parser.add_argument("--shape", default="small", choices=full_attention)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--spec-tokens", type=int, default=3, help="drafts per step")
    parser.add_argument("--cpu-gib", type=float, default=2.0, help="the CPU tier")
    parser.add_argument(
        "--shared-prefixes",
        type=int,
        default=0,
        help=f"prompts share this many prefixes (all but their last {OWN_TOKENS} tokens); "
        "0: every prompt its own",
    )
    parser.add_argument(
        "--gpu-blocks", type=int, help="KV-cache blocks (default: the whole batch fits)"
    )
    parser.add_argument("--reps", type=int, default=3, help="batches per config, alternating")
    parser.add_argument(
        "--profile", help="a directory: cProfile stats of each config's first batch there"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("batch", "prompt_tokens", "decode_tokens", "chunk_size", "reps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: at least 1")
    need = blocks_per_request(args) + 1
    if args.gpu_blocks is not None and args.gpu_blocks < need:
        parser.error(f"--gpu-blocks: at least {need} (one request, and vLLM's null block)")
    if args.shared_prefixes < 0:
        parser.error("--shared-prefixes: at least 0")
    if args.shared_prefixes and args.prompt_tokens <= OWN_TOKENS:
        parser.error(f"--prompt-tokens: more than {OWN_TOKENS} with --shared-prefixes")
    # vLLM's CPU platform, in this process. No kernel runs (the scheduler and the
    # connector's memmoves only), so vLLM's CPU kernel library is not needed.
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    report: dict[str, Any] = {"args": vars(args), "configs": {c: [] for c in CONFIGS}}
    with tempfile.TemporaryDirectory(prefix="hook-cost-") as tmp:  # removed at the end
        work = Path(tmp)
        for rep in range(args.reps):
            for config in CONFIGS:
                engine = Engine(args, config, work)
                profiler = cProfile.Profile() if args.profile and rep == 0 else None
                if profiler is not None:
                    profiler.enable()
                engine.run(args)
                if profiler is not None:
                    profiler.disable()
                    Path(args.profile).mkdir(parents=True, exist_ok=True)
                    profiler.dump_stats(Path(args.profile) / f"{config}.prof")
                report["configs"][config].append(summarize(engine.clock.steps))
                del engine  # its KV and host pool, before the next engine allocates its own
    report["summary"] = compare(report["configs"])
    print(json.dumps(report["summary"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
