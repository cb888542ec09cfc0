"""Key salts: what must match for stored KV to be reused (weights, LoRA, cache salt)."""

from __future__ import annotations

import functools
import os
import shutil
import types
from pathlib import Path

import pytest
from kv_sim import SimSetup, make_vllm_config, write_tiny_llama

from vllm_draft_offload.chunk_keys import make_salt, request_salt
from vllm_draft_offload.config import parse_config
from vllm_draft_offload.identity import drafter_identity, target_identity, weights_fingerprint


def _salt(target: Path, draft: Path) -> bytes:
    config = make_vllm_config(target, draft, SimSetup())
    return make_salt({"target": target_identity(config), "drafter": drafter_identity(config)})


def _write_weights(path: Path, fill: int, size: int = 300_000) -> None:
    path.write_bytes(bytes([fill]) * size)


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path]:
    target = write_tiny_llama(tmp_path / "target", layers=2, heads=1, kv_heads=1, head_dim=32)
    draft = write_tiny_llama(tmp_path / "draft", layers=1, heads=2, kv_heads=2, head_dim=64)
    _write_weights(target / "model.safetensors", 1)
    _write_weights(draft / "model.safetensors", 2)
    return target, draft


@pytest.mark.parametrize("which", [0, 1], ids=["target", "drafter"])
def test_replacing_weights_in_place_changes_the_salt(models: tuple[Path, Path], which: int) -> None:
    before = _salt(*models)
    assert _salt(*models) == before  # deterministic
    weights = models[which] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8192] = b"\x07" * 8192  # same size, new data
    weights.write_bytes(bytes(data))
    assert _salt(*models) != before
    _write_weights(weights, 9, size=400_000)  # another size
    assert _salt(*models) != before


def test_same_files_elsewhere_share_the_fingerprint(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """Another host's copy (other mtimes) keys units the same, so storage is shared."""
    copy = tmp_path / "copy"
    shutil.copytree(models[0], copy)
    os.utime(copy / "model.safetensors", (1, 1))
    assert weights_fingerprint(str(copy), None) == weights_fingerprint(str(models[0]), None)
    assert weights_fingerprint("org/model", "main") != weights_fingerprint("org/model", "v2")


def test_quantization_and_hf_overrides_are_part_of_the_identity(
    models: tuple[Path, Path],
) -> None:
    config = make_vllm_config(*models, SimSetup())
    base = target_identity(config)
    config.model_config.hf_overrides = {"rope_theta": 1234.0}
    assert target_identity(config)["hf_overrides"] == {"rope_theta": 1234.0}
    config.model_config.quantization = "fp8"
    changed = target_identity(config)
    assert changed["quantization"] == "fp8"
    assert make_salt(changed) != make_salt(base)


def test_a_callable_hf_override_is_named_the_same_in_every_process(
    models: tuple[Path, Path],
) -> None:
    """vLLM gives an EAGLE drafter a functools.partial as hf_overrides. Another process
    (a second engine sharing storage) holds its function at another address, so the
    identity must name it, never by repr (which prints the address)."""
    config = make_vllm_config(*models, SimSetup(eagle=True))
    draft = config.speculative_config.draft_model_config
    override = draft.hf_overrides
    assert isinstance(override, functools.partial)
    before = drafter_identity(config)
    func = override.func
    # The same function at another address, as another process would load it.
    twin = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    assert id(twin) != id(func)
    draft.hf_overrides = functools.partial(twin, *override.args, **override.keywords)
    assert drafter_identity(config) == before
    # Other bound arguments are another override: another identity.
    draft.hf_overrides = functools.partial(twin, transformers_mtp_overrides={"x": 1})
    assert drafter_identity(config) != before


def test_cache_generation_changes_every_key(model_dirs: tuple[Path, Path]) -> None:
    from kv_sim import SimEngine

    salts = {
        SimEngine(
            *model_dirs, SimSetup(extra_config={"cache_generation": g})
        ).scheduler.connector.scheduler.salt
        for g in (0, 1)
    }
    assert len(salts) == 2
    assert parse_config({"cpu_bytes_to_use": 1}).cache_generation == 0


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("None", None), (None, "None")),  # a LoRA named "None" vs no LoRA
        (("None", "x"), (None, "x")),
        (("a|salt=b", "c"), ("a", "b|salt=c")),  # a separator inside a name
        (("None", None), (None, None)),
        (("x", None), (None, "x")),  # the same string as LoRA or as cache salt
    ],
)
def test_request_salt_never_collides(
    a: tuple[str | None, str | None], b: tuple[str | None, str | None]
) -> None:
    base = make_salt({"model": "m"})
    assert request_salt(base, *a) != request_salt(base, *b)
