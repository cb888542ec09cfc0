"""`fixtures --long-context L`: the opt-in long-context stage, at the tiny preset on CPU.

The stage runs (target, EAGLE3 head, MoE target and MTP layers, at up to 512 tokens
here), the metas and the index record it, the configs carry the rope settings and
lengths vLLM reads, and vLLM's own config loader takes them (32k for the gpu preset).
The chunked TTT attention that long sequences use matches the dense mask.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.fixtures.attention_masks import (
    DENSE_TTT_MAX_LEN,
    TttMask,
    masked_sdpa,
    ttt_mask,
)
from vllm_draft_offload.bench.fixtures.build import (
    INDEX_FILE,
    META_FILE,
    build_fixtures,
    parse_args,
)
from vllm_draft_offload.bench.fixtures.data import make_sequence
from vllm_draft_offload.bench.fixtures.long_context import (
    LONG_STAGES,
    long_context_preset,
    resolve_long_stage,
)
from vllm_draft_offload.bench.fixtures.models import PRESETS, ROPE_THETA, llama_config

LONG = 512  # > the tiny preset's 128-token training length
MAX_STEPS = 3


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("long_fixtures")
    argv = ["fixtures", "--out", str(out), "--preset", "tiny", "--max-steps", str(MAX_STEPS)]
    argv += ["--only", "eagle3,glm-mtp", "--long-context", str(LONG)]
    assert cli.main(argv) == 0
    return out


def _meta(d: Path) -> dict[str, Any]:
    return json.loads((d / META_FILE).read_text())


# ------------------------------------------------------------------ attention, corpus


@pytest.mark.parametrize("step", [1, 2, 3])
def test_chunked_ttt_attention_matches_the_dense_mask(step: int) -> None:
    torch.manual_seed(step)
    t = 45
    q = torch.randn(2, 3, t, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, step * t, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, step * t, 16, dtype=torch.float64, requires_grad=True)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=ttt_mask(t, step, q.device)
    )
    grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    assert torch.equal(masked_sdpa(q, k, v, TttMask(t, step)), dense)  # short: dense, as before
    for chunk in (4, 16, 64):
        out = masked_sdpa(q, k, v, TttMask(t, step), chunk=chunk)
        torch.testing.assert_close(out, dense)
        for g, ref in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), grads, strict=True):
            torch.testing.assert_close(g, ref)
    assert PRESETS["gpu"].target_train.seq_len <= DENSE_TTT_MAX_LEN  # default presets: dense


def test_copies_reach_far_back_in_32k_contexts() -> None:
    """Copy sources are uniform over the context: at 32k, most repeated 16-grams
    first occurred more than 8k tokens earlier, many more than 16k."""
    n = 32768
    seq = make_sequence(np.random.default_rng(0), n, PRESETS["gpu"].corpus.for_length(n))
    first: dict[tuple[int, ...], int] = {}
    dist = []
    for i in range(n - 16):
        gram = tuple(seq[i : i + 16])
        if gram in first:
            dist.append(i - first[gram])
        else:
            first[gram] = i
    d = np.asarray(dist)
    assert len(d) > n // 2
    assert (d > n // 4).mean() > 0.5 and (d > n // 2).mean() > 0.3 and d.max() > 3 * n // 4


def test_long_schedule_doubles_up_from_the_main_length() -> None:
    gpu = PRESETS["gpu"]
    stage = LONG_STAGES["gpu"]
    sched = stage.schedule(gpu.target_train, 32768, stage.target_steps)
    lengths = [sched.seq_len_at(i) for i in range(sched.steps)]
    assert lengths[0] == 8192 and lengths[-1] == 32768 and sorted(lengths) == lengths
    assert {sched.batch_for(n) * n for n in lengths} == {32768}  # 32k tokens per step
    assert lengths.count(32768) >= 0.4 * sched.steps
    assert sched.lr < gpu.target_train.lr and sched.warm_max_steps == 0
    capped = resolve_long_stage("gpu", max_steps=5, long_steps=40)
    assert (capped.target_steps, capped.head_steps) == (5, 5)
    assert resolve_long_stage("gpu", long_steps=40).head_steps == 40


# ------------------------------------------------------------------ build


def test_long_stage_runs_and_is_recorded(long_dir: Path) -> None:
    index = json.loads((long_dir / INDEX_FILE).read_text())
    assert index["long_context"] == LONG
    # only the named drafters (and the target, its self-draft) are built
    assert set(index["fixtures"]) == {"target", "self-draft", "eagle3", "glm-mtp"}
    assert not (long_dir / "small-draft").exists() and not (long_dir / "eagle").exists()
    for name in ("target", "eagle3"):
        meta = _meta(long_dir / name)
        long = meta["long_context"]
        assert long["seq_len"] == LONG and long["steps"] == MAX_STEPS and long["batch"] == 1
        extra = meta["train_extra"]
        assert extra["long_context"] == LONG and extra["long_steps"] == MAX_STEPS
        assert meta["steps"] == 2 * MAX_STEPS  # main steps, then the long ones
        assert np.isfinite(meta["final_loss"]) and np.isfinite(extra["main_final_loss"])
    assert 0.0 <= _meta(long_dir / "target")["long_copy_acc"] <= 1.0
    assert _meta(long_dir / "self-draft")["long_context"]["seq_len"] == LONG
    glm = _meta(long_dir / "glm-mtp")
    assert glm["long_context"]["target"]["seq_len"] == LONG
    assert glm["long_context"]["mtp"]["seq_len"] == LONG
    assert glm["mtp_train"]["train_extra"]["long_steps"] == MAX_STEPS
    assert glm["target_train"]["train_extra"]["long_steps"] == MAX_STEPS
    assert len(glm["long_mtp_step_copy_acc"]) == 3


@pytest.mark.parametrize("name", ["target", "eagle3", "glm-mtp"])
def test_saved_configs_carry_the_rope_vllm_reads(long_dir: Path, name: str) -> None:
    cfg = json.loads((long_dir / name / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == ROPE_THETA
    assert cfg["rope_parameters"]["rope_type"] == "default"
    assert cfg["max_position_embeddings"] >= LONG


def test_vllm_loads_the_long_fixtures(long_dir: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    for model, spec in (
        (long_dir / "target", {"method": "eagle3", "model": str(long_dir / "eagle3")}),
        (long_dir / "glm-mtp", {"method": "mtp"}),
    ):
        cfg = EngineArgs(
            model=str(model),
            dtype="float32",
            block_size=16,
            enforce_eager=True,
            max_model_len=LONG,
            skip_tokenizer_init=True,
            speculative_config={**spec, "num_speculative_tokens": 3},
        ).create_engine_config()
        hf = cfg.model_config.hf_config
        assert hf.rope_parameters["rope_theta"] == ROPE_THETA
        assert cfg.model_config.max_model_len == LONG
        draft = cfg.speculative_config.draft_model_config.hf_config
        assert draft.rope_parameters["rope_theta"] == ROPE_THETA


def test_gpu_long_config_takes_32k_prompts_in_vllm(tmp_path: Path) -> None:
    """The gpu preset's --long-context 32768 configs: vLLM accepts max_model_len 32768
    and reads rope_theta 1e6 (no training: config and tokenizer only)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_draft_offload.bench.fixtures.meta import save_tokenizer

    preset = long_context_preset(PRESETS["gpu"], 32768)
    assert preset.max_position == 32768
    big = long_context_preset(PRESETS["gpu"], 65536)
    assert big.max_position == 65536 and big.target == preset.target
    cfg = llama_config(preset.target, preset, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    save_tokenizer(tmp_path, preset.corpus.vocab_size, preset.max_position)
    engine = EngineArgs(
        model=str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=32768
    ).create_engine_config()
    assert engine.model_config.max_model_len == 32768
    assert engine.model_config.hf_config.rope_parameters["rope_theta"] == ROPE_THETA
    with pytest.raises(ValueError, match="must exceed"):
        long_context_preset(PRESETS["gpu"], 4096)


def test_long_context_refuses_what_it_does_not_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["fixtures", "--out", str(tmp_path), "--preset", "tiny"]
    for extra in (
        ["--long-context", "512", "--sliding-window", "64"],
        ["--long-context", "512", "--only", "hybrid-mtp"],
        ["--long-context", "128"],  # not longer than the preset's training length
        ["--long-steps", "5"],  # without --long-context
    ):
        with pytest.raises(SystemExit):
            parse_args(base[1:] + extra)
    assert "--long-context" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Llama family and the MTP"):
        build_fixtures(tmp_path, 0, "tiny", 1, only=["hybrid-mtp"], long_context=LONG)
    assert parse_args(base[1:]).long_context is None  # opt-in
