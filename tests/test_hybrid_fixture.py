"""The ``hybrid-mtp`` fixture (Qwen3-Next-shaped: Gated-DeltaNet + full attention + MTP),
built at the tiny preset and checked against what vLLM 0.33 does with it on a CPU:

* vLLM's config loader resolves ``method: "mtp"`` from the saved directory to
  ``Qwen3NextMTP`` and, with prefix caching, sets ``mamba_cache_mode="align"`` and
  keeps the fixture's recorded block size (a Gated-DeltaNet state fits one page);
* vLLM's own target and MTP classes load every parameter from the checkpoint;
* the KV cache groups vLLM builds are MambaSpec groups (align mode) next to a
  full-attention group holding the MTP layer as a draft layer, and the connector's
  layout accepts them (state pages per Mamba group).

vLLM's CPU backend cannot run the model (its Gated-DeltaNet kernels are Triton/CUDA
ones); the engine run is the GPU runbook's ``hybrid`` phase (scripts/gpu/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm_model_checks import kv_cache_config_with_drafts, load_as_mtp_proposer

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.fixtures.build import META_FILE
from vllm_draft_offload.bench.fixtures.hybrid_mtp import (
    HYBRID_FIXTURE,
    HYBRID_PRESETS,
    HybridShape,
)

MAX_STEPS = 1


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hybrid_fixture")
    argv = ["fixtures", "--out", str(out), "--preset", "tiny", "--max-steps", str(MAX_STEPS)]
    assert cli.main([*argv, "--only", HYBRID_FIXTURE]) == 0
    return out / HYBRID_FIXTURE


def _meta(d: Path) -> dict[str, Any]:
    return json.loads((d / META_FILE).read_text())


def _engine_config(d: Path, block_size: int, prefix_caching: bool = True):  # -> VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(
        model=str(d),
        dtype="float32",
        block_size=block_size,
        enforce_eager=True,
        max_model_len=512,
        skip_tokenizer_init=True,
        enable_prefix_caching=prefix_caching,
        speculative_config={
            "method": "mtp",
            "num_speculative_tokens": _meta(d)["num_speculative_tokens"],
        },
    ).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves
    return cfg


# ------------------------------------------------------------------ build


def test_fixture_is_built_with_its_meta_and_mtp_weights(fixture_dir: Path) -> None:
    from safetensors.torch import load_file

    meta = _meta(fixture_dir)
    cfg = json.loads((fixture_dir / "config.json").read_text())
    index = json.loads((fixture_dir.parent / "fixtures.json").read_text())
    assert index["fixtures"] == {HYBRID_FIXTURE: str(fixture_dir)}
    assert meta["spec_method"] == "mtp" and meta["mtp_trained"] is False
    assert "RANDOM" in meta["how"] and meta["steps"] == MAX_STEPS
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["num_experts_per_tok"] == cfg["num_experts"] >= 4
    assert cfg["dtype"] == "float32"  # the tiny preset's (bfloat16 for gpu)
    names = load_file(fixture_dir / "model.safetensors").keys()
    mtp = {n for n in names if n.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= mtp
    # per-expert names, as released Qwen3-Next checkpoints (and vLLM's loader) have them
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in mtp
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert (fixture_dir / "tokenizer.json").exists()


def test_block_size_holds_a_state_and_is_a_power_of_two() -> None:
    for hp in HYBRID_PRESETS.values():
        b = hp.shape.block_size(hp.num_speculative_tokens)
        per_token = 2 * hp.shape.kv_heads * hp.shape.head_dim
        assert b >= 64 and b & (b - 1) == 0
        assert b * per_token >= hp.shape.state_elements(hp.num_speculative_tokens)
        assert (b // 2) * per_token < hp.shape.state_elements(hp.num_speculative_tokens) or b == 64
    with pytest.raises(ValueError, match="hybrid geometry"):
        HybridShape(6, 64, 2, 1, 32, 2, 2, 32, 4, 64)  # not whole groups of 4


def test_only_hybrid_with_sliding_window_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(
            ["fixtures", "--out", "/nonexistent", "--only", HYBRID_FIXTURE, "--sliding-window", "8"]
        )
    assert HYBRID_FIXTURE in capsys.readouterr().err


# ------------------------------------------------------------------ against vLLM


def test_vllm_resolves_method_mtp_in_align_mode(fixture_dir: Path) -> None:
    cfg = _engine_config(fixture_dir, _meta(fixture_dir)["block_size"])
    spec = cfg.speculative_config
    assert spec.method == "mtp" and spec.num_speculative_tokens == 3
    assert spec.draft_model_config.model == str(fixture_dir)  # the target's checkpoint
    assert spec.draft_model_config.hf_config.architectures == ["Qwen3NextMTP"]
    assert spec.draft_model_config.hf_config.n_predict == 1
    assert cfg.model_config.is_hybrid
    assert cfg.cache_config.mamba_cache_mode == "align"
    off = _engine_config(fixture_dir, 64, prefix_caching=False)
    assert off.cache_config.mamba_cache_mode == "none"  # refused by the connector


def test_vllm_loads_every_parameter_and_builds_mamba_and_draft_groups(
    fixture_dir: Path, vllm_dist: None
) -> None:
    from safetensors.torch import load_file
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from vllm_draft_offload.geometry import build_unit_layout

    block = _meta(fixture_dir)["block_size"]
    cfg = _engine_config(fixture_dir, block)
    weights = load_file(fixture_dir / "model.safetensors")
    with set_current_vllm_config(cfg):
        target_layers = load_as_mtp_proposer(cfg, weights)
        # as the executor does after loading: the recorded block size holds a state,
        # so vLLM keeps it and makes it the Mamba block size
        current_platform.update_block_size_for_backend(cfg)
        assert cfg.cache_config.block_size == cfg.cache_config.mamba_block_size == block
        layers = get_layers_from_vllm_config(cfg, AttentionLayerBase)
        draft_names = set(layers) - target_layers
        assert draft_names == {"mtp.layers.0.self_attn.attn"}
        kv_cache_config, _ = kv_cache_config_with_drafts(cfg, layers, draft_names)
    kinds = [type(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    mamba = [g for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    full = [
        g for g in kv_cache_config.kv_cache_groups if type(g.kv_cache_spec) is FullAttentionSpec
    ]
    assert mamba and full and len(mamba) + len(full) == len(kinds)
    assert all(g.kv_cache_spec.mamba_cache_mode == "align" for g in mamba)
    assert {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups} == {block}
    assert sum(len(g.layer_names) for g in mamba) == 3  # the Gated-DeltaNet layers
    draft_group = [g for g in full if "mtp.layers.0.self_attn.attn" in g.layer_names]
    assert len(draft_group) == 1 and draft_group[0].is_eagle_group
    context = cfg.compilation_config.static_forward_context
    seen = frozenset(x for x, layer in context.items() if getattr(layer, "is_draft_layer", False))
    layout = build_unit_layout(kv_cache_config, block, seen)
    assert {s.name for s in layout.layers if s.is_draft} == draft_names
    assert layout.has_eagle_group


def test_vllm_raises_a_smaller_block_size_to_hold_the_state(
    fixture_dir: Path, vllm_dist: None
) -> None:
    """Why the fixture records a block size: vLLM raises a smaller one (docs/hybrid.md),
    and the connector's chunk_size must be a multiple of what vLLM ends with."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform

    cfg = _engine_config(fixture_dir, 32)
    with set_current_vllm_config(cfg):
        initialize_model(cfg)
        initialize_model(cfg, model_config=cfg.speculative_config.draft_model_config)
        current_platform.update_block_size_for_backend(cfg)
    cache = cfg.cache_config
    assert cache.block_size > 32 and cache.block_size == cache.mamba_block_size
    assert cache.block_size <= _meta(fixture_dir)["block_size"]


