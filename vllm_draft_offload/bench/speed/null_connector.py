"""A KV connector that does nothing, for decode-overhead's ``null`` configuration.

vLLM runs its connector plumbing for any configured connector: the per-layer wrapper
around every attention call, the per-step context in the model runner, the
scheduler's bookkeeping. This one returns at once from every hook, so an engine with
it costs what vLLM's plumbing costs and nothing else. Against ``none`` it measures
vLLM's share of a connector's decode overhead; against ``idle`` (DraftOffloadConnector
storing nothing) ours.

Benchmark tooling only: the product never configures it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

MODULE = __name__
NAME = "NullConnector"


def transfer_config() -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for an engine with this connector."""
    return {"kv_connector": NAME, "kv_connector_module_path": MODULE, "kv_role": "kv_both"}


class NullConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()
