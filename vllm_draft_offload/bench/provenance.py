"""What every result file names about where it ran: the GPU, the versions that decide
the figures (vLLM, torch, LMCache, xxhash, this package) and which reader storage fetches
used (``fast_io``: the native loop, or the Python one and why)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

PACKAGES = ("vllm", "torch", "lmcache", "xxhash", "vllm-draft-offload")


def provenance() -> dict[str, Any]:
    """``{"gpu": name or "cpu", "versions": {package: version or None},
    "fetch_reader": fast_io.reader()}``."""
    import torch

    from vllm_draft_offload import fast_io

    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    versions["torch"] = torch.__version__  # with its CUDA tag (+cu130), as torch says it
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "versions": versions, "fetch_reader": fast_io.reader()}
