"""Acceptance-parity harness: does restored KV give the drafter the acceptance of fresh KV?

Runs vLLM offline (``vllm.LLM``) in a subprocess on shared-prefix prompts built from
the fixture's synthetic corpus, in phases, and writes one JSON file (:class:`AcceptCheckResult`;
the phases are compared with their references in compare.py).

Default plan (connector parity), ``--kv-transfer-config`` selects the connector:
  fresh     base prompts, nothing cached
  restored  ``reset_prefix_cache()`` first, same prompts: prefixes come from the
            connector; outputs must equal ``fresh``, acceptance ratio restored/fresh ~ 1
  extended  reset again, base prompts + continuations (prefix from the connector)

``--divergent-successors`` plan (EAGLE/MTP successor rule, ``divergent.py``):
  fresh_jJ   per successor position J (0, 1, S-1): the base prompts with the token
             at boundary + J replaced, under their own cache salt (reused by nobody)
  seed       reset, the base prompts (they store their chunks)
  diverge_jJ reset, as fresh_jJ without the salt: restored up to boundary + J - S
             tokens; outputs must equal fresh_jJ's, acceptance ratio ~ 1

``--prefix-cache-hit`` plan (are the models deterministic under a GPU prefix-cache hit?):
  fresh      base prompts
  cached     the same prompts again, no reset (the GPU prefix cache serves all but
             the last block); outputs must equal ``fresh``'s

``--restart-from-storage`` plan (DraftOffloadConnector's storage tier, ``restart.py``):
  fresh             engine 0: base prompts; their units are written to an fs:// dir,
                    the engine waits for the writes to settle and shuts down
  restored_storage  engine 1, a new process on the same dir (CPU tier empty): the
                    same prompts, hits from storage; outputs must equal ``fresh``

``--corrupt-draft-kv`` plan (KV-sensitivity check, ``probe_connector.py``):
  fresh             base prompts
  extended          base + continuations, prefix from the GPU prefix cache
  refill            reset, base prompts again (re-fills the cache with intact KV)
  extended_corrupt  as ``extended``, but the drafter's KV of the cached prefix is
                    zeroed first; outputs must equal ``extended`` (target KV intact),
                    acceptance must drop (>= 30% on the gpu fixtures)

``--corrupt-target-window-kv`` plan (the same, on a sliding-window target):
  extended_corrupt_window  as ``extended``, but the *target's* sliding-window layers'
                    KV of the cached prefix (the in-window blocks vLLM kept) is zeroed;
                    outputs or acceptance must change: a restore that left the window
                    out would be caught
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench import PACKAGE_PARENT
from vllm_draft_offload.bench.accept.compare import summarize
from vllm_draft_offload.bench.accept.divergent import divergence_boundary, draft_successors
from vllm_draft_offload.bench.accept.plans import plan_divergent, plan_phases, plan_restart
from vllm_draft_offload.bench.accept.restart import (
    check_l3_dir,
    engine_configs,
    merge_results,
    needs_storage,
    storage_dir,
    storage_transfer_config,
    storage_units,
)
from vllm_draft_offload.bench.accept.schema import AcceptCheckResult, Environment, RunConfig
from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.procs import run_in_group

EXAMPLES = """examples:
  # parity of vLLM's OffloadingConnector with an EAGLE head (fixtures from `fixtures`)
  vllm-draft-offload accept --fixtures F --spec-method eagle --draft eagle \\
      --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"cpu_bytes_to_use":8000000000}}' --out res.json
  # parity restored from storage after an engine restart (our connector's L3 tier)
  vllm-draft-offload accept --fixtures F --spec-method eagle3 --draft eagle3 \\
      --kv-transfer-config '{"kv_connector":"DraftOffloadConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"cpu_bytes_to_use":2000000000}}' \\
      --restart-from-storage --out restart.json
  # KV sensitivity: zero the restored draft KV, acceptance must drop
  vllm-draft-offload accept --fixtures F --spec-method draft_model --draft small-draft \\
      --corrupt-draft-kv --enforce-eager --out sens.json
  # sliding-window fixtures: zero the target's in-window KV, outputs must change
  vllm-draft-offload accept --fixtures F-SWA --spec-method eagle3 --draft eagle3 \\
      --corrupt-target-window-kv --enforce-eager --out window.json
  # an MTP fixture: the target carries its MTP layers (vLLM loads both from it)
  vllm-draft-offload accept --fixtures F --spec-method mtp --draft glm-mtp --out mtp.json
  # any model dirs instead of fixtures
  vllm-draft-offload accept --model /models/target --spec-method eagle3 \\
      --draft /models/eagle3 --out res.json
