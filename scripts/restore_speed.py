#!/usr/bin/env python
"""TTFT of a restored prefix vs recompute, at real KV sizes (a Llama-3-8B shape).

    python scripts/restore_speed.py --out results/restore_speed.json [--tokens 16384]

Weights are random (`load_format="dummy"`): this measures bytes moved and time,
not acceptance. Every configuration runs in its own subprocess, one after
another, on the same prompts:

* `recompute`: prefix caching off, every prompt is prefilled;
* `native`: vLLM's OffloadingConnector, CPU tier;
* `ours`: DraftOffloadConnector, CPU tier.

Each runs with a `draft_model` drafter (a small Llama shape, same vocabulary),
so the drafter's KV is offloaded and restored too. For a hit, a prompt is
prefilled once, the GPU prefix cache is emptied, and the same prompt is sent
again with max_tokens=1: its latency is the restored TTFT. The pinned
host->device copy bandwidth is measured in the same run, as the physical limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
DRAFT_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
VOCAB = 128256


def write_config(path: Path, shape: dict[str, int], max_len: int) -> str:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        **shape,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def pinned_h2d_gbps(gib: float) -> float:
    import torch

    nbytes = int(gib * 2**30)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 0.0
    for _ in range(5):
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, nbytes / (start.elapsed_time(end) / 1000) / 1e9)
    return best


def connector_config(name: str, cpu_bytes: int, chunk: int) -> dict[str, Any] | None:
    if name == "native":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
        }
    if name == "ours":
        return {
            "kv_connector": "DraftOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "chunk_size": chunk},
        }
    return None


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """Child process: one engine, fresh vs hit TTFT over several prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = connector_config(args.config, args.cpu_gib * 2**30, args.chunk_size)
    llm = LLM(
        model=args.target,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.tokens + 64,
        max_num_batched_tokens=args.tokens + 64,
        gpu_memory_utilization=args.gpu_mem,
        enable_prefix_caching=args.config != "recompute",
        speculative_config={
            "method": "draft_model",
            "model": args.draft,
            "num_speculative_tokens": 3,
        }
        if args.draft
        else None,
        kv_transfer_config=transfer,
        disable_log_stats=False,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompt(seed: int) -> TokensPrompt:
        return TokensPrompt(
            prompt_token_ids=[
                (seed * 7919 + i * 131) % (VOCAB - 1000) + 500 for i in range(args.tokens)
            ]
        )

    def timed(p: TokensPrompt) -> tuple[float, int]:
        start = time.perf_counter()
        out = llm.generate([p], one, use_tqdm=False)[0]
        return time.perf_counter() - start, int(out.num_cached_tokens or 0)

    timed(prompt(10_000))  # compile/warm-up
    results: dict[str, Any] = {"config": args.config, "fresh_s": [], "hit_s": [], "hit_cached": []}
    for rep in range(args.reps):
        fresh_s, _ = timed(prompt(rep))
        results["fresh_s"].append(fresh_s)
        time.sleep(0.5)  # let stores land
        llm.reset_prefix_cache()
        hit_s, cached = timed(prompt(rep))
        results["hit_s"].append(hit_s)
        results["hit_cached"].append(cached)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--cpu-gib", type=int, default=24)
    parser.add_argument("--configs", default="recompute,native,ours")
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument("--gpu-mem", type=float, default=0.5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--draft", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.child).write_text(json.dumps(run_config(args)))
        return

    import torch
    import vllm

    work = Path(tempfile.mkdtemp(prefix="restore-speed-"))
    target = write_config(work / "target", LLAMA8B, args.tokens + 64)
    draft = None if args.no_draft else write_config(work / "draft", DRAFT_SHAPE, args.tokens + 64)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "shape": {"target": LLAMA8B, "draft": None if draft is None else DRAFT_SHAPE},
        "tokens": args.tokens,
        "chunk_size": args.chunk_size,
        "pinned_h2d_GBps": pinned_h2d_gbps(1.0),
        "kv_bytes_per_token": 2 * 2 * LLAMA8B["num_hidden_layers"] * 8 * 128
        + (0 if draft is None else 2 * 2 * DRAFT_SHAPE["num_hidden_layers"] * 8 * 128),
        "configs": {},
    }
    for config in args.configs.split(","):
        child_out = work / f"{config}.json"
        cmd = [
            sys.executable, __file__, "--out", args.out, "--child", str(child_out),
            "--target", target, "--config", config, "--tokens", str(args.tokens),
            "--reps", str(args.reps), "--chunk-size", str(args.chunk_size),
            "--cpu-gib", str(args.cpu_gib), "--gpu-mem", str(args.gpu_mem),
        ]  # fmt: skip
        if draft:
            cmd += ["--draft", draft]
        proc = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True)
        if proc.returncode != 0 or not child_out.exists():
            report["configs"][config] = {"error": proc.stderr[-3000:]}
        else:
            report["configs"][config] = json.loads(child_out.read_text())
        print(config, json.dumps(report["configs"][config])[:400], flush=True)
    summarize(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def summarize(report: dict[str, Any]) -> None:
    configs = report["configs"]
    recompute = configs.get("recompute", {})
    base = _median(recompute["fresh_s"]) if recompute.get("fresh_s") else None
    summary: dict[str, Any] = {"recompute_ttft_s": base}
    for name in ("native", "ours"):
        hit = configs.get(name, {}).get("hit_s")
        if not hit:
            continue
        steady = _median(hit[1:] or hit)
        cached = configs[name]["hit_cached"][-1]
        summary[name] = {
            "hit_ttft_s_steady": steady,
            "hit_ttft_s_first": hit[0],
            "cached_tokens": cached,
            "ratio_to_recompute": steady / base if base else None,
            # A lower bound on restore bandwidth: the whole hit TTFT counted as copy time.
            "restore_GBps_lower_bound": cached * report["kv_bytes_per_token"] / steady / 1e9,
        }
    if "native" in summary and "ours" in summary:
        summary["ours_vs_native_ttft"] = (
            summary["ours"]["hit_ttft_s_steady"] / summary["native"]["hit_ttft_s_steady"]
        )
    report["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
