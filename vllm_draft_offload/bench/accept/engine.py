"""Engine side of ``vllm-draft-offload accept`` (check.py): the phases in ``vllm.LLM``.

    python -m vllm_draft_offload.bench.accept.engine CONFIG.json RESULT.json

RESULT.json is rewritten after every phase, so a crash of the engine (e.g. an
unsupported connector) leaves the finished phases and the traceback behind.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from vllm_draft_offload.bench.accept.check import collect_env
from vllm_draft_offload.bench.accept.compare import acceptance_length
from vllm_draft_offload.bench.accept.divergent import diverge
from vllm_draft_offload.bench.accept.restart import settle_writes
from vllm_draft_offload.bench.accept.schema import (
    AcceptCheckResult,
    PhaseResult,
    PhaseSpec,
    RequestResult,
    RunConfig,
    StorageRun,
)
from vllm_draft_offload.bench.fixtures.data import CorpusSpec, PromptSet, build_prompts

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
SETTLE_S = 1.0
_KEEP_ALIVE: list[Any] = []  # let async connector stores finish before the prefix cache is reset


def on_cpu() -> bool:
    return os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or not torch.cuda.is_available()


def cpu_kernel_modules() -> list[str]:
    """vLLM's CPU kernel libraries this CPU can run, preferred first.

    vLLM picks ``vllm._C`` (AVX512-BF16), ``vllm._C_AVX512`` or ``vllm._C_AVX2`` by the
    CPU's flags (``CpuPlatform.import_kernels``); the AVX2 build comes last as the
    fallback, since it runs on any x86-64 CPU with AVX2.  Importing a build whose
    instructions the CPU lacks kills the process with SIGILL, so none is tried here.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["vllm._C"]
    if not torch.cpu._is_avx512_supported():
        return ["vllm._C_AVX2"]
    best = "vllm._C" if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512"
    return [best, "vllm._C_AVX2"]


def prepare_cpu_platform() -> None:
    """CPU runs: one process (fast init), and vLLM's CPU kernels loaded.

    An environment may lack the build vLLM would pick for this CPU (a venv carrying
    only ``_C_AVX2``: on a CPU with AVX512-bf16 vLLM then looks for ``vllm._C`` and
    finds no ops).  Loading a build this CPU runs registers the same
    ``torch.ops._C`` ops.  Only the in-process executor sees this, hence ``uni``.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if torch.cpu._is_amx_tile_supported():
        # vLLM's AMX attention kernel (bfloat16, a prefill on top of cached KV) runs tile
        # instructions without asking Linux for the AMX state first: the process dies by
        # SIGILL unless something (oneDNN, or this) asked before.
        torch.cpu._init_amx()
    if hasattr(torch.ops._C, "init_cpu_memory_env"):
        return
    for name in cpu_kernel_modules():
        # _C_AVX2/_C_AVX512 "fail" to import as Python modules, but their ops load
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
        if hasattr(torch.ops._C, "init_cpu_memory_env"):
            return


def load_corpus(model: str) -> CorpusSpec:
    """The fixture's corpus (fixture_meta.json); else a plain corpus over its vocab."""
    meta = Path(model) / "fixture_meta.json"
    if meta.exists():
        return CorpusSpec.from_dict(json.loads(meta.read_text())["corpus"])
    config = json.loads((Path(model) / "config.json").read_text())
    return CorpusSpec(vocab_size=int(config["vocab_size"]))


def make_prompts(cfg: RunConfig) -> PromptSet:
    return build_prompts(
        load_corpus(cfg.model),
        seed=cfg.prompt_seed,
        num_prompts=cfg.num_prompts,
        prompt_tokens=cfg.prompt_tokens,
        prompts_per_group=cfg.prompts_per_group,
        max_tokens=cfg.max_tokens,
    )


def build_llm_kwargs(
    cfg: RunConfig, prompts: PromptSet, probe_report: Path | None
) -> dict[str, Any]:
    spec_k = int((cfg.speculative_config or {}).get("num_speculative_tokens", 0))
    longest = max(len(p) for p in prompts.extended)
    kw: dict[str, Any] = {
        "model": cfg.model,
        "dtype": cfg.dtype,
        "seed": 0,
        "max_model_len": longest + cfg.max_tokens + spec_k + 64,
        "enable_prefix_caching": True,
        "enforce_eager": cfg.enforce_eager,
        "disable_log_stats": False,  # needed for llm.get_metrics()
    }
    if cfg.speculative_config:
        kw["speculative_config"] = cfg.speculative_config
        kw["per_request_spec_decode_metrics"] = "summary"  # vLLM rejects it without spec
    if cfg.corrupt_draft_kv or cfg.corrupt_target_window_kv:
        # imports vllm: after env setup
        from vllm_draft_offload.bench.accept.probe_connector import (
            CORRUPT_DRAFT,
            CORRUPT_TARGET_WINDOW,
            probe_transfer_config,
        )

        kw["kv_transfer_config"] = probe_transfer_config(
            report_path=str(probe_report) if probe_report else None,
            mode=cfg.corrupt_mode,
            layers=CORRUPT_TARGET_WINDOW if cfg.corrupt_target_window_kv else CORRUPT_DRAFT,
        )
    elif cfg.kv_transfer_config:
        kw["kv_transfer_config"] = cfg.kv_transfer_config
    if cfg.block_size:
        kw["block_size"] = cfg.block_size
    if on_cpu():
        kw.setdefault("block_size", 32)  # CPU attention needs a multiple of 32
        kw["enforce_eager"] = True
        kw["distributed_executor_backend"] = "uni"
    kw.update(cfg.llm_kwargs)
    return kw


