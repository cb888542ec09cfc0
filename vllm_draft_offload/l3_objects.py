"""The LMCache storage tier (L3) behind the CPU tier: what its worker side
(``l3_worker``) and its scheduler side (``l3_lookup``) share.

Units move between the host pool and L3 whole: one LMCache object per unit and TP rank
(``object_key``), holding every target and draft layer plus a header (key, geometry
fingerprint, drafter identity, successor tokens, checksums). ``open_store`` connects
either side to the configured backend, with a staging pool sized for such units.
"""

from __future__ import annotations

import logging

from vllm_draft_offload.config import L3Config
from vllm_draft_offload.l3_errors import L3Error
from vllm_draft_offload.l3_store import L3Store

logger = logging.getLogger(__name__)


def object_key(chunk_key: bytes, rank: int) -> str:
    """LMCache object name of one rank's part of a unit (hex, as LMCache keys need)."""
    return f"{chunk_key.hex()}{rank:04x}"


def open_store(config: L3Config, unit_bytes: int = 0) -> L3Store | None:
    """Connect to the configured backend; None (and a warning) when it is unreachable.

    With `unit_bytes`, the default staging pool holds the worker's reads
    (units_in_flight) and writes in flight at once: the unpinned host memory the tier
    may use, bounded by `l3_staging_mb` when that is set."""
    try:
        store = L3Store.from_lmcache(
            config.config_file,
            config.lmcache,
            timeout_s=config.timeout_s,
            min_staging_bytes=(config.units_in_flight + config.writes_in_flight)
            * (unit_bytes + STAGING_HEADER_BYTES),
        )
    except L3Error as exc:
        if exc.kind == "config":
            raise
        logger.warning("DraftOffloadConnector: L3 storage unavailable at start (%s)", exc)
        return None
    if not store.healthy():
        logger.warning(
            "DraftOffloadConnector: L3 backend %s unreachable at start; serving from the CPU "
            "tier and retrying in the background",
            store.settings.scheme,
        )
    return store


# Room for a unit's header in a staging buffer (generous: layer table and checksums).
STAGING_HEADER_BYTES = 64 << 10
