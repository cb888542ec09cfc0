"""Fixture builder (`vllm-draft-offload fixtures`): tiny preset on CPU, reload checks.

Drafts and the target must reload with transformers; the EAGLE heads must load
into vLLM 0.33's own ``EagleLlamaForCausalLM`` / ``Eagle3LlamaForCausalLM`` with
every parameter filled from the checkpoint (except the embedding vLLM shares
from the target at runtime).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.fixtures.attention_masks import ttt_mask
from vllm_draft_offload.bench.fixtures.build import (
    ALL_FIXTURES,
    FIXTURES,
    META_FILE,
    build_fixtures,
)
from vllm_draft_offload.bench.fixtures.data import (
    BOS_ID,
    FIRST_WORD_ID,
    CorpusSpec,
    build_prompts,
    make_sequence,
)
from vllm_draft_offload.bench.fixtures.models import (
    LlamaShape,
    TrainSchedule,
    eagle3_aux_layer_ids,
)

MAX_STEPS = 3


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fixtures")
    argv = ["fixtures", "--out", str(out), "--preset", "tiny", "--max-steps", str(MAX_STEPS)]
    assert cli.main(argv) == 0
    return out


def _meta(d: Path) -> dict:
    return json.loads((d / META_FILE).read_text())


# ------------------------------------------------------------------ corpus and prompts


def test_sequences_are_deterministic_and_contain_long_range_copies() -> None:
    spec = CorpusSpec(vocab_size=512, min_span=4, max_span=8, p_copy=0.8, min_copy=8, max_copy=32)
    a = make_sequence(np.random.default_rng(5), 256, spec)
    b = make_sequence(np.random.default_rng(5), 256, spec)
    c = make_sequence(np.random.default_rng(6), 256, spec)
    assert a == b and a != c
    assert len(a) == 256 and a[0] == BOS_ID
    assert all(FIRST_WORD_ID <= t < 512 for t in a[1:])
    # copies: many 8-grams occur twice; random tokens over 508 words almost never do
    grams = [tuple(a[i : i + 8]) for i in range(1, len(a) - 8)]
    assert len(grams) - len(set(grams)) > 20


def test_prompts_share_prefixes_and_cue_a_copy() -> None:
    spec = CorpusSpec(vocab_size=256)
    ps = build_prompts(spec, seed=1, num_prompts=4, prompt_tokens=300, max_tokens=32)
    assert [len(p) for p in ps.base] == [300] * 4
    assert ps.group_of == [0, 0, 1, 1]
    n = ps.shared_prefix_len
    assert ps.base[0][:n] == ps.base[1][:n] and ps.base[0][:n] != ps.base[2][:n]
    assert ps.base[0] != ps.base[1]  # private tails
    for base, ext, gold in zip(ps.base, ps.extended, ps.expected_copy, strict=True):
        assert ext[: len(base)] == base and len(ext) > len(base)
        cue = base[-16:]
        prefix = base[:n]
        start = next(i for i in range(n) if prefix[i : i + 16] == cue)
        assert gold == prefix[start + 16 : start + 16 + 32]  # continuation = the copied text
    assert build_prompts(spec, 1, 4, 300, max_tokens=32).base == ps.base


def test_curriculum_doubles_length_and_keeps_tokens_per_step() -> None:
    s = TrainSchedule(100, batch=4, seq_len=1024, lr=1e-3, warmup=10, min_seq_len=64)
    lengths = [s.seq_len_at(i) for i in range(100)]
    assert lengths[0] == 128 and lengths[-1] == 1024
    assert lengths == sorted(lengths) and lengths.count(1024) >= 40
    assert {s.batch_for(n) * n for n in set(lengths)} == {4 * 1024}
    assert TrainSchedule(10, 4, 256, 1e-3, 2).seq_len_at(0) == 256  # no curriculum


def test_ttt_mask_matches_the_drafting_chain() -> None:
    m1 = ttt_mask(6, 1, torch.device("cpu"))
    assert torch.equal(m1, torch.ones(6, 6).tril().bool())  # step 1: causal
    m3 = ttt_mask(6, 3, torch.device("cpu"))
    assert m3.shape == (6, 18)
    # step-3 query at j=4: base p=2 -> step-1 keys 0..2, step-2 key 3, step-3 key 4
    assert m3[4, :6].nonzero().flatten().tolist() == [0, 1, 2]
    assert m3[4, 6:12].nonzero().flatten().tolist() == [3]
    assert m3[4, 12:].nonzero().flatten().tolist() == [4]


def test_geometry_and_aux_layer_guards() -> None:
    with pytest.raises(ValueError):
        LlamaShape(2, 32, 2, 1, 16, 64)  # head_dim < 32: no vLLM CPU attention
    assert eagle3_aux_layer_ids(4) == [1, 2, 3]
    assert eagle3_aux_layer_ids(2) == [0, 1, 2]


# ------------------------------------------------------------------ built fixtures


def test_all_fixture_dirs_with_meta(fixtures_dir: Path) -> None:
    index = json.loads((fixtures_dir / "fixtures.json").read_text())
    assert set(index["fixtures"]) == set(ALL_FIXTURES)  # the MTP ones: test_mtp_fixtures.py
    for name in FIXTURES:
        meta = _meta(fixtures_dir / name)
        assert meta["fixture"] == name and meta["preset"] == "tiny" and meta["seed"] == 0
        assert meta["corpus"]["vocab_size"] == 256
        if name != "self-draft":
            assert meta["steps"] == MAX_STEPS and math.isfinite(meta["final_loss"])
    assert _meta(fixtures_dir / "eagle")["spec_method"] == "eagle"
    assert _meta(fixtures_dir / "small-draft")["spec_method"] == "draft_model"


def test_target_and_drafts_reload_with_transformers(fixtures_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures_dir / "target")
    assert len(tok) == 256 and tok.encode("w0 w1", add_special_tokens=False) == [
        FIRST_WORD_ID,
        FIRST_WORD_ID + 1,
    ]
    assert tok.decode([FIRST_WORD_ID, FIRST_WORD_ID + 1]) == "w0 w1"
    x = torch.tensor([[BOS_ID, 10, 11, 12]])
    for name in ("target", "self-draft", "small-draft"):
        cfg = AutoConfig.from_pretrained(fixtures_dir / name)
        assert cfg.vocab_size == 256 and cfg.head_dim >= 32
        model = AutoModelForCausalLM.from_pretrained(fixtures_dir / name).eval()
        assert model.config.architectures == ["LlamaForCausalLM"]
        assert model(input_ids=x).logits.shape == (1, 4, 256)


def test_self_draft_is_the_target_and_small_draft_differs_in_kv_geometry(
    fixtures_dir: Path,
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    t = load_file(fixtures_dir / "target" / "model.safetensors")
    s = load_file(fixtures_dir / "self-draft" / "model.safetensors")
    assert t.keys() == s.keys() and all(torch.equal(t[k], s[k]) for k in t)
    tc = AutoConfig.from_pretrained(fixtures_dir / "target")
    dc = AutoConfig.from_pretrained(fixtures_dir / "small-draft")
    assert (dc.num_key_value_heads, dc.head_dim) != (tc.num_key_value_heads, tc.head_dim)
    assert dc.num_hidden_layers < tc.num_hidden_layers or dc.hidden_size < tc.hidden_size


def test_same_seed_same_weights_other_seed_differs(fixtures_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    for out, seed in ((tmp_path / "a", 0), (tmp_path / "b", 1)):
        build_fixtures(out, seed, "tiny", MAX_STEPS, log=print, only=FIXTURES)
    for name in ("target", "small-draft", "eagle", "eagle3"):
        ref = load_file(fixtures_dir / name / "model.safetensors")
        same = load_file(tmp_path / "a" / name / "model.safetensors")
        other = load_file(tmp_path / "b" / name / "model.safetensors")
        assert all(torch.equal(ref[k], same[k]) for k in ref), name
        assert not all(torch.equal(ref[k], other[k]) for k in ref), name


# ------------------------------------------------------------------ EAGLE heads vs vLLM


def _vllm_head(fixtures_dir: Path, method: str) -> tuple[torch.nn.Module, object]:
    """vLLM's own drafter module for ``method``, built from the fixture configs."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    cfg = EngineArgs(
        model=str(fixtures_dir / "target"),
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        max_model_len=256,
        speculative_config={
            "method": method,
            "model": str(fixtures_dir / method),
            "num_speculative_tokens": 2,
        },
    ).create_engine_config()
    cls = EagleLlamaForCausalLM if method == "eagle" else Eagle3LlamaForCausalLM
    with set_current_vllm_config(cfg):
        return cls(vllm_config=cfg, prefix=""), cfg