def snapshot(llm: Any) -> dict[str, Any]:
    """vLLM counters (summed over labels except ``source``) and per-position vectors."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            key = f"{m.name}{{source={m.labels['source']}}}" if "source" in m.labels else m.name
            out[key] = out.get(key, 0) + m.value
        elif isinstance(m, Vector):
            prev = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + b for a, b in zip(prev, m.values, strict=False)]
    return out


CONNECTOR_PREFIX = "vllm:draft_offload_"
ENGINE_LABELS = frozenset({"engine", "model_name"})


def connector_snapshot(llm: Any) -> dict[str, float]:
    """DraftOffloadConnector's counters, one entry per label set
    (``vllm:draft_offload_loaded_chunks{tier=l3}``), summed over engines."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name.startswith(CONNECTOR_PREFIX):
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ENGINE_LABELS
            )
            key = f"{m.name}{{{labels}}}" if labels else m.name
            out[key] = out.get(key, 0.0) + float(m.value)
    return out


def diff(before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, float], list[float]]:
    counters = {
        k: float(v - before.get(k, 0))
        for k, v in after.items()
        if not isinstance(v, list) and (v != before.get(k, 0) or k in SPEC_COUNTERS)
    }
    old = before.get(PER_POSITION, [])
    per_pos = [
        float(v - (old[i] if i < len(old) else 0))
        for i, v in enumerate(after.get(PER_POSITION, []))
    ]
    return counters, per_pos


def request_result(i: int, out: Any, prompts: list[int], group: int) -> RequestResult:
    comp = out.outputs[0]
    r = RequestResult(
        index=i,
        group=group,
        prompt_len=len(prompts),
        num_cached_tokens=out.num_cached_tokens,
        output_token_ids=list(comp.token_ids),
    )
    if comp.spec_decode_metrics is not None:
        d = comp.spec_decode_metrics.to_dict()
        r.num_drafts, r.num_accepted = d["num_spec_steps"], d["num_accepted_draft_tokens"]
        r.acceptance_length = acceptance_length(r.num_drafts, r.num_accepted)
    return r


def scrub_kv_caches(worker: Any) -> int:
    """On a worker (via ``collective_rpc``): zero every KV-cache tensor (Mamba states
    too); the bytes zeroed."""
    zeroed = 0

    def zero(value: Any) -> None:
        nonlocal zeroed
        if isinstance(value, torch.Tensor):
            value.zero_()
            zeroed += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            for item in value:
                zero(item)

    zero(worker.model_runner.kv_caches)
    return zeroed


def reset_prefix_cache(llm: Any, phase: str, tries: int = 10) -> int:
    """Evict the GPU prefix cache, then zero the whole KV cache; retried, since vLLM
    refuses while blocks are still held (e.g. by a connector's in-flight stores).

    A reset only forgets which blocks hold what: their bytes stay, and a restore into
    the same block ids would find the right KV already there. A connector that left a
    layer out (the probe's EAGLE3 head on a sliding-window target, session 15) would
    then still pass. Once the reset succeeded no block is held, so every byte of the
    KV cache is free to zero, and whatever a later phase reads of its prefix came from
    the connector or was computed again. Returns the bytes zeroed."""
    for _ in range(tries):
        time.sleep(SETTLE_S)
        if llm.reset_prefix_cache():
            zeroed = sum(llm.collective_rpc(scrub_kv_caches))
            if zeroed <= 0:
                raise RuntimeError(f"no KV cache to zero before phase {phase}")
            return zeroed
    raise RuntimeError(f"reset_prefix_cache() kept failing before phase {phase}")


def phase_prompts(spec: PhaseSpec, prompts: PromptSet, cfg: RunConfig) -> list[list[int]]:
    """The phase's token lists: base or extended prompts, diverged where it says so."""
    token_lists = prompts.base if spec.prompts == "base" else prompts.extended
    if spec.diverge_at is None:
        return token_lists
    if cfg.divergence_boundary is None:
        raise ValueError(f"phase {spec.name} diverges, but the run has no divergence_boundary")
    vocab = load_corpus(cfg.model).vocab_size
    return [diverge(t, cfg.divergence_boundary, spec.diverge_at, vocab) for t in token_lists]


