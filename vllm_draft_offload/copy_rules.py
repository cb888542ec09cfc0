"""``copy_path=auto``'s table: which copies go to the kernel, per GPU, from measurement.

The table is ``copy_rules.json`` beside this module: per GPU name (as
``torch.cuda.get_device_name()`` spells it) and direction, the largest copy (a run
of pages after merging) the gather/scatter kernel moves faster than batched DMA,
and the fewest such copies in a batch that pay for a kernel launch. A GPU the table
does not name uses its ``default`` entry. ``vllm-draft-offload copy-speed
--write-rules`` derives an entry from a run (``rules_from_rows``) and writes it
there, so the threshold follows what was measured, not a guess.

Stores follow the same rule as loads. Session 28 sent stores above 32 KiB to DMA
(at the Llama-8B shape with 64 requests decoding, storing every chunk: 1.00 x on DMA
against 0.95 x on the kernel), but session 29 found where the cost went: DMA's batch
call blocked the engine's thread for a whole batch's prefill, and storing batches
spent 1.10-1.13 x as long before decoding as batches opting out, where stores on the
kernel added nothing (1.00 x). So stores are back on the kernel where it is faster;
``store_thread`` (store_issuer.py) issues the copies off the engine's thread. A step that
decodes only, though, stores by DMA where pages are large enough
(``decode_stores_by_dma``): there the kernel's copies cost decode about 5 % and DMA's
nothing (session 31 ran both by phase side by side).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_draft_offload.metric_defs import DIRECTIONS, Direction

RULES_FILE = Path(__file__).with_name("copy_rules.json")
# Fewest kernel-sized copies in a batch worth a launch (vLLM's MIN_N; copy-speed's
# batches are far larger, so it does not measure this).
DEFAULT_MIN_COUNT = 16


@dataclass(frozen=True)
class AutoRule:
    """Copies of at most ``max_bytes`` go to the kernel, when the batch planned together
    (a group of ``copy_paths.pipeline_groups``) has at least ``min_count`` of them; the
    rest, and every copy of a smaller batch, to DMA."""

    max_bytes: int
    min_count: int

    def to_dict(self) -> dict[str, int]:
        return {"max_bytes": self.max_bytes, "min_count": self.min_count}


# The smallest page a decode step's stores go to DMA for by default (decode_stores_dma).
# Measured at 64 KiB (the 8B shape, session 31); below 48 KiB DMA stored slowly (32 KiB
# and below 0.05-0.49 x pinned memcpy, results/gpu/session5_h100/copy_speed.json; 48 KiB
# 0.70 x but 64 KiB 0.57 x in that run), so smaller pages stay on the kernel. 48 KiB is
# session 28's DMA floor for stores.
DECODE_STORE_DMA_MIN_PAGE_BYTES = 48 * 1024


def decode_stores_by_dma(setting: bool | None, copy_path: str, page_bytes: Iterable[int]) -> bool:
    """Whether a decode-only step's stores go by DMA: ``setting`` when given, else (the
    default) under ``copy_path`` auto when every layer's page is at least
    ``DECODE_STORE_DMA_MIN_PAGE_BYTES``. A forced ``copy_path`` is what the user asked
    for every copy, so the default leaves it alone."""
    if setting is not None:
        return setting
    pages = list(page_bytes)
    return copy_path == "auto" and bool(pages) and min(pages) >= DECODE_STORE_DMA_MIN_PAGE_BYTES


Rules = Mapping[Direction, AutoRule]
# What ``auto`` does when the table cannot be read: DMA only, the path that needs nothing.
DMA_ONLY: dict[Direction, AutoRule] = {d: AutoRule(0, DEFAULT_MIN_COUNT) for d in DIRECTIONS}


def _parse(entry: Mapping[str, Any], where: str) -> dict[Direction, AutoRule]:
    rules: dict[Direction, AutoRule] = {}
    for direction in DIRECTIONS:
        raw = entry.get(direction)
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: no {direction!r} rule")
        rule = AutoRule(int(raw["max_bytes"]), int(raw.get("min_count", DEFAULT_MIN_COUNT)))
        if rule.max_bytes < 0 or rule.min_count < 1:
            raise ValueError(f"{where}.{direction}: max_bytes >= 0 and min_count >= 1 needed")
        rules[direction] = rule
    return rules


@functools.cache
def _table(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def auto_rules(gpu: str | None = None, path: Path | None = None) -> dict[Direction, AutoRule]:
    """The rules measured on ``gpu``, else the table's default entry."""
    path = path or RULES_FILE
    table = _table(path)
    gpus = table["gpus"]
    name = gpu if gpu in gpus else table["default"]
    return _parse(gpus[name], f"{path.name}:{name}")


def rule_source(gpu: str | None = None, path: Path | None = None) -> str:
    """Which entry ``auto_rules(gpu)`` uses and where it was measured (for the log)."""
    table = _table(path or RULES_FILE)
    name = gpu if gpu in table["gpus"] else table["default"]
    measured = table["gpus"][name].get("measured", "?")
    return f"{name}{'' if name == gpu else ' (default)'}: {measured}"


def rules_from_rows(
    rows: Iterable[Mapping[str, Any]], min_count: int = DEFAULT_MIN_COUNT
) -> dict[Direction, AutoRule]:
    """An entry from copy-speed rows: per direction, the largest page size up to which
    the kernel was at least as fast as DMA at every measured size (0: DMA wins from
    the smallest), so a size between two measured ones goes to DMA unless the kernel
    won on both sides."""
    best: dict[tuple[str, str, int], float] = {}
    for row in rows:
        key = (row["direction"], row["setting"], int(row["page_bytes"]))
        best[key] = max(best.get(key, 0.0), float(row["GBps"]))
    rules: dict[Direction, AutoRule] = {}
    for direction in DIRECTIONS:
        pages = sorted(
            page
            for (d, setting, page) in best
            if d == direction and setting == "kernel" and (d, "memcpy", page) in best
        )
        if not pages:
            raise ValueError(f"no kernel and memcpy rows of the same page size for {direction}")
        limit = 0
        for page in pages:
            if best[(direction, "kernel", page)] < best[(direction, "memcpy", page)]:
                break
            limit = page
        rules[direction] = AutoRule(limit, min_count)
    return rules


def write_rules(gpu: str, rules: Rules, measured: str, path: Path) -> None:
    """Set ``gpu``'s entry in the table (the default entry stays as it is, unless the
    table is new: then this GPU becomes the default)."""
    table = json.loads(path.read_text()) if path.exists() else {"default": gpu, "gpus": {}}
    table["gpus"][gpu] = {
        **{direction: rules[direction].to_dict() for direction in DIRECTIONS},
        "measured": measured,
    }
    _parse(table["gpus"][gpu], f"{path.name}:{gpu}")
    path.write_text(json.dumps(table, indent=1) + "\n")
    _table.cache_clear()
