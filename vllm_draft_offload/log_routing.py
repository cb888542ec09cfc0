"""Where the connector's log lines go.

Its modules log under ``vllm_draft_offload.*``, outside the ``vllm`` logger, the only
one vLLM configures (a stderr handler, its format, ``VLLM_LOGGING_LEVEL``; ``vllm`` does
not propagate to the root). Left alone, Python's last-resort handler prints only
warnings, so every INFO line (what staging, the copy paths and the tiers chose at start;
the storage decisions log under ``vllm.draft_offload.l3``, inside vLLM's tree) went
nowhere in a vLLM process: session 33 found the staging line missing from every engine
log of an acceptance run.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "vllm_draft_offload"
VLLM_LOGGER = "vllm"


class _ToVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger, so the handlers vLLM has at that
    moment print it (vLLM re-applies its configuration when an engine starts, replacing
    its handlers)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(VLLM_LOGGER).handle(record)


def route_to_vllm_handlers() -> None:
    """Print the package's lines where vLLM prints its own, at vLLM's level, and only
    there, unless logging is left to the application: a handler on the package already,
    or none on ``vllm`` (``VLLM_CONFIGURE_LOGGING=0``, or no engine configured logging in
    this process). A handler on the root does not count as the application's: in
    session 33's GPU engines the lines were still missing with the first form of this
    routing, which stood aside for any root handler (the likely cause, not recorded; an
    H100 engine of session 11 printed the package's warnings in ``basicConfig``'s
    format, so a root handler existed there, and one at the root's default WARNING drops
    every INFO line). Idempotent; called where a connector is built, after vLLM
    configured logging in that process."""
    package = logging.getLogger(PACKAGE_LOGGER)
    vllm_logger = logging.getLogger(VLLM_LOGGER)
    if package.handlers or not vllm_logger.handlers:
        return
    package.addHandler(_ToVllm())
    package.setLevel(vllm_logger.getEffectiveLevel())
    # As vLLM's own (``vllm`` does not propagate): a root handler would print each line
    # a second time, in its own format.
    package.propagate = False
