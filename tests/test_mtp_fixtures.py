"""MTP fixtures (GLM-4-MoE, DeepSeek-V3 MLA, multi-module): built at the tiny preset and
checked against what vLLM 0.33 does with them on a CPU.

* the torch models compute what transformers' own Glm4Moe / DeepseekV3 code computes
  from the saved checkpoint (names and math of the target);
* vLLM's config loader resolves ``method: "mtp"`` from the saved directory;
* vLLM's own target and MTP classes load every parameter from it;
* the MTP layers vLLM builds are discovered as draft layers, in the group vLLM flags
  ``is_eagle_group``, with MLA's single latent tensor per layer, and the connector
  derives the right number of successor tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_model_checks import kv_cache_config_with_drafts, load_as_mtp_proposer

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.fixtures.build import META_FILE, build_fixtures, resolve_preset
from vllm_draft_offload.bench.fixtures.moe_models import MoeLM, MoeShape
from vllm_draft_offload.bench.fixtures.mtp_build import MTP_FIXTURES, MTP_PRESETS

MAX_STEPS = 3
NAMES = ",".join(MTP_FIXTURES)
# fixture -> (architecture, vLLM's MTP architecture, MTP layers, speculative tokens)
EXPECTED = {
    "glm-mtp": ("Glm4MoeForCausalLM", "Glm4MoeMTPModel", 1, 3),
    "glm-mtp2": ("Glm4MoeForCausalLM", "Glm4MoeMTPModel", 2, 2),
    "dsv3-mla-mtp": ("DeepseekV3ForCausalLM", "DeepSeekMTPModel", 1, 3),
}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mtp_fixtures")
    argv = ["fixtures", "--out", str(out), "--preset", "tiny", "--max-steps", str(MAX_STEPS)]
    assert cli.main([*argv, "--only", NAMES]) == 0
    return out


def _meta(d: Path) -> dict[str, Any]:
    return json.loads((d / META_FILE).read_text())


def _target_from_checkpoint(d: Path) -> MoeLM:
    """Our torch target, loaded back from the saved checkpoint (its MTP layers left out)."""
    from safetensors.torch import load_file

    meta = _meta(d)
    model = MoeLM(MoeShape(**meta["shape"]), meta["corpus"]["vocab_size"]).eval()
    saved = load_file(d / "model.safetensors")
    n = meta["shape"]["num_layers"]
    mtp = tuple(f"model.layers.{n + k}." for k in range(meta["num_nextn_predict_layers"]))
    model.load_state_dict({k: v for k, v in saved.items() if not k.startswith(mtp)}, strict=True)
    return model


# ------------------------------------------------------------------ build


def test_every_mtp_fixture_is_built_with_its_meta(mtp_dir: Path) -> None:
    index = json.loads((mtp_dir / "fixtures.json").read_text())
    assert set(index["fixtures"]) == set(MTP_FIXTURES)
    for name, (arch, _, modules, k) in EXPECTED.items():
        meta = _meta(mtp_dir / name)
        cfg = json.loads((mtp_dir / name / "config.json").read_text())
        assert meta["spec_method"] == "mtp" and meta["preset"] == "tiny"
        assert meta["num_speculative_tokens"] == k
        assert cfg["architectures"] == [arch]
        assert cfg["num_nextn_predict_layers"] == meta["num_nextn_predict_layers"] == modules
        # dense routing: every routed expert selected, so no top-k tie can flip
        assert cfg["num_experts_per_tok"] == cfg["n_routed_experts"] >= 4
        assert cfg["n_group"] == cfg["topk_group"] == 1
        assert meta["target_train"]["steps"] == meta["mtp_train"]["steps"] == MAX_STEPS
        assert len(meta["mtp_step_copy_acc"]) == k
    dsv3 = json.loads((mtp_dir / "dsv3-mla-mtp" / "config.json").read_text())
    assert (dsv3["kv_lora_rank"], dsv3["qk_rope_head_dim"]) == (512, 64)
    assert (dsv3["scoring_func"], dsv3["topk_method"]) == ("sigmoid", "noaux_tc")


def test_glm_fixtures_share_one_target(mtp_dir: Path) -> None:
    from safetensors.torch import load_file

    one = load_file(mtp_dir / "glm-mtp" / "model.safetensors")
    two = load_file(mtp_dir / "glm-mtp2" / "model.safetensors")
    n = _meta(mtp_dir / "glm-mtp")["shape"]["num_layers"]
    mtp = (f"model.layers.{n}.", f"model.layers.{n + 1}.")
    shared = [k for k in one if not k.startswith(mtp)]
    assert shared and all(torch.equal(one[k], two[k]) for k in shared)
    assert any(k.startswith(mtp[1]) for k in two) and not any(k.startswith(mtp[1]) for k in one)


def test_presets_route_densely_and_keep_the_flash_mla_geometry() -> None:
    for preset in MTP_PRESETS.values():
        for shape in (preset.glm, preset.dsv3):
            assert shape.top_k == shape.experts and shape.first_k_dense >= 1
        assert (preset.dsv3.kv_lora_rank, preset.dsv3.qk_rope_head_dim) == (512, 64)
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        replace(MTP_PRESETS["tiny"].dsv3, kv_lora_rank=256)


def test_same_seed_same_weights_and_only_keeps_the_index(mtp_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    # an earlier build of the same preset and seed left its entries in the index
    earlier = {"preset": resolve_preset("tiny", MAX_STEPS).to_dict(), "seed": 0}
    index_file = tmp_path / "fixtures.json"
    index_file.write_text(json.dumps(earlier | {"fixtures": {"target": "/x/target"}}))
    build_fixtures(tmp_path, 0, "tiny", MAX_STEPS, log=print, only=["dsv3-mla-mtp"])
    ref = load_file(mtp_dir / "dsv3-mla-mtp" / "model.safetensors")
    again = load_file(tmp_path / "dsv3-mla-mtp" / "model.safetensors")
    assert ref.keys() == again.keys() and all(torch.equal(ref[k], again[k]) for k in ref)
    index = json.loads(index_file.read_text())
    assert index["fixtures"] == {
        "target": "/x/target",
        "dsv3-mla-mtp": str(tmp_path / "dsv3-mla-mtp"),
    }


def test_only_names_unknown_fixtures(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["fixtures", "--out", "/nonexistent", "--only", "glm-mtp,glm-mtp3"])
    err = capsys.readouterr().err
    assert "--only" in err and "glm-mtp3" in err and "dsv3-mla-mtp" in err


# ------------------------------------------------------------------ against transformers


@pytest.mark.parametrize("name", ["glm-mtp", "dsv3-mla-mtp"])
def test_target_computes_what_transformers_computes(mtp_dir: Path, name: str) -> None:
    """transformers' Glm4MoeForCausalLM / DeepseekV3ForCausalLM (the reference vLLM is
    tested against) load the checkpoint and give our logits: names, routing (bias,
    renormalisation), partial / interleaved rope and MLA all agree."""
    from transformers import AutoModelForCausalLM

    ours = _target_from_checkpoint(mtp_dir / name)
    theirs = AutoModelForCausalLM.from_pretrained(mtp_dir / name, attn_implementation="eager")
    theirs.eval()
    # Sparse routing with a score bias in both, so selection and weighting are compared
    # too (the fixtures select every expert, where neither would matter).
    bias = torch.tensor([0.3, -0.2, 0.1, -0.4])
    for model in (ours, theirs):
        for module in model.modules():
            if hasattr(module, "top_k"):
                module.top_k = 2
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(bias)
    tokens = torch.randint(4, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens).logits, theirs(input_ids=tokens).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    assert a.std() > 0.01  # not a degenerate comparison


# ------------------------------------------------------------------ against vLLM


def _engine_config(d: Path, k: int, block_size: int):  # -> VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(
        model=str(d),
        dtype="float32",
        block_size=block_size,
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    ).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves
    return cfg


@pytest.mark.parametrize("name", list(EXPECTED))
def test_vllm_resolves_method_mtp(mtp_dir: Path, name: str) -> None:
    _, mtp_arch, modules, k = EXPECTED[name]
    cfg = _engine_config(mtp_dir / name, k, 16)
    spec = cfg.speculative_config
    assert spec.method == "mtp" and spec.num_speculative_tokens == k
    assert spec.draft_model_config.model == str(mtp_dir / name)  # the target's checkpoint
    assert spec.draft_model_config.hf_config.architectures == [mtp_arch]
    assert spec.draft_model_config.hf_config.n_predict == modules
    assert spec.needs_eagle_block_drop()
    assert spec.use_multi_module_mtp() == (modules > 1)
    assert cfg.model_config.use_mla == (name == "dsv3-mla-mtp")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_vllm_loads_target_and_mtp_and_finds_the_draft_layers(
    mtp_dir: Path, vllm_dist: None, name: str
) -> None:
    from safetensors.torch import load_file
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from vllm_draft_offload.geometry import build_unit_layout, successor_tokens_needed

    _, _, modules, k = EXPECTED[name]
    d = mtp_dir / name
    cfg = _engine_config(d, k, 16)
    n = _meta(d)["shape"]["num_layers"]
    weights = load_file(d / "model.safetensors")
    with set_current_vllm_config(cfg):
        target_layers = load_as_mtp_proposer(cfg, weights)
        layers = get_layers_from_vllm_config(cfg, AttentionLayerBase)
        # the proposer marks every attention layer the drafter added (and the model
        # runner the layer's spec) as draft
        draft_names = set(layers) - target_layers
        assert draft_names == {f"model.layers.{n + m}.self_attn.attn" for m in range(modules)}
        kv_cache_config, specs = kv_cache_config_with_drafts(cfg, layers, draft_names)
    assert [g.is_eagle_group for g in kv_cache_config.kv_cache_groups] == [True]
    context = cfg.compilation_config.static_forward_context
    seen = frozenset(x for x, layer in context.items() if getattr(layer, "is_draft_layer", False))
    layout = build_unit_layout(kv_cache_config, 64, seen)
    assert {s.name for s in layout.layers if s.is_draft} == draft_names
    assert len(layout.layers) == n + modules and layout.has_eagle_group
    assert successor_tokens_needed(cfg, layout) == (k if modules > 1 else 1)
    spec = next(iter(specs.values()))
    if name == "dsv3-mla-mtp":
        # one latent tensor per layer: 512 + 64 per token, one "head", no K/V pair
        assert all(type(s) is MLAAttentionSpec for s in specs.values())
        assert (spec.num_kv_heads, spec.head_size) == (1, 576)
        assert {s.page_bytes for s in layout.layers} == {16 * 576 * 4}
    else:
        assert all(type(s) is FullAttentionSpec for s in specs.values())
        assert {s.page_bytes for s in layout.layers} == {spec.page_size_bytes}