"""
# The engine side, run as ``python -m`` in its own process.
ENGINE_MODULE = "vllm_draft_offload.bench.accept.engine"


# ------------------------------------------------------------------ environment


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_env() -> Environment:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return Environment(
        gpu=gpu,
        python=platform.python_version(),
        platform=platform.platform(),
        versions={
            d: _version(d)
            for d in ("vllm", "torch", "transformers", "lmcache", "vllm-draft-offload")
        },
    )


# ------------------------------------------------------------------ running


def child_env() -> dict[str, str]:
    """Environment of the engine subprocess: this package importable (the engine module
    and the probe connector, also in vLLM's own worker processes), installed or not."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_engine_subprocess(
    cfg: RunConfig, result_path: Path, timeout_s: float
) -> tuple[int, str, str]:
    """Run the phases in a child process; returns (returncode, output tail, output).

    The child rewrites ``result_path`` after every phase, so the phases that
    finished before a crash survive it.
    """
    cfg_path = result_path.with_suffix(".config.json")
    cfg_path.write_text(cfg.model_dump_json(indent=1))
    cmd = [sys.executable, "-m", ENGINE_MODULE, str(cfg_path), str(result_path)]
    # own process group: on timeout the whole group (vLLM's worker processes too) is
    # killed, and engine processes the child left behind (holding GPU memory) are reaped
    with tempfile.TemporaryFile("w+") as fh:
        rc, _ = run_in_group(cmd, child_env(), fh, subprocess.STDOUT, timeout_s)
        fh.seek(0)
        out = fh.read()
    if rc is None:
        return 124, f"timeout after {timeout_s}s\n{out[-4000:]}", out
    return rc, out[-8000:], out


def finish_result(
    raw: dict[str, Any] | None, cfg: RunConfig, rc: int, tail: str
) -> AcceptCheckResult:
    if raw is None:  # the engine process died before writing anything
        raw = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "env": collect_env().model_dump(),
            "config": {"run": cfg.model_dump()},
        }
    result = AcceptCheckResult.model_validate(raw)
    if rc != 0 and result.error is None:
        result.error = f"engine subprocess exited with {rc}:\n{tail}"
    elif result.error is not None:
        # The engine's root cause (EngineCore's traceback) is in the child's output,
        # not in the client-side EngineDeadError the child recorded.
        result.error += f"\n--- engine output (tail) ---\n{tail}"
    result.summary = summarize(result.phases)
    return result


def run(cfg: RunConfig, timeout_s: float = 3600.0) -> AcceptCheckResult:
    """Run the plan's engines one after another (each its own process, ``timeout_s``
    each); a later engine starts only after the previous one exited cleanly."""
    results: list[AcceptCheckResult] = []
    outputs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="accept_check_") as tmp, storage_dir(cfg) as st:
        run_cfg, kept = st
        for i, sub in enumerate(engine_configs(run_cfg)):
            result_path = Path(tmp) / f"result_{i}.json"
            rc, tail, output = run_engine_subprocess(sub, result_path, timeout_s)
            raw = json.loads(result_path.read_text()) if result_path.exists() else None
            result = finish_result(raw, sub, rc, tail)
            writes = result.storage.writes if result.storage else None
            if writes is not None and sub.l3_dir:
                # counted once the process exited: its shutdown flushed the rest
                writes.units_in_storage, writes.bytes_in_storage = storage_units(Path(sub.l3_dir))
            results.append(result)
            outputs.append(output)
            if result.error:
                break
        if not needs_storage(run_cfg):
            return results[0]
        merged = merge_results(run_cfg, results, outputs, kept)
    merged.summary = summarize(merged.phases)
    return merged


# ------------------------------------------------------------------ CLI


def _json_arg(text: str | None) -> Any:
    if text is None or text.strip().lower() in ("", "none", "null"):
        return None
    return json.loads(text)


def _default_prompt_tokens(model: str) -> int:
    """Fixture-aware default: long prompts for gpu fixtures, short for CPU ones."""
    meta = Path(model) / "fixture_meta.json"
    preset = json.loads(meta.read_text()).get("preset") if meta.exists() else None
    return {"gpu": 4096, "cpu": 448, "tiny": 256}.get(preset or "", 1024)


def model_dirs(args: argparse.Namespace) -> tuple[str, str | None]:
    """(target, drafter) dirs: ``--model``/``--draft`` as given, or in ``--fixtures``
    (where a ``--draft`` without a ``/`` names a fixture). An MTP drafter lives in its
    target's checkpoint: with ``--spec-method mtp``, ``--draft`` names the target
    (an MTP fixture) and the drafter dir is None (vLLM reads the target's)."""
    fixtures = Path(args.fixtures) if args.fixtures else None
    draft = args.draft
    if draft and fixtures is not None and "/" not in draft:
        draft = str(fixtures / draft)
    if args.spec_method == "mtp":
        model = args.model or draft
        if model is None:
            raise SystemExit("--spec-method mtp needs --draft (an MTP fixture) or --model")
        return model, None
    model = args.model or (str(fixtures / "target") if fixtures else None)
    if model is None:
        raise SystemExit("give --model or --fixtures")
    return model, draft


