"""Engine side of the benchmark: one ``vllm.LLM`` per process, or the memcpy probe.

    python -m vllm_draft_offload.bench.workloads.worker run JOB.json   # writes job["out"]
    python -m vllm_draft_offload.bench.workloads.worker memcpy OUT.json --gib 1

Run by ``vllm-draft-offload bench`` (``run.py``) in a subprocess per configuration x
drafter, so that a connector that crashes the engine (or the interpreter) becomes a
recorded result.
The result JSON is rewritten after every step, so a crash keeps what ran before it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_draft_offload.bench.workloads.specs import (
    Sizes,
    Workload,
    build_workload,
    chat_next_turn,
    digest,
    restore_expected_hit,
    unique_prompt,
)

# Label names vLLM adds to every series; dropped so keys are stable across runs.
_ENGINE_LABELS = frozenset({"model_name", "engine"})


def snapshot_metrics() -> dict[str, float]:
    """All ``vllm:*`` counters and histograms of this process, as floats.

    Read from prometheus_client's REGISTRY directly rather than ``LLM.get_metrics()``:
    vLLM's reader casts counters to int, which would truncate
    ``vllm:draft_offload_transfer_seconds`` to whole seconds. Keys are
    ``sample_name{label=value,...}`` (``_total``/``_sum``/``_count``/``_bucket``
    suffixes kept), summed over engines.
    """
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("vllm:") or family.type not in ("counter", "histogram"):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in _ENGINE_LABELS
            )
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _keep(key: str) -> bool:
    """Counters and histogram sums/counts; buckets only of the recomputed-tokens histogram
    (the goal needs its <= 1 bucket): the other histograms have ~20 buckets each, which
    would bloat every phase."""
    name = key.partition("{")[0]
    return not name.endswith("_bucket") or name.startswith(
        "vllm:draft_offload_recomputed_tokens_per_hit"
    )


def metrics_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Nonzero differences only: keeps the JSON readable (hundreds of zero series)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if _keep(k)}
    return {k: v for k, v in delta.items() if v}


def reset_prefix_cache_after_stores(
    llm: Any, step: Callable[[], object], attempts: int = 100, pause_s: float = 0.02
) -> int | None:
    """Evict the GPU prefix cache; returns the attempts it took, None if it never did.

    A connector keeps a finished request's blocks until its stores complete, and
    the offline engine only notices completions while stepping, so a failed reset
    is followed by ``step()``: a tiny request (shorter than a block: nothing gets
    stored).
    """
    for attempt in range(1, attempts + 1):
        if llm.reset_prefix_cache():
            return attempt
        step()
        time.sleep(pause_s)
    return None


def top_margins(logprobs: list[dict[int, Any]]) -> list[float | None]:
    """Per output position, the chosen token's logprob lead over the next-best token
    (needs ``SamplingParams(logprobs=2)``; None where only one token was returned).
    A greedy output that flips where this lead is tiny is a numerics near-tie."""
    margins: list[float | None] = []
    for position in logprobs:
        best = sorted((lp.logprob for lp in position.values()), reverse=True)
        margins.append(round(best[0] - best[1], 5) if len(best) > 1 else None)
    return margins


def request_record(out: Any, expected_hit: int | None) -> dict[str, Any]:
    comp = out.outputs[0]
    m = out.metrics
    rec: dict[str, Any] = {
        "prompt_len": len(out.prompt_token_ids or []),
        "cached": int(out.num_cached_tokens or 0),
        "out_len": len(comp.token_ids),
        "expected_hit": expected_hit,
    }
    if m is not None:
        # first_token_latency: frontend wall clock, arrival -> first token processed.
        rec["ttft_s"] = float(m.first_token_latency)
        # engine-core monotonic timestamps; only differences between them are used
        rec["first_ts"] = float(m.first_token_ts)
        rec["last_ts"] = float(m.last_token_ts)
    if comp.logprobs:  # requested (pressure): how close each greedy pick was
        rec["margins"] = top_margins(comp.logprobs)
    spec = getattr(comp, "spec_decode_metrics", None)
    if spec is not None:
        d = spec.to_dict()
        rec["spec"] = {
            "steps": d["num_spec_steps"],
            "accepted": d["num_accepted_draft_tokens"],
            "drafted": d["num_draft_tokens"],
        }
    return rec


class Runner:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.sizes = Sizes.from_dict(job["sizes"])
        self.out_path = Path(job["out"])
        self.record: dict[str, Any] = {
            "config": job["config"],
            "drafter": job["drafter"],
            "stage": job["stage"],
            "status": "running",
            "engine_kwargs": job["engine_kwargs"],
            "env": job.get("env", {}),
            "workloads": {},
            "ttft_curve": {},
        }
        self.llm: Any = None
        self.vocab = int(job["vocab"])
        self._dummy = 0

    # ------------------------------------------------------------------ helpers
    def save(self) -> None:
        tmp = self.out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1))
        tmp.replace(self.out_path)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return outs, time.perf_counter() - t0

    def reset_gpu_cache(self) -> dict[str, Any]:
        """Evict the GPU prefix cache (see `reset_prefix_cache_after_stores`)."""

        def step() -> None:
            self._dummy += 1
            self.generate([unique_prompt(self.vocab, 7, f"dummy{self._dummy}", 2)], 1)

        attempts = reset_prefix_cache_after_stores(self.llm, step)
        return {"ok": attempts is not None, "attempts": attempts or 100}

    def phase(
        self,
        name: str,
        prompts: list[list[int]],
        max_tokens: int,
        expected: list[int | None],
        reset: bool,
        round_: int = 0,
        keep_outputs: bool = False,
    ) -> tuple[dict[str, Any], list[list[int]]]:
        rec: dict[str, Any] = {"phase": name, "round": round_, "n": len(prompts)}
        if reset:
            rec["reset"] = self.reset_gpu_cache()
        before = snapshot_metrics()
        outs, wall = self.generate(prompts, max_tokens)
        rec["counters"] = metrics_delta(snapshot_metrics(), before)
        rec["wall_s"] = wall
        rec["digest"] = digest(prompts)
        answers = [list(o.outputs[0].token_ids) for o in outs]
        rec["outputs_digest"] = digest(answers)
        rec["output_tokens"] = sum(len(a) for a in answers)
        rec["requests"] = [request_record(o, e) for o, e in zip(outs, expected, strict=True)]
        if keep_outputs:
            rec["answers"] = answers
        return rec, answers

    # ------------------------------------------------------------------ engine
    def start_engine(self) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(**self.job["engine_kwargs"])
        self.record["engine"] = {"startup_s": time.perf_counter() - t0, **self.engine_info()}
        self.save()

    def engine_info(self) -> dict[str, Any]:
        """KV bytes per token of target and drafter, from the configs vLLM resolved."""
        import torch

        vc = self.llm.llm_engine.vllm_config
        info: dict[str, Any] = {
            "dtype": str(vc.model_config.dtype),
            "block_size": vc.cache_config.block_size,
            "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
            "cache_dtype": str(vc.cache_config.cache_dtype),
        }
        cache_dtype = vc.cache_config.cache_dtype
        elem = (
            torch.tensor([], dtype=vc.model_config.dtype).element_size()
            if cache_dtype == "auto"
            else 1  # fp8 KV cache variants
        )

        def per_token(mc: Any) -> int:
            return (
                2
                * mc.get_num_layers(vc.parallel_config)
                * mc.get_num_kv_heads(vc.parallel_config)
                * mc.get_head_size()
                * elem
            )

        try:
            info["kv_bytes_per_token_target"] = per_token(vc.model_config)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            info["kv_bytes_per_token_error"] = repr(exc)
            return info
        draft = 0
        try:
            spec = vc.speculative_config
            if spec is not None and spec.draft_model_config is not None:
                draft = per_token(spec.draft_model_config)
        except Exception as exc:  # noqa: BLE001
            info["kv_bytes_per_token_draft_error"] = repr(exc)
        info["kv_bytes_per_token_draft"] = draft
        info["kv_bytes_per_token"] = info["kv_bytes_per_token_target"] + draft
        return info

    # ------------------------------------------------------------------ steps
    def warmup(self) -> None:
        rec, _ = self.phase(
            "warmup",
            [unique_prompt(self.vocab, self.sizes.seed, "warmup", self.sizes.warmup_len)],
            8,
            [None],
            reset=False,
        )
        self.record["warmup"] = rec
        self.save()

    def gen1(self, prompt: list[int]) -> dict[str, Any]:
        outs, wall = self.generate([prompt], 1)
        rec = request_record(outs[0], None)
        rec["wall_s"] = wall
        return rec

    def ttft_curve(self, do_fresh: bool, do_hits: bool, prior: dict[str, Any]) -> None:
        """Single-request TTFT (max_tokens=1) at each prefix length.

        Prompt = ``L`` prefix tokens + 1, so a hit can cover the whole prefix. Fresh:
        ``reps`` unique prompts. Hits: the first fresh prompt again after a GPU-cache
        reset; the first hit is kept apart (cold paths), then ``reps`` steady hits.
        ``tail``: a fresh prompt as long as the uncached tail of a hit, used to turn
        TTFT into an estimated restore throughput.
        """
        s = self.sizes
        for length in s.ttft_lengths:
            key = str(length)
            cur = dict(prior.get(key, {}))
            cur["prompt_len"] = length + 1
            main_prompt = unique_prompt(self.vocab, s.seed, f"ttft-{length}-0", length + 1)
            if do_fresh:
                cur["fresh"] = [
                    self.gen1(unique_prompt(self.vocab, s.seed, f"ttft-{length}-{rep}", length + 1))
                    for rep in range(s.ttft_reps)
                ]
            if do_hits:
                cur["reset"] = self.reset_gpu_cache()
                before = snapshot_metrics()
                cur["first_hit"] = self.gen1(main_prompt)
                cur["first_hit_counters"] = metrics_delta(snapshot_metrics(), before)
                hits = []
                before = snapshot_metrics()
                for _ in range(s.ttft_reps):
                    self.reset_gpu_cache()
                    hits.append(self.gen1(main_prompt))
                cur["hits"] = hits
                cur["hits_counters"] = metrics_delta(snapshot_metrics(), before)
                cached = int(statistics.median(h["cached"] for h in hits))
                if 0 < cached <= length:
                    tail_len = length + 1 - cached
                    cur["tail"] = [
                        self.gen1(
                            unique_prompt(self.vocab, s.seed, f"tail-{length}-{rep}", tail_len)
                        )
                        for rep in range(s.ttft_reps)
                    ]
            self.record["ttft_curve"][key] = cur
            self.save()

    def workload(
        self, wl: Workload, do_fill: bool, do_restore: bool, prior: dict[str, Any]
    ) -> None:
        s = self.sizes
        entry = self.record["workloads"].setdefault(wl.name, {"params": wl.params, "phases": []})
        phases: list[dict[str, Any]] = entry["phases"]
        chunk = s.chunk_size
        fill_answers: list[list[int]] | None = None
        if do_fill:
            rec, fill_answers = self.phase(
                "fill",
                wl.fill,
                wl.max_tokens,
                [None] * len(wl.fill),
                reset=False,
                keep_outputs=wl.name == "chat",
            )
            phases.append(rec)
            self.save()
        else:
            # restore stage of ours_disk: the fill ran in the previous engine
            for p in prior.get("phases", []):
                if p["phase"] == "fill":
                    phases.append(p)
                    fill_answers = p.get("answers")
        if not do_restore or wl.name == "nohit":
            return  # no-hit: only fresh unique prompts, for decode throughput
        expected = [restore_expected_hit(len(p), chunk) for p in wl.fill]
        rec, _ = self.phase("restore", wl.fill, wl.max_tokens, expected, reset=True)
        phases.append(rec)
        self.save()
        if wl.name == "chat":
            prompts, answers = wl.fill, fill_answers
            for turn in range(2, s.chat_turns + 1):
                if answers is None:
                    break
                prompts = chat_next_turn(s, self.vocab, prompts, answers, turn)
                # A hit may stop short of the previous answer's end: the last sampled
                # token has no KV yet, so the expected hit is not known in advance.
                rec, answers = self.phase(
                    "continue",
                    prompts,
                    wl.max_tokens,
                    [None] * len(prompts),
                    reset=True,
                    round_=turn - 1,
                )
                phases.append(rec)
                self.save()
            return
        for r, (prompts, hits) in enumerate(zip(wl.cont or [], wl.cont_hit or [], strict=True)):
            rec, _ = self.phase("continue", prompts, wl.max_tokens, hits, reset=True, round_=r + 1)
            phases.append(rec)
            self.save()

    def run(self) -> None:
        job = self.job
        stage = job["stage"]  # "all" | "fill" | "restore"
        prior: dict[str, Any] = {}
        if job.get("prior"):
            prior = json.loads(Path(job["prior"]).read_text())
        self.start_engine()
        self.warmup()
        start = snapshot_metrics()
        if job.get("ttft"):
            self.ttft_curve(stage != "restore", stage != "fill", prior.get("ttft_curve", {}))
        for name in job["workloads"]:
            wl = build_workload(name, self.sizes, self.vocab)
            self.workload(
                wl,
                stage != "restore",
                stage != "fill",
                prior.get("workloads", {}).get(name, {}),
            )
        if stage == "fill":
            # Stores finish only while the engine steps; the reset loop steps it until
            # every finished request released its blocks, i.e. all stores completed
            # (then the settle time lets the async L3 writes land).
            self.record["final_reset"] = self.reset_gpu_cache()
        self.record["totals"] = metrics_delta(snapshot_metrics(), start)
        self.record["status"] = "ok"
        self.save()


# ----------------------------------------------------------------------------- memcpy


def measure_memcpy(gib: float, iters: int = 5) -> dict[str, Any]:
    """Pinned host -> device copy bandwidth, the ceiling for restoring KV from CPU."""
    import torch

    if not torch.cuda.is_available():
        return {"gbps": None, "device": "cpu", "reason": "no CUDA device"}
    n = int(gib * (1 << 30))
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up: first touch, driver mappings
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        samples.append(n / (start.elapsed_time(end) / 1e3) / 1e9)
    return {
        "gbps": statistics.median(samples),
        "samples_gbps": samples,
        "bytes": n,
        "device": torch.cuda.get_device_name(0),
        "method": "torch pinned uint8 tensor -> cuda non_blocking copy_, CUDA events, median",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("job", type=Path)
    m = sub.add_parser("memcpy")
    m.add_argument("out", type=Path)
    m.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.cmd == "memcpy":
        args.out.write_text(json.dumps(measure_memcpy(args.gib), indent=1))
        return 0
    job = json.loads(args.job.read_text())
    runner = Runner(job)
    try:
        runner.run()
    except BaseException as exc:  # noqa: BLE001 - any failure is a result to record
        runner.record["status"] = "error"
        runner.record["error"] = f"{type(exc).__name__}: {exc}"
        runner.record["traceback"] = traceback.format_exc()[-8000:]
        runner.save()
        return 1
    finally:
        sys.stdout.flush()
    # Leave without vLLM's slow teardown racing the interpreter shutdown; the
    # fresh-engine L3 stage waits for its writes in the parent (settle time).
    if job["stage"] == "fill" and job.get("settle_s"):
        time.sleep(float(job["settle_s"]))
    del runner
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
