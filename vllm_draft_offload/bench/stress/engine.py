"""Engine-process helpers shared by the pressure run and the soak.

* `StreamDriver`: N concurrent *streams* on one offline engine (``LLM.llm_engine``'s
  ``add_request``/``step`` loop, the loop ``LLM.generate`` runs itself): a stream
  submits its next request as soon as its previous one finished, so the engine
  always holds N requests (closed-loop load) without AsyncLLM. Bounded by a
  deadline and a request count; an exception of the engine is recorded as a crash.
  ``params_for(t)`` gives a request submitted at ``t`` its ``kv_transfer_params``
  (the connector's per-request options, request_options.py), or None for plain.
* `connector_memory`: runs on every worker through ``collective_rpc`` and reads the
  connector's host pool and storage-tier buffers.
* `process_tree_rss`: resident memory of this process and of its children (EngineCore).

Importing this module has no side effects; vLLM is imported inside the functions.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Finished:
    """One finished request of a stream."""

    stream: int
    seq: int  # submission order over all streams
    kind: str
    prompt: list[int] | None  # None unless the driver was asked to keep it
    output: list[int] | None
    record: dict[str, Any]  # workloads.worker.request_record(...)
    submit_t: float  # seconds since the driver started
    end_t: float
    kv_params: dict[str, Any] | None = None  # the kv_transfer_params it was sent with


@dataclass
class DriverResult:
    finished: list[Finished] = field(default_factory=list)
    crashes: int = 0
    error: str | None = None
    traceback: str | None = None
    stopped_by: str = "done"  # done | deadline | max_requests | crash
    tick_errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


# A stream yields (kind, prompt, max_tokens) and is sent the finished output tokens.
Stream = Iterator[tuple[str, list[int], int]]


class StreamDriver:
    """Keep ``len(streams)`` requests in flight on ``llm`` until the streams or limits end."""

    def __init__(
        self,
        llm: Any,
        streams: list[Callable[[list[int] | None], tuple[str, list[int], int] | None]],
        *,
        deadline_s: float | None = None,
        max_requests: int | None = None,
        on_tick: Callable[[float], None] | None = None,
        tick_s: float = 1.0,
        logprobs: int | None = None,
        keep_prompt: Callable[[int], bool] = lambda _seq: True,
        keep_output: Callable[[int], bool] = lambda _seq: True,
        params_for: Callable[[float], dict[str, Any] | None] | None = None,
    ) -> None:
        # streams[i](last_output) -> next (kind, prompt, max_tokens), or None when done
        # keep_prompt / keep_output(seq): whether Finished keeps that request's tokens. A
        # soak runs ~30 requests a second of up to 16k tokens each: keeping every prompt
        # grows this process by about 8 bytes a token (18k requests: 0.9 GB).
        self.keep_prompt, self.keep_output = keep_prompt, keep_output
        self.llm = llm
        self.streams = streams
        self.deadline_s = deadline_s
        self.max_requests = max_requests
        self.on_tick = on_tick
        self.tick_s = tick_s
        # top-k logprobs per output token (greedy picks stay the same): the records
        # then carry each pick's margin over the next-best token (near-tie analysis)
        self.logprobs = logprobs
        self.params_for = params_for

    def run(self) -> DriverResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from vllm_draft_offload.bench.workloads.worker import request_record

        engine = self.llm.llm_engine
        res = DriverResult()
        t0 = time.perf_counter()
        inflight: dict[str, tuple[int, int, str, list[int], float, dict[str, Any] | None]] = {}
        seq = 0
        last_tick = -1e9
        stopping = False

        def submit(stream: int, last: list[int] | None) -> None:
            nonlocal seq, stopping
            if stopping:
                return
            nxt = self.streams[stream](last)
            if nxt is None:
                return
            kind, prompt, max_tokens = nxt
            sub_t = time.perf_counter() - t0
            kv = self.params_for(sub_t) if self.params_for is not None else None
            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
                logprobs=self.logprobs,
                extra_args={"kv_transfer_params": kv} if kv else None,
            )
            rid = f"s{stream}-{seq}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
            inflight[rid] = (stream, seq, kind, prompt, sub_t, kv)
            seq += 1
            if self.max_requests is not None and seq >= self.max_requests:
                stopping, res.stopped_by = True, "max_requests"

        try:
            for i in range(len(self.streams)):
                submit(i, None)
            while inflight:
                now = time.perf_counter() - t0
                if not stopping and self.deadline_s is not None and now >= self.deadline_s:
                    # no new requests; the ones in flight finish (bounded by max_tokens)
                    stopping, res.stopped_by = True, "deadline"
                if self.on_tick is not None and now - last_tick >= self.tick_s:
                    last_tick = now
                    try:
                        self.on_tick(now)
                    except Exception as exc:  # noqa: BLE001 - a failed sample is no crash
                        res.tick_errors.append(f"{now:.1f}s {type(exc).__name__}: {exc}")
                for out in engine.step():
                    if not out.finished or out.request_id not in inflight:
                        continue
                    stream, s, kind, prompt, sub_t, kv = inflight.pop(out.request_id)
                    tokens = list(out.outputs[0].token_ids)
                    res.finished.append(
                        Finished(
                            stream,
                            s,
                            kind,
                            prompt if self.keep_prompt(s) else None,
                            tokens if self.keep_output(s) else None,
                            request_record(out, None),
                            sub_t,
                            time.perf_counter() - t0,
                            kv,
                        )
                    )
                    submit(stream, tokens)
        except Exception as exc:  # noqa: BLE001 - an engine failure is a result (a crash)
            res.crashes += 1
            res.error = f"{type(exc).__name__}: {exc}"
            res.traceback = traceback.format_exc()[-6000:]
            res.stopped_by = "crash"
        res.wall_s = time.perf_counter() - t0
        res.finished.sort(key=lambda f: f.seq)
        return res


def queue_streams(
    requests: list[tuple[str, list[int], int]], n_streams: int
) -> list[Callable[[list[int] | None], tuple[str, list[int], int] | None]]:
    """Streams that take the next request of one shared, ordered list.

    Every configuration gets the same submission order and concurrency: request k is
    submitted when k-1 were, as soon as any stream is free.
    """
    it = iter(requests)

    def take(_last: list[int] | None) -> tuple[str, list[int], int] | None:
        return next(it, None)

    return [take] * n_streams


# ----------------------------------------------------------------------------- memory


def connector_memory(worker: Any) -> dict[str, Any]:
    """On a worker (via ``collective_rpc``): bytes the connector holds in host memory.

    Reads attributes of the worker-side connector (`HostPool`, `WorkerL3`); any of them
    missing gives None rather than an error, so a changed connector only loses a field.
    """
    out: dict[str, Any] = {"connector": False}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return out
        w = getattr(get_kv_transfer_group(), "_worker", None)
    except Exception as exc:  # noqa: BLE001 - a probe never fails the run
        return {**out, "error": repr(exc)}
    pool = getattr(w, "pool", None)
    out["connector"] = w is not None
    if pool is not None:
        out["pool_bytes"] = int(pool.num_slots * pool.unit_bytes)
        out["pool_pinned"] = bool(pool.pinned)
        out["unit_bytes"] = int(pool.unit_bytes)
    l3 = getattr(w, "l3", None)
    if l3 is not None:
        out["l3_pending_write_bytes"] = int(getattr(l3, "_pending_write_bytes", 0))
        store = getattr(l3, "store", None)
        try:
            out["l3_staging_in_use_bytes"] = int(store.staging_in_use()) if store else None
        except Exception:  # noqa: BLE001
            out["l3_staging_in_use_bytes"] = None
    return out


def process_tree_rss() -> tuple[int, int]:
    """RSS of this process (the driver: vLLM's frontend and what the run keeps) and of
    its children (the EngineCore/worker processes on a GPU, where the connector lives)."""
    import psutil

    me = psutil.Process()
    children = 0
    for child in me.children(recursive=True):
        try:
            children += child.memory_info().rss
        except psutil.Error:
            continue
    return int(me.memory_info().rss), int(children)


def memory_sample(llm: Any, t: float, state: bool = False) -> dict[str, Any]:
    """One sample: RSS of the process tree, plus each worker's connector buffers; with
    `state`, the entries of every container of the connector (stress/state.py)."""
    driver, engine = process_tree_rss()
    sample: dict[str, Any] = {
        "t": round(t, 3),
        "rss_bytes": driver + engine,
        "rss_driver_bytes": driver,
        "rss_engine_bytes": engine,
    }
    if state:
        from vllm_draft_offload.bench.stress.state import connector_state

        try:
            ranks = llm.collective_rpc(connector_state, timeout=10)
            # rank 0, and what grows on any rank: the largest count of each path
            merged: dict[str, int] = {}
            for sizes in ranks:
                for path, n in sizes.items():
                    merged[path] = max(n, merged.get(path, 0))
            sample["state"] = {path: n for path, n in sorted(merged.items()) if n}
        except Exception as exc:  # noqa: BLE001 - recorded, sampling goes on
            sample["state_error"] = repr(exc)
    try:
        workers = llm.collective_rpc(connector_memory, timeout=10)
    except Exception as exc:  # noqa: BLE001 - recorded, sampling goes on
        sample["probe_error"] = repr(exc)
        return sample
    pinned = sum(w.get("pool_bytes", 0) for w in workers if w.get("pool_pinned"))
    sample["pinned_bytes"] = pinned
    sample["pool_bytes"] = sum(w.get("pool_bytes", 0) for w in workers)
    sample["l3_pending_write_bytes"] = sum(w.get("l3_pending_write_bytes") or 0 for w in workers)
    sample["l3_staging_in_use_bytes"] = sum(w.get("l3_staging_in_use_bytes") or 0 for w in workers)
    return sample


# ----------------------------------------------------------------------------- model sizes


def kv_bytes_per_token(model_dir: str, dtype_bytes: int) -> int:
    """Target or drafter KV bytes per token (K and V, every layer) from its config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def dtype_bytes(dtype: str, model_dir: str) -> int:
    if dtype == "auto":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return 4 if "32" in dtype else 2