def _fixture_spec_tokens(model: str) -> int | None:
    """The speculative tokens an MTP fixture was trained for (its meta), if any."""
    meta = Path(model) / "fixture_meta.json"
    if not meta.exists():
        return None
    value = json.loads(meta.read_text()).get("num_speculative_tokens")
    return int(value) if value is not None else None


def build_config(args: argparse.Namespace) -> RunConfig:
    model, draft = model_dirs(args)
    spec = _json_arg(args.speculative_config)
    if spec is None and args.spec_method != "none":
        if not draft and args.spec_method not in ("ngram", "mtp"):
            raise SystemExit("--draft is required with --spec-method " + args.spec_method)
        k = args.num_spec_tokens
        if k is None:  # an MTP fixture runs with what it was trained for (multi-module: S)
            k = (_fixture_spec_tokens(model) if args.spec_method == "mtp" else None) or 3
        spec = {"method": args.spec_method, "num_speculative_tokens": k}
        if draft:
            spec["model"] = draft
    kv = _json_arg(args.kv_transfer_config)
    probe = args.corrupt_draft_kv or args.corrupt_target_window_kv
    if probe and kv is not None:
        raise SystemExit(
            "--corrupt-draft-kv / --corrupt-target-window-kv use their own probe connector; "
            "drop --kv-transfer-config"
        )
    prompt_tokens = args.prompt_tokens or _default_prompt_tokens(model)
    plans = [
        args.corrupt_draft_kv,
        args.corrupt_target_window_kv,
        args.divergent_successors,
        args.prefix_cache_hit,
    ]
    if sum([*plans, args.restart_from_storage]) > 1:
        raise SystemExit(
            "choose one of --corrupt-draft-kv, --corrupt-target-window-kv, "
            "--divergent-successors, --prefix-cache-hit, --restart-from-storage"
        )
    phases = plan_phases(
        args.corrupt_draft_kv, args.prefix_cache_hit, args.corrupt_target_window_kv
    )
    if args.l3_dir and not args.restart_from_storage:
        raise SystemExit("--l3-dir goes with --restart-from-storage")
    if args.restart_from_storage:
        try:
            storage_transfer_config(kv, "/")  # only checks kv: the dir is set at run time
            if args.l3_dir:
                check_l3_dir(args.l3_dir)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        phases = plan_restart()
    boundary = None
    if args.divergent_successors:
        if spec is None:
            raise SystemExit("--divergent-successors needs a drafter (--spec-method)")
        successors = draft_successors(spec["method"], model, spec["num_speculative_tokens"])
        try:
            boundary = divergence_boundary(prompt_tokens, args.chunk_size, successors)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        phases = plan_divergent(boundary, successors)
    return RunConfig(
        model=model,
        speculative_config=spec,
        kv_transfer_config=kv,
        corrupt_draft_kv=args.corrupt_draft_kv,
        corrupt_target_window_kv=args.corrupt_target_window_kv,
        corrupt_mode=args.corrupt_mode,
        prompt_tokens=prompt_tokens,
        num_prompts=args.num_prompts,
        # divergent and restart plans: one prompt per prefix, so every hit comes from
        # the connector (restart: through storage), none from another prompt's prefix
        prompts_per_group=1
        if args.divergent_successors or args.restart_from_storage
        else args.prompts_per_group,
        max_tokens=args.max_tokens,
        prompt_seed=args.prompt_seed,
        divergence_boundary=boundary,
        dtype=args.dtype,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        llm_kwargs=_json_arg(args.llm_kwargs) or {},
        phases=phases,
        l3_dir=args.l3_dir,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = command_parser("accept", __doc__, EXAMPLES)
    ap.add_argument(
        "--fixtures",
        help="fixture dir from `vllm-draft-offload fixtures`: --model defaults to "
        "FIXTURES/target and a bare --draft name is FIXTURES/NAME",
    )
    ap.add_argument("--model", help="target model dir (default FIXTURES/target)")
    ap.add_argument(
        "--spec-method",
        default="none",
        choices=["none", "draft_model", "eagle", "eagle3", "mtp", "ngram"],
    )
    ap.add_argument(
        "--draft",
        help="drafter dir (draft model or EAGLE head), or a fixture name; with mtp: the "
        "target carrying the MTP layers (e.g. glm-mtp), which then is the model",
    )
    ap.add_argument(
        "--num-spec-tokens",
        type=int,
        default=None,
        help="default 3; an MTP fixture's own (fixture_meta.json: 2 for glm-mtp2)",
    )
    ap.add_argument(
        "--speculative-config", help="JSON; overrides --spec-method/--draft/--num-spec-tokens"
    )
    ap.add_argument("--kv-transfer-config", help="JSON for any connector, or 'none'")
    ap.add_argument(
        "--corrupt-draft-kv", action="store_true", help="KV-sensitivity plan (probe connector)"
    )
    ap.add_argument(
        "--corrupt-target-window-kv",
        action="store_true",
        help="KV-sensitivity plan on the target's sliding-window layers (probe connector): "
        "their in-window KV of the cached prefix zeroed, outputs or acceptance must change",
    )
    ap.add_argument("--corrupt-mode", choices=["zero", "noise"], default="zero")
    ap.add_argument(
        "--divergent-successors",
        action="store_true",
        help="successor-rule plan: prompts that differ from stored ones at successor "
        "position 0, 1 and S-1 after a chunk boundary (EAGLE/MTP drafters; one prompt "
        "per group)",
    )
    ap.add_argument(
        "--prefix-cache-hit",
        action="store_true",
        help="determinism plan: the prompts again with the GPU prefix cache kept; "
        "outputs must equal the fresh ones",
    )
    ap.add_argument(
        "--restart-from-storage",
        action="store_true",
        help="storage-restart plan (DraftOffloadConnector in --kv-transfer-config, its "
        "L3 tier on): engine 0 runs the prompts fresh and writes them to storage, shuts "
        "down; a new engine process runs them again from storage (one prompt per group)",
    )
    ap.add_argument(
        "--l3-dir",
        help="with --restart-from-storage: the fs:// directory (new or empty; kept). "
        "Default: a temporary directory, removed after the run",
    )
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=256,
        help="with --divergent-successors: the connector's chunk_size (where the boundary is)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default: by fixture preset")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompts-per-group", type=int, default=2, help="prompts sharing one prefix")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=None, help="default: vLLM's (32 on CPU)")
    ap.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (faster engine start)"
    )
    ap.add_argument("--llm-kwargs", help="JSON of extra vllm.LLM kwargs (applied last)")
    ap.add_argument(
        "--timeout", type=float, default=3600.0, help="timeout of each engine subprocess (s)"
    )
    ap.add_argument("--out", type=Path, help="result JSON (default: stdout only)")
    return ap.parse_args(argv)


