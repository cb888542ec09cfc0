"""The one error type of the L3 store, and the kinds a caller can tell apart.

Its own module so that callers (the L3 tier, unit fetches, tests) name the error without
pulling in the store's connector machinery, and so that ``l3_channel`` and ``l3_store``
share it without importing each other both ways.
"""

from __future__ import annotations

from typing import Literal

L3ErrorKind = Literal[
    "config",  # bad configuration; raised by the constructor only
    "unavailable",  # backend unreachable, or circuit breaker open
    "timeout",  # the call hit timeout_s
    "io",  # the backend answered with an error (disk full, redis OOM, ...)
    "corrupt",  # the key exists but no well-formed object could be read
    "staging_exhausted",  # staging pool full; raise l3_staging_mb or lower concurrency
    "too_large",  # object larger than the staging pool or LMCache's int32 limit
    "unsupported",  # e.g. remove() on a connector without deletion
    "invalid_key",
    "closed",
]


class L3Error(Exception):
    def __init__(
        self,
        kind: L3ErrorKind,
        message: str,
        *,
        op: str | None = None,
        key: str | None = None,
    ) -> None:
        where = " ".join(x for x in (op, key) if x)
        super().__init__(f"[{kind}] {where}: {message}" if where else f"[{kind}] {message}")
        self.kind: L3ErrorKind = kind
        self.op = op
        self.key = key