@pytest.mark.e2e
def test_e2e_connector_restores_gated_deltanet_state_without_a_drafter(
    fixture_dir: Path, tmp_path: Path
) -> None:
    """Real vLLM on CPU, align mode, DraftOffloadConnector: the restored phase's prefix
    (attention KV and the Gated-DeltaNet state at its end) comes from the connector,
    and the outputs equal the fresh prefill's. No drafter: vLLM's CPU build cannot run
    align mode's speculative state copy (a Triton kernel); the MTP run is the GPU's."""
    from vllm_draft_offload.bench.accept.schema import AcceptCheckResult

    block = _meta(fixture_dir)["block_size"]
    ours = {
        "kv_connector": "DraftOffloadConnector",
        "kv_role": "kv_both",
        # Twice the recorded block size: vLLM runs the float32 checkpoint in bfloat16, and
        # on a CPU with AVX512-BF16 (accelerated GDN, which refuses float32) it keeps the
        # state in float32, in twice the block size the fixture records for one dtype.
        "kv_connector_extra_config": {"cpu_bytes_to_use": 200_000_000, "chunk_size": 2 * block},
    }
    out = tmp_path / "result.json"
    args = ["--model", str(fixture_dir), "--spec-method", "none", "--block-size", str(block)]
    args += ["--num-prompts", "2", "--max-tokens", "16", "--enforce-eager", "--out", str(out)]
    args += ["--prompt-tokens", str(4 * block + 32)]  # whole chunks to hit at either size
    rc = cli.main(["accept", *args, "--kv-transfer-config", json.dumps(ours)])
    res = AcceptCheckResult.model_validate_json(out.read_text())
    assert rc == 0 and res.error is None, res.error
    fresh, restored, _ = res.phases
    hits = [r.num_cached_tokens for r in restored.requests]
    # a hit ends at a block boundary where vLLM kept a state (the prompt's checkpoint)
    assert all(h and h % block == 0 for h in hits), hits
    assert restored.cached_tokens_by_source.get("device", 0) == 0  # prefix cache was reset
    assert restored.counters["vllm:draft_offload_loaded_bytes"] > 0
    assert res.summary.all_outputs_match
