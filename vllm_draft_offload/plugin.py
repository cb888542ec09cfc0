"""vLLM general-plugin entry point: makes `DraftOffloadConnector` a known name."""

from __future__ import annotations

CONNECTOR_NAME = "DraftOffloadConnector"


def register() -> None:
    """Register the connector with vLLM's factory (idempotent, once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # Registered by class name: vLLM rebuilds connector stats by that name.
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_draft_offload.connector", "DraftOffloadConnector"
        )