def run_phase(llm: Any, spec: PhaseSpec, prompts: PromptSet, cfg: RunConfig) -> PhaseResult:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_draft_offload.bench.accept.probe_connector import CORRUPT_ARG

    zeroed = reset_prefix_cache(llm, spec.name) if spec.reset_before else None
    token_lists = phase_prompts(spec, prompts, cfg)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=cfg.max_tokens,
        ignore_eos=True,
        extra_args={CORRUPT_ARG: True} if spec.corrupt_draft_kv else None,
    )
    before, connector_before = snapshot(llm), connector_snapshot(llm)
    t0 = time.time()
    salt = {"cache_salt": spec.cache_salt} if spec.cache_salt else {}
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=t, **salt) for t in token_lists], params, use_tqdm=False
    )
    wall = time.time() - t0
    counters, per_pos = diff(before, snapshot(llm))
    connector_after = connector_snapshot(llm)
    prefix = CACHED_BY_SOURCE + "{source="
    return PhaseResult(
        spec=spec,
        wall_s=round(wall, 3),
        counters=counters,
        cached_tokens_by_source={
            k[len(prefix) : -1]: v for k, v in counters.items() if k.startswith(prefix)
        },
        accepted_per_position=per_pos,
        acceptance_length=acceptance_length(
            counters.get(SPEC_COUNTERS[0], 0.0), counters.get(SPEC_COUNTERS[2], 0.0)
        ),
        requests=[
            request_result(i, o, token_lists[i], prompts.group_of[i]) for i, o in enumerate(outs)
        ],
        connector_counters={
            k: v - connector_before.get(k, 0.0)
            for k, v in connector_after.items()
            if v != connector_before.get(k, 0.0)
        },
        kv_cache_zeroed_bytes=zeroed,
    )


def wait_for_storage_writes(llm: Any, cfg: RunConfig, prompts: PromptSet) -> StorageRun:
    """Engine 0 of the restart plan: every store of its phases done (GPU prefix cache
    reset), then its storage writes settled (restart.settle_writes)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_draft_offload.bench.workloads.worker import reset_prefix_cache_after_stores

    if cfg.l3_dir is None:
        raise ValueError("wait_l3_writes needs l3_dir")
    # two tokens, less than a block: the engine steps, nothing is stored
    tiny = TokensPrompt(prompt_token_ids=prompts.base[0][:2])
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def step() -> None:
        llm.generate([tiny], one, use_tqdm=False)

    if reset_prefix_cache_after_stores(llm, step, attempts=200, pause_s=0.05) is None:
        raise RuntimeError("the GPU prefix cache never emptied: stores did not complete")
    writes = settle_writes(Path(cfg.l3_dir), step, lambda: connector_snapshot(llm))
    return StorageRun(l3_url=f"fs://{cfg.l3_dir}", writes=writes)


def shutdown_engine(llm: Any, timeout_s: float = 60.0) -> None:
    """Stop vLLM's engine processes, but never wait on them for long: a hung
    shutdown must not turn a finished run into a timeout.  check.py kills
    whatever is left of this process group afterwards."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    worker = threading.Thread(target=core.shutdown, kwargs={"timeout": timeout_s}, daemon=True)
    worker.start()
    worker.join(timeout_s + 5)


def write(result: AcceptCheckResult, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(result.model_dump_json(indent=1))
    os.replace(tmp, path)


def main(cfg_path: str, result_path: str) -> int:
    cfg = RunConfig.model_validate_json(Path(cfg_path).read_text())
    out = Path(result_path)
    probe = cfg.corrupt_draft_kv or cfg.corrupt_target_window_kv
    probe_report = out.parent / "probe_report.json" if probe else None
    if on_cpu():
        prepare_cpu_platform()
    prompts = make_prompts(cfg)
    kwargs = build_llm_kwargs(cfg, prompts, probe_report)
    result = AcceptCheckResult(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        env=collect_env(),
        config={"run": cfg.model_dump(), "llm_kwargs": kwargs},
        prompts=prompts.to_summary(),
    )
    write(result, out)
    llm = None
    try:
        from vllm import LLM

        # scrub_kv_caches goes to the engine's workers as a callable (collective_rpc)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        t0 = time.time()
        llm = LLM(**kwargs)
        result.init_s = round(time.time() - t0, 2)
        for spec in cfg.phases:
            result.phases.append(run_phase(llm, spec, prompts, cfg))
            write(result, out)
        if cfg.wait_l3_writes:
            result.storage = wait_for_storage_writes(llm, cfg, prompts)
    except Exception:
        result.error = traceback.format_exc()
    if probe_report is not None and probe_report.exists():
        result.probe_report = json.loads(probe_report.read_text())
    write(result, out)
    if llm is not None:
        _KEEP_ALIVE.append(llm)  # no implicit teardown when main() returns
        shutdown_engine(llm)
    return 0 if result.error is None else 1


if __name__ == "__main__":
    # os._exit: vLLM's engine threads / atexit hooks can hang interpreter shutdown
    sys.stdout.flush()
    code = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
