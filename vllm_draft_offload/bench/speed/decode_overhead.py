"""Decode throughput with the connector storing every chunk vs no connector, and the
multi-turn decode-KV reuse check, at the Llama-8B and 1B shapes (issue 13, item 3).

    vllm-draft-offload decode-overhead --out $OUT/decode_overhead.json [--shape small,llama8b]

Weights are random (``load_format="dummy"``), with a ``draft_model`` drafter of the
shape's (restore-speed's shapes: ``llama8b`` 32 layers + a 4-layer drafter, ``small`` a
Llama-3.2-1B geometry + a 2-layer drafter). Per shape, each configuration runs in its
own engine (a child process), one after another, ``--rounds`` times alternating:

* ``none``: no KV connector (GPU prefix caching on, as in ``store``);
* ``idle``: DraftOffloadConnector, CPU tier, with ``min_store_tokens`` above every
  request's length: its hooks run every step, nothing is stored (what the connector
  costs per step, apart from its copies);
* ``store``: DraftOffloadConnector, CPU tier, ``store_decode`` on: every whole chunk of
  every request is stored, the prompt's while the batch decodes and the answer's as it
  is produced; no request ever hits (every prompt is new);
* ``null``: a connector whose every hook returns at once (``null_connector.py``): what
  vLLM's connector plumbing costs by itself (``null_vs_none``), so that ``idle`` over
  ``null`` is our connector's own per-step cost;
* ``native``: vLLM's OffloadingConnector with the same CPU budget, storing every block
  (the side-by-side for ``store``);
* ``store_dma`` / ``store_kernel``: ``store`` with every copy on DMA (``copy_path``
  memcpy) or on the page kernel (``kernel``), whatever ``--copy-path`` says: what
  each path's stores cost decode, side by side (``store_dma_vs_none``,
  ``store_kernel_vs_none``);
* ``store_thread``: ``store`` with ``store_thread`` on, the store copies issued on a
  thread of their own;
* ``store_decode_dma`` / ``store_decode_kernel``: ``store`` without staging and with
  ``decode_stores_dma`` on (a decode-only step's stores by DMA, a step's with prompt
  tokens as ``copy_path`` says) or off (every store as ``copy_path`` says);
* ``store_staged``: ``store`` with ``store_staging_units`` 8: every store gathered by
  the pair kernel into a GPU buffer, then one DMA a unit. ``store`` itself takes the
  default, which stages on CUDA through up to 8 units (staged_stores.staging_units);
* ``store_staged1``: ``store`` with a one-unit staging buffer: one region, so each unit
  is gathered and then moved with nothing overlapped (since session 33 a larger buffer's
  halves overlap one wave's gather with the previous wave's DMAs);
* ``store_unstaged``: ``store`` with staging off (the default before session 32:
  ``decode_stores_dma``'s default, on where every page is at least 48 KiB).

Besides decode tokens/s, each pair gives its batches' prefill seconds, storing over
opting out (``paired_prefill``; the table's ``prefill_on_vs_off``): a batch's wall time
less its decode span, where its prompts are prefilled and stored.

The output file is rewritten after every engine (``complete`` false, no table, until
the last has run), so a run cut short keeps the engines that finished; the log gives
each engine's decode tokens/s per batch.

``--profile`` adds one batch per engine under ``torch.profiler`` (engine in the child's
process): its wall time, the GPU's busy time (kernels and copies, summed), and the
top operations by CPU and by GPU time, in ``profile``. A gap between two engines that
shows in wall time and not in GPU time is host-side (launches, hooks, syncs).

Each engine decodes ``--reps`` pairs of batches of ``--batch`` new prompts of
``--prompt-tokens`` tokens, ``--decode-tokens`` tokens each (greedy, EOS ignored), after
a warm-up batch. A pair is an ``on`` batch and an ``off`` batch, in alternating order;
in an engine that stores, the ``off`` batch's requests opt out of stores
(``kv_transfer_params={"draft_offload": {"store": false}}``), so the pair's ratio is
what the stores cost, with the engine's own speed (which differed by up to 1.3 x
between engines of one config on an H100, session 16) divided out. In every other
engine both batches are plain, and their ratios are the method's noise floor.
``--no-paired``: ``on`` batches only. Decode throughput is the batch's output tokens
after the first, over the time from the last request's first token to the last
request's last token (the engine's own timestamps); ``store_vs_none`` is the median of
``store``'s ``on`` batches over the median of ``none``'s (the goal: >= 0.97),
``idle_vs_none`` the same for ``idle``; ``paired`` gives per config the median on/off
ratio of its pairs, a bootstrap 95 % interval of that median, and their range, and
``store_off_vs_none`` the storing engines' ``off`` batches over ``none`` (what the
connector costs apart from its stores, across engines).
``stored_fraction``: chunks the connector stored over the most a batch can have
(``decode_report.whole_chunks``: every token of prompt and answer, which the 8B runs'
batches reached).

Every batch records what the machine did meanwhile (``reps[].machine``,
``bench/machine_state.py``): CPU time stolen by the hypervisor, the host's busy share,
the GPU's SM clock and NVML's reasons for holding it down; ``summary.machine`` gives per
config each field's range and its rank correlation with the batches' decode tokens/s,
so a spread between batches can be told to come from the machine or not.
``--pool A.json B.json ...`` runs nothing: it pools the engines of earlier output files
per shape and config, and writes one summary over all their pairs.

The ``store`` engine then runs the multi-turn check: turn 1 answers ``--turn-prompts``
prompts; turn 2 sends each prompt + its answer + new user tokens twice, once salted
(``cache_salt``: neither vLLM's prefix cache nor the connector can hit, so it is
computed fresh) and once plain, after the GPU prefix cache was emptied, so the prompt
and the answer's decode KV come back from the CPU tier. ``turns``: hit tokens against
the prompt's length (more means decode KV was reused), outputs equal, and the
acceptance length restored over fresh (the goal: parity). With random weights the
drafter's acceptance hardly depends on KV, so this shows the path works at real
sizes; ``vllm-draft-offload accept`` on the fixtures is the KV-sensitive parity check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.machine_state import gc_pauses
from vllm_draft_offload.bench.options import add_child_args, command_parser
from vllm_draft_offload.bench.procs import run_child
from vllm_draft_offload.bench.progress import progress
from vllm_draft_offload.bench.provenance import provenance
from vllm_draft_offload.bench.speed.decode_configs import CONFIGS
from vllm_draft_offload.bench.speed.decode_engine import run_config
from vllm_draft_offload.bench.speed.decode_report import pool_reports, summarize, table_row
from vllm_draft_offload.bench.speed.shapes import SHAPES, kv_bytes_per_token, write_config
from vllm_draft_offload.bench.workloads.run import CPU_ENV

EXAMPLES = """examples:
  vllm-draft-offload decode-overhead --shape small,llama8b --out $OUT/decode_overhead.json
  vllm-draft-offload decode-overhead --shape small --rounds 2 --reps 2 --out /tmp/d.json
