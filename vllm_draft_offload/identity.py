"""Who computed a unit's KV: the identity of the target and the drafter (model,
revision, a fingerprint of the weights, dtypes, quantization, overrides, parallelism)
that goes into the key salt, so KV of other weights or settings is never reused.

The same in every process: engines sharing storage must derive one salt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Files whose content decides the KV a model computes.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
CONFIG_FILES = ("config.json", "params.json")
# Bytes read from each weight file: its head (the safetensors header names every
# tensor's dtype, shape and offset) and evenly spaced windows of its data.
HEAD_BYTES = 1 << 16
WINDOW_BYTES = 1 << 12
WINDOWS = 8
# " at 0x7f...": an object's default str() names its address, which differs per process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _file_sample(path: Path, size: int) -> bytes:
    with path.open("rb") as fh:
        parts = [fh.read(HEAD_BYTES)]
        if size > HEAD_BYTES:
            span = size - HEAD_BYTES - WINDOW_BYTES
            for i in range(WINDOWS):
                fh.seek(HEAD_BYTES + max(0, span) * (i + 1) // WINDOWS)
                parts.append(fh.read(WINDOW_BYTES))
    return b"".join(parts)


def weights_fingerprint(model: str | None, revision: str | None) -> str:
    """A cheap identity of a model's weights, so KV of replaced weights is never reused.

    A local directory (or single weight file) is fingerprinted by the names and
    sizes of its weight and config files and a sample of their bytes (header plus
    a few windows): replacing a checkpoint in place changes it, while copies of the
    same files on other hosts (other mtimes) agree, so they can share storage. A hub
    id that is not a local path is named with its revision.
    """
    if not model:
        return "none"
    path = Path(model).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(
            entry
            for entry in path.iterdir()
            if entry.is_file()
            and (entry.name.endswith(WEIGHT_SUFFIXES) or entry.name in CONFIG_FILES)
        )
    else:
        return json.dumps({"hub": model, "revision": revision})
    hasher = hashlib.blake2b(digest_size=16)
    for file in files:
        size = os.stat(file).st_size
        hasher.update(f"{file.name}\0{size}\0".encode())
        hasher.update(_file_sample(file, size))
    return hasher.hexdigest()


def _stable(value: Any) -> object:
    """JSON for what json cannot encode, the same in every process: engines sharing
    storage must derive one salt, and a repr that prints a memory address differs."""
    if isinstance(value, functools.partial):
        # vLLM gives EAGLE/MTP drafters a partial of SpeculativeConfig.hf_config_override.
        return {"partial": value.func, "args": list(value.args), "keywords": value.keywords}
    if callable(value):
        owner = value if hasattr(value, "__qualname__") else type(value)
        return f"{getattr(owner, '__module__', '?')}.{owner.__qualname__}"
    return _ADDRESS.sub("", str(value))


def _overrides(value: Any) -> object:
    """hf_overrides as JSON: a dict as is, a function by its qualified name, a partial
    by its function and bound arguments."""
    return json.loads(json.dumps(value, sort_keys=True, default=_stable))


def drafter_identity(vllm_config: VllmConfig) -> dict[str, object]:
    """What distinguishes one drafter's KV from another's."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.uses_draft_kv_cache():
        return {"method": None}
    draft = spec.draft_model_config
    return {
        "method": spec.method,
        "model": getattr(draft, "model", None),
        "revision": getattr(draft, "revision", None),
        "dtype": str(getattr(draft, "dtype", None)),
        "kv_cache_dtype": str(getattr(spec, "kv_cache_dtype", None)),
        "weights": weights_fingerprint(
            getattr(draft, "model", None), getattr(draft, "revision", None)
        ),
        "quantization": getattr(draft, "quantization", None),
        "hf_overrides": _overrides(getattr(draft, "hf_overrides", None)),
        # Multi-module MTP writes a different draft KV per speculative depth.
        "num_speculative_tokens": spec.num_speculative_tokens
        if spec.use_multi_module_mtp()
        else None,
    }


def target_identity(vllm_config: VllmConfig) -> dict[str, object]:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return {
        "model": model.model,
        "revision": model.revision,
        "weights": weights_fingerprint(model.model, model.revision),
        "quantization": model.quantization,
        "hf_overrides": _overrides(model.hf_overrides),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
    }
