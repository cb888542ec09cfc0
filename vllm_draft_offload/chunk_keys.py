"""Content keys for stored units.

A key chains the hash of every token before a chunk's end with a salt that
names the target model, the drafter and the unit's byte layout, so two engines
with different drafters or geometries never share an entry. Keys are computed
from token ids with a fixed hash (not vLLM's block hashes, whose seed is random
per process unless PYTHONHASHSEED is set), so a restarted engine finds the
units its predecessor wrote to storage.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, field

DIGEST_BYTES = 16


def _digest(*parts: bytes) -> bytes:
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        hasher.update(part)
    return hasher.digest()


def make_salt(identity: dict[str, object]) -> bytes:
    """Root of every key chain: everything that must match for KV to be reusable."""
    return _digest(b"vllm-draft-offload/v1", json.dumps(identity, sort_keys=True).encode())


def request_salt(base_salt: bytes, lora_name: str | None, cache_salt: str | None) -> bytes:
    """Per-request root: LoRA adapters and cache salts isolate KV like vLLM's own cache."""
    if lora_name is None and cache_salt is None:
        return base_salt
    # JSON of the pair: a LoRA named "None" or a name holding a separator cannot
    # collide with another pair.
    return _digest(base_salt, json.dumps([lora_name, cache_salt]).encode())


@dataclass
class ChunkKeyChain:
    """Incrementally extended keys of a growing token sequence."""

    salt: bytes
    chunk_size: int
    keys: list[bytes] = field(default_factory=list)

    def extend(self, token_ids: list[int] | tuple[int, ...]) -> list[bytes]:
        """Hash every complete chunk of `token_ids` not hashed yet."""
        num_full = len(token_ids) // self.chunk_size
        prev = self.keys[-1] if self.keys else self.salt
        for index in range(len(self.keys), num_full):
            start = index * self.chunk_size
            tokens = array("q", token_ids[start : start + self.chunk_size]).tobytes()
            prev = _digest(prev, tokens)
            self.keys.append(prev)
        return self.keys


def key_hex(key: bytes) -> str:
    return key.hex()
