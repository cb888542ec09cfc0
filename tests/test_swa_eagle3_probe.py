"""The KV probe on a Gemma-3-shaped target with an EAGLE3 head (`fixtures --sliding-window`).

vLLM 0.33 builds the EAGLE3 head's one layer as full attention (its config carries no
``layer_types``, as gpt-oss's EAGLE3 heads): it joins the target's full-attention
layer in one KV-cache group, and vLLM lays every group over one allocation from byte
0, so the draft layer's tensor is the tensor of target sliding-window layers of other
groups. The probe took that for a drafter sharing the target's KV and skipped it: it
corrupted nothing and ``--corrupt-draft-kv`` could not fail (H100: AL 2.969 intact and
"corrupted"). Checked here on vLLM's own objects: the config and KV-cache spec vLLM
builds, its KV-cache groups and tensors, and the probe on them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_model_checks import kv_cache_config_with_drafts

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.accept.check import build_config, parse_args
from vllm_draft_offload.bench.accept.compare import summarize
from vllm_draft_offload.bench.accept.plans import EXTENDED_CORRUPT_WINDOW
from vllm_draft_offload.bench.accept.schema import PhaseResult, PhaseSpec, RequestResult

WINDOW = 16
TARGET_LAYERS = 6  # the tiny target in whole Gemma-3 groups: 5 sliding, 1 full


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fixtures-swa-eagle3")
    argv = ["fixtures", "--out", str(out), "--preset", "tiny", "--max-steps", "2"]
    assert cli.main([*argv, "--only", "target", "--sliding-window", str(WINDOW)]) == 0
    return out


def _engine_config(swa_dir: Path, layers: str = "draft") -> Any:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_draft_offload.bench.accept.probe_connector import probe_transfer_config

    cfg = EngineArgs(
        model=str(swa_dir / "target"),
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        max_model_len=512,
        enable_prefix_caching=True,
        speculative_config={
            "method": "eagle3",
            "model": str(swa_dir / "eagle3"),
            "num_speculative_tokens": 3,
        },
        # (draft: the probe's default, its config as before --corrupt-target-window-kv)
        kv_transfer_config=probe_transfer_config(
            **({"layers": layers} if layers != "draft" else {})
        ),
    ).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU
    return cfg


def _probe_on_vllm_caches(swa_dir: Path, layers: str = "draft") -> dict[str, Any]:
    """Target and EAGLE3 head as vLLM builds them, their KV-cache config and tensors
    (vLLM's allocate_kv_cache), and the probe registered on those tensors."""
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.v1.worker.utils import allocate_kv_cache

    from vllm_draft_offload.bench.accept.probe_connector import KVProbeConnector

    cfg = _engine_config(swa_dir, layers)
    with set_current_vllm_config(cfg):
        initialize_model(cfg)
        target_names = set(get_layers_from_vllm_config(cfg, AttentionLayerBase))
        initialize_model(cfg, model_config=cfg.speculative_config.draft_model_config)
        attn = get_layers_from_vllm_config(cfg, AttentionLayerBase)
        draft_names = set(attn) - target_names
        kv_cache_config, specs = kv_cache_config_with_drafts(cfg, attn, draft_names)
        caches = allocate_kv_cache(
            kv_cache_config,
            torch.device("cpu"),
            cfg.cache_config.get_resolved_kv_cache_layout(),
        )
        probe = KVProbeConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
        probe.register_kv_caches(caches)
    return {
        "cfg": cfg,
        "kv_cache_config": kv_cache_config,
        "specs": specs,
        "caches": caches,
        "probe": probe,
        "draft": draft_names,
        "target": target_names,
    }


def _layer_group(kv_cache_config: Any) -> dict[str, int]:
    return {n: i for i, g in enumerate(kv_cache_config.kv_cache_groups) for n in g.layer_names}


def _blocks_by_group(kv_cache_config: Any) -> dict[int, list[int]]:
    """Disjoint block ids per group, as vLLM's one block pool hands them out (not 0:
    the null block)."""
    return {g: [1 + 3 * g, 2 + 3 * g] for g in range(len(kv_cache_config.kv_cache_groups))}


def _run_probe(env: dict[str, Any], blocks: dict[int, list[int]]) -> None:
    """Every cache byte 1, then the probe's start_load_kv on `blocks`."""
    from vllm_draft_offload.bench.accept.probe_connector import ProbeMetadata

    for tensor in env["caches"].values():
        tensor.fill_(1)
    probe = env["probe"]
    probe.bind_connector_metadata(ProbeMetadata(corrupt_blocks=blocks, requests=[("r", 64)]))
    probe.start_load_kv(None)


def _block_is_zero(env: dict[str, Any], name: str, block: int) -> bool:
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    view = group_kernel_blocks(env["caches"][name], env["kv_cache_config"].num_blocks)
    return bool((view[block] == 0).all())


def test_vllm_builds_the_eagle3_head_as_full_attention_next_to_window_layers(
    swa_dir: Path, vllm_dist: None
) -> None:
    """What vLLM 0.33 makes of the fixture: the target's sliding layers get window 16,
    the head (no layer_types, as gpt-oss's EAGLE3 heads) full attention, grouped with
    the target's full layer; its tensor is the same as other groups' target layers'."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    head = json.loads((swa_dir / "eagle3" / "config.json").read_text())
    assert "layer_types" not in head and "sliding_window" not in head
    env = _probe_on_vllm_caches(swa_dir)
    cfg, specs = env["cfg"], env["specs"]
    hf = cfg.speculative_config.draft_model_config.hf_config
    assert getattr(hf, "layer_types", None) is None and getattr(hf, "sliding_window", None) is None
    assert cfg.cache_config.sliding_window is None  # per layer: nothing model-wide to inherit
    (draft,) = env["draft"]
    assert draft == f"model.layers.{TARGET_LAYERS}.self_attn.attn"  # after the target's
    assert type(specs[draft]) is FullAttentionSpec
    window = sorted(n for n in env["target"] if type(specs[n]) is SlidingWindowSpec)
    assert len(window) == TARGET_LAYERS - 1
    assert {specs[n].sliding_window for n in window} == {WINDOW}
    groups = env["kv_cache_config"].kv_cache_groups
    group = _layer_group(env["kv_cache_config"])
    full = groups[group[draft]]
    assert full.is_eagle_group
    assert set(full.layer_names) == {draft, f"model.layers.{TARGET_LAYERS - 1}.self_attn.attn"}
    caches = env["caches"]
    aliased = [
        n
        for n in env["target"]
        if caches[n].data_ptr() == caches[draft].data_ptr()
        and caches[n].stride() == caches[draft].stride()
    ]
    # the condition the probe mistook for a drafter sharing the target's KV: only
    # target layers of other groups (their blocks are others)
    assert aliased and all(group[n] != group[draft] for n in aliased)


def test_probe_corrupts_the_eagle3_heads_kv_and_nothing_of_the_target(
    swa_dir: Path, vllm_dist: None
) -> None:
    """Before the fix: draft_layers [] and the head 'shares storage with a target
    layer', so nothing was zeroed."""
    env = _probe_on_vllm_caches(swa_dir)
    probe = env["probe"]
    (draft,) = env["draft"]
    assert probe.draft_layers == [draft] and probe.corrupt_targets == [draft]
    assert probe.skipped_layers == {}
    blocks = _blocks_by_group(env["kv_cache_config"])
    _run_probe(env, blocks)
    group = _layer_group(env["kv_cache_config"])
    assert probe.corrupted == {draft: len(blocks[group[draft]])}
    assert all(_block_is_zero(env, draft, b) for b in blocks[group[draft]])
    for name in env["target"]:  # every target layer's own blocks intact
        assert not any(_block_is_zero(env, name, b) for b in blocks[group[name]]), name


def test_probe_corrupts_the_targets_window_kv_only(swa_dir: Path, vllm_dist: None) -> None:
    """--corrupt-target-window-kv: the target's sliding-window layers are zeroed, its
    full-attention layer and the head are not."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    env = _probe_on_vllm_caches(swa_dir, layers="target_window")
    probe, specs = env["probe"], env["specs"]
    window = {n for n in env["target"] if type(specs[n]) is SlidingWindowSpec}
    assert set(probe.corrupt_targets) == window and len(window) == TARGET_LAYERS - 1
    assert probe.target_window_layers == probe.corrupt_targets
    assert probe.skipped_layers == {}
    blocks = _blocks_by_group(env["kv_cache_config"])
    _run_probe(env, blocks)
    group = _layer_group(env["kv_cache_config"])
    assert set(probe.corrupted) == window
    for name in set(env["caches"]):
        zeroed = [_block_is_zero(env, name, b) for b in blocks[group[name]]]
        assert zeroed == [name in window] * len(zeroed), name
    assert probe.report()["corrupt_layers"] == "target_window"


def test_probe_skips_a_layer_sharing_its_tensor_within_its_group() -> None:
    """A KV-sharing layer (the same tensor in the same group, or in none) still cannot
    be corrupted alone; the same tensor in another group can."""
    from vllm_draft_offload.bench.accept.probe_connector import shared_in_group

    buf = torch.zeros(64)
    other_buf = torch.zeros(64)
    caches = {"t0": buf, "t1": buf, "d": buf, "x": other_buf}
    assert shared_in_group(caches, {"t0": 0, "d": 1}, "d", {"t0"}) is None
    assert shared_in_group(caches, {"t0": 1, "d": 1}, "d", {"t0"}) == "t0"
    assert shared_in_group(caches, {"t0": 0, "t1": 1, "d": 1}, "d", {"t0", "t1"}) == "t1"
    assert shared_in_group(caches, {"t0": 0}, "d", {"t0"}) == "t0"  # d in no group
    assert shared_in_group(caches, {"x": 1, "d": 1}, "d", {"x"}) is None


def test_cached_blocks_leave_out_the_null_block() -> None:
    """A sliding-window group's cached blocks that left the window are vLLM's null
    block: never corrupted (nor counted)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    from vllm_draft_offload.bench.accept.probe_connector import cached_blocks

    req = NewRequestData(
        req_id="r",
        prompt_token_ids=list(range(200)),
        mm_features=[],
        sampling_params=SamplingParams(),
        pooling_params=None,
        block_ids=([1, 2, 3, 4, 5], [0, 0, 0, 9, 10], [0, 0, 0, 0, 0]),
        num_computed_tokens=160,
        lora_request=None,
    )
    assert cached_blocks(req, [32, 32, 32]) == {0: [1, 2, 3, 4, 5], 1: [9, 10]}


# ------------------------------------------------------------------ the plan and its summary


def test_corrupt_target_window_plan(tmp_path: Path) -> None:
    fx = str(tmp_path)
    argv = ["--fixtures", fx, "--model", "/m/t", "--spec-method", "eagle3", "--draft", "d"]
    cfg = build_config(parse_args([*argv, "--corrupt-target-window-kv"]))
    assert cfg.corrupt_target_window_kv and not cfg.corrupt_draft_kv
    names = [p.name for p in cfg.phases]
    assert names == ["fresh", "extended", "refill", EXTENDED_CORRUPT_WINDOW]
    assert cfg.phases[-1].corrupt_draft_kv and cfg.phases[-1].reference == "extended"
    with pytest.raises(SystemExit):
        build_config(parse_args([*argv, "--corrupt-target-window-kv", "--corrupt-draft-kv"]))
    with pytest.raises(SystemExit):
        build_config(parse_args([*argv, "--corrupt-target-window-kv", "--kv-transfer-config",
                                 '{"kv_connector": "X"}']))  # fmt: skip


def _phase(name: str, outputs: list[list[int]], al: float, ref: str | None = None) -> PhaseResult:
    return PhaseResult(
        spec=PhaseSpec(name=name, prompts="extended", reference=ref),
        wall_s=1.0,
        acceptance_length=al,
        requests=[
            RequestResult(index=i, group=0, prompt_len=9, num_cached_tokens=8, output_token_ids=o)
            for i, o in enumerate(outputs)
        ],
    )


def test_window_sensitivity_passes_on_changed_outputs_or_acceptance() -> None:
    ref = _phase("extended", [[1, 2], [3, 4]], 3.0)

    def summary(outputs: list[list[int]], al: float) -> Any:
        return summarize([ref, _phase(EXTENDED_CORRUPT_WINDOW, outputs, al, "extended")])

    same = summary([[1, 2], [3, 4]], 2.9)
    assert same.sensitivity_pass is False and same.corruption_drop == pytest.approx(1 / 30)
    assert summary([[1, 2], [3, 5]], 3.0).sensitivity_pass  # an output changed
    assert summary([[1, 2], [3, 4]], 1.5).sensitivity_pass  # acceptance halved
    assert summary([[1, 2], [3, 4]], 4.0).sensitivity_pass  # or rose by a third


def test_table_lists_window_sensitivity_apart() -> None:
    from vllm_draft_offload.bench.accept.schema import AcceptCheckResult, Environment
    from vllm_draft_offload.bench.accept.table import render

    env = Environment(gpu="cpu", python="3", platform="p", versions={})
    phases = [
        _phase("extended", [[1, 2]], 3.0),
        _phase(EXTENDED_CORRUPT_WINDOW, [[1, 3]], 2.0, "extended"),
    ]
    result = AcceptCheckResult(created="now", env=env, config={}, phases=phases)
    result.summary = summarize(phases)
    text = render({("eagle3", "corrupt_window"): result})
    assert "### A2." in text
    row = next(line for line in text.splitlines() if "eagle3" in line and "33.3%" in line)
    assert "| yes | 0/1 |" in row
    header_b = text.splitlines()[text.splitlines().index("### B. Restored/fresh acceptance") + 4]
    assert "corrupt_window" not in header_b


# ------------------------------------------------------------------ end to end (CPU vLLM)


def _accept(swa_dir: Path, tmp_path: Path, flag: str) -> Any:
    from vllm_draft_offload.bench.accept.schema import AcceptCheckResult

    out = tmp_path / "result.json"
    args = ["--fixtures", str(swa_dir), "--spec-method", "eagle3", "--draft", "eagle3", flag]
    rc = cli.main(["accept", *args, "--num-prompts", "2", "--max-tokens", "16", "--out", str(out)])
    res = AcceptCheckResult.model_validate_json(out.read_text())
    assert rc == 0 and res.error is None, res.error
    return res


@pytest.mark.e2e
def test_e2e_corrupt_draft_kv_reaches_the_eagle3_head(swa_dir: Path, tmp_path: Path) -> None:
    """In vLLM's engine (the layout and blocks it picks): the head's cached blocks are
    zeroed, no target layer (tiny fixtures learn too little to show a drop)."""
    res = _accept(swa_dir, tmp_path, "--corrupt-draft-kv")
    report = res.probe_report
    draft = [n for n, v in report["layers"].items() if v["draft"]]
    assert draft == [f"model.layers.{TARGET_LAYERS}.self_attn.attn"]
    assert report["draft_layers"] == report["corrupt_targets"] == draft
    assert report["skipped_layers"] == {}
    assert set(report["corrupted_blocks"]) == set(draft) and report["corrupted_blocks"][draft[0]]
    assert len(report["corrupted_requests"]) == 2
    assert res.summary.all_outputs_match  # the target's KV was not touched


@pytest.mark.e2e
def test_e2e_corrupt_target_window_kv_zeroes_the_window_layers(
    swa_dir: Path, tmp_path: Path
) -> None:
    res = _accept(swa_dir, tmp_path, "--corrupt-target-window-kv")
    report = res.probe_report
    window = report["target_window_layers"]
    assert len(window) == TARGET_LAYERS - 1 and report["corrupt_targets"] == window
    assert set(report["corrupted_blocks"]) == set(window)
    # the in-window blocks only: the window (16) fits in one 32-token block
    assert set(report["corrupted_blocks"].values()) == {1}
    assert [p.spec.name for p in res.phases][-1] == EXTENDED_CORRUPT_WINDOW
