"""Offline vLLM run: fresh prefill, evict the GPU prefix cache, run again.

    python tests/e2e_offline.py TARGET_DIR DRAFT_DIR OUT_JSON [CONNECTOR_JSON]

Used by tests/test_e2e_cpu.py on the CPU platform; prints nothing the test
parses except the JSON it writes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def counters(llm: LLM) -> dict[str, float]:
    wanted = {
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:external_prefix_cache_hits",
        "vllm:prefix_cache_hits",
    }
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in wanted}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def main() -> None:
    target, draft, out_path = sys.argv[1:4]
    transfer = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    llm = LLM(
        model=target,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        block_size=32,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
        kv_transfer_config=transfer,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [
        [(seed * 131 + i * 17) % (vocab - 10) + 5 for i in range(length)]
        for seed, length in ((1, 200), (2, 129))
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    result: dict[str, Any] = {"prompt_lengths": [len(p) for p in prompts]}
    for phase in ("fresh", "restored"):
        if phase == "restored":
            result["reset_prefix_cache"] = llm.reset_prefix_cache()
        before = counters(llm)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        result[phase] = {
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "num_cached_tokens": [o.num_cached_tokens for o in outputs],
            "counters": delta(counters(llm), before),
        }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
