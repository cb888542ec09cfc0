"""What ``serve-bench`` runs: the workload, the two servers and the bench client, as
exact command lines (pure: nothing is started here, so tests check them on a CPU).

The GPU KV cache is fixed in *tokens* (``--num-gpu-blocks-override``), smaller than the
workload's shared prefixes together, so a prefix is evicted from the GPU before it
comes back and only a KV connector can serve it again. ``--kv-cache-memory-bytes``
is passed too, only so that vLLM skips its memory profiling (faster start, and the
result does not depend on what else holds GPU memory): with the block override, vLLM
allocates exactly the blocks asked for.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RUNS: tuple[str, ...] = ("none", "ours_cpu")  # the same names as the workload bench's configs
CONNECTOR = "DraftOffloadConnector"
VLLM_CLI = "vllm.entrypoints.cli.main"  # `python -m` of it is the `vllm` command
MAX_LEN_MARGIN = 64  # BOS, re-tokenization drift of the bench's prompts, draft tokens


@dataclass(frozen=True)
class Workload:
    """``vllm bench serve --dataset-name prefix_repetition``: ``num_prefixes`` random
    prefixes of ``prefix_len`` tokens, each followed by its own random suffix in
    ``num_prompts // num_prefixes`` requests, shuffled."""

    prefix_len: int
    suffix_len: int
    num_prefixes: int
    output_len: int
    num_prompts: int
    max_concurrency: int
    request_rate: float = math.inf  # requests/s; inf sends all at once, up to the concurrency

    @property
    def working_set_tokens(self) -> int:
        """Tokens of all shared prefixes: what a cache must hold to serve every repeat."""
        return self.num_prefixes * self.prefix_len

    @property
    def request_tokens(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len


# Defaults: a GPU run of both servers in about 3 minutes (--enforce-eager; an estimate
# until timed on a GPU), and the --dry-run-cpu one (about 2.5 minutes on 2 cores).
GPU_WORKLOAD = Workload(
    prefix_len=4096, suffix_len=256, num_prefixes=32, output_len=64, num_prompts=256,
    max_concurrency=8,
)  # fmt: skip
CPU_WORKLOAD = Workload(
    prefix_len=256, suffix_len=32, num_prefixes=4, output_len=8, num_prompts=12,
    max_concurrency=2,
)  # fmt: skip


@dataclass(frozen=True)
class ServePlan:
    fixtures: Path
    draft: str | None  # fixture dir of the drafter; None: no speculative decoding
    spec_method: str | None
    num_spec: int
    workload: Workload
    block_size: int
    gpu_kv_tokens: int
    kv_cache_memory_bytes: int
    chunk_size: int
    cpu_bytes: int
    port: int
    enforce_eager: bool
    seed: int = 0

    @property
    def target(self) -> Path:
        return self.fixtures / "target"

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu_kv_tokens // self.block_size

    @property
    def max_model_len(self) -> int:
        return self.workload.request_tokens + self.num_spec + MAX_LEN_MARGIN

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def check(self) -> None:
        """Refuse a plan whose run would not measure what it claims, naming the option."""
        w = self.workload
        positive = {
            "--prefix-len": w.prefix_len, "--suffix-len": w.suffix_len,
            "--num-prefixes": w.num_prefixes, "--output-len": w.output_len,
            "--num-prompts": w.num_prompts, "--max-concurrency": w.max_concurrency,
            "--block-size": self.block_size, "--chunk-size": self.chunk_size,
            "--gpu-kv-tokens": self.gpu_kv_tokens, "--cpu-gib": self.cpu_bytes,
        }  # fmt: skip
        for option, value in positive.items():
            if value <= 0:
                raise ValueError(f"{option} must be > 0, got {value}")
        if w.num_prompts < 2 * w.num_prefixes:
            raise ValueError(
                f"--num-prompts={w.num_prompts} gives a prefix fewer than 2 requests "
                f"(--num-prefixes={w.num_prefixes}): nothing would be reused"
            )
        if self.gpu_kv_tokens % self.block_size:
            raise ValueError(
                f"--gpu-kv-tokens={self.gpu_kv_tokens} is not a multiple of "
                f"--block-size={self.block_size}"
            )
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"--chunk-size={self.chunk_size} is not a multiple of --block-size="
                f"{self.block_size} (kv_connector_extra_config.chunk_size)"
            )
        if self.gpu_kv_tokens >= w.working_set_tokens:
            raise ValueError(
                f"--gpu-kv-tokens={self.gpu_kv_tokens} holds all {w.num_prefixes} prefixes "
                f"({w.working_set_tokens} tokens): they would never leave the GPU"
            )
        if self.gpu_kv_tokens - self.block_size < self.max_model_len:
            raise ValueError(
                f"--gpu-kv-tokens={self.gpu_kv_tokens} less the block vLLM holds back is "
                f"smaller than one request ({self.max_model_len} tokens with margin): "
                "vLLM refuses to start"
            )
        if self.draft is not None and not self.spec_method:
            raise ValueError(
                f"--spec-method is needed for --draft={self.draft} (its fixture_meta.json "
                "names none)"
            )

    def speculative_config(self) -> dict[str, Any] | None:
        if self.draft is None:
            return None
        return {
            "method": self.spec_method,
            "model": str(self.fixtures / self.draft),
            "num_speculative_tokens": self.num_spec,
        }

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": CONNECTOR,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": self.cpu_bytes,
                "chunk_size": self.chunk_size,
            },
        }

    def server_argv(self, python: str, run: str) -> list[str]:
        """``vllm serve`` of the target (and drafter), with the connector iff ``run`` is
        ``ours_cpu``."""
        if run not in RUNS:
            raise ValueError(f"run must be one of {RUNS}, got {run!r}")
        argv = [
            python, "-m", VLLM_CLI, "serve", str(self.target),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--seed", str(self.seed),
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.num_gpu_blocks),
            "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
            "--enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.enforce_eager:
            argv.append("--enforce-eager")
        spec = self.speculative_config()
        if spec is not None:
            # per-request acceptance: the connector splits it by restored vs fresh prefix
            argv += ["--speculative-config", json.dumps(spec)]
            argv += ["--per-request-spec-decode-metrics", "summary"]
        if run == "ours_cpu":
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return argv

    def bench_argv(self, python: str, result_dir: Path, run: str) -> list[str]:
        """``vllm bench serve`` against the running server; the result lands in
        ``result_dir/bench.json``. Greedy and ``--ignore-eos``: both runs generate the
        same number of tokens, and an exact connector gives the same text."""
        w = self.workload
        return [
            python, "-m", VLLM_CLI, "bench", "serve",
            "--backend", "vllm", "--base-url", self.base_url,
            "--model", str(self.target), "--tokenizer", str(self.target),
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(w.prefix_len),
            "--prefix-repetition-suffix-len", str(w.suffix_len),
            "--prefix-repetition-num-prefixes", str(w.num_prefixes),
            "--prefix-repetition-output-len", str(w.output_len),
            "--num-prompts", str(w.num_prompts),
            "--max-concurrency", str(w.max_concurrency),
            "--request-rate", "inf" if math.isinf(w.request_rate) else str(w.request_rate),
            "--seed", str(self.seed), "--temperature", "0", "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--label", run, "--disable-tqdm",
            # per request too (generated text: the two runs' outputs are compared)
            "--save-result", "--save-detailed",
            "--result-dir", str(result_dir), "--result-filename", "bench.json",
        ]  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fixtures"] = str(self.fixtures)
        out["workload"]["working_set_tokens"] = self.workload.working_set_tokens
        out["workload"]["request_rate"] = str(self.workload.request_rate)
        out.update(num_gpu_blocks=self.num_gpu_blocks, max_model_len=self.max_model_len)
        return out


def fixture_spec_method(drafter_dir: Path) -> str | None:
    """The ``speculative_config.method`` a drafter fixture was built for (its
    ``fixture_meta.json``, written by ``vllm-draft-offload fixtures``), if recorded."""
    meta = drafter_dir / "fixture_meta.json"
    if not meta.exists():
        return None
    method = json.loads(meta.read_text()).get("spec_method")
    return str(method) if method else None
