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
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.options import command_parser
from vllm_draft_offload.bench.speed.decode_configs import connector_config
from vllm_draft_offload.bench.speed.shapes import (
    BLOCK_SIZE,
    SHAPES,
    VOCAB,
    Shape,
    has_windows,
    write_config,
)

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
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",  # what vLLM calls on a SupportsHMA connector
    "get_kv_connector_stats",
    "has_pending_push_work",
    "has_pending_block_frees",
)
WORKER_HOOKS = (
    "handle_preemptions",
    "start_load_kv",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "wait_for_save",
)

# What it times: no connector, and ours storing nothing or everything (decode-overhead's
# null and native configurations are other connectors, whose hooks it does not wrap).
CONFIGS = ("none", "idle", "store")


# The engine thread's CPU time, not wall time: what other processes on a shared machine
# take from it does not count (what the engine does meanwhile, it does anyway).
cpu_time = time.thread_time

# What a step was (Engine.step), beside the seconds timed in it.
TAGS = ("tokens", "store_jobs", "stored_chunks", "loaded_chunks", "decode")
OWN_TOKENS = 64  # a prompt's own tokens after a shared prefix (--shared-prefixes)


def max_request_len(args: argparse.Namespace) -> int:
    """A request's tokens at most: its prompt, its decode and the drafts' room."""
    return args.prompt_tokens + args.decode_tokens + 64


