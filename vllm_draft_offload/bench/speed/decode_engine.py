"""One decode-overhead engine, the child process: a warm-up batch, the timed batches
(with what the machine did meanwhile), and as asked the hooks' wall time with the
engine's decode steps and GC pauses (``--time-hooks``, engine_timeline.py), one
profiled batch (``--profile``) and the multi-turn check (``store``)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from vllm_draft_offload.bench.machine_state import MachineSampler
from vllm_draft_offload.bench.speed.decode_batches import (
    FIRST_TOKEN,
    arm_params,
    arm_prompts,
    batch_arms,
    batch_prompts,
    tokens,
)
from vllm_draft_offload.bench.speed.decode_configs import connector_config
from vllm_draft_offload.bench.speed.decode_report import acceptance_length, decode_rate
from vllm_draft_offload.bench.speed.engine_timeline import EngineTimeline
from vllm_draft_offload.bench.speed.shapes import draft_model_config

STORED_CHUNKS = "vllm:draft_offload_stored_chunks_total"
LOADED_BYTES = "vllm:draft_offload_loaded_bytes_total"


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """Child process: one engine, a warm-up batch, ``reps`` timed batches, and (``store``)
    the multi-turn check."""
    cpu: dict[str, Any] = {}
    if args.dry_run_cpu:
        from vllm_draft_offload.bench.accept.engine import prepare_cpu_platform

        prepare_cpu_platform()
        # CPU attention needs blocks of a multiple of 32; one process starts fastest.
        cpu = {"block_size": 32, "distributed_executor_backend": "uni"}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_draft_offload.bench.workloads.summary import sum_prefix
    from vllm_draft_offload.bench.workloads.worker import (
        metrics_delta,
        request_record,
        reset_prefix_cache_after_stores,
        snapshot_metrics,
    )

    turn_len = args.prompt_tokens + args.turn_decode_tokens + args.turn_user_tokens
    max_len = max(args.prompt_tokens + args.decode_tokens, turn_len + args.turn_decode_tokens)
    speculative = draft_model_config(args.draft)
    llm = LLM(
        model=args.target,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_len + 64,
        # The whole batch's prefill in one step: every request then decodes together.
        max_num_batched_tokens=max(8192, args.batch * args.prompt_tokens),
        gpu_memory_utilization=args.gpu_mem,
        enforce_eager=args.enforce_eager or args.dry_run_cpu,
        enable_prefix_caching=True,
        speculative_config=speculative,
        kv_transfer_config=connector_config(
            args.config, args.cpu_gib, args.chunk_size, max_len + 64, args.copy_path
        ),
        disable_log_stats=False,
        **cpu,
    )

    def generate(
        prompts: list[list[int]],
        max_tokens: int,
        salt: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> list:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        inputs = [
            TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {}))
            for p in prompts
        ]
        return llm.generate(inputs, sampling, use_tqdm=False)

    def step() -> None:
        """A request shorter than a block: the engine steps, nothing is stored."""
        generate([[FIRST_TOKEN, FIRST_TOKEN + 1]], 1)

    def settle() -> bool:
        """Every store landed and the GPU prefix cache is empty; one more step brings
        the stores' counters to this process."""
        done = reset_prefix_cache_after_stores(llm, step, attempts=400, pause_s=0.05)
        step()
        return done is not None

    generate(batch_prompts(-1, args.batch, args.prompt_tokens), args.decode_tokens)  # warm-up
    settle()
    clock = hook_clock(*engine_parts(llm)) if args.time_hooks and args.config != "none" else None
    timeline = None
    if args.time_hooks:
        decode_tokens = 1 + (speculative or {}).get("num_speculative_tokens", 0)
        timeline = EngineTimeline(llm.llm_engine.engine_core.engine_core, decode_tokens)
    result: dict[str, Any] = {"config": args.config, "reps": []}
    for rep, arm in batch_arms(args.reps, args.paired):
        before = snapshot_metrics()
        if clock is not None:
            clock.on = True
        if timeline is not None:
            timeline.on = True
        # the sampler's set-up and tear-down (a scan of every process) stay outside `wall`
        with MachineSampler() as machine:
            start = time.perf_counter()
            outs = generate(
                arm_prompts(rep, arm, args.batch, args.prompt_tokens),
                args.decode_tokens,
                params=arm_params(args.config, arm),
            )
            wall = time.perf_counter() - start
        hooks = None
        if clock is not None:
            clock.on = False
            hooks = clock.take()
        steps = None
        if timeline is not None:
            timeline.on = False
            steps = timeline.take()
        settled = settle()  # outside the timed window: the last stores land
        counters = metrics_delta(snapshot_metrics(), before)
        records = [request_record(o, None) for o in outs]
        result["reps"].append(
            {
                "rep": rep,
                "arm": arm,
                **decode_rate(records),
                "wall_s": wall,
                "output_tok_s": sum(r["out_len"] for r in records) / wall,
                "stored_chunks": sum_prefix(counters, STORED_CHUNKS, tier="cpu"),
                "loaded_bytes": sum_prefix(counters, LOADED_BYTES),
                "hit_tokens": sum(r["cached"] for r in records),
                "acceptance_length": acceptance_length(counters),
                "settled": settled,
                "machine": machine.summary,
                **({"hooks": hooks} if hooks is not None else {}),
                **({"engine": steps} if steps is not None else {}),
            }
        )
        print(args.config, json.dumps(result["reps"][-1]), flush=True)
    if args.profile:
        result["profile"] = profile_batch(
            lambda: generate(
                batch_prompts(args.reps, args.batch, args.prompt_tokens), args.decode_tokens
            )
        )
        settle()
    if args.config == "store" and args.turn_prompts > 0:
        result["turns"] = multi_turn(args, generate, settle, snapshot_metrics, metrics_delta)
    if timeline is not None:
        timeline.close()
    return result