@pytest.mark.parametrize(
    ("method", "arch"), [("eagle", "EagleLlamaForCausalLM"), ("eagle3", "Eagle3LlamaForCausalLM")]
)
def test_eagle_heads_load_into_vllm_loaders(
    fixtures_dir: Path, vllm_dist: None, method: str, arch: str
) -> None:
    from safetensors.torch import load_file

    model, cfg = _vllm_head(fixtures_dir, method)
    hf = cfg.speculative_config.draft_model_config.hf_config
    assert hf.architectures == [arch]
    if method == "eagle3":
        # the aux layers vLLM will tap, and no vocab remapping (full draft vocab)
        assert list(hf.eagle_aux_hidden_state_layer_ids) == [0, 1, 2]
        assert hf.draft_vocab_size == hf.vocab_size and model.draft_id_to_target_id is None
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    saved = load_file(fixtures_dir / method / "model.safetensors")
    model.load_weights(saved.items())  # raises on any name the loader cannot place
    unloaded = {n for n, p in model.named_parameters() if torch.isnan(p).any()}
    # embed_tokens is not in the checkpoint on purpose: vLLM shares the target's
    assert unloaded == {"model.embed_tokens.weight"}
    params = dict(model.named_parameters())
    assert torch.equal(params["model.fc.weight"], saved["fc.weight"])
    layer = "layers.0." if method == "eagle" else "midlayer."
    q = saved[layer + "self_attn.q_proj.weight"]
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"][: q.shape[0]], q)