def blocks_per_request(args: argparse.Namespace) -> int:
    return -(-max_request_len(args) // BLOCK_SIZE)


class Clock:
    """Seconds spent per name in the current step, then per step; ``timer`` is the
    engine thread's CPU time, or wall time where waiting counts (a GPU)."""

    def __init__(self, timer: Callable[[], float] = cpu_time) -> None:
        self.timer = timer
        self.step: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        timer = self.timer

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = timer()
            try:
                return func(*args, **kwargs)
            finally:
                self.step[name] += timer() - start
                self.calls[name] += 1

        return timed

    def wrap_hooks(self, scheduler_connector: Any, worker_connector: Any) -> None:
        """Time the connector's hooks on these instances (None: that half is absent)."""
        for obj, prefix, names in (
            (scheduler_connector, "sched", SCHEDULER_HOOKS),
            (worker_connector, "worker", WORKER_HOOKS),
        ):
            if obj is not None:
                for name in names:
                    setattr(obj, name, self.wrap(f"{prefix}.{name}", getattr(obj, name)))

    def end_step(self, **tags: float) -> None:
        self.steps.append({**self.step, **tags})
        self.step = defaultdict(float)


class Engine:
    """vLLM's Scheduler (with or without the connector) and the worker connector, with
    the model runner's connector calls in its order (speculative decoding: the worker's
    stores are issued after the drafter, vLLM's ``defer_finalize``)."""

    def __init__(self, args: argparse.Namespace, config: str, work: Path) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.plugins import load_general_plugins
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from vllm_draft_offload.connector import DraftOffloadConnector

        load_general_plugins()
        target_shape, draft_shape = SHAPES[args.shape]
        max_len = max_request_len(args)
        target = write_config(work / "target", target_shape, max_len)
        draft = write_config(work / "draft", draft_shape, max_len)
        model_config = ModelConfig(
            model=target, dtype="bfloat16", seed=0, max_model_len=max_len, skip_tokenizer_init=True
        )
        num_tokens = args.batch * args.prompt_tokens
        transfer = None
        connector = connector_config(config, args.cpu_gib, args.chunk_size, max_len)
        if connector is not None:
            # The CPU's copies are memmoves: no kernel table to build (a GPU's is cheap).
            connector["kv_connector_extra_config"]["copy_path"] = "memcpy"
            transfer = KVTransferConfig(**connector)
        self.vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=max(args.batch, 16),
                max_num_batched_tokens=max(8192, num_tokens),
                max_model_len=max_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
            speculative_config=SpeculativeConfig(
                method="draft_model",
                model=draft,
                num_speculative_tokens=args.spec_tokens,
                target_model_config=model_config,
                target_parallel_config=ParallelConfig(),
            ),
        )
        # FlashAttention's layout on CUDA (NHD): a layer's K and V of a block side by side.
        self.vllm_config.cache_config.kv_cache_layout = "LBNHC"

        def spec(shape: Shape, is_draft: bool) -> FullAttentionSpec:
            return FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=shape["num_key_value_heads"],
                head_size=shape["head_dim"],
                dtype=torch.bfloat16,
                is_draft=is_draft,
            )

        specs = {
            f"model.layers.{i}.self_attn.attn": spec(target_shape, False)
            for i in range(target_shape["num_hidden_layers"])
        } | {
            f"draft_model.model.layers.{i}.self_attn.attn": spec(draft_shape, True)
            for i in range(draft_shape["num_hidden_layers"])
        }
        groups = get_kv_cache_groups(self.vllm_config, specs)
        num_blocks = args.batch * blocks_per_request(args) + 1
        if args.gpu_blocks is not None:
            num_blocks = args.gpu_blocks  # main() checked that one request fits
        page = sum(specs[name].page_size_bytes for g in groups for name in g.layer_names)
        kv_cache_config = get_kv_cache_config_from_groups(
            self.vllm_config, groups, page * num_blocks
        )
        kv_cache_config.num_blocks = num_blocks
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        scheduler_kv = generate_scheduler_kv_cache_config([kv_cache_config])
        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_kv, self.vllm_config)
        for kv in (kv_cache_config, scheduler_kv):
            kv.hash_block_size = hash_block_size
        self.worker = None
        if connector is not None:
            context = self.vllm_config.compilation_config.static_forward_context
            for name, layer_spec in specs.items():
                context[name] = argparse.Namespace(is_draft_layer=layer_spec.is_draft)
            self.kv_caches = kv_caches = allocate_kv_cache(
                kv_cache_config,
                torch.device("cpu"),
                self.vllm_config.cache_config.get_resolved_kv_cache_layout(),
            )
            self.worker = DraftOffloadConnector(
                self.vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
            self.worker.register_kv_caches(kv_caches)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=scheduler_kv,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(hash_block_size, sha256)
        self.clock = Clock()
        self._wrap_hooks()

    def _wrap_hooks(self) -> None:
        self.clock.wrap_hooks(self.scheduler.connector, self.worker)
        if self.worker is not None:
            # The memmove of CPU tensors: enqueued on a GPU, so timed apart.
            copier = self.worker.worker.copier
            assert copier is not None
            copier._run = self.clock.wrap("copy_exec", copier._run)  # noqa: SLF001

    def add_requests(self, args: argparse.Namespace) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        def tokens(seed: int, n: int) -> list[int]:
            return [(seed * 7919 + j * 131) % (VOCAB - 1000) + 500 for j in range(n)]

        shared = args.shared_prefixes
        prefixes = [tokens(-1 - k, args.prompt_tokens - OWN_TOKENS) for k in range(shared)]
        for i in range(args.batch):
            params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
            params.update_from_generation_config({}, 2)
            if shared:
                # the own tokens from another sequence: a prefix's requests differ there
                prompt = prefixes[i % shared] + tokens(i + 1000, OWN_TOKENS)
            else:
                prompt = tokens(i, args.prompt_tokens)
            request = Request(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.block_hasher,
            )
            self.scheduler.add_request(request)

    def step(self, spec_tokens: int) -> None:
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput

        from vllm_draft_offload.worker_audit import job_slots

        clock = self.clock
        start = cpu_time()
        out = self.scheduler.schedule()
        clock.step["schedule"] += cpu_time() - start
        kv_out = None
        worker = self.worker
        if worker is not None:
            meta = out.kv_connector_metadata
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
            worker.start_load_kv(None)
            results = worker.get_transfer_results(out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.wait_for_save()  # after the drafter (defer_finalize)
            worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens + out.num_scheduled_tokens[req_id]
            prefill_left = request.num_prompt_tokens - done
            # Every draft accepted, plus the bonus token; none while the prompt is cut.
            count = (
                0 if prefill_left > 0 else len(out.scheduled_spec_decode_tokens.get(req_id, ())) + 1
            )
            sampled.append([500 + (done + k) % 1000 for k in range(count)])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_out,
        )
        start = cpu_time()
        self.scheduler.update_from_output(out, runner_out)
        clock.step["update_from_output"] += cpu_time() - start
        live = [r for r in req_ids if r in self.scheduler.requests]
        if spec_tokens and live:
            drafts = [[600 + k for k in range(spec_tokens)] for _ in live]
            self.scheduler.update_draft_token_ids(DraftTokenIds(live, drafts))
        meta = out.kv_connector_metadata if self.worker is not None else None
        stores, loads = (meta.stores, meta.loads) if meta is not None else ([], [])
        layout = self.worker.worker.layout if self.worker is not None else None
        clock.end_step(
            tokens=float(out.total_num_scheduled_tokens),
            store_jobs=float(len(stores)),
            stored_chunks=float(sum(len(job_slots(layout, job)) for job in stores)),
            loaded_chunks=float(sum(len(job_slots(layout, job)) for job in loads)),
            decode=float(all(n <= 1 + spec_tokens for n in out.num_scheduled_tokens.values())),
        )

    def run(self, args: argparse.Namespace) -> None:
        self.add_requests(args)
        while self.scheduler.has_requests() or (
            self.scheduler.connector is not None
            and self.scheduler.connector.scheduler.has_inflight_jobs()
        ):
            self.step(args.spec_tokens)


def engine_us(step: dict[str, float]) -> float:
    """Microseconds the engine spent on a step outside the forward: the scheduler, and
    the worker's connector calls without the CPU-only memmove (``copy_exec``)."""
    worker = sum(v for k, v in step.items() if k.startswith("worker."))
    return 1e6 * (step.get("schedule", 0.0) + step.get("update_from_output", 0.0) + worker
                  - step.get("copy_exec", 0.0))  # fmt: skip


def hooks_us(step: dict[str, float]) -> float:
    """Microseconds of the connector's own hooks in a step, both halves (the memmove
    left out): the part of ``engine_us`` that is ours alone."""
    hooks = sum(v for k, v in step.items() if k.startswith(("sched.", "worker.")))
    return 1e6 * (hooks - step.get("copy_exec", 0.0))


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Mean microseconds per decode step of each timed name (steps with store jobs and
    without apart), and the engine's total per decode step and over the batch's decode."""
    decode = [s for s in steps if s.get("decode") and s.get("tokens")]
    names = sorted({k for s in decode for k in s} - set(TAGS))

    def mean_us(group: list[dict[str, float]]) -> dict[str, float]:
        if not group:
            return {}
        return {n: round(1e6 * statistics.fmean(s.get(n, 0.0) for s in group), 1) for n in names}

    with_stores = [s for s in decode if s.get("store_jobs")]
    return {
        "decode_steps": len(decode),
        "steps_with_stores": len(with_stores),
        "store_jobs": int(sum(s.get("store_jobs", 0) for s in steps)),
        "stored_chunks": int(sum(s.get("stored_chunks", 0) for s in steps)),
        "us_per_step_with_stores": mean_us(with_stores),
        "us_per_step_without_stores": mean_us([s for s in decode if not s.get("store_jobs")]),
        "engine_us_per_decode_step": round(statistics.fmean(map(engine_us, decode)), 1),
        "engine_ms_over_decode": round(sum(map(engine_us, decode)) / 1e3, 2),
        "hooks_us_per_decode_step": round(statistics.fmean(map(hooks_us, decode)), 1),
        "hooks_ms_over_decode": round(sum(map(hooks_us, decode)) / 1e3, 2),
        # every step, prefills and restores too (the load of --shared-prefixes)
        "steps": len(steps),
        "loaded_chunks": int(sum(s.get("loaded_chunks", 0) for s in steps)),
        "engine_ms_all_steps": round(sum(map(engine_us, steps)) / 1e3, 2),
        "hooks_ms_all_steps": round(sum(map(hooks_us, steps)) / 1e3, 2),
    }


def compare(configs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the connector adds to the engine's CPU time over the batch's decode, idle
    and storing: its hooks alone, and the engine's total over ``none``'s (which also
    counts vLLM's own connector plumbing, and more noise). The fastest batch of each
    config: the least disturbed by other work on the machine."""
    steps = configs["none"][0]["decode_steps"]
    out: dict[str, Any] = {}
    for span in ("over_decode", "all_steps"):
        best = {c: min(r[f"engine_ms_{span}"] for r in runs) for c, runs in configs.items()}
        hooks = {c: min(r[f"hooks_ms_{span}"] for r in runs) for c, runs in configs.items()}
        out[f"hooks_ms_{span}"] = {c: ms for c, ms in hooks.items() if c != "none"}
        out[f"engine_ms_{span}"] = best
        out[f"added_ms_{span}"] = {c: round(ms - best["none"], 2) for c, ms in best.items()
                                   if c != "none"}  # fmt: skip
    out["added_us_per_decode_step"] = {
        c: round(1e3 * ms / steps, 1) if steps else None
        for c, ms in out["added_ms_over_decode"].items()
    }
    return out


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
    work = Path(tempfile.mkdtemp(prefix="hook-cost-"))
    report: dict[str, Any] = {"args": vars(args), "configs": {c: [] for c in CONFIGS}}
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
