"""Engine side of the pressure run and the soak: one ``vllm.LLM`` per process.

    python -m vllm_draft_offload.bench.stress.worker JOB.json      # writes job["out"]

``job["mode"]``:

* ``pressure``: the request list of `load.pressure_requests` on
  ``job["streams"]`` streams (`StreamDriver`), outputs and counters recorded.
* ``soak``: the load mix of `load.SoakStreams` until ``job["seconds"]`` (requests
  submitted before ``job["idle_s"]`` ask the connector to turn off what
  ``job["idle_off"]`` names, storing and restoring by default: `phases.idle_params`); every
  second a memory sample (RSS of this process and of the engine's, the connector's
  buffers; every 10 s also the entries of each connector container) and the
  connector/prefix-cache counters; writes
  ``job["ready"]`` once the engine serves, so the parent starts its fault schedule.
* ``replay``: ``job["replay"]`` prompts twice on this engine (as given, then reversed:
  other batches, the numerics control), greedy. A ``soak`` job with ``replay`` does
  this after its load (the soak's no-connector baseline engine).

A failing engine is a result (``status``, ``crashes``), never a traceback only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Counters sampled over time by the soak (prefix match on the series name).
SAMPLED = (
    "vllm:draft_offload_lookup_",
    "vllm:draft_offload_loaded_chunks",
    "vllm:draft_offload_stored_chunks",
    "vllm:draft_offload_fallbacks",
    "vllm:draft_offload_refusals",
    "vllm:draft_offload_spec_",
    "vllm:prefix_cache_",
    "vllm:external_prefix_cache_",
    "vllm:spec_decode_num_",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:draft_offload_l3_thread_seconds",
    "vllm:num_preemptions",
)
# Histograms sampled by their sum and count only (their buckets would bloat every
# sample): the count of ``iteration_tokens_total`` is the engine steps that produced
# output; the request histograms say where requests spent their time.
SAMPLED_HISTOGRAMS = (
    "vllm:iteration_tokens_total",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
)
# Samples (one a second) between counts of the connector's containers (stress/state.py).
STATE_EVERY = 10


def _counters() -> dict[str, float]:
    from vllm_draft_offload.bench.workloads.worker import snapshot_metrics

    return {k: v for k, v in snapshot_metrics().items() if v and _sampled(k)}


def _sampled(key: str) -> bool:
    name = key.partition("{")[0]
    if name.startswith(SAMPLED_HISTOGRAMS):
        return name.endswith(("_sum", "_count"))
    return name.startswith(SAMPLED)


def _engine_info(llm: Any) -> dict[str, Any]:
    vc = llm.llm_engine.vllm_config
    sc = vc.scheduler_config
    async_sched = getattr(sc, "async_scheduling", None)  # None: vLLM left it unresolved
    return {
        "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
        "block_size": vc.cache_config.block_size,
        "dtype": str(vc.model_config.dtype),
        "max_model_len": vc.model_config.max_model_len,
        "device": _device_name(),
        # what vLLM resolved (the engine kwargs leave them to it)
        "async_scheduling": None if async_sched is None else bool(async_sched),
        "max_num_batched_tokens": getattr(sc, "max_num_batched_tokens", None),
        "max_num_seqs": getattr(sc, "max_num_seqs", None),
        "executor_backend": str(getattr(vc.parallel_config, "distributed_executor_backend", None)),
    }


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


class Worker:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.out = Path(job["out"])
        self.result: dict[str, Any] = {"mode": job["mode"], "status": "starting", "crashes": 0}
        self.llm: Any = None

    def save(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result))
        tmp.replace(self.out)

    def start(self) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(**self.job["engine_kwargs"])
        self.result["engine"] = {"startup_s": time.perf_counter() - t0, **_engine_info(self.llm)}
        self.result["status"] = "running"
        self.save()

    # ------------------------------------------------------------------ modes
    def pressure(self) -> None:
        from vllm_draft_offload.bench.stress.engine import (
            StreamDriver,
            memory_sample,
            queue_streams,
        )
        from vllm_draft_offload.bench.stress.load import PressurePlan, pressure_requests

        plan = PressurePlan(**self.job["plan"])
        requests = pressure_requests(plan, int(self.job["vocab"]))
        before = _counters()
        # logprobs=2: each answer token's lead over the runner-up, so the report can
        # tell a near-tie flip (numerics) from a confident one (wrong KV)
        res = StreamDriver(
            self.llm,
            queue_streams(requests, plan.streams),
            logprobs=2,
            keep_prompt=lambda _seq: False,
        ).run()
        self._driver_result(res)
        self.result["counters"] = _delta(_counters(), before)
        self.result["memory"] = memory_sample(self.llm, res.wall_s)
        self.result["requests"] = [
            {"kind": f.kind, "seq": f.seq, "output": f.output, **f.record} for f in res.finished
        ]

    def soak(self) -> None:
        from vllm_draft_offload.bench.stress.engine import StreamDriver, memory_sample
        from vllm_draft_offload.bench.stress.load import SoakLoad, SoakStreams
        from vllm_draft_offload.bench.stress.phases import TRANSFERS, idle_params

        load = SoakLoad.from_dict(self.job["load"])
        idle_s = float(self.job.get("idle_s") or 0.0)  # the connector moves nothing until then
        streams = SoakStreams(load, int(self.job["vocab"]))
        samples: list[dict[str, Any]] = []
        last_save = [time.perf_counter()]

        def tick(t: float, last: bool = False) -> None:
            # Every STATE_EVERY-th sample also counts the connector's containers.
            state = self.job.get("state", True) and (last or len(samples) % STATE_EVERY == 0)
            sample = (
                memory_sample(self.llm, t, state=state)
                if self.job.get("memory", True)
                else {"t": t}
            )
            sample["counters"] = _counters()
            samples.append(sample)
            if time.perf_counter() - last_save[0] > 30:  # a hard crash keeps what ran
                last_save[0] = time.perf_counter()
                self.save()

        self.result["samples"] = samples
        Path(self.job["ready"]).write_text(str(time.time()))
        every = max(1, int(self.job.get("replay_every", 1)))
        cap = int(self.job.get("replay_n", 0))

        def sampled(seq: int) -> bool:  # the replay sample: only its tokens are kept
            return seq % every == 0 and seq // every < cap

        res = StreamDriver(
            self.llm,
            [streams.make(i) for i in range(load.streams)],
            deadline_s=float(self.job["seconds"]),
            max_requests=int(self.job["max_requests"]),
            on_tick=tick,
            keep_prompt=sampled,
            keep_output=sampled,
            params_for=idle_params(idle_s, tuple(self.job.get("idle_off") or TRANSFERS))
            if idle_s > 0
            else None,
        ).run()
        tick(res.wall_s, last=True)
        self._driver_result(res)
        self.result["requests"] = [
            {
                "kind": f.kind,
                "seq": f.seq,
                "submit_t": f.submit_t,
                "end_t": f.end_t,
                **f.record,
                **({"kv_transfer_params": f.kv_params} if f.kv_params else {}),
            }
            for f in res.finished
        ]
        self.result["replay_sample"] = [
            {
                "seq": f.seq,
                "kind": f.kind,
                "prompt": f.prompt,
                "output": f.output,
                "cached": f.record.get("cached"),
            }  # fmt: skip
            for f in res.finished
            if sampled(f.seq)
        ]

    def replay(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_draft_offload.bench.workloads.worker import top_margins

        items = self.job["replay"]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in items]
        # logprobs=2 (greedy picks stay the same): each reference pick's lead over the
        # runner-up, so the report tells a near-tie flip (numerics) from a confident one
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=len(r["output"]), ignore_eos=True, logprobs=2
            )
            for r in items
        ]
        first = self.llm.generate(prompts, params, use_tqdm=False)
        second = self.llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]
        self.result["reference"] = [list(o.outputs[0].token_ids) for o in first]
        self.result["reference_margins"] = [top_margins(o.outputs[0].logprobs or []) for o in first]
        self.result["control"] = [list(o.outputs[0].token_ids) for o in second]

    def _driver_result(self, res: Any) -> None:
        self.result.update(
            crashes=res.crashes,
            error=res.error,
            traceback=res.traceback,
            stopped_by=res.stopped_by,
            wall_s=res.wall_s,
            n_finished=len(res.finished),
            # What this process keeps of the requests' tokens (the replay sample's).
            tokens_kept=sum(len(f.prompt or ()) + len(f.output or ()) for f in res.finished),
            tick_errors=res.tick_errors[:20],
        )

    def run(self) -> None:
        self.start()
        getattr(self, self.job["mode"])()
        if self.job["mode"] == "soak" and self.job.get("replay"):
            # the baseline engine replays ours' sample too: one engine start fewer
            self.result["replay_reset"] = bool(self.llm.reset_prefix_cache())
            self.replay()
        self.result["status"] = "crashed" if self.result["crashes"] else "ok"
        self.save()


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def main(argv: list[str] | None = None) -> int:
    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    worker = Worker(job)
    try:
        worker.run()
    except BaseException as exc:  # noqa: BLE001 - any failure is a result to record
        worker.result["status"] = "error"
        worker.result["error"] = f"{type(exc).__name__}: {exc}"
        worker.result["traceback"] = traceback.format_exc()[-8000:]
        worker.save()
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is saved: skip vLLM's teardown (tens of seconds on a small CPU box);
    # the parent kills the process group, so no engine child outlives it.
    os._exit(rc)