"""
MODULE = "vllm_draft_offload.bench.speed.decode_overhead"
# The parent's settings a child engine needs, passed on as they are.
CHILD_FLAGS = (
    "batch", "prompt_tokens", "decode_tokens", "reps", "chunk_size", "cpu_gib", "gpu_mem",
    "turn_prompts", "turn_decode_tokens", "turn_user_tokens",
)  # fmt: skip


def child_command(
    args: argparse.Namespace, config: str, target: str, draft: str | None, child_out: Path
) -> list[str]:
    """The command line of one engine's child: this module with the parent's settings."""
    cmd = [
        sys.executable, "-m", MODULE, "--out", args.out, "--child", str(child_out),
        "--target", target, "--config", config,
    ]  # fmt: skip
    for flag in CHILD_FLAGS:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if draft:
        cmd += ["--draft", draft]
    if args.copy_path:
        cmd += ["--copy-path", args.copy_path]
    if args.time_hooks:
        cmd.append("--time-hooks")
    if args.profile:
        cmd.append("--profile")
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if not args.paired:
        cmd.append("--no-paired")
    if args.dry_run_cpu:
        cmd.append("--dry-run-cpu")
    return cmd


def run_shape(
    args: argparse.Namespace,
    name: str,
    work: Path,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every engine of one shape, one after another; ``checkpoint`` gets the report so
    far after each engine (``main`` writes it out, so a run cut short keeps them)."""
    target_shape, draft_shape = SHAPES[name]
    max_len = args.prompt_tokens + args.decode_tokens + 2 * args.turn_decode_tokens + 128
    max_len += args.turn_user_tokens
    target = write_config(work / "target", target_shape, max_len)
    draft = None if args.no_draft else write_config(work / "draft", draft_shape, max_len)
    report: dict[str, Any] = {
        "shape_name": name,
        "shape": {"target": target_shape, "draft": None if draft is None else draft_shape},
        "kv_bytes_per_token": kv_bytes_per_token(target_shape)
        + (0 if draft is None else kv_bytes_per_token(draft_shape)),
        **{k: getattr(args, k) for k in ("batch", "prompt_tokens", "decode_tokens", "chunk_size")},
        "enforce_eager": args.enforce_eager,
        "copy_path": args.copy_path or "auto (connector default)",
        "configs": {config: [] for config in args.configs},
    }
    engines = [config for _ in range(args.rounds) for config in args.configs]
    for i, config in enumerate(progress(engines, f"decode-overhead {name}")):
        child_out = work / f"{config}-{i}.json"
        cmd = child_command(args, config, target, draft, child_out)
        env = os.environ.copy()
        if args.dry_run_cpu:
            env = {**CPU_ENV, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if args.time_hooks or args.profile:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in the child's process
        proc = run_child(cmd, env, args.engine_timeout)
        if proc.returncode != 0 or not child_out.exists():
            run = {"error": proc.stderr[-3000:], "stdout_tail": proc.stdout[-2000:]}
        else:
            run = json.loads(child_out.read_text())
        if env.get("VLLM_GC_DEBUG", "0") != "0":
            run["gc_pauses"] = gc_pauses(proc.stdout + proc.stderr)
        report["configs"][config].append(run)
        print(name, config, engine_line(run), flush=True)
        if checkpoint is not None:
            checkpoint(report)
    summarize(report)
    return report


def engine_line(run: dict[str, Any]) -> str:
    """One engine's result for the log: decode tokens/s per batch, or its error."""
    if "error" in run:
        lines = run["error"].strip().splitlines()
        return f"error: {lines[-1][:300]}" if lines else "error"
    rates = [round(rep["decode_tok_s"]) for rep in run.get("reps", []) if "decode_tok_s" in rep]
    return f"decode tok/s per batch {rates}"


def write_out(path: Path, shapes: dict[str, Any], complete: bool) -> dict[str, Any]:
    """The output file: every shape's report so far; ``complete`` False while engines
    are still to run (no table then: a shape's summary comes after its last engine)."""
    out = {
        **provenance(),
        "complete": complete,
        "shapes": shapes,
        "table": [table_row(name, report) for name, report in shapes.items()] if complete else [],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("decode-overhead", __doc__, EXAMPLES)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--pool",
        nargs="+",
        metavar="FILE",
        help="run nothing: pool these output files' engines per shape and config, and "
        "write one summary over all their pairs to --out",
    )
    parser.add_argument(
        "--shape", default="small,llama8b", help="of llama8b, small (comma-separated)"
    )
    parser.add_argument("--configs", default="none,idle,store", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=1, help="engines per config, alternating")
    parser.add_argument("--reps", type=int, default=3, help="timed batches per engine")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--cpu-gib", type=float, default=24)
    parser.add_argument("--gpu-mem", type=float, default=0.5)
    parser.add_argument("--turn-prompts", type=int, default=4, help="0: no multi-turn check")
    parser.add_argument(
        "--turn-decode-tokens",
        type=int,
        default=384,
        help="turn 1's answer: more than a chunk, so whole chunks of it are stored",
    )
    parser.add_argument("--turn-user-tokens", type=int, default=64)
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument(
        "--no-paired",
        dest="paired",
        action="store_false",
        help="one batch per rep instead of a pair: with stores (on) and without "
        "(off: the requests opt out of stores), in one engine",
    )
    parser.add_argument(
        "--copy-path",
        choices=("auto", "memcpy", "kernel"),
        help="the connector's copy_path (default: its default); memcpy keeps stores off the "
        "SMs, except store_staged's (an explicit store_staging_units gathers on the SMs "
        "whatever the path)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (decode is then CPU-bound)"
    )
    parser.add_argument(
        "--time-hooks",
        action="store_true",
        help="engine in the child's process, the connector's hooks timed per batch "
        "(reps[].hooks); tok/s then not comparable with runs without it",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more batch per engine under torch.profiler (engine in the child's "
        "process): wall, GPU busy time and top operations, in configs[].profile",
    )
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="vLLM on the CPU (with --shape tiny and small sizes: checks the tool runs)",
    )
    add_child_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        Path(args.child).write_text(json.dumps(run_config(args)))
        return
    if args.pool:
        pooled = pool_reports({path: json.loads(Path(path).read_text()) for path in args.pool})
        Path(args.out).write_text(json.dumps(pooled, indent=1))
        print(json.dumps(pooled["table"], indent=1), flush=True)
        return
    shapes = args.shape.split(",")
    if any(s not in SHAPES for s in shapes) or len(set(shapes)) != len(shapes):
        parser.error(f"--shape: give distinct names of {', '.join(sorted(SHAPES))}")
    args.configs = args.configs.split(",")
    if not args.configs or any(c not in CONFIGS for c in args.configs):
        parser.error(f"--configs: of {', '.join(CONFIGS)}")
    for flag in ("rounds", "reps", "batch", "prompt_tokens", "decode_tokens", "chunk_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: at least 1")
    for flag in ("turn_prompts", "turn_decode_tokens", "turn_user_tokens"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')}: at least 0")

    out_path = Path(args.out)
    reports: dict[str, Any] = {}
    # The engines' model configs and results: removed at the end.
    with tempfile.TemporaryDirectory(prefix="decode-overhead-") as work:
        for name in shapes:
            reports[name] = run_shape(
                args,
                name,
                Path(work) / name,
                checkpoint=lambda partial, name=name: write_out(
                    out_path, {**reports, name: partial}, complete=False
                ),
            )
    out = write_out(out_path, reports, complete=True)
    print(json.dumps(out["table"], indent=1), flush=True)


if __name__ == "__main__":
    main()