# ------------------------------------------------------- Gemma-3-shaped (sliding windows)

WINDOW = 16


@pytest.fixture(scope="module")
def windows_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Gemma-3-shaped target and self-draft of `fixtures --sliding-window` (the
    other fixtures are built as without it)."""
    from dataclasses import replace

    from vllm_draft_offload.bench.fixtures.build import parse_args, resolve_preset
    from vllm_draft_offload.bench.fixtures.hybrid import SlidingWindowLayout
    from vllm_draft_offload.bench.fixtures.llama_build import LlamaFamilyBuilder

    argv = ["--out", "x", "--sliding-window", str(WINDOW), "--full-every", "3"]
    args = parse_args(argv)
    windows = SlidingWindowLayout(args.sliding_window, args.full_every)
    preset = resolve_preset("tiny", MAX_STEPS)
    preset = replace(preset, target=windows.target_shape(preset.target))
    out = tmp_path_factory.mktemp("fixtures-swa")
    builder = LlamaFamilyBuilder(out, 0, preset, lambda _: None, windows)
    builder.target()
    builder.self_draft()
    return out


def test_sliding_window_layout_shapes_and_masks() -> None:
    """Whole groups of layers (Gemma 3: five sliding to one full), and the training
    mask hook gives a sliding layer vLLM's window: a token sees itself and the
    window - 1 tokens before it, no further."""
    from transformers import LlamaForCausalLM

    from vllm_draft_offload.bench.fixtures.build import parse_args, resolve_preset
    from vllm_draft_offload.bench.fixtures.hybrid import SlidingWindowLayout, apply_sliding_windows
    from vllm_draft_offload.bench.fixtures.models import llama_config

    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--sliding-window", "1"])
    with pytest.raises(SystemExit):  # the MTP fixtures have no sliding-window form
        parse_args(["--out", "x", "--sliding-window", "8", "--only", "target,glm-mtp"])
    gemma = SlidingWindowLayout(512)
    shape = LlamaShape(4, 64, 2, 2, 32, 128)
    assert gemma.target_shape(shape).num_layers == 6
    assert gemma.layer_types(12) == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    layout = SlidingWindowLayout(4, full_every=2)  # one layer: sliding
    preset = resolve_preset("tiny")
    model = LlamaForCausalLM(llama_config(LlamaShape(1, 64, 2, 2, 32, 128), preset)).eval()
    model.config._attn_implementation = "sdpa"
    apply_sliding_windows(model, layout)
    tokens = torch.arange(10, 30)[None]
    with torch.no_grad():
        last = model(input_ids=tokens).logits[0, -1]
        for position, inside in ((len(tokens[0]) - 5, False), (len(tokens[0]) - 4, True)):
            other = tokens.clone()
            other[0, position] = 99
            changed = not torch.allclose(model(input_ids=other).logits[0, -1], last)
            assert changed == inside, position


def test_sliding_windows_default_to_the_llama_family() -> None:
    """`--sliding-window` without `--only` builds what has a sliding-window form (session
    15: the runbook's build stopped at once, refusing the MTP fixtures it had not been
    asked for); naming an MTP fixture is still refused."""
    from vllm_draft_offload.bench.fixtures.build import FIXTURES, fixture_names

    assert fixture_names(None, windows=True) == list(FIXTURES)
    assert "glm-mtp" in fixture_names(None, windows=False)
    with pytest.raises(ValueError, match="glm-mtp"):
        fixture_names(["target", "glm-mtp"], windows=True)


def test_gemma3_shaped_fixture_is_read_by_vllm_as_sliding_windows(
    windows_dir: Path, vllm_dist: None
) -> None:
    """The target and self-draft carry layer_types / sliding_window; vLLM 0.33's
    Llama gives those layers sliding-window KV (its own grouping then frees them)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    for name in ("target", "self-draft"):
        config = json.loads((windows_dir / name / "config.json").read_text())
        assert config["layer_types"] == ["sliding_attention"] * 2 + ["full_attention"]
        assert config["sliding_window"] == WINDOW
        assert _meta(windows_dir / name)["sliding_window"] == {"window": WINDOW, "full_every": 3}
    cfg = EngineArgs(
        model=str(windows_dir / "target"), dtype="float32", block_size=32, max_model_len=256
    ).create_engine_config()
    assert cfg.cache_config.sliding_window is None  # per layer, not model-wide
    with set_current_vllm_config(cfg):
        model = LlamaForCausalLM(vllm_config=cfg, prefix="")
        specs = [layer.self_attn.attn.get_kv_cache_spec(cfg) for layer in model.model.layers]
    assert [type(s) for s in specs] == [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec]
    assert specs[0].sliding_window == WINDOW


def test_index_keeps_builds_of_one_layout_only(tmp_path: Path) -> None:
    """`--only` adds to fixtures.json when preset, seed and sliding-window layout are the
    ones already there; a different layout starts a new index (its target is another
    model)."""
    from vllm_draft_offload.bench.fixtures.meta import INDEX_FILE, update_index

    swa = {"sliding_window": {"window": 16, "full_every": 3}}
    update_index(tmp_path, {"name": "tiny"}, 0, {"target": "t"}, swa)
    update_index(tmp_path, {"name": "tiny"}, 0, {"eagle": "e"}, swa)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["fixtures"] == {"target": "t", "eagle": "e"}
    assert index["sliding_window"] == swa["sliding_window"]
    update_index(tmp_path, {"name": "tiny"}, 0, {"glm-mtp": "g"})
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["fixtures"] == {"glm-mtp": "g"} and "sliding_window" not in index