def profile_batch(run: Any, top: int = 25) -> dict[str, Any]:  # noqa: ANN401
    """One batch under torch.profiler: wall, GPU busy time, and the top operations."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)

    def rows(key: str) -> list[dict[str, Any]]:
        ranked = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]
        return [
            {
                "name": e.key[:120],
                "calls": e.count,
                "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                "self_device_ms": round(getattr(e, "self_device_time_total", 0.0) / 1e3, 3),
            }
            for e in ranked
        ]

    return {
        "wall_s": wall,
        "device_busy_s": device_us / 1e6,
        "top_cpu": rows("self_cpu_time_total"),
        "top_device": rows("self_device_time_total"),
    }


class HookClock:
    """Wall time in the connector's hooks of an in-process engine (``--time-hooks``),
    while ``on``: wall time, so a hook that waits for the GPU shows."""

    def __init__(self) -> None:
        from vllm_draft_offload.bench.speed.hook_timing import Clock

        self.clock = Clock(time.perf_counter)
        self.on = False

    def take(self) -> dict[str, Any]:
        """Milliseconds, calls and the longest call's milliseconds per hook since the
        last take."""
        step, calls, longest = self.clock.step, self.clock.calls, self.clock.longest
        self.clock.step, self.clock.calls = type(step)(float), type(calls)(int)
        self.clock.longest = type(longest)(float)
        return {
            "ms": {name: round(1e3 * seconds, 3) for name, seconds in sorted(step.items())},
            "calls": dict(sorted(calls.items())),
            "max_ms": {name: round(1e3 * s, 3) for name, s in sorted(longest.items())},
        }


def engine_parts(llm: Any) -> tuple[Any, Any]:  # noqa: ANN401 - vllm.LLM
    """vLLM's Scheduler and the worker's connector of an engine whose core and worker
    run in this process (the child sets VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core  # LLMEngine -> InprocClient -> EngineCore
    return core.scheduler, get_kv_transfer_group()


def hook_clock(scheduler: Any, worker_connector: Any) -> HookClock:  # noqa: ANN401
    """Time ``scheduler.schedule`` and the hooks of both connector halves while on."""
    clock = HookClock()
    inner = clock.clock
    wrap = inner.wrap

    def gated(name: str, func: Any) -> Any:  # noqa: ANN401
        timed = wrap(name, func)
        return lambda *a, **k: timed(*a, **k) if clock.on else func(*a, **k)

    inner.wrap = gated  # type: ignore[method-assign]
    inner.wrap_hooks(scheduler.connector, worker_connector)
    scheduler.schedule = gated("schedule", scheduler.schedule)
    return clock


def multi_turn(args: argparse.Namespace, generate, settle, snapshot, delta) -> dict[str, Any]:  # noqa: ANN001
    """Turn 1, then turn 2 (prompt + answer + user) computed fresh (salted) and restored."""
    first = [tokens(7_000_001 + i, args.prompt_tokens) for i in range(args.turn_prompts)]
    answers = [list(o.outputs[0].token_ids) for o in generate(first, args.turn_decode_tokens)]
    second = [
        p + a + tokens(9_000_001 + i, args.turn_user_tokens)
        for i, (p, a) in enumerate(zip(first, answers, strict=True))
    ]
    phases: dict[str, Any] = {"settled_after_turn1": settle()}
    for name, salt in (("fresh", "decode-overhead-fresh"), ("restored", None)):
        before = snapshot()
        outs = generate(second, args.turn_decode_tokens, salt)
        counters = delta(snapshot(), before)
        phases[name] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "hit_tokens": [int(o.num_cached_tokens or 0) for o in outs],
            "acceptance_length": acceptance_length(counters),
        }
        phases[f"settled_after_{name}"] = settle()
    return {
        "prompt_tokens": args.prompt_tokens,
        "answer_tokens": args.turn_decode_tokens,
        "turn2_tokens": [len(p) for p in second],
        **phases,
    }
