"""Acceptance-parity harness: does restored KV give the drafter the acceptance of fresh KV?

Runs vLLM offline (``vllm.LLM``) in a subprocess on shared-prefix prompts built from
the fixture's synthetic corpus, in phases, and writes one JSON file (:class:`AcceptCheckResult`).

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

``--corrupt-draft-kv`` plan (KV-sensitivity check, ``probe_connector.py``):
  fresh             base prompts
  extended          base + continuations, prefix from the GPU prefix cache
  refill            reset, base prompts again (re-fills the cache with intact KV)
  extended_corrupt  as ``extended``, but the drafter's KV of the cached prefix is
                    zeroed first; outputs must equal ``extended`` (target KV intact),
                    acceptance must drop (>= 30% on the gpu fixtures)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench import PACKAGE_PARENT
from vllm_draft_offload.bench.accept.divergent import divergence_boundary, draft_successors
from vllm_draft_offload.bench.accept.plans import plan_divergent, plan_phases
from vllm_draft_offload.bench.accept.schema import (
    AcceptCheckResult,
    Comparison,
    Environment,
    PhaseResult,
    RunConfig,
    Summary,
)
from vllm_draft_offload.bench.options import command_parser

EXAMPLES = """examples:
  # parity of vLLM's OffloadingConnector with an EAGLE head (fixtures from `fixtures`)
  vllm-draft-offload accept --fixtures F --spec-method eagle --draft eagle \\
      --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"cpu_bytes_to_use":8000000000}}' --out res.json
  # KV sensitivity: zero the restored draft KV, acceptance must drop
  vllm-draft-offload accept --fixtures F --spec-method draft_model --draft small-draft \\
      --corrupt-draft-kv --enforce-eager --out sens.json
  # an MTP fixture: the target carries its MTP layers (vLLM loads both from it)
  vllm-draft-offload accept --fixtures F --spec-method mtp --draft glm-mtp --out mtp.json
  # any model dirs instead of fixtures
  vllm-draft-offload accept --model /models/target --spec-method eagle3 \\
      --draft /models/eagle3 --out res.json
"""
# The engine side, run as ``python -m`` in its own process.
ENGINE_MODULE = "vllm_draft_offload.bench.accept.engine"
SENSITIVITY_MIN_DROP = 0.30  # corrupted draft KV must cost >= 30% of the acceptance length

# ------------------------------------------------------------------ pure functions


def acceptance_length(num_drafts: float, num_accepted: float) -> float | None:
    """vLLM's mean acceptance length: 1 + accepted draft tokens per verify step."""
    return 1.0 + num_accepted / num_drafts if num_drafts > 0 else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mark_matches(phase: PhaseResult, reference: PhaseResult) -> None:
    """Fill matches_reference / first_mismatch of ``phase`` against ``reference``."""
    ref = {r.index: r.output_token_ids for r in reference.requests}
    for r in phase.requests:
        if r.index in ref:
            r.first_mismatch = first_mismatch(r.output_token_ids, ref[r.index])
            r.matches_reference = r.first_mismatch is None


def compare(phase: PhaseResult, reference: PhaseResult) -> Comparison:
    compared = [r for r in phase.requests if r.matches_reference is not None]
    cached = [r.num_cached_tokens for r in phase.requests if r.num_cached_tokens is not None]
    expected = phase.spec.expected_cached_tokens
    return Comparison(
        expected_cached_tokens=expected,
        cached_as_expected=None if expected is None else sum(c == expected for c in cached),
        phase=phase.spec.name,
        reference=reference.spec.name,
        acceptance_length=phase.acceptance_length,
        reference_acceptance_length=reference.acceptance_length,
        ratio=ratio(phase.acceptance_length, reference.acceptance_length),
        outputs_match=sum(bool(r.matches_reference) for r in compared),
        outputs_compared=len(compared),
        mean_cached_tokens=sum(cached) / len(cached) if cached else None,
    )


def summarize(phases: list[PhaseResult]) -> Summary:
    """Comparisons of every phase with its reference, and the headline ratios."""
    by_name = {p.spec.name: p for p in phases}
    comps = []
    for p in phases:
        ref = by_name.get(p.spec.reference or "")
        if ref is not None:
            mark_matches(p, ref)
            comps.append(compare(p, ref))
    by_phase = {c.phase: c for c in comps}
    summary = Summary(comparisons=comps)
    if "restored" in by_phase:
        summary.acceptance_ratio = by_phase["restored"].ratio
    if "extended_corrupt" in by_phase and by_phase["extended_corrupt"].ratio is not None:
        summary.corruption_ratio = by_phase["extended_corrupt"].ratio
        summary.corruption_drop = 1.0 - summary.corruption_ratio
        summary.sensitivity_pass = summary.corruption_drop >= SENSITIVITY_MIN_DROP
    if comps:
        summary.all_outputs_match = all(c.outputs_match == c.outputs_compared for c in comps)
    hits = [(c, by_name[c.phase]) for c in comps if c.expected_cached_tokens is not None]
    if hits:
        summary.hits_as_expected = all(c.cached_as_expected == len(p.requests) for c, p in hits)
    return summary


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


def run_engine_subprocess(cfg: RunConfig, result_path: Path, timeout_s: float) -> tuple[int, str]:
    """Run the phases in a child process; returns (returncode, output tail).

    The child rewrites ``result_path`` after every phase, so the phases that
    finished before a crash survive it.
    """
    cfg_path = result_path.with_suffix(".config.json")
    cfg_path.write_text(cfg.model_dump_json(indent=1))
    cmd = [sys.executable, "-m", ENGINE_MODULE, str(cfg_path), str(result_path)]
    # own session: on timeout the whole group (vLLM's worker processes too) is killed
    proc = subprocess.Popen(
        cmd,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
        return 124, f"timeout after {timeout_s}s\n{(out or '')[-4000:]}"
    _kill_group(proc.pid)  # engine processes the child left behind hold GPU memory
    return proc.returncode, (out or "")[-8000:]


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
    with tempfile.TemporaryDirectory(prefix="accept_check_") as tmp:
        result_path = Path(tmp) / "result.json"
        rc, tail = run_engine_subprocess(cfg, result_path, timeout_s)
        raw = json.loads(result_path.read_text()) if result_path.exists() else None
    return finish_result(raw, cfg, rc, tail)


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
    if args.corrupt_draft_kv and kv is not None:
        raise SystemExit(
            "--corrupt-draft-kv uses its own probe connector; drop --kv-transfer-config"
        )
    prompt_tokens = args.prompt_tokens or _default_prompt_tokens(model)
    if sum([args.corrupt_draft_kv, args.divergent_successors, args.prefix_cache_hit]) > 1:
        raise SystemExit(
            "choose one of --corrupt-draft-kv, --divergent-successors, --prefix-cache-hit"
        )
    phases = plan_phases(args.corrupt_draft_kv, args.prefix_cache_hit)
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
        corrupt_mode=args.corrupt_mode,
        prompt_tokens=prompt_tokens,
        num_prompts=args.num_prompts,
        # divergent plan: one prompt per prefix, so every hit comes from the connector
        prompts_per_group=1 if args.divergent_successors else args.prompts_per_group,
        max_tokens=args.max_tokens,
        prompt_seed=args.prompt_seed,
        divergence_boundary=boundary,
        dtype=args.dtype,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        llm_kwargs=_json_arg(args.llm_kwargs) or {},
        phases=phases,
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
    ap.add_argument("--timeout", type=float, default=3600.0, help="engine subprocess timeout (s)")
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
