"""Checks the fixture tests run on vLLM's own model classes (CPU, no forward)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch


def nan_load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> list[str]:
    """Parameters vLLM's ``load_weights`` left unset (filled with NaN first)."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_weights(weights.items())
    return sorted(n for n, p in model.named_parameters() if torch.isnan(p).any())


def load_as_mtp_proposer(cfg: Any, weights: dict[str, torch.Tensor]) -> set[str]:
    """Load the target, then the drafter as vLLM's MTP proposer does (the target's
    config, the draft's model), asserting each left no parameter unset; the target's
    attention layer names (the drafter's are the ones added after). Call it inside
    ``set_current_vllm_config(cfg)``."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model

    target = initialize_model(cfg)
    target_layers = set(get_layers_from_vllm_config(cfg, AttentionLayerBase))
    assert nan_load(target, weights) == []
    draft = initialize_model(cfg, model_config=cfg.speculative_config.draft_model_config)
    assert nan_load(draft, weights) == []
    return target_layers


def kv_cache_config_with_drafts(
    cfg: Any, layers: dict[str, Any], draft_names: set[str]
) -> tuple[Any, dict[str, Any]]:
    """The KV-cache config vLLM plans for these attention layers, and their specs, the
    drafter's marked as the proposer marks them (the layer) and the model runner does
    (its spec)."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    specs = {}
    for layer_name, layer in layers.items():
        spec = layer.get_kv_cache_spec(cfg)
        if layer_name in draft_names:
            layer.is_draft_layer = True
            spec = replace(spec, is_draft=True)
        specs[layer_name] = spec
    groups = get_global_kv_cache_groups(cfg, [specs])
    return get_kv_cache_configs(cfg, [specs], [1 << 26], groups)[0], specs