def format_summary(result: AcceptCheckResult) -> str:
    lines = [
        f"gpu={result.env.gpu} vllm={result.env.versions.get('vllm')} error={bool(result.error)}"
    ]
    for p in result.phases:
        cached = [r.num_cached_tokens or 0 for r in p.requests]
        sources = {k: v for k, v in p.cached_tokens_by_source.items() if v}
        lines.append(
            f"  {p.spec.name:17s} AL={p.acceptance_length} cached={cached} "
            f"by_source={sources} {p.wall_s:.1f}s"
        )
    s = result.summary
    for c in s.comparisons:
        match = f"{c.outputs_match}/{c.outputs_compared}"
        line = f"  {c.phase} vs {c.reference}: ratio={c.ratio} outputs {match}"
        if c.expected_cached_tokens is not None:
            line += f" hits {c.cached_as_expected} at the expected {c.expected_cached_tokens}"
        lines.append(line)
    if s.storage_reads is not None:
        r = s.storage_reads
        lines.append(
            f"  from storage={r.from_storage}: {r.requests_hit}/{r.requests} requests hit, "
            f"{r.hit_tokens}/{r.prompt_tokens} tokens, units fetched {r.fetched_chunks:.0f} "
            f"restored {r.restored_chunks:.0f}, declined {r.declined_chunks}"
        )
    if result.storage is not None and result.storage.writes is not None:
        w = result.storage.writes
        lines.append(
            f"  engine 0 wrote {w.stored_chunks:.0f} units ({w.units_in_storage} in storage, "
            f"dropped {w.write_dropped:.0f}, failed {w.store_failed:.0f}, "
            f"settled={w.settled} in {w.settle_s}s)"
        )
    if s.hits_as_expected is not None:
        lines.append(f"  divergent successors: every hit as expected={s.hits_as_expected}")
    if s.corruption_drop is not None:
        lines.append(f"  corruption drop={s.corruption_drop:.3f} pass={s.sensitivity_pass}")
    if result.error:
        lines.append("  ERROR: " + result.error.strip().splitlines()[0])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(build_config(args), timeout_s=args.timeout)
    text = result.model_dump_json(indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(format_summary(result))
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
