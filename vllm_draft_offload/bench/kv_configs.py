"""The `kv_transfer_config` of vLLM's own CPU offloading, the baseline several benchmarks
run beside ours."""

from __future__ import annotations

from typing import Any


def native_offloading_config(cpu_bytes: float) -> dict[str, Any]:
    """vLLM's OffloadingConnector with a CPU budget of `cpu_bytes` (its defaults else)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }
